"""Tracing: spans across a real compile server into a real OTLP receiver, setup from the environment, forward spans.

Processes that install global providers (init_tracing) run as children, so this process's own provider state
never depends on test order; the forward-span writer is checked against the SDK's own in-memory exporter and
reader.
"""

import asyncio
import json
import logging
import multiprocessing
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import TINY_CONFIG, TINY_MODEL, client_tracer, otel_env
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exec_service.telemetry import forward_stats
from exec_service.telemetry.batch_size_log import BatchSizeLog, log_batchsize_interval
from exec_service.telemetry.forward_stats import ForwardStats, stats_line
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.step_record import StepRecord
from protos import compile_pb2, compile_pb2_grpc
from tracing import spans
from tracing.forward_span_writer import DURATION_BUCKETS_MS, FORWARD_DURATION, ForwardSpanWriter
from tracing.forward_spans import EvenSampler, ForwardSpans, forward_span_ratio
from tracing.grpc_instrumentation import instrumented_aio_channel, instrumented_channel

COMPILE_RPC = "/kiln.v1.CompileService/Compile"


def run_python(code: str, env: dict, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


# --- one trace across the client and a real compile server ---

def test_compile_is_one_trace_from_client_to_inductor(traced_compile_server, otlp_receiver):
    provider, tracer = client_tracer(otlp_receiver.endpoint)
    request = compile_pb2.CompileRequest(model=TINY_MODEL, config=TINY_CONFIG)
    with tracer.start_as_current_span("client compile") as root:
        channel = instrumented_channel(traced_compile_server.address, CHANNEL_OPTIONS, tracer_provider=provider)
        events = list(compile_pb2_grpc.CompileServiceStub(channel).Compile(request))
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        channel.close()
    result = events[-1].result
    assert not result.cache_hit
    trace_id = format(root.get_span_context().trace_id, "032x")
    # Each process exports in the order spans end; the last to end in each: all there.
    otlp_receiver.wait_for(lambda r: {("client compile", "INTERNAL"), (COMPILE_RPC, "SERVER")} <= {
        (s.name, s.kind) for s in r.spans(trace_id)})
    trace = otlp_receiver.spans(trace_id)
    named = {s.name: s for s in trace}

    client_rpc = next(s for s in trace if s.name == COMPILE_RPC and s.kind == "CLIENT")
    server_rpc = next(s for s in trace if s.name == COMPILE_RPC and s.kind == "SERVER")
    compile_span = named[spans.COMPILE]
    assert client_rpc.parent_span_id == named["client compile"].span_id
    assert server_rpc.parent_span_id == client_rpc.span_id
    assert compile_span.parent_span_id == server_rpc.span_id  # the worker thread carried the handler's context
    assert server_rpc.resource["service.name"] == "kiln-compile"
    assert server_rpc.resource["kiln.device"] == "cpu"
    assert server_rpc.resource["deployment.environment"] == "ci"  # OTEL_RESOURCE_ATTRIBUTES
    assert named["client compile"].resource["service.name"] == "kiln-test-client"
    assert not [s for s in otlp_receiver.spans() if "Health" in s.name]

    assert compile_span.attributes == {
        spans.MODEL: "tiny-llama", spans.CACHE_KEY: result.key.digest, spans.CACHE_HIT: False,
        spans.NUM_PIECES: result.num_pieces, spans.BYTES: result.bundle_bytes}
    phases = [s for s in trace if s.parent_span_id == compile_span.span_id]
    assert {s.name for s in phases} == {spans.TRACE, spans.SPLIT, spans.INDUCTOR, spans.SAVE}
    # tiny-llama's layers are one kind: one trace and one split, of the layer that serves both.
    assert named[spans.TRACE].attributes == {spans.REGION: "layer0"}
    # q/k/v's three products made one and gate/up's two (three calls gone); no FP8 quantize to route, no FP8 product
    # to add the residual to in bf16, and on the CPU no rotary given the attention op
    assert named[spans.SPLIT].attributes == {spans.NUM_PIECES: result.num_pieces, spans.NUM_SPLITS: result.num_splits,
                                             spans.MERGED_LINEARS: 3, spans.ROUTED_QUANTIZES: 0,
                                             spans.FUSED_RESIDUAL_ADDS: 0, spans.ROUTED_ROTARIES: 0,
                                             spans.REGION: "layer0"}
    assert named[spans.SAVE].attributes == {spans.BYTES: result.bundle_bytes}
    assert named[spans.TRACE].end_ns <= named[spans.SPLIT].start_ns  # Dynamo, then the backend's own phases

    inductor = [s for s in phases if s.name == spans.INDUCTOR]
    sizes = ["symbolic", *map(str, TINY_CONFIG.compile_sizes)]
    assert sorted((s.attributes[spans.PIECE], s.attributes[spans.COMPILE_SIZE]) for s in inductor) == sorted(
        (piece, size) for piece in range(1, result.num_pieces + 1) for size in sizes)
    assert all(isinstance(s.attributes[spans.CACHE_HIT], bool) and s.attributes[spans.REGION] == "layer0"
               for s in inductor)
    for s in phases:
        assert compile_span.start_ns <= s.start_ns <= s.end_ns <= compile_span.end_ns


def test_aio_channel_continues_the_callers_trace(traced_compile_server, otlp_receiver):
    provider, tracer = client_tracer(otlp_receiver.endpoint)

    async def list_artifacts():
        async with instrumented_aio_channel(traced_compile_server.address, tracer_provider=provider) as channel:
            return await compile_pb2_grpc.CompileServiceStub(channel).ListArtifacts(compile_pb2.ListArtifactsRequest())

    with tracer.start_as_current_span("client list") as root:
        asyncio.run(list_artifacts())
    trace_id = format(root.get_span_context().trace_id, "032x")
    rpc = "/kiln.v1.CompileService/ListArtifacts"
    trace = otlp_receiver.wait_for(lambda r: len([s for s in r.spans(trace_id) if s.name == rpc]) == 2
                                   and r.spans(trace_id))
    client = next(s for s in trace if s.name == rpc and s.kind == "CLIENT")
    server = next(s for s in trace if s.name == rpc and s.kind == "SERVER")
    assert client.parent_span_id == root.get_span_context().span_id.to_bytes(8, "big").hex()
    assert server.parent_span_id == client.span_id


# --- setup from the environment ---

@pytest.mark.parametrize("off", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": None},
    {"OTEL_SDK_DISABLED": "true"},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
], ids=["no-endpoint", "sdk-disabled", "exporters-none"])
def test_tracing_off_installs_nothing_and_costs_nothing(off, otlp_receiver, request):
    service = f"kiln-off-{request.node.callspec.id}"
    env = {k: v for k, v in {**otel_env(otlp_receiver.endpoint, OTEL_SERVICE_NAME=service), **off}.items()
           if v is not None}
    out = run_python("""
        import json, sys
        from opentelemetry import metrics, trace
        from tracing import spans
        from tracing.grpc_instrumentation import instrumented_channel, server_interceptors
        from tracing.setup import init_tracing

        telemetry = init_tracing("kiln-compile")
        with spans.phase_span(spans.SAVE, bytes=1) as span:
            recording = span.is_recording()
        telemetry.shutdown()
        print(json.dumps({
            "enabled": telemetry.enabled, "recording": recording,
            "proxy_tracer": isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider),
            "proxy_meter": type(metrics.get_meter_provider()).__name__,
            "interceptors": len(server_interceptors()),
            "plain_channel": type(instrumented_channel("127.0.0.1:1")).__module__ == "grpc._channel",
            "torch": "torch" in sys.modules,
            "exporters": sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter"))}))
    """, env)
    # Not even imported: what the execute service would otherwise load before it listens.
    assert out == {**out, "enabled": False, "recording": False, "proxy_tracer": True,
                   "proxy_meter": "_ProxyMeterProvider", "interceptors": 0, "plain_channel": True, "torch": False,
                   "exporters": []}
    assert "Traceback" not in out["stderr"] and "ERROR" not in out["stderr"]
    assert not [s for s in otlp_receiver.spans() if s.resource.get("service.name") == service]


def test_dead_collector_never_slows_span_creation():
    with __import__("socket").socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    out = run_python("""
        import json, time
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from tracing.setup import MAX_QUEUE_SIZE, init_tracing

        def loop(tracer) -> float:
            start = time.perf_counter()
            for i in range(20000):
                with tracer.start_as_current_span("forward", attributes={"kiln.batch_size": i % 32}):
                    pass
            return time.perf_counter() - start

        live = TracerProvider()  # the same batch processor, in front of an exporter that always takes the spans
        live.add_span_processor(BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=MAX_QUEUE_SIZE))
        baseline_s = loop(live.get_tracer("bench"))
        telemetry = init_tracing("kiln-exec")
        loop_s = loop(trace.get_tracer("bench"))
        start = time.perf_counter()
        telemetry.shutdown()
        print(json.dumps({"baseline_s": baseline_s, "loop_s": loop_s, "shutdown_s": time.perf_counter() - start}))
    """, otel_env(f"http://127.0.0.1:{dead}", OTEL_BSP_SCHEDULE_DELAY="10"))
    # The export retries run on the SDK's thread: spans cost what they cost with a live collector (2x: noise of a
    # shared CI host; blocking on the dead collector costs orders of magnitude more).
    assert out["loop_s"] < 2 * out["baseline_s"], out
    assert out["shutdown_s"] < 10, out  # Telemetry's bound (5 s), not the SDK's 30 s


def test_init_tracing_exports_forward_spans_and_the_histogram(otlp_receiver):
    """The exec service's setup end to end: the writer process exports the engine's step records with the serving
    process's resource (OTEL_SERVICE_NAME wins), thinned by KILN_FORWARD_SPAN_RATIO, linked across the process."""
    out = run_python("""
        import json
        from opentelemetry import trace
        from kiln.step_record import StepRecord
        from tracing.forward_spans import ForwardSpans
        from tracing.setup import init_tracing

        telemetry = init_tracing("kiln-exec", {"kiln.model": "metric-model"})
        request = trace.get_tracer("test").start_span("generate r1")
        observer = ForwardSpans(telemetry.resource)
        observer.request_started("r1", request.get_span_context())
        for i in range(6):
            observer(StepRecord(model="metric-model", batch_size=3, num_tokens=3, padded_size=4,
                                runtime_mode="compiled", path="compiled", phase="decode",
                                start_ns=1_000_000_000 + i * 10_000_000,
                                end_ns=1_007_000_000 + i * 10_000_000, request_ids=("r1", "gone")))
        request.end()
        observer.request_ended("r1")  # at once: the writer may not have made the steps' spans yet
        observer.close()
        telemetry.shutdown()
        context = request.get_span_context()
        print(json.dumps({"enabled": telemetry.enabled, "trace_id": f"{context.trace_id:032x}",
                          "span_id": f"{context.span_id:016x}"}))
    """, otel_env(otlp_receiver.endpoint, OTEL_SERVICE_NAME="exec-renamed", KILN_FORWARD_SPAN_RATIO="0.5",
                  OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=otlp_receiver.endpoint))
    assert out["enabled"]
    forward = sorted((s for s in otlp_receiver.spans() if s.attributes.get(spans.MODEL) == "metric-model"),
                     key=lambda s: s.start_ns)
    assert [s.start_ns for s in forward] == [1_010_000_000, 1_030_000_000, 1_050_000_000]  # every 2nd step
    for span in forward:
        assert span.resource["service.name"] == "exec-renamed" and span.resource["kiln.model"] == "metric-model"
        assert span.end_ns - span.start_ns == 7_000_000
        assert span.attributes == {spans.MODEL: "metric-model", spans.BATCH_SIZE: 3, spans.NUM_TOKENS: 3,
                                   spans.PADDED_SIZE: 4, spans.RUNTIME_MODE: "compiled", spans.PHASE: "decode",
                                   spans.PATH: "compiled"}
        assert (span.trace_id, span.parent_span_id) == (out["trace_id"], out["span_id"])
        assert span.links == [(out["trace_id"], out["span_id"])]  # "gone" has no span
    points = [p for resource, p in otlp_receiver.histogram_points(FORWARD_DURATION)
              if resource["service.name"] == "exec-renamed"]
    assert points[-1]["attributes"] == {spans.BATCH_SIZE: 3, spans.RUNTIME_MODE: "compiled", spans.PHASE: "decode",
                                        spans.PATH: "compiled"}
    assert points[-1]["count"] == 6 and points[-1]["sum"] == pytest.approx(42.0)  # every step
    assert points[-1]["bounds"] == list(DURATION_BUCKETS_MS)


def test_a_dead_span_writer_never_stops_the_engine(caplog):
    """The writer process killed mid-run: steps keep being accepted at no cost, one warning says spans are off."""
    observer = ForwardSpans(Resource({"service.name": "kiln-exec"}), ratio=1.0)
    (writer,) = [p for p in multiprocessing.active_children() if p.name == "kiln-forward-spans"]
    writer.kill()
    writer.join(10)
    with caplog.at_level(logging.WARNING, logger="tracing.forward_spans"):
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            for record in steps(50, []):
                observer(record)
            time.sleep(0.06)
        started = time.monotonic()
        observer.close()
    assert time.monotonic() - started < 1
    (warning,) = caplog.records
    assert "forward-span writer exited" in warning.getMessage() and "are off" in warning.getMessage()


# --- forward spans from engine steps, as the writer process builds them ---

@pytest.fixture
def sdk():
    """A tracer and meter of their own, read back in memory: the real SDK, no global state."""
    spans_out, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans_out))
    meters = MeterProvider(metric_readers=[reader])
    yield provider.get_tracer("tests"), meters.get_meter("tests"), spans_out, reader
    provider.shutdown()
    meters.shutdown()


def steps(n: int, request_ids: list[str]) -> list[StepRecord]:
    """n steps as the engine records them, of increasing forward time (1, 2, ... ms), 10 ms apart."""
    base = time.time_ns()
    return [StepRecord(model="tiny-llama", batch_size=2, num_tokens=9, padded_size=16, runtime_mode="cudagraph",
                       path="mixed_graph", phase="mixed", start_ns=base + i * 10_000_000,
                       end_ns=base + i * 10_000_000 + (i + 1) * 1_000_000, request_ids=tuple(request_ids))
            for i in range(n)]


def test_forward_span_per_step_with_gpu_times_attributes_and_links(sdk):
    tracer, meter, out, _ = sdk
    requests = {rid: tracer.start_span(f"generate {rid}") for rid in ("a", "b")}
    contexts = {rid: span.get_span_context() for rid, span in requests.items()}
    writer = ForwardSpanWriter(tracer, meter)
    records = steps(3, ["b", "a"])
    for record in records:
        writer.write(record, [contexts[r] for r in record.request_ids])

    forward = [s for s in out.get_finished_spans() if s.name == spans.FORWARD]
    assert len(forward) == 3
    for span, record in zip(forward, records, strict=True):
        assert (span.start_time, span.end_time) == (record.start_ns, record.end_ns)
        assert dict(span.attributes) == {
            spans.MODEL: "tiny-llama", spans.BATCH_SIZE: 2, spans.NUM_TOKENS: 9, spans.PADDED_SIZE: 16,
            spans.RUNTIME_MODE: "cudagraph", spans.PHASE: "mixed", spans.PATH: "mixed_graph"}
        assert [link.context for link in span.links] == [contexts["b"], contexts["a"]]
        assert span.parent.span_id == contexts["b"].span_id  # the oldest request it served
        assert span.context.trace_id == contexts["b"].trace_id


def test_forward_span_of_no_known_request_is_a_root(sdk):
    tracer, meter, out, _ = sdk
    ForwardSpanWriter(tracer, meter).write(steps(1, [])[0], [])
    (span,) = out.get_finished_spans()
    assert span.parent is None and not span.links


def test_unsampled_steps_get_the_histogram_but_no_span(sdk):
    tracer, meter, out, reader = sdk
    writer = ForwardSpanWriter(tracer, meter)
    sampled = EvenSampler(0.25)
    for record in steps(8, []):
        writer.write(record, [] if sampled() else None)
    assert len(out.get_finished_spans()) == 2  # every 4th step

    (metric,) = [m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == FORWARD_DURATION]
    (point,) = metric.data.data_points
    assert metric.unit == "ms" and point.count == 8
    assert dict(point.attributes) == {spans.BATCH_SIZE: 2, spans.RUNTIME_MODE: "cudagraph", spans.PHASE: "mixed",
                                      spans.PATH: "mixed_graph"}
    assert point.sum == pytest.approx(sum(range(1, 9)))  # step i lasts i + 1 ms


def test_even_sampler_spaces_the_sampled_steps():
    for ratio, expected in ((0.0, "0000000000"), (1.0, "1111111111"), (0.5, "0101010101"), (0.3, "0001001001")):
        sampled = EvenSampler(ratio)
        assert "".join(str(int(sampled())) for _ in range(10)) == expected, ratio


def test_ratio_and_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv("KILN_FORWARD_SPAN_RATIO", raising=False)
    monkeypatch.delenv("KILN_LOG_BATCHSIZE_INTERVAL", raising=False)
    assert forward_span_ratio() == 1.0 and log_batchsize_interval() is None
    monkeypatch.setenv("KILN_FORWARD_SPAN_RATIO", "0.1")
    monkeypatch.setenv("KILN_LOG_BATCHSIZE_INTERVAL", "2.5")
    assert forward_span_ratio() == 0.1 and log_batchsize_interval() == 2.5
    monkeypatch.setenv("KILN_LOG_BATCHSIZE_INTERVAL", "-1")
    assert log_batchsize_interval() is None
    for bad in ("1.5", "lots"):
        monkeypatch.setenv("KILN_FORWARD_SPAN_RATIO", bad)
        with pytest.raises(ValueError, match="KILN_FORWARD_SPAN_RATIO"):
            forward_span_ratio()
    monkeypatch.setenv("KILN_LOG_BATCHSIZE_INTERVAL", "soon")
    with pytest.raises(ValueError, match="KILN_LOG_BATCHSIZE_INTERVAL"):
        log_batchsize_interval()


# --- the periodic forward-time table ---

def test_batch_size_log_reports_the_table_as_line_and_span(sdk, caplog):
    """The log line keeps vLLM's format, an entry per (batch size, phase) with its paths merged; the span has a row
    per (batch size, phase, path)."""
    tracer, _, out, _ = sdk
    stats = ForwardStats()
    for ms in (6.0, 7.0, 6.5):
        stats.record("tiny-llama", 1, ms, "cudagraph", "decode", "full_graph")
    stats.record("tiny-llama", 1, 20.0, "cudagraph", "prefill", "mixed_graph")
    stats.record("tiny-llama", 1, 40.0, "cudagraph", "prefill", "compiled")
    stats.record("tiny-llama", 32, 7.51, "cudagraph", "decode", "full_graph")
    stats.record("other", 4, 3.0, "eager", "decode", "eager")
    report = BatchSizeLog(stats, interval_s=0.2, tracer=tracer)
    step = steps(1, [])[0]

    with caplog.at_level(logging.INFO, logger="exec_service.telemetry.batch_size_log"):
        report(step)  # the interval has not passed yet
        assert not caplog.records and not out.get_finished_spans()
        time.sleep(0.25)
        report(step)
        report.join()
    assert {r.threadName for r in caplog.records} == {"batch-size-log"}  # never on the engine's thread
    merged = stats.by_phase()
    lines = {m: [s for s in merged if s.model == m] for m in ("other", "tiny-llama")}
    assert [r.getMessage() for r in caplog.records] == [f"{m}: {stats_line(rows)}" for m, rows in lines.items()]
    assert caplog.records[1].getMessage().endswith(
        "Batchsize forward time stats (batchsize, count, median_time(ms)): [(1, 3, 6.50), (1, 2, 30.00), "
        "(32, 1, 7.51)]")

    snapshot = stats.snapshot()
    by_model = {m: [s for s in snapshot if s.model == m] for m in ("other", "tiny-llama")}
    assert [(s.batch_size, s.phase, s.path) for s in by_model["tiny-llama"]] == [
        (1, "decode", "full_graph"), (1, "prefill", "compiled"), (1, "prefill", "mixed_graph"),
        (32, "decode", "full_graph")]
    emitted = {s.attributes[spans.MODEL]: s for s in out.get_finished_spans()}
    assert set(emitted) == {"other", "tiny-llama"}
    for model, rows in by_model.items():
        span = emitted[model]
        assert span.name == spans.FORWARD_STATS and span.parent is None
        assert list(span.attributes[spans.STATS_BATCH_SIZES]) == [s.batch_size for s in rows]
        assert list(span.attributes[spans.STATS_COUNTS]) == [s.count for s in rows]
        assert list(span.attributes[spans.STATS_MEDIAN_MS]) == [s.median_ms for s in rows]
        assert list(span.attributes[spans.STATS_P90_MS]) == [s.p90_ms for s in rows]
        assert list(span.attributes[spans.STATS_P99_MS]) == [s.p99_ms for s in rows]
        assert list(span.attributes[spans.STATS_RUNTIME_MODES]) == [s.runtime_mode for s in rows]
        assert list(span.attributes[spans.STATS_PHASES]) == [s.phase for s in rows]
        assert list(span.attributes[spans.STATS_PATHS]) == [s.path for s in rows]
        assert span.end_time - span.start_time >= 0.2e9  # it covers the interval it reports on


def test_forward_stats_readers_sort_outside_the_lock(monkeypatch):
    """GetForwardStats and the log line copy the series under the lock and sort them outside it, so the engine
    thread's record of its next step never waits for them."""
    stats = ForwardStats()
    for ms in (1.0, 3.0, 2.0):
        stats.record("tiny-llama", 1, ms, "eager", "decode", "eager")
    computed = []

    def stat_outside_the_lock(key, series):
        assert not stats._lock.locked()
        computed.append(key)
        return stat(key, series)

    stat = forward_stats._stat
    monkeypatch.setattr(forward_stats, "_stat", stat_outside_the_lock)
    assert [s.median_ms for s in stats.snapshot()] == [s.median_ms for s in stats.by_phase()] == [2.0]
    assert [s.count for s in stats.snapshot(reset=True)] == [3] and not stats.snapshot()
    assert len(computed) == 3


def test_batch_size_log_off_reports_nothing(sdk, caplog, monkeypatch):
    tracer, _, out, _ = sdk
    monkeypatch.delenv("KILN_LOG_BATCHSIZE_INTERVAL", raising=False)
    stats = ForwardStats()
    stats.record("tiny-llama", 1, 1.0, "eager")
    with caplog.at_level(logging.INFO, logger="exec_service.telemetry.batch_size_log"):
        BatchSizeLog(stats, tracer=tracer)(steps(1, [])[0])
    assert not caplog.records and not out.get_finished_spans()


# --- phase spans ---

def test_phase_span_logs_its_time_and_nests(sdk, caplog, monkeypatch):
    tracer, _, out, _ = sdk
    monkeypatch.setattr(spans, "tracer", tracer)
    with caplog.at_level(logging.INFO, logger="tracing.spans"):
        with spans.phase_span(spans.FETCH, model="tiny-llama") as fetch:
            with spans.phase_span(spans.LOAD_WEIGHTS) as load:
                load.set_attribute(spans.BYTES, 123)
    finished = {s.name: s for s in out.get_finished_spans()}
    assert finished[spans.LOAD_WEIGHTS].parent.span_id == fetch.get_span_context().span_id
    assert dict(finished[spans.FETCH].attributes) == {spans.MODEL: "tiny-llama"}
    assert dict(finished[spans.LOAD_WEIGHTS].attributes) == {spans.BYTES: 123}
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("load_weights took ") and messages[0].endswith(" s")
    assert messages[1].startswith("fetch took ") and messages[1].endswith(" s (model=tiny-llama)")
