"""gRPC server and client spans with W3C trace-context propagation, so client -> exec -> compile is one trace.

Client spans come from opentelemetry-instrumentation-grpc, server spans from tracing.grpc_server_spans (which says
why). With no tracer provider installed (tracing off) servers get no interceptor and channels stay plain: nothing
is paid per call.
"""

from collections.abc import Sequence

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, client_interceptor, filters
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel
from opentelemetry.trace import TracerProvider

from tracing.grpc_server_spans import ServerSpans

# Health checks and reflection would be a span each, and tell nothing about a compile or a request.
_TRACED_CALLS = filters.negate(filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection")))


def tracing_on(tracer_provider: TracerProvider | None = None) -> bool:
    """Whether spans would be recorded: a provider given, or one installed (init_tracing) in place of the API's."""
    return tracer_provider is not None or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """For a grpc.aio server: a server span per call, continuing the caller's trace. Call after init_tracing."""
    return [ServerSpans(trace.get_tracer("kiln.grpc"), _TRACED_CALLS)] if tracing_on() else []


def instrumented_channel(address: str, options: Sequence = (), tracer_provider: TracerProvider | None = None,
                         credentials: grpc.ChannelCredentials | None = None,
                         interceptors: Sequence = ()) -> grpc.Channel:
    """A blocking channel (TLS with ``credentials``, plaintext without) whose calls are client spans carrying the
    current trace to the server; ``interceptors`` (a bearer token) run on every call."""
    channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials
               else grpc.insecure_channel(address, options=list(options)))
    if interceptors:
        channel = grpc.intercept_channel(channel, *interceptors)
    if not tracing_on(tracer_provider):
        return channel
    return intercept_channel(channel, client_interceptor(tracer_provider, filter_=_TRACED_CALLS))


def instrumented_aio_channel(address: str, options: Sequence = (), tracer_provider: TracerProvider | None = None,
                             credentials: grpc.ChannelCredentials | None = None,
                             interceptors: Sequence = ()) -> grpc.aio.Channel:
    """The grpc.aio counterpart of instrumented_channel, for calls made from a server's event loop."""
    tracing = aio_client_interceptors(tracer_provider, filter_=_TRACED_CALLS) if tracing_on(tracer_provider) else []
    interceptors = [*interceptors, *tracing] or None
    if credentials:
        return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
