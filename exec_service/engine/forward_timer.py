"""Times one forward, and where its step ends, without adding a sync: CUDA events on GPU, read after the step's own
sync; host clock on CPU.

The engine launches a step while the one before it still runs, so on a GPU the host clock at launch is not when the
forward starts. The start is put on the wall clock through the previous step's: the start events of consecutive
steps are timed on the device. It is the launch time when the device had nothing queued at launch (the first step,
or after the engine idled), and never earlier than the launch. The step's end (its logits and sampling queued after
the forward) is on the same clock, so the next step's start minus it is how long the device waited for the host.
"""

import time

import torch


class ForwardTimer:
    """``with ForwardTimer(device, previous, device_idle) as t: forward()``, then ``t.step_done()`` after the rest of
    the step is queued; once the step has synced, ``t.start_ns``, ``t.elapsed_ms()`` and ``t.step_end_ns``."""

    def __init__(self, device: str, previous: "ForwardTimer | None" = None, device_idle: bool = True):
        self.cuda = device == "cuda"
        self.launch_ns = 0  # wall clock when the host launched the forward
        self._previous = previous if self.cuda and not device_idle else None  # the host clock needs no chain
        self._start_ns: int | None = None
        # The forward's start and end, and the step's end.
        self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if self.cuda else None
        self._host_ns = [0, 0, 0]

    def __enter__(self) -> "ForwardTimer":
        self.launch_ns = time.time_ns()
        if self.cuda:
            self._events[0].record()
        else:
            self._host_ns[0] = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[1].record()
        else:
            self._host_ns[1] = time.perf_counter_ns()

    def step_done(self) -> None:
        """Mark the step's end: after its last kernel (sampling, the copy back) is queued."""
        if self.cuda:
            self._events[2].record()
        else:
            self._host_ns[2] = time.perf_counter_ns()

    @property
    def start_ns(self) -> int:
        """The forward's start on the wall clock; on CUDA only valid after the step synced, and after the previous
        step's was read (the engine reads steps in order)."""
        if self._start_ns is None:
            self._start_ns = self.launch_ns
            if self._previous is not None:
                gap_ms = self._previous._events[0].elapsed_time(self._events[0])
                self._start_ns = max(self.launch_ns, self._previous.start_ns + int(gap_ms * 1e6))
                self._previous = None  # the chain ends here: nothing keeps old steps' events alive
        return self._start_ns

    def elapsed_ms(self) -> float:
        """The forward's device time; on CUDA only valid after the stream passed the end event (the step synced)."""
        if self.cuda:
            return self._events[0].elapsed_time(self._events[1])
        return (self._host_ns[1] - self._host_ns[0]) / 1e6

    @property
    def step_end_ns(self) -> int:
        """The step's end on the wall clock (its start's clock); valid when ``elapsed_ms`` is, after step_done."""
        if self.cuda:
            return self.start_ns + int(self._events[0].elapsed_time(self._events[2]) * 1e6)
        return self.start_ns + self._host_ns[2] - self._host_ns[0]
