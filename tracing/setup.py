"""Tracing and metrics for a Kiln process, from the standard OpenTelemetry environment variables.

Traces go over OTLP/gRPC to OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT (OTEL_TRACES_EXPORTER=none turns them off).
Metrics are off unless asked for: OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, or OTEL_METRICS_EXPORTER=otlp with the
shared endpoint. The shared endpoint alone is usually Jaeger, which takes traces only and would refuse every
metrics export. With no endpoint nothing is installed, so every span is the API's no-op one. Export runs on the
SDK's own threads behind a bounded queue: a collector that is down or slow costs dropped spans, never serving time.
"""

import logging
import os
import platform
import threading
from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)

# Defaults where the SDK's suit a batch job better than a server; each standard variable still wins.
EXPORT_TIMEOUT_S = 5  # the SDK's 10 s, retried, would hold shutdown that long with the collector gone
MAX_QUEUE_SIZE = 8192  # spans held while the collector is away; the oldest are dropped beyond it
SHUTDOWN_TIMEOUT_S = 5  # the last flush; the SDK's own waits 30 s per provider when the collector is gone


@dataclass
class Telemetry:
    """What init_tracing installed; both None when tracing is off. Call shutdown() before the process exits."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    resource: Resource | None = None

    @property
    def enabled(self) -> bool:
        return self.tracer_provider is not None or self.meter_provider is not None

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flush what is queued and stop exporting; after ``timeout_s`` give up, so a gone collector never holds
        the exit (the flush goes on in a daemon thread until the process ends)."""
        if not self.enabled:
            return
        flush = threading.Thread(target=self._shutdown_providers, name="telemetry-shutdown", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            log.warning("the collector did not take the last spans and metrics in %.0f s; they are dropped", timeout_s)

    def _shutdown_providers(self) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()


_installed = Telemetry(None, None)


def installed_telemetry() -> Telemetry:
    """What init_tracing installed in this process (off until it ran): a server built afterwards exports through it,
    whether the CLI or a Python caller started it."""
    return _installed


def init_tracing(service_name: str, resource_attributes: dict | None = None) -> Telemetry:
    """Install the global tracer and meter providers for ``service_name`` (OTEL_SERVICE_NAME overrides it)."""
    global _installed
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return Telemetry(None, None)
    if not (_endpoint("TRACES") or _endpoint("METRICS")):
        log.debug("tracing off: OTEL_EXPORTER_OTLP_ENDPOINT is not set")
        return Telemetry(None, None)
    telemetry = exporting_telemetry(_resource(service_name, resource_attributes or {}))
    if telemetry.tracer_provider:
        trace.set_tracer_provider(telemetry.tracer_provider)
    if telemetry.meter_provider:
        metrics.set_meter_provider(telemetry.meter_provider)
    _installed = telemetry
    log.info("tracing as %s to %s", telemetry.resource.attributes[SERVICE_NAME],
             _endpoint("TRACES") or _endpoint("METRICS"))
    return telemetry


def exporting_telemetry(resource: Resource) -> Telemetry:
    """Providers for ``resource`` that export over OTLP as the OTEL_* variables say, not installed globally: a
    process that exports for another one (the forward-span writer) uses these with that process's resource."""
    traces_endpoint, metrics_endpoint = _endpoint("TRACES"), _endpoint("METRICS")
    tracer_provider = meter_provider = None
    # Imported here: a server with tracing off does not pay for the OTLP exporters before it listens.
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    if traces_endpoint:
        # Sampler from OTEL_TRACES_SAMPLER[_ARG]. No exit hook: Telemetry.shutdown is the one, bounded, flush.
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        tracer_provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(timeout=_timeout("TRACES")),
            max_queue_size=_env_int("OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUE_SIZE)))
    if metrics_endpoint:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(timeout=_timeout("METRICS")))
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
    return Telemetry(tracer_provider, meter_provider, resource)


def _endpoint(signal: str) -> str:
    """Where ``signal`` goes; empty when it is off. Metrics need their own endpoint or an explicit exporter."""
    exporter = os.environ.get(f"OTEL_{signal}_EXPORTER", "").lower()
    own = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", "")
    if exporter == "none":
        return ""
    if own or signal == "TRACES" or exporter == "otlp":
        return own or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return ""


def _timeout(signal: str) -> float | None:
    """None lets the exporter read the variables itself."""
    if f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT" in os.environ or "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ:
        return None
    return EXPORT_TIMEOUT_S


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an integer") from None


def _resource(service_name: str, attributes: dict) -> Resource:
    """Kiln's defaults, then the caller's attributes, then OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME."""
    ours = {SERVICE_NAME: service_name, **_device_attributes(), **attributes}
    return Resource.create(ours).merge(OTELResourceDetector().detect())


def _device_attributes() -> dict:
    import torch  # here, not at the top: a client with tracing off should not pay for importing torch

    attributes = {"kiln.torch.version": torch.__version__, "host.arch": platform.machine()}
    if torch.cuda.is_available():
        return {**attributes, "kiln.device": "cuda", "kiln.device.name": torch.cuda.get_device_name(0),
                "kiln.device.count": torch.cuda.device_count()}
    return {**attributes, "kiln.device": "cpu", "kiln.device.name": platform.processor() or platform.machine(),
            "kiln.device.count": os.cpu_count() or 1}
