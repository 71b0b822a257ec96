"""What one engine step did, handed to the step observers (forward spans, metrics) after the step's sync."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    model: str
    batch_size: int  # sequences in the step
    num_tokens: int  # tokens scheduled: prefill chunks plus decodes
    padded_size: int  # tokens the forward ran, CUDA-graph padding included
    runtime_mode: str  # eager / compiled / cudagraph
    phase: str  # prefill / decode / mixed
    start_ns: int  # the forward's start and end, wall-clock ns
    end_ns: int
    request_ids: tuple[str, ...]  # the requests the step served, in batch order

    @property
    def forward_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6
