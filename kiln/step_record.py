"""What one engine step did: the record the engine hands its step observers (forward stats, forward spans, the
batch-size log) after the step's own sync. Plain values, so it pickles cheaply to the forward-span writer.

``runtime_mode`` is what LoadModel asked for (kiln.runtime_mode.RuntimeMode); ``path`` is how this step ran: a
cudagraph model's decode step replays a decode graph, its prefill of 200 tokens a mixed graph, one of 4,000 tokens
the compiled code.
"""

import enum
from collections.abc import Callable
from typing import NamedTuple


class StepPath(enum.StrEnum):
    FULL_GRAPH = "full_graph"  # a decode-only step replayed from a decode graph (of its batch size)
    MIXED_GRAPH = "mixed_graph"  # a prefill or mixed step replayed from a mixed graph (of its token count)
    COMPILED = "compiled"  # the compiled layers launched from Python
    EAGER = "eager"  # the uncompiled model


class StepRecord(NamedTuple):
    model: str  # the served model's name
    batch_size: int  # sequences in the step
    num_tokens: int  # tokens scheduled: prefill chunks plus decodes
    padded_size: int  # tokens the compiled code or CUDA graph ran, padding included
    runtime_mode: str  # the mode LoadModel asked for: eager / compiled / cudagraph
    path: str  # a StepPath value: how this step ran
    phase: str  # prefill / decode / mixed
    start_ns: int  # the forward's start and end, wall-clock ns (CUDA events on GPU, host clock on CPU)
    end_ns: int
    request_ids: tuple[str, ...]  # the requests the step served, in batch order
    # How long the device waited for the host before this forward: from the previous step's end (its sampling
    # included) to this start, when the engine had this step's work all along; -1 after it waited for work.
    host_wait_ns: int = -1

    @property
    def forward_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


StepObserver = Callable[[StepRecord], None]  # called on the engine thread after each step; must not block
