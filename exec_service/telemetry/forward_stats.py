"""Forward time per batch size, phase and path, as in vLLM's "allow tracking forward time" (batch_size, count,
median_ms), split so that a decode replayed from a full graph, a prefill replayed piecewise and a long prefill run
from Python are three series, not one median. Beside each series' forward time, how long the device waited for the
host before its steps (kiln.step_record.StepRecord.host_wait_ns): the GPU's idle time that the host, not a lack of
work, caused.

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
    runtime_mode: str  # what LoadModel asked for
    total_ms: float  # every step of this series, not only the samples kept
    phase: str = ""  # prefill / decode / mixed
    path: str = ""  # kiln.step_record.StepPath value; "" in a row that merges paths (``by_phase``)
    host_wait_ms: float = 0.0  # the device's wait for the host before every step of this series


class _Series:
    def __init__(self):
        self.count = 0
        self.total_ms = 0.0
        self.host_wait_ms = 0.0
        self.samples: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self.runtime_mode = ""

    def copy(self) -> "_Series":
        """What the readers compute from, taken under the lock; the sorting happens outside it."""
        taken = _Series()
        taken.count, taken.total_ms, taken.runtime_mode = self.count, self.total_ms, self.runtime_mode
        taken.host_wait_ms = self.host_wait_ms
        taken.samples = deque(self.samples)
        return taken


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ForwardStats:
    """Thread-safe: the engine thread records, gRPC handlers and the logger read. A reader holds the lock only to
    copy the series, never while it sorts their samples (tens of ms when every series is full), so a step's
    ``record`` never waits for a GetForwardStats or a log line."""

    def __init__(self):
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int, str, str], _Series] = defaultdict(_Series)

    def __call__(self, step: StepRecord) -> None:
        self.record(step.model, step.batch_size, step.forward_ms, step.runtime_mode, step.phase, step.path,
                    max(0, step.host_wait_ns) / 1e6)

    def record(self, model: str, batch_size: int, ms: float, runtime_mode: str, phase: str = "",
               path: str = "", host_wait_ms: float = 0.0) -> None:
        with self._lock:
            series = self._series[(model, batch_size, phase, path)]
            series.count += 1
            series.total_ms += ms
            series.host_wait_ms += host_wait_ms
            series.samples.append(ms)
            series.runtime_mode = runtime_mode

    def snapshot(self, model: str | None = None, reset: bool = False) -> list[BatchSizeStat]:
        """One row per (model, batch size, phase, path)."""
        with self._lock:
            keys = sorted(k for k in self._series if model in (None, "", k[0]))
            taken = [(key, self._series[key].copy()) for key in keys]
            if reset:
                for key in keys:
                    del self._series[key]
        return [_stat(key, [series]) for key, series in taken]

    def by_phase(self, model: str | None = None) -> list[BatchSizeStat]:
        """One row per (model, batch size, phase), its paths merged: the vLLM-style log line's entries."""
        merged: dict[tuple[str, int, str, str], list[_Series]] = defaultdict(list)
        with self._lock:
            for key, series in self._series.items():
                if model in (None, "", key[0]):
                    merged[(*key[:3], "")].append(series.copy())
        return [_stat(key, merged[key]) for key in sorted(merged)]


def _stat(key: tuple[str, int, str, str], series: list[_Series]) -> BatchSizeStat:
    ordered = sorted(ms for s in series for ms in s.samples)
    return BatchSizeStat(
        model=key[0], batch_size=key[1], count=sum(s.count for s in series),
        median_ms=round(statistics.median(ordered), 3), p90_ms=round(_percentile(ordered, 0.9), 3),
        p99_ms=round(_percentile(ordered, 0.99), 3), runtime_mode=series[-1].runtime_mode,
        total_ms=round(sum(s.total_ms for s in series), 3), phase=key[2], path=key[3],
        host_wait_ms=round(sum(s.host_wait_ms for s in series), 3))


def stats_line(stats) -> str:
    """The vLLM PR's log line, so eager and compiled runs compare exactly as there: an entry per row, so one per
    (batch size, phase) given ``ForwardStats.by_phase``'s rows.

    ``stats``: BatchSizeStat rows or the GetForwardStats reply's messages (same field names)."""
    table = ", ".join(f"({s.batch_size}, {s.count}, {s.median_ms:.2f})" for s in stats)
    return f"Batchsize forward time stats (batchsize, count, median_time(ms)): [{table}]"
