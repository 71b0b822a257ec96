"""Times one forward without adding a sync: CUDA events on GPU, read after the step's own sync; host clock on CPU."""

import time

import torch


class ForwardTimer:
    """``with ForwardTimer(device) as t: forward()``; then, once the step has synced, ``t.elapsed_ms()``."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.start_ns = 0  # wall clock at launch, for spans
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda \
            else None
        self._host_ns = (0, 0)

    def __enter__(self) -> "ForwardTimer":
        self.start_ns = time.time_ns()
        if self.cuda:
            self._events[0].record()
        else:
            self._host_ns = (time.perf_counter_ns(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[1].record()
        else:
            self._host_ns = (self._host_ns[0], time.perf_counter_ns())

    def elapsed_ms(self) -> float:
        """The forward's device time; on CUDA only valid after the stream passed the end event (the step synced)."""
        if self.cuda:
            return self._events[0].elapsed_time(self._events[1])
        return (self._host_ns[1] - self._host_ns[0]) / 1e6

