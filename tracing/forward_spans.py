"""One ``forward`` span per engine step, timed by the engine's own clock, and the forward-time histogram.

An engine step observer: the engine calls it with each step's record after the step's own sync, so reading the
times costs no extra device sync. The record (exec_service.step_record.StepRecord) is duck-typed; it needs

    model: str            the served model's name
    batch_size: int       sequences in the step
    num_tokens: int       tokens scheduled (prefill chunks + decodes)
    padded_size: int      tokens the compiled code or CUDA graph ran, padding included
    runtime_mode: str     eager / compiled / cudagraph
    phase: str            prefill / decode / mixed
    start_ns, end_ns: int the forward's start and end, wall-clock ns (CUDA events on GPU, host clock on CPU)
    request_ids: Sequence[str]  the requests it served, looked up in ``request_spans`` for links
"""

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping

from opentelemetry import context, metrics, trace
from opentelemetry.trace import Link, SpanContext

from tracing import spans

log = logging.getLogger(__name__)

FORWARD_DURATION = "kiln.forward.duration"
# Steps waiting for the writer thread; past this, steps are counted in ``dropped`` rather than slowing the engine.
PENDING_LIMIT = 10_000
# Forward times run from well under a millisecond (tiny decode) to seconds (long prefill on CPU).
DURATION_BUCKETS_MS = (0.25, 0.5, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100, 150, 250, 500, 1000,
                       2500, 5000)


def forward_span_ratio() -> float:
    """KILN_FORWARD_SPAN_RATIO: the fraction of steps that get a span (default 1.0), so busy servers can thin them."""
    value = os.environ.get("KILN_FORWARD_SPAN_RATIO", "1.0")
    try:
        ratio = float(value)
    except ValueError:
        raise ValueError(f"KILN_FORWARD_SPAN_RATIO: {value!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"KILN_FORWARD_SPAN_RATIO: {ratio} is not in [0, 1]")
    return ratio


class ForwardSpans:
    """Step observer: a span for ``ratio`` of the steps, evenly spaced; the histogram for every step.

    Parent: the first request the step served (the oldest, in scheduler order), so a request's trace shows the
    steps that ran it; links: every request it served. ``request_spans`` maps a request id to its span's
    context (the Generate handler adds and removes entries); ids not in it get no link.

    The engine thread only reads the live request contexts and queues the step: building a span with a link per
    request costs hundreds of microseconds of Python, which a writer thread spends while the engine waits on the
    device instead of between steps.
    """

    def __init__(self, request_spans: Mapping[str, SpanContext] | None = None, ratio: float | None = None,
                 tracer: trace.Tracer | None = None, meter: metrics.Meter | None = None):
        self.request_spans = request_spans if request_spans is not None else {}
        self.ratio = forward_span_ratio() if ratio is None else ratio
        self._tracer = tracer or trace.get_tracer("kiln")
        meter = meter or metrics.get_meter("kiln")
        self._duration = meter.create_histogram(
            FORWARD_DURATION, unit="ms", description="GPU time of one engine forward (host time on CPU)",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_MS))
        self._steps = 0
        self.dropped = 0
        self._pending: queue.Queue = queue.Queue(PENDING_LIMIT)
        threading.Thread(target=self._write, name="forward-spans", daemon=True).start()

    def __call__(self, step) -> None:
        served = [ctx for ctx in map(self.request_spans.get, step.request_ids) if ctx is not None] \
            if self._sampled() else None
        try:
            self._pending.put_nowait((step, served))
        except queue.Full:
            if not self.dropped:
                log.warning("forward spans: the writer is %d steps behind; dropping steps until it catches up",
                            PENDING_LIMIT)
            self.dropped += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued step has its span and histogram point; False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self._pending.unfinished_tasks

    def _sampled(self) -> bool:
        """Deterministic: step n is sampled when floor(n * ratio) moves, so ratio 0.25 is every 4th step."""
        before = int(self._steps * self.ratio)
        self._steps += 1
        return int(self._steps * self.ratio) > before

    def _write(self) -> None:
        while True:
            step, served = self._pending.get()
            try:
                self._duration.record((step.end_ns - step.start_ns) / 1e6,
                                      {spans.BATCH_SIZE: step.batch_size, spans.RUNTIME_MODE: step.runtime_mode})
                if served is not None:
                    self._emit(step, served)
            except Exception:  # noqa: BLE001 - telemetry never stops serving
                log.exception("forward span of a %s step failed", step.model)
            finally:
                self._pending.task_done()

    def _emit(self, step, served: list[SpanContext]) -> None:
        parent = trace.set_span_in_context(trace.NonRecordingSpan(served[0])) if served else context.Context()
        span = self._tracer.start_span(
            spans.FORWARD, context=parent, links=[Link(ctx) for ctx in served], start_time=step.start_ns,
            attributes={
                spans.MODEL: step.model, spans.BATCH_SIZE: step.batch_size, spans.NUM_TOKENS: step.num_tokens,
                spans.PADDED_SIZE: step.padded_size, spans.RUNTIME_MODE: step.runtime_mode, spans.PHASE: step.phase,
            })
        span.end(end_time=step.end_ns)
