"""One span per Generate, with the OpenTelemetry GenAI attributes; watchers hear when each one starts and ends.

ForwardSpans watches, to parent and link each step's ``forward`` span to the requests it served. With tracing off
every span is the API's no-op one: no watcher hears of it and no attribute is computed.
"""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanContext, Status, StatusCode

from exec_service.engine.sequence import Sequence
from kiln.errors import first_line
from tracing import spans


class RequestWatcher(Protocol):
    def request_started(self, request_id: str, context: SpanContext) -> None: ...

    def request_ended(self, request_id: str) -> None: ...


class RequestSpans:
    """Starts and ends the span of each Generate, telling ``watchers`` the request's span context while it runs."""

    def __init__(self, tracer: trace.Tracer | None = None, watchers: Iterable[RequestWatcher] = ()):
        self._tracer = tracer or spans.tracer
        self.watchers = list(watchers)

    @contextmanager
    def track(self, model: str, seq: Sequence) -> Iterator[trace.Span]:
        """The request's span, a child of the current one (the Generate server span), for the ``with`` body.

        On exit it takes the outcome from ``seq``: usage, finish reason, an event per preemption; an exception is
        the span's error, and leaving before the last token (the client went away) sets ``kiln.cancelled``.
        """
        span = self._tracer.start_span(f"{spans.TEXT_COMPLETION} {model}", attributes=_request_attributes(model, seq))
        watchers = self.watchers if span.get_span_context().is_valid else []
        for watcher in watchers:
            watcher.request_started(seq.request_id, span.get_span_context())
        failed = False
        try:
            yield span
        except Exception as exc:
            failed = True
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, first_line(exc)))
            raise
        finally:
            for watcher in watchers:
                watcher.request_ended(seq.request_id)
            if span.is_recording():
                _record_outcome(span, seq, failed)
            span.end()


def _request_attributes(model: str, seq: Sequence) -> dict:
    params = seq.params
    attributes = {
        spans.GEN_AI_OPERATION_NAME: spans.TEXT_COMPLETION, spans.GEN_AI_REQUEST_MODEL: model,
        spans.GEN_AI_RESPONSE_ID: seq.request_id, spans.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
        spans.GEN_AI_REQUEST_TEMPERATURE: params.temperature, spans.GEN_AI_REQUEST_TOP_P: params.top_p,
        spans.GEN_AI_USAGE_INPUT_TOKENS: seq.num_prompt_tokens,
    }
    if params.top_k:
        attributes[spans.GEN_AI_REQUEST_TOP_K] = params.top_k
    if params.seed is not None:
        attributes[spans.GEN_AI_REQUEST_SEED] = params.seed
    return attributes


def _record_outcome(span: trace.Span, seq: Sequence, failed: bool) -> None:
    usage = seq.usage()
    span.set_attributes({
        spans.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens, spans.QUEUE_S: usage.queue_s,
        spans.NUM_PREEMPTIONS: usage.num_preemptions, spans.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_tokens,
    })
    if seq.first_token_s is not None:
        span.set_attribute(spans.TIME_TO_FIRST_TOKEN_S, usage.time_to_first_token_s)
    if seq.finish_reason is not None:
        span.set_attribute(spans.GEN_AI_RESPONSE_FINISH_REASONS, [seq.finish_reason.value])
    elif not failed:
        span.set_attribute(spans.CANCELLED, True)
    for time_ns, recomputed in list(seq.preemptions):
        span.add_event(spans.PREEMPTION, {spans.RECOMPUTED_TOKENS: recomputed}, timestamp=time_ns)
