"""HTTP server spans for the OpenAI-compatible ports (``kiln api-server``, ``kiln exec-server --openai-port``),
continuing the HTTP client's W3C trace context (``traceparent``), so an application that traces its own calls sees
one trace from its request through the gateway and the execute service to the engine's steps.

opentelemetry-instrumentation-asgi's middleware: one SERVER span per request, lasting until its answer's last byte
(a stream's whole life), with none per ASGI message (a streamed answer would make one a chunk); health probes are
not traced. With tracing off the app is returned as it is: nothing is paid per request.
"""

from collections.abc import Callable

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

from tracing.grpc_instrumentation import tracing_on

UNTRACED_PATHS = "/health$"  # regular expressions over the URL, comma-separated (the middleware's own format)


def traced_http(app, span_name: Callable[[dict], str]):
    """``app`` behind the middleware when tracing is on; ``span_name(scope)`` names a request's span (a route's
    template rather than its path, so a model's name does not make a span name of its own)."""
    if not tracing_on():
        return app
    return OpenTelemetryMiddleware(app, excluded_urls=UNTRACED_PATHS, exclude_spans=["receive", "send"],
                                   default_span_details=lambda scope: (span_name(scope), {}))
