"""The execute service's side of tracing: one cold LoadModel + Generate across both real services is one trace.

``kiln compile-server`` and ``kiln exec-server`` run as child processes with fresh stores, tracing to the session's
real OTLP receiver; the client's own spans go there too. Request spans are also checked on the SDK in memory.
"""

import asyncio
import json
import random
import subprocess
import time
import urllib.request
from collections import Counter

import pytest
from conftest import TINY_CONFIG, TINY_MODEL, client_tracer, otel_env
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer, StatusCode

from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.telemetry.request_spans import RequestSpans
from kiln.errors import Internal
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln_cli.service_process import LocalServices, free_port, kiln_command
from protos import exec_pb2, exec_pb2_grpc
from tracing import spans
from tracing.forward_span_writer import FORWARD_DURATION
from tracing.grpc_instrumentation import instrumented_aio_channel

MODEL = "traced"
PROMPTS = [[(5 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 12, 23)]
MAX_TOKENS = 8
STARTUP = [spans.FETCH, spans.LOAD_WEIGHTS, spans.PROFILE_MEMORY, spans.LOAD_COMPILED, spans.CAPTURE_CUDAGRAPHS]
ROOT = "client load and generate"


@pytest.fixture(scope="module")
def traced_services(otlp_receiver, tmp_path_factory):
    """Both services as `kiln` child processes, fresh store and exec cache, tracing (and metrics) to the receiver."""
    workdir = tmp_path_factory.mktemp("traced-services")
    env = otel_env(otlp_receiver.endpoint, KILN_FORWARD_SPAN_RATIO="1.0", OTEL_METRIC_EXPORT_INTERVAL="200",
                   OTEL_METRICS_EXPORTER="otlp")
    services = LocalServices(workdir, workdir / "store", env)
    try:
        services.start(timeout=120)
        yield services
        services.stop()
    finally:
        services.cleanup()


async def _load_and_generate(address: str, provider) -> tuple[list, list, list]:
    async def generate(stub, prompt):
        request = exec_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True)
        return [response async for response in stub.Generate(request)]

    async with instrumented_aio_channel(address, CHANNEL_OPTIONS, tracer_provider=provider) as channel:
        stub = exec_pb2_grpc.ExecServiceStub(channel)
        events = [e async for e in stub.LoadModel(exec_pb2.LoadModelRequest(name=MODEL, model=TINY_MODEL,
                                                                            config=TINY_CONFIG))]
        responses = await asyncio.gather(*(generate(stub, p) for p in PROMPTS))
        stats = (await stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=MODEL))).stats
    return events, responses, list(stats)


@pytest.fixture(scope="module")
def traced_run(traced_services, otlp_receiver):
    """The client's root span around a cold LoadModel, three concurrent Generates and GetForwardStats; the trace."""
    provider, tracer = client_tracer(otlp_receiver.endpoint)
    with tracer.start_as_current_span(ROOT) as root:
        events, responses, stats = asyncio.run(_load_and_generate(traced_services.exec.address, provider))
    trace_id = format(root.get_span_context().trace_id, "032x")
    steps = sum(s.count for s in stats)

    def complete(receiver):
        trace = receiver.spans(trace_id)
        names = Counter(s.name for s in trace)
        return names[ROOT] == 1 and names[spans.FORWARD] == steps and names[f"text_completion {MODEL}"] == 3 \
            and names[spans.LOAD_MODEL] == 1 and names[spans.COMPILE] == 1 and trace

    trace = otlp_receiver.wait_for(complete)
    return {"events": events, "responses": responses, "stats": stats, "trace": trace, "trace_id": trace_id}


def one(trace, name: str, kind: str | None = None):
    (span,) = [s for s in trace if s.name == name and kind in (None, s.kind)]
    return span


def children(trace, parent) -> list:
    return sorted((s for s in trace if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)


def test_one_trace_from_the_client_through_exec_to_compile(traced_run, otlp_receiver):
    trace = traced_run["trace"]
    by_id = {s.span_id: s for s in trace}
    root = one(trace, ROOT)
    assert root.parent_span_id == "" and root.resource["service.name"] == "kiln-test-client"
    assert all(s.parent_span_id in by_id for s in trace if s is not root), "every span's parent is in the trace"
    # Nothing of this model or its compile went anywhere else.
    elsewhere = [s for s in otlp_receiver.spans() if s.trace_id != traced_run["trace_id"]
                 and (s.attributes.get(spans.MODEL) == MODEL or s.attributes.get(spans.GEN_AI_REQUEST_MODEL) == MODEL)]
    assert not elsewhere

    exec_spans = [s for s in trace if s.resource["service.name"] == "kiln-exec"]
    assert exec_spans and all(s.resource["kiln.device"] == "cpu" for s in exec_spans)
    load_client = one(trace, "/kiln.v1.ExecService/LoadModel", "CLIENT")
    load_server = one(trace, "/kiln.v1.ExecService/LoadModel", "SERVER")
    assert load_client.parent_span_id == root.span_id and load_server.parent_span_id == load_client.span_id
    assert load_server.resource["service.name"] == "kiln-exec"
    load_model = one(trace, spans.LOAD_MODEL)
    assert load_model.parent_span_id == load_server.span_id
    assert load_model.attributes == {spans.MODEL: MODEL, spans.RUNTIME_MODE: "compiled"}


def test_compile_service_spans_are_under_the_exec_fetch_span(traced_run):
    trace = traced_run["trace"]
    fetch = one(trace, spans.FETCH)
    calls = [s for s in children(trace, fetch) if s.kind == "CLIENT"]
    assert [(s.name, s.kind) for s in calls] == [("/kiln.v1.CompileService/Compile", "CLIENT"),
                                                  ("/kiln.v1.CompileService/GetArtifact", "CLIENT")]
    assert all(s.resource["service.name"] == "kiln-exec" for s in calls)
    for client in calls:
        (server,) = children(trace, client)
        assert (server.name, server.kind, server.resource["service.name"]) == (client.name, "SERVER", "kiln-compile")
        assert fetch.start_ns <= client.start_ns <= client.end_ns <= fetch.end_ns

    compile_server = children(trace, calls[0])[0]
    (compile_span,) = children(trace, compile_server)
    assert compile_span.name == spans.COMPILE and compile_span.attributes[spans.CACHE_HIT] is False
    phases = children(trace, compile_span)
    assert {s.name for s in phases} == {spans.TRACE, spans.SPLIT, spans.INDUCTOR, spans.SAVE}
    assert [s.name for s in phases if s.name != spans.INDUCTOR] == [spans.TRACE, spans.SPLIT, spans.SAVE]
    key = traced_run["events"][-1].ready.key.digest
    assert compile_span.attributes[spans.CACHE_KEY] == key == fetch.attributes[spans.CACHE_KEY]
    assert fetch.attributes[spans.SOURCE].startswith("downloaded")


def test_startup_phase_spans_carry_what_startup_measured(traced_run):
    trace = traced_run["trace"]
    load_model = one(trace, spans.LOAD_MODEL)
    phases = children(trace, load_model)
    assert [s.name for s in phases] == STARTUP
    for before, after in zip(phases, phases[1:], strict=False):
        assert before.end_ns <= after.start_ns  # one after the other, in the contract's order
    assert load_model.start_ns <= phases[0].start_ns and phases[-1].end_ns <= load_model.end_ns

    sizing = traced_run["events"][-1].ready
    named = {s.name: s for s in phases}
    assert named[spans.LOAD_WEIGHTS].attributes == {spans.BYTES: sizing.weights_bytes, spans.WEIGHTS: "dummy"}
    assert named[spans.PROFILE_MEMORY].attributes == {
        spans.ACTIVATION_PEAK_BYTES: sizing.activation_peak_bytes, spans.NUM_KV_BLOCKS: sizing.num_kv_blocks,
        spans.KV_CACHE_BYTES: sizing.kv_cache_bytes}
    assert sizing.num_kv_blocks > 0
    assert named[spans.LOAD_COMPILED].attributes == {spans.CACHE_KEY: sizing.key.digest}
    assert named[spans.CAPTURE_CUDAGRAPHS].attributes == {}  # CPU: nothing captured
    # The phase spans last what the LoadModel stream reported (the stream's clock starts a little earlier).
    reported = {e.phase.phase: e.phase.seconds for e in traced_run["events"]
                if e.HasField("phase") and not e.phase.progress}
    for s in phases:
        assert (s.end_ns - s.start_ns) / 1e9 == pytest.approx(reported[s.name], abs=0.05)


def test_startup_steps_are_child_spans_of_their_phase_as_the_stream_reported(traced_run):
    """Each step inside a phase (the key, verify, unpickle, warm-up, ...) is a child span of that phase, in order and
    within it, and lasts what its progress event in the LoadModel stream said."""
    trace = traced_run["trace"]
    phases = {s.name: s for s in children(trace, one(trace, spans.LOAD_MODEL))}
    reported = [(e.phase.phase, e.phase.step, e.phase.seconds) for e in traced_run["events"]
                if e.HasField("phase") and e.phase.step]
    assert [(phase, step) for phase, step, _ in reported] == [
        (spans.FETCH, spans.BUNDLE_KEY), (spans.FETCH, spans.VERIFY), (spans.FETCH, spans.CHECK_FACTORS),
        (spans.LOAD_WEIGHTS, spans.BUILD_MODEL), (spans.PROFILE_MEMORY, spans.PROFILE_FORWARD),
        (spans.PROFILE_MEMORY, spans.KV_CACHE), (spans.LOAD_COMPILED, spans.UNPICKLE),
        (spans.LOAD_COMPILED, spans.WARM_UP), (spans.LOAD_COMPILED, spans.WARM_UP_ATTENTION)]
    for phase, step, seconds in reported:
        parent = phases[phase]
        (span,) = [s for s in children(trace, parent) if s.name == step]
        assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns
        assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(seconds, abs=0.05)


def test_a_request_span_per_generate_with_the_genai_attributes(traced_run):
    trace = traced_run["trace"]
    requests = [s for s in trace if s.name == f"text_completion {MODEL}"]
    by_input = {s.attributes[spans.GEN_AI_USAGE_INPUT_TOKENS]: s for s in requests}
    assert sorted(by_input) == sorted(len(p) for p in PROMPTS)
    for prompt, responses in zip(PROMPTS, traced_run["responses"], strict=True):
        span, usage = by_input[len(prompt)], responses[-1].usage
        server = next(s for s in trace if s.span_id == span.parent_span_id)
        assert (server.name, server.kind) == ("/kiln.v1.ExecService/Generate", "SERVER")
        assert span.kind == "INTERNAL" and span.resource["service.name"] == "kiln-exec"
        attributes = dict(span.attributes)
        assert len(attributes.pop(spans.GEN_AI_RESPONSE_ID)) == 32
        assert attributes.pop(spans.TIME_TO_FIRST_TOKEN_S) == pytest.approx(usage.time_to_first_token_s)
        assert attributes.pop(spans.QUEUE_S) == pytest.approx(usage.queue_s)
        assert attributes == {
            spans.GEN_AI_OPERATION_NAME: "text_completion", spans.GEN_AI_REQUEST_MODEL: MODEL,
            spans.GEN_AI_REQUEST_MAX_TOKENS: MAX_TOKENS, spans.GEN_AI_REQUEST_TEMPERATURE: 0.0,
            spans.GEN_AI_REQUEST_TOP_P: 1.0, spans.GEN_AI_USAGE_INPUT_TOKENS: len(prompt),
            spans.GEN_AI_USAGE_OUTPUT_TOKENS: MAX_TOKENS, spans.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
            spans.NUM_PREEMPTIONS: 0, spans.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_tokens}
        assert usage.output_tokens == MAX_TOKENS
        assert server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns


def test_forward_spans_link_to_the_requests_they_served(traced_run):
    trace = traced_run["trace"]
    requests = {s.span_id: s for s in trace if s.name == f"text_completion {MODEL}"}
    forward = sorted((s for s in trace if s.name == spans.FORWARD), key=lambda s: s.start_ns)
    assert forward
    served: dict[str, list] = {span_id: [] for span_id in requests}
    for f in forward:
        linked = [span_id for _, span_id in f.links]
        assert linked and set(linked) <= set(requests) and len(set(linked)) == len(linked)
        assert f.parent_span_id == linked[0], "parented to the oldest request it served"
        assert f.resource["service.name"] == "kiln-exec"
        assert f.attributes[spans.MODEL] == MODEL and f.attributes[spans.RUNTIME_MODE] == "compiled"
        assert f.attributes[spans.BATCH_SIZE] == len(linked)  # every request it ran was live, so linked
        assert f.attributes[spans.PADDED_SIZE] == f.attributes[spans.NUM_TOKENS]  # no padding without graphs
        for span_id in linked:
            served[span_id].append(f)
            assert requests[span_id].start_ns <= f.start_ns <= f.end_ns <= requests[span_id].end_ns
    # Each request: one prefill step (its whole prompt fits the token budget), then MAX_TOKENS - 1 decodes.
    first_step = {}
    for span_id, steps in served.items():
        assert len(steps) == MAX_TOKENS
        first_step[span_id] = steps[0].span_id
    for f in forward:
        prefills = [requests[r].attributes[spans.GEN_AI_USAGE_INPUT_TOKENS] for _, r in f.links
                    if first_step[r] == f.span_id]
        decodes = len(f.links) - len(prefills)
        assert f.attributes[spans.NUM_TOKENS] == sum(prefills) + decodes
        assert f.attributes[spans.PHASE] == ("prefill" if not decodes else "decode" if not prefills else "mixed")


def test_forward_stats_agree_with_the_forward_spans_and_the_histogram(traced_run, otlp_receiver):
    """A series per batch size, phase and path: the decodes of 3 sequences are not averaged with their prefill. The
    mode asked for (compiled) stays apart from the path each step took (compiled, on CPU)."""
    stats = traced_run["stats"]
    forward = [s for s in traced_run["trace"] if s.name == spans.FORWARD]

    def series(attributes) -> tuple:
        return attributes[spans.BATCH_SIZE], attributes[spans.PHASE], attributes[spans.PATH]

    assert {(s.batch_size, s.phase, s.path): s.count for s in stats} == Counter(series(f.attributes) for f in forward)
    assert {s.phase for s in stats} >= {"prefill", "decode"}
    assert all(s.runtime_mode == "compiled" and s.path == "compiled" for s in stats)
    for s in stats:
        durations = sorted((f.end_ns - f.start_ns) / 1e6 for f in forward
                           if series(f.attributes) == (s.batch_size, s.phase, s.path))
        assert s.median_ms == pytest.approx((durations[(len(durations) - 1) // 2] + durations[len(durations) // 2])
                                            / 2, abs=2e-3)
        waits = [f.attributes.get(spans.HOST_WAIT_MS, 0) for f in forward
                 if series(f.attributes) == (s.batch_size, s.phase, s.path)]
        assert s.host_wait_ms == pytest.approx(sum(waits), abs=2e-3 * len(waits))  # the span's, rounded to µs
    # Decodes follow a step of their own: each waited for the host, and its span says how long.
    assert all(f.attributes[spans.HOST_WAIT_MS] > 0 for f in forward if f.attributes[spans.PHASE] == "decode")

    def histogram(receiver) -> dict:
        latest = {}
        for resource, point in receiver.histogram_points(FORWARD_DURATION):
            if resource["service.name"] == "kiln-exec" and resource["kiln.device"] == "cpu":
                latest[series(point["attributes"])] = point["count"]  # cumulative: the last one counts
        return latest == {(s.batch_size, s.phase, s.path): s.count for s in stats} and latest

    otlp_receiver.wait_for(histogram, timeout_s=15)


def test_an_http_request_is_one_trace_from_its_client_through_the_gateway(traced_run, traced_services, otlp_receiver,
                                                                          tmp_path):
    """A traced ``kiln api-server``: a request carrying its client's ``traceparent`` is the gateway's server span
    under the client's span, lasting the whole stream; its Generate a client span under it; the execute service's
    spans under that. Health probes are not traced. (After the test above: its steps would count in the histogram.)"""
    port = free_port()
    log = (tmp_path / "api-server.log").open("w")
    gateway = subprocess.Popen(kiln_command("api-server", "--port", str(port), "--exec-server",
                                            traced_services.exec.address),
                               env=otel_env(otlp_receiver.endpoint), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # until its readiness probe answers 200
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError:
                assert gateway.poll() is None and time.monotonic() < deadline, (tmp_path / "api-server.log").read_text()
                time.sleep(0.2)
        trace_id, client_span = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "stream": True,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
            "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{client_span}-01"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.read().endswith(b"data: [DONE]\n\n")

        def complete(receiver):
            trace = receiver.spans(trace_id)
            kinds = Counter((s.name, s.kind) for s in trace)
            return kinds[("POST /v1/completions", "SERVER")] == 1 and kinds[(f"text_completion {MODEL}", "INTERNAL")] \
                and kinds[(spans.FORWARD, "INTERNAL")] >= 3 and trace

        trace = otlp_receiver.wait_for(complete)
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)
        log.close()
    http = one(trace, "POST /v1/completions", "SERVER")
    assert http.parent_span_id == client_span and http.resource["service.name"] == "kiln-api"
    call = one(trace, "/kiln.v1.ExecService/Generate", "CLIENT")
    served = one(trace, "/kiln.v1.ExecService/Generate", "SERVER")
    assert call.parent_span_id == http.span_id and call.resource["service.name"] == "kiln-api"
    assert served.parent_span_id == call.span_id and served.resource["service.name"] == "kiln-exec"
    assert one(trace, f"text_completion {MODEL}").parent_span_id == served.span_id
    assert http.start_ns <= call.start_ns and call.end_ns <= http.end_ns
    api_spans = [s for s in otlp_receiver.spans() if s.resource["service.name"] == "kiln-api"]
    assert not [s for s in api_spans if "health" in s.name]


# --- request spans on the SDK in memory ---

@pytest.fixture
def memory_tracer():
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("tests"), exporter
    provider.shutdown()


def sequence(max_tokens: int = 3, **params) -> Sequence:
    return Sequence("r1", [4, 5, 6, 7], SamplingParams(max_tokens=max_tokens, **params), max_model_len=64)


class Watcher:
    """Hears what ForwardSpans hears from RequestSpans."""

    def __init__(self):
        self.calls = []

    def request_started(self, request_id, context):
        self.calls.append(("started", request_id, context))

    def request_ended(self, request_id):
        self.calls.append(("ended", request_id))


def test_request_span_tells_its_watchers_and_records_preemptions(memory_tracer):
    tracer, exporter = memory_tracer
    watcher = Watcher()
    requests = RequestSpans(tracer, [watcher])
    seq = sequence(temperature=0.7, top_k=5, seed=11)
    with requests.track("tiny", seq) as span:
        assert watcher.calls == [("started", "r1", span.get_span_context())]
        seq.first_scheduled_s = time.perf_counter()
        seq.append_token(9, time.perf_counter())
        seq.preemptions.append((time.time_ns(), 5))
        seq.append_token(10, time.perf_counter())
        seq.append_token(11, time.perf_counter())
    assert watcher.calls[1:] == [("ended", "r1")]
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "text_completion tiny"
    attributes = finished.attributes
    assert (attributes[spans.GEN_AI_REQUEST_TEMPERATURE], attributes[spans.GEN_AI_REQUEST_TOP_K],
            attributes[spans.GEN_AI_REQUEST_SEED]) == (0.7, 5, 11)
    assert attributes[spans.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert list(attributes[spans.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]
    assert attributes[spans.NUM_PREEMPTIONS] == 1
    (event,) = finished.events
    assert (event.name, event.timestamp, dict(event.attributes)) == (
        spans.PREEMPTION, seq.preemptions[0][0], {spans.RECOMPUTED_TOKENS: 5})


def test_request_span_of_a_failed_or_cancelled_request(memory_tracer):
    tracer, exporter = memory_tracer
    watcher = Watcher()
    requests = RequestSpans(tracer, [watcher])
    with pytest.raises(Internal), requests.track("tiny", sequence()):
        raise Internal("forward failed: boom")

    async def stream():
        with requests.track("tiny", sequence()):
            yield 1
            yield 2

    async def read_one():
        async for _ in stream():
            break  # the client went away

    asyncio.run(read_one())
    failed, cancelled = exporter.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR and "forward failed: boom" in failed.status.description
    assert spans.CANCELLED not in failed.attributes and spans.GEN_AI_RESPONSE_FINISH_REASONS not in failed.attributes
    assert cancelled.attributes[spans.CANCELLED] is True and cancelled.status.status_code is StatusCode.UNSET
    assert spans.TIME_TO_FIRST_TOKEN_S not in cancelled.attributes  # no token came
    assert [call[0] for call in watcher.calls] == ["started", "ended"] * 2


def test_request_spans_with_tracing_off_tell_no_watcher():
    watcher = Watcher()
    requests = RequestSpans(NoOpTracer(), [watcher])
    with requests.track("tiny", sequence()) as span:
        assert not span.is_recording()
    assert watcher.calls == []
