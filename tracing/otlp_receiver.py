"""A real OTLP/gRPC receiver on loopback (the protocol Jaeger ingests), collecting spans and metrics.

Where Jaeger cannot run (CI, the benches' machines), tests and benches export to this instead. It needs only
opentelemetry-proto, which the OTLP exporter already depends on.
"""

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    start_ns: int
    end_ns: int
    attributes: dict
    resource: dict
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)
    status: tuple[str, str] = ("UNSET", "")  # (UNSET / OK / ERROR, message)
    events: list[tuple[str, dict]] = field(default_factory=list)  # (name, attributes)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            received = [
                ReceivedSpan(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix(
                        "SPAN_KIND_"), start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes=_attributes(s.attributes), resource=_attributes(rs.resource.attributes),
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                    status=(trace_pb2.Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                            s.status.message),
                    events=[(e.name, _attributes(e.attributes)) for e in s.events])
                for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans
            ]
            with self._lock:
                self._spans.extend(received)
            return trace_service_pb2.ExportTraceServiceResponse()
        with self._lock:
            self._metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def start(self) -> "OtlpReceiver":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id in (None, s.trace_id)]

    def histogram_points(self, name: str) -> list[tuple[dict, dict]]:
        """(resource attributes, data point) of every exported point of histogram ``name``."""
        with self._lock:
            requests = list(self._metrics)
        return [
            (_attributes(rm.resource.attributes),
             {"attributes": _attributes(p.attributes), "count": p.count, "sum": p.sum,
              "bounds": list(p.explicit_bounds)})
            for request in requests for rm in request.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics if m.name == name for p in m.histogram.data_points
        ]

    def wait_for(self, predicate, timeout_s: float = 30.0):
        """Poll until predicate(self) is truthy; returns its value, or fails with what arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate(self)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"not received in {timeout_s}s; spans: {sorted({s.name for s in self.spans()})}")
