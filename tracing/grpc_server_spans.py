"""Server spans for grpc.aio servers that say what the client got, continuing the caller's W3C trace.

opentelemetry-instrumentation-grpc's aio server interceptor leaves a rejected call's span without an error (the
RPC conventions count INVALID_ARGUMENT, NOT_FOUND, ... as the client's concern), records one abort as two
identical "Locally aborted" events, and ends a call the client cancelled as if it succeeded. Here every server span
carries the status code the client got (``rpc.grpc.status_code``) and, for anything but OK, an error status with
the message the client read; a call cancelled or past its deadline before it finished says so.
"""

import asyncio
import inspect
from collections.abc import Callable

import grpc
from opentelemetry import context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kiln.errors import first_line

RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
CALL_ENDED_EARLY = "rpc.call_ended_early"  # event: cancelled or past its deadline


class ServerSpans(grpc.aio.ServerInterceptor):
    """A SERVER span around each unary or server-streaming call that ``filter_`` (handler call details -> bool)
    lets through."""

    def __init__(self, tracer: trace.Tracer, filter_: Callable | None = None):
        self._tracer = tracer
        self._filter = filter_

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or (self._filter is not None and not self._filter(handler_call_details)):
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer)
        return handler  # Kiln serves no client-streaming calls, and streams only from async generators

    def _start(self, method: str, servicer_context) -> trace.Span:
        carrier = {m.key: m.value for m in servicer_context.invocation_metadata() or ()}
        service, _, name = method.lstrip("/").partition("/")
        return self._tracer.start_span(method, context=propagate.extract(carrier), kind=SpanKind.SERVER, attributes={
            RPC_SYSTEM: "grpc", RPC_SERVICE: service, RPC_METHOD: name})

    def _unary(self, behavior, method: str):
        async def call(request, servicer_context):
            span = self._start(method, servicer_context)
            outcome = _Outcome(span, servicer_context)
            try:
                with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                    response = await behavior(request, servicer_context)
            except BaseException as exc:
                outcome.failed(exc)
                raise
            outcome.finished()
            return response

        return call

    def _stream(self, behavior, method: str):
        async def call(request, servicer_context):
            span = self._start(method, servicer_context)
            outcome = _Outcome(span, servicer_context)
            responses = behavior(request, servicer_context)
            in_span = trace.set_span_in_context(span)
            try:
                while True:
                    # The span is current while the handler runs, and only then: between messages this generator
                    # may be finished by another task (the event loop's finalizer), where no context was attached.
                    token = context.attach(in_span)
                    try:
                        response = await responses.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        context.detach(token)
                    yield response
            except BaseException as exc:
                outcome.failed(exc)
                raise
            finally:
                await responses.aclose()
            outcome.finished()

        return call


class _Outcome:
    """Ends a server span with what the client got."""

    def __init__(self, span: trace.Span, servicer_context):
        self.span = span
        self.servicer_context = servicer_context

    def finished(self) -> None:
        code = self.servicer_context.code() or grpc.StatusCode.OK
        self._end(code, self.servicer_context.details() or "")

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # context.abort: the status is on the context
            self._end(self.servicer_context.code(), self.servicer_context.details() or "")
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            remaining = self.servicer_context.time_remaining()
            past_deadline = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if past_deadline else grpc.StatusCode.CANCELLED
            reason = "the deadline passed" if past_deadline else "the client cancelled or the server shut down"
            self.span.add_event(CALL_ENDED_EARLY, {"reason": reason})
            self._end(code, f"ended before it finished: {reason}")
        else:  # escaped every handler: gRPC answers UNKNOWN
            self.span.record_exception(exc)
            self._end(grpc.StatusCode.UNKNOWN, first_line(exc))

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        self.span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
        if code != grpc.StatusCode.OK:
            self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
        self.span.end()
