"""Forward time per batch size, as in vLLM's "allow tracking forward time": (batch_size, count, median_ms).

A step observer of every engine: it records every step; GetForwardStats, the periodic log line and the stats span
read from here.
"""

import statistics
import threading
from collections import defaultdict, deque
from dataclasses import dataclass

from kiln.step_record import StepRecord

# Percentiles come from the most recent samples of each batch size; counts are exact.
SAMPLES_KEPT = 10_000


@dataclass(frozen=True)
class BatchSizeStat:
    model: str
    batch_size: int
    count: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    runtime_mode: str
    total_ms: float  # every step of this size, not only the samples kept


class _Series:
    def __init__(self):
        self.count = 0
        self.total_ms = 0.0
        self.samples: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self.runtime_mode = ""


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ForwardStats:
    """Thread-safe: the engine thread records, gRPC handlers and the logger read."""

    def __init__(self):
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int], _Series] = defaultdict(_Series)

    def __call__(self, step: StepRecord) -> None:
        self.record(step.model, step.batch_size, step.forward_ms, step.runtime_mode)

    def record(self, model: str, batch_size: int, ms: float, runtime_mode: str) -> None:
        with self._lock:
            series = self._series[(model, batch_size)]
            series.count += 1
            series.total_ms += ms
            series.samples.append(ms)
            series.runtime_mode = runtime_mode

    def snapshot(self, model: str | None = None, reset: bool = False) -> list[BatchSizeStat]:
        with self._lock:
            keys = sorted(k for k in self._series if model in (None, "", k[0]))
            out = []
            for key in keys:
                series = self._series[key]
                ordered = sorted(series.samples)
                out.append(BatchSizeStat(
                    model=key[0], batch_size=key[1], count=series.count,
                    median_ms=round(statistics.median(ordered), 3), p90_ms=round(_percentile(ordered, 0.9), 3),
                    p99_ms=round(_percentile(ordered, 0.99), 3), runtime_mode=series.runtime_mode,
                    total_ms=round(series.total_ms, 3)))
                if reset:
                    del self._series[key]
            return out


def stats_line(stats) -> str:
    """The vLLM PR's log line, so eager and compiled runs compare exactly as there.

    ``stats``: BatchSizeStat rows or the GetForwardStats reply's messages (same field names)."""
    table = ", ".join(f"({s.batch_size}, {s.count}, {s.median_ms:.2f})" for s in stats)
    return f"Batchsize forward time stats (batchsize, count, median_time(ms)): [{table}]"
