"""Every KILN_LOG_BATCHSIZE_INTERVAL seconds, the forward-time table: vLLM's log line (an entry per batch size and
phase) and a ``forward_stats`` span (a row per batch size, phase and path).

Off when the variable is unset, like vLLM's VLLM_LOG_BATCHSIZE_INTERVAL. Driven by the engine's steps (an idle
engine has nothing new to report), but the report itself runs in a thread of its own: sorting every series' samples
takes tens of ms once they are full (133 ms for 64 full series on the CPU host), which on the engine thread held back
that step's tokens, and every stream's next one.
"""

import itertools
import logging
import os
import threading
import time

from opentelemetry import context, trace

from exec_service.telemetry.forward_stats import BatchSizeStat, ForwardStats, stats_line
from kiln.step_record import StepRecord
from tracing import spans

log = logging.getLogger(__name__)


def log_batchsize_interval() -> float | None:
    """KILN_LOG_BATCHSIZE_INTERVAL in seconds; None (off) when unset or negative."""
    value = os.environ.get("KILN_LOG_BATCHSIZE_INTERVAL", "")
    if not value:
        return None
    try:
        interval = float(value)
    except ValueError:
        raise ValueError(f"KILN_LOG_BATCHSIZE_INTERVAL: {value!r} is not a number of seconds") from None
    return interval if interval >= 0 else None


class BatchSizeLog:
    """Step observer: once ``interval_s`` has passed since the last report, report ``stats`` for every model."""

    def __init__(self, stats: ForwardStats, interval_s: float | None = None, tracer: trace.Tracer | None = None):
        self.stats = stats
        self.interval_s = log_batchsize_interval() if interval_s is None else interval_s
        self._tracer = tracer or trace.get_tracer("kiln")
        self._last = time.monotonic()
        self._last_ns = time.time_ns()
        self._reporter: threading.Thread | None = None

    def __call__(self, step: StepRecord) -> None:
        """A step observer (the engine thread): starts the report when it is due, and returns."""
        if self.interval_s is None or time.monotonic() - self._last < self.interval_s:
            return
        if self._reporter is not None and self._reporter.is_alive():
            return  # the last one is still being written
        self._last = time.monotonic()
        self._reporter = threading.Thread(target=self.report, name="batch-size-log", daemon=True)
        self._reporter.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the report being written, if one is."""
        if self._reporter is not None:
            self._reporter.join(timeout_s)

    def report(self) -> None:
        """Log and emit the table now; the span covers the time since the previous report."""
        start_ns, self._last_ns, self._last = self._last_ns, time.time_ns(), time.monotonic()
        for model, rows in itertools.groupby(self.stats.by_phase(), key=lambda s: s.model):
            log.info("%s: %s", model, stats_line(list(rows)))
        for model, rows in itertools.groupby(self.stats.snapshot(), key=lambda s: s.model):
            self._emit(model, list(rows), start_ns)

    def _emit(self, model: str, rows: list[BatchSizeStat], start_ns: int) -> None:
        span = self._tracer.start_span(spans.FORWARD_STATS, context=context.Context(), start_time=start_ns, attributes={
            spans.MODEL: model,
            spans.STATS_BATCH_SIZES: [s.batch_size for s in rows],
            spans.STATS_COUNTS: [s.count for s in rows],
            spans.STATS_MEDIAN_MS: [s.median_ms for s in rows],
            spans.STATS_P90_MS: [s.p90_ms for s in rows],
            spans.STATS_P99_MS: [s.p99_ms for s in rows],
            spans.STATS_RUNTIME_MODES: [s.runtime_mode for s in rows],
            spans.STATS_PHASES: [s.phase for s in rows],
            spans.STATS_PATHS: [s.path for s in rows],
        })
        span.end(end_time=self._last_ns)
