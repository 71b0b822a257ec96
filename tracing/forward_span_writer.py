"""Builds the ``forward`` spans and the forward-time histogram, in a process of its own.

A forward span that links every request of a large batch is a lot of SDK and OTLP-encoder Python. In the serving
process that work holds the GIL the engine thread needs between steps (BENCHMARKS.md, tracing cost, has what it
cost), so ForwardSpans ships each step's few numbers here over a pipe and this process, with the serving process's
resource and the same OTEL_* settings, builds and exports them.

Messages, in the order the serving process sent them (a request starts before any step serves it):
    (REQUEST_STARTED, request_id, trace_id, span_id, trace_flags)   its span's context, for links
    (REQUEST_ENDED, request_id)
    (STEP, StepRecord, sampled)        not sampled: histogram only, and the record comes without its request ids
"""

import logging
import signal
from collections import OrderedDict
from multiprocessing.connection import Connection

from opentelemetry import context, metrics, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Link, SpanContext, TraceFlags

from kiln.step_record import StepRecord
from tracing import spans
from tracing.setup import exporting_telemetry

log = logging.getLogger(__name__)

FORWARD_DURATION = "kiln.forward.duration"
# Forward times run from well under a millisecond (tiny decode) to seconds (long prefill on CPU).
DURATION_BUCKETS_MS = (0.25, 0.5, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100, 150, 250, 500, 1000,
                       2500, 5000)

REQUEST_STARTED, REQUEST_ENDED, STEP = "started", "ended", "step"
# Contexts of requests that ended, kept for the steps still to come that served them: a request cancelled while
# its last step runs ends before that step's message is sent, and that step's span still belongs in its trace.
ENDED_KEPT = 4096


class ForwardSpanWriter:
    """A histogram point for every step; a span for the sampled ones (those that come with their served requests).

    Parent: the first request the step served (the oldest, in scheduler order), so a request's trace shows the
    steps that ran it; links: every request it served.
    """

    def __init__(self, tracer: trace.Tracer, meter: metrics.Meter):
        self._tracer = tracer
        self._duration = meter.create_histogram(
            FORWARD_DURATION, unit="ms", description="GPU time of one engine forward (host time on CPU)",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_MS))

    def write(self, step: StepRecord, served: list[SpanContext] | None) -> None:
        self._duration.record(step.forward_ms,
                              {spans.BATCH_SIZE: step.batch_size, spans.PHASE: step.phase, spans.PATH: step.path,
                               spans.RUNTIME_MODE: step.runtime_mode})
        if served is None:
            return
        parent = trace.set_span_in_context(trace.NonRecordingSpan(served[0])) if served else context.Context()
        attributes = {
            spans.MODEL: step.model, spans.BATCH_SIZE: step.batch_size, spans.NUM_TOKENS: step.num_tokens,
            spans.PADDED_SIZE: step.padded_size, spans.RUNTIME_MODE: step.runtime_mode, spans.PHASE: step.phase,
            spans.PATH: step.path,
        }
        if step.host_wait_ns >= 0:
            attributes[spans.HOST_WAIT_MS] = round(step.host_wait_ns / 1e6, 3)
        span = self._tracer.start_span(spans.FORWARD, context=parent, links=[Link(ctx) for ctx in served],
                                       start_time=step.start_ns, attributes=attributes)
        span.end(end_time=step.end_ns)


def serve(messages: Connection, resource_attributes: dict, log_level: int) -> None:
    """The writer process: handle every batch of messages that arrives until ``None`` or the serving process is
    gone (end of pipe), then flush the exporters within their bound and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the server says when
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    telemetry = exporting_telemetry(Resource(resource_attributes))
    writer = ForwardSpanWriter(
        telemetry.tracer_provider.get_tracer("kiln") if telemetry.tracer_provider else trace.NoOpTracer(),
        telemetry.meter_provider.get_meter("kiln") if telemetry.meter_provider else metrics.NoOpMeter("kiln"))
    known = _RequestContexts()
    try:
        while (batch := _receive(messages)) is not None:
            for message in batch:
                kind = message[0]
                if kind == REQUEST_STARTED:
                    _, request_id, trace_id, span_id, flags = message
                    known.started(request_id, SpanContext(trace_id, span_id, is_remote=True,
                                                          trace_flags=TraceFlags(flags)))
                elif kind == REQUEST_ENDED:
                    known.ended(message[1])
                else:
                    _, step, sampled = message
                    _write(writer, step, step.request_ids if sampled else None, known)
    finally:
        telemetry.shutdown()


class _RequestContexts:
    """Request id -> its span's context: every running request, and the last ENDED_KEPT that ended."""

    def __init__(self):
        self._live: dict[str, SpanContext] = {}
        self._ended: OrderedDict[str, SpanContext] = OrderedDict()

    def started(self, request_id: str, context: SpanContext) -> None:
        self._live[request_id] = context

    def ended(self, request_id: str) -> None:
        context = self._live.pop(request_id, None)
        if context is not None:
            self._ended[request_id] = context
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def get(self, request_id: str) -> SpanContext | None:
        return self._live.get(request_id) or self._ended.get(request_id)


def _write(writer: ForwardSpanWriter, step: StepRecord, request_ids: tuple[str, ...] | None,
           known: _RequestContexts) -> None:
    """Ids of requests whose span this process never heard of (tracing off for them) get no link."""
    contexts = None if request_ids is None else [known.get(r) for r in request_ids]
    served = None if contexts is None else [c for c in contexts if c is not None]
    try:
        writer.write(step, served)
    except Exception:  # noqa: BLE001 - one bad step does not end the others' spans
        log.exception("forward span of a %s step failed", step.model)


def _receive(messages: Connection) -> list | None:
    try:
        return messages.recv()
    except EOFError:
        return None
