"""Faults and bad input against real servers and real child processes (issue 11): nothing silently wrong, nothing
stuck, every trace true to what happened. Everything listens on loopback; every wait is bounded.

The session's compile server, exec server and tiny bundle (conftest) serve most cases; child processes only where
a process must die, restart or be signalled, or must trace to the OTLP receiver.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from conftest import TINY_CONFIG, TINY_MODEL, BackgroundServer, client_tracer, compile_result, load_model, otel_env
from opentelemetry import propagate
from test_exec_service import generate, hf_model, model_info, prompt_of, wait_until

from exec_service.server import ExecServerSettings, start_exec_server
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store import bundle
from kiln_cli.service_process import ServiceProcess, free_port, kiln_command
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc
from tracing import spans
from tracing.forward_span_writer import FORWARD_DURATION
from tracing.grpc_server_spans import CALL_ENDED_EARLY, RPC_GRPC_STATUS_CODE

ROOT = Path(__file__).resolve().parents[1]
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # one KV block of tiny-llama: 2 layers, 16 tokens, 2 KV heads of 16, fp32
GRACE_S = 1.5  # the traced exec server's --shutdown-grace-s


def config(**fields) -> common_pb2.CompileConfig:
    out = common_pb2.CompileConfig()
    out.CopyFrom(TINY_CONFIG)
    for name, value in fields.items():
        getattr(out, name)[:] = value
    return out


def compile_process(store: Path, port: int, log: Path, keys: Path) -> ServiceProcess:
    return ServiceProcess("compile", kiln_command("compile-server", "--host", "127.0.0.1", "--port", str(port),
                                                  "--store", str(store), "--shutdown-grace-s", "1",
                                                  "--signing-key", str(keys / "signing.key")),
                          f"127.0.0.1:{port}", log)


def flip_keeping_mtime(path: Path) -> None:
    """Bit rot: one byte changes, the size and modification time do not."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x5A
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def fetch_detail(events: list) -> str:
    """What LoadModel's fetch phase reported when it ended."""
    return next(e.phase.detail for e in events if e.HasField("phase") and e.phase.phase == "fetch"
                and not e.phase.progress)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


# --- the compile service: killed, restarted, its store rotting ---

def test_kill_9_mid_compile_leaves_nothing_after_a_restart(tmp_path, signing_dir):
    store, port = tmp_path / "store", free_port()
    first = compile_process(store, port, tmp_path / "compile.log", signing_dir)
    first.start()
    try:
        first.wait_healthy(120)
        with grpc.insecure_channel(first.address, options=CHANNEL_OPTIONS) as channel:
            events = compile_pb2_grpc.CompileServiceStub(channel).Compile(
                compile_pb2.CompileRequest(model=TINY_MODEL, config=TINY_CONFIG), timeout=120)
            next(e for e in events if e.progress.phase == "inductor")  # Inductor is writing into staging now
            first.process.kill()
            first.process.wait(30)
    finally:
        first.kill()
    assert list((store / ".staging").iterdir()) and list((store / ".locks").iterdir()), "what a kill leaves"
    assert not [p for p in store.iterdir() if not p.name.startswith(".")], "no partial bundle"

    second = compile_process(store, port, tmp_path / "compile.log", signing_dir)
    second.start()
    try:
        second.wait_healthy(120)
        assert not list((store / ".staging").iterdir()) and not list((store / ".locks").iterdir())
        with grpc.insecure_channel(second.address, options=CHANNEL_OPTIONS) as channel:
            stub = compile_pb2_grpc.CompileServiceStub(channel)
            result = compile_result(stub)
            assert not result.cache_hit and bundle.verify(store / result.key.digest).key == result.key.digest
            assert not list((store / ".staging").iterdir()) and not list((store / ".locks").iterdir())

            # SIGTERM mid-compile: the process leaves within its grace, not when the compile would have ended.
            # A token range no other test compiles: Inductor's cache has none of its pieces, so the compile is still
            # running when the signal comes (a layer compiled once takes seconds, not a minute).
            unseen = config(compile_sizes=[4])
            unseen.max_compiled_tokens = 120
            events = stub.Compile(compile_pb2.CompileRequest(model=TINY_MODEL, config=unseen))
            next(e for e in events if e.progress.phase == "trace")
            signalled = time.monotonic()
            second.process.send_signal(signal.SIGTERM)
            assert second.process.wait(30) == 0 and time.monotonic() - signalled < 10
            assert rpc_error(lambda: list(events)).code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    finally:
        second.kill()


def test_flipped_bytes_with_the_mtime_kept_are_caught_on_the_next_serve(compile_stub, compile_store, tiny_key,
                                                                       exec_stub, exec_cache, tiny_loaded):
    flip_keeping_mtime(compile_store / tiny_key / bundle.compiled_layer_file(0))
    request = compile_pb2.GetArtifactRequest(key=common_pb2.ArtifactKey(digest=tiny_key))
    error = rpc_error(lambda: list(compile_stub.GetArtifact(request)))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "compiled_layer0.bin" in error.details()
    assert (compile_store / ".quarantine" / tiny_key).is_dir() and not (compile_store / tiny_key).exists()
    rebuilt = compile_result(compile_stub)
    assert not rebuilt.cache_hit and rebuilt.key.digest == tiny_key
    assert len(list(compile_stub.GetArtifact(request))) > 1

    # The exec service's own copy rots too: found when the next load reads it, downloaded again.
    flip_keeping_mtime(exec_cache / tiny_key / bundle.compiled_layer_file(0))
    events = load_model(exec_stub, "tiny-after-rot")
    assert fetch_detail(events).startswith("downloaded") and (exec_cache / ".quarantine" / tiny_key).is_dir()
    assert len(generate(exec_stub, "tiny-after-rot", [1, 2, 3], max_tokens=3, ignore_eos=True)[0]) == 3


# --- the execute service: a compile service that comes back, bad weights ---
# (66 streams with cancellations and preemption, each equal to itself run alone, no block leaked:
# tests/test_engine.py::test_concurrent_streams_equal_each_request_run_alone.)

def test_load_model_waits_for_a_compile_service_that_comes_back(compile_store, tiny_key, tmp_path, signing_dir,
                                                                trusted_keys):
    port = free_port()
    compile_service = compile_process(compile_store, port, tmp_path / "compile.log", signing_dir)
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, f"127.0.0.1:{port}", cache_dir=tmp_path / "cache")
    server = BackgroundServer(lambda: start_exec_server(settings))
    try:
        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            request = exec_pb2.LoadModelRequest(name="tiny", model=TINY_MODEL, config=TINY_CONFIG)
            with ThreadPoolExecutor(1) as pool:
                loading = pool.submit(lambda: list(stub.LoadModel(request, timeout=150)))
                time.sleep(1.0)
                assert not loading.done(), "with nothing listening, LoadModel must wait, not fail fast"
                compile_service.start()
                events = loading.result(timeout=160)
            assert events[-1].ready.key.digest == tiny_key
            assert fetch_detail(events).startswith("downloaded")

            # Gone for good: a LoadModel that needs it ends at its deadline, not later.
            compile_service.stop()
            started = time.monotonic()
            error = rpc_error(lambda: list(stub.LoadModel(exec_pb2.LoadModelRequest(
                name="tiny-4", model=TINY_MODEL, config=config(compile_sizes=[4])), timeout=3)))
            # The client's deadline, or the server's wait bounded by it answering first: either way, at 3 s.
            assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), error.details()
            assert time.monotonic() - started < 8
    finally:
        compile_service.kill()
        server.stop()


@pytest.fixture(scope="module")
def weights_dirs(tmp_path_factory):
    """A tiny checkpoint saved by transformers, and copies of it with a tensor renamed, one mis-shaped, one cut."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("weights")
    hf_model(seed=7).save_pretrained(root / "good")
    tensors = load_file(root / "good" / "model.safetensors")

    def variant(name: str, change) -> Path:
        shutil.copytree(root / "good", root / name)
        changed = dict(tensors)
        change(changed)
        save_file(changed, root / name / "model.safetensors", metadata={"format": "pt"})
        return root / name

    dirs = {
        "misnamed": variant("misnamed", lambda t: t.update({"model.final_norm.weight": t.pop("model.norm.weight")})),
        "misshaped": variant("misshaped", lambda t: t.update(
            {"model.layers.1.mlp.up_proj.weight": torch.zeros(96, 64), "lm_head.weight": torch.zeros(512, 32)})),
        "extra": variant("extra", lambda t: t.update({f"model.layers.{n}.input_layernorm.weight": torch.ones(64)
                                                      for n in range(2, 7)})),
    }
    shutil.copytree(root / "good", root / "truncated")
    data = (root / "good" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[:len(data) - 100])
    dirs["truncated"] = root / "truncated"
    return dirs


@pytest.mark.parametrize("case, code, message", [
    ("misnamed", grpc.StatusCode.FAILED_PRECONDITION,
     "weights: misnamed does not match the model config (1 missing: model.norm.weight; 1 unexpected: "
     "model.final_norm.weight)"),
    ("misshaped", grpc.StatusCode.FAILED_PRECONDITION,
     "2 mis-shaped: model.layers.1.mlp.up_proj.weight [96, 64] where the model has [128, 64], lm_head.weight "
     "[512, 32] where the model has [512, 64]"),
    ("extra", grpc.StatusCode.FAILED_PRECONDITION,
     "5 unexpected: model.layers.2.input_layernorm.weight, model.layers.3.input_layernorm.weight, "
     "model.layers.4.input_layernorm.weight, ..."),
    ("truncated", grpc.StatusCode.DATA_LOSS, "weights: model.safetensors is not a readable safetensors file"),
])
def test_weights_that_do_not_match_the_model_are_refused_before_serving(exec_stub, tiny_loaded, weights_dirs, case,
                                                                       code, message):
    error = rpc_error(lambda: load_model(exec_stub, f"tiny-{case}", weights=str(weights_dirs[case])))
    assert error.code() == code and message in error.details(), error.details()
    info = model_info(exec_stub, f"tiny-{case}")
    assert info.state == exec_pb2.MODEL_STATE_FAILED and message in info.error


# --- caller errors: the caller's status, naming the field ---

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize("spec, code, message", [
    (dict(config_json=json.dumps({**LLAMA, "junk": "x" * (2 << 20)})), grpc.StatusCode.INVALID_ARGUMENT,
     "model.config_json: 2097"),
    (dict(config_json=json.dumps({**LLAMA, "hidden_size": "32"})), grpc.StatusCode.INVALID_ARGUMENT,
     "model config: Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int"),
    (dict(config_json=json.dumps({**LLAMA, "hidden_act": "no-such-activation"})), grpc.StatusCode.INVALID_ARGUMENT,
     "model config: transformers cannot build this model: KeyError: 'no-such-activation'"),
    (dict(config_json=json.dumps({**LLAMA, "intermediate_size": -64})), grpc.StatusCode.INVALID_ARGUMENT,
     "model config: intermediate_size: -64"),
    (dict(config_json=json.dumps({**LLAMA, "num_key_value_heads": 3})), grpc.StatusCode.INVALID_ARGUMENT,
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(config_json=json.dumps({**LLAMA, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
                                  "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8})),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "model config: the weights of llama in float32 take"),
    (dict(hf_dir="/tmp/" + "d" * 300), grpc.StatusCode.INVALID_ARGUMENT, "model.hf_dir: '/tmp/ddd"),
    (dict(hf_dir="/tmp/a\0b"), grpc.StatusCode.INVALID_ARGUMENT, "model.hf_dir: not a usable path"),
])
def test_a_bad_model_config_gets_the_callers_status(compile_stub, spec, code, message):
    started = time.monotonic()
    error = rpc_error(lambda: compile_result(compile_stub, model=common_pb2.ModelSpec(**spec)))
    assert error.code() == code and message in error.details(), error.details()
    assert time.monotonic() - started < 30


def test_bad_load_requests_get_the_callers_status(exec_stub, tiny_loaded):
    cases = [
        (dict(kv_cache_bytes=1 << 39), grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_cache_bytes: 549755813888 bytes"),
        (dict(kv_cache_bytes=1 << 50), grpc.StatusCode.INVALID_ARGUMENT, "kv_cache_bytes: 1125899906842624 is outside"),
        (dict(weights="/tmp/" + "w" * 300), grpc.StatusCode.INVALID_ARGUMENT, "weights: '/tmp/www"),
    ]
    for fields, code, message in cases:
        error = rpc_error(lambda: load_model(exec_stub, "tiny-bad-load", **fields))  # noqa: B023
        assert error.code() == code and message in error.details(), error.details()


def _can_mount() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs unshare -rm to mount a small tmpfs without privileges")
def test_a_full_then_read_only_store_gets_the_callers_status(tmp_path, signing_dir):
    """The compile service's store on a 256 KiB tmpfs (a bundle is about 1.4 MB), remounted read-only on cue."""
    store, flag, port = tmp_path / "store", tmp_path / "remount-ro", free_port()
    store.mkdir()
    serve = " ".join(map(str, kiln_command("compile-server", "--host", "127.0.0.1", "--port", str(port), "--store",
                                           str(store), "--shutdown-grace-s", "1", "--signing-key",
                                           str(signing_dir / "signing.key"))))
    script = (f"mount -t tmpfs -o size=256k tmpfs {store} && "
              f"{{ while [ ! -e {flag} ]; do sleep 0.1; done; mount -o remount,ro {store}; touch {flag}.done; }} & "
              f"exec {serve}")
    service = ServiceProcess("compile", ["unshare", "-rm", "sh", "-c", script], f"127.0.0.1:{port}",
                             tmp_path / "compile.log")
    service.start()
    try:
        service.wait_healthy(120)
        with grpc.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = compile_pb2_grpc.CompileServiceStub(channel)
            error = rpc_error(lambda: compile_result(stub))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert error.details().startswith("compile of tiny-llama: the disk is full at ")
            flag.touch()
            wait_until(lambda: Path(f"{flag}.done").exists(), timeout_s=10)
            error = rpc_error(lambda: compile_result(stub))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "is not writable" in error.details()
    finally:
        service.kill()


# --- traces: what Jaeger shows is what happened (a traced exec server child, the session's OTLP receiver) ---

@pytest.fixture(scope="module")
def traced_exec(compile_server, tiny_key, otlp_receiver, tmp_path_factory, signing_dir):
    """``kiln exec-server`` tracing to the receiver with only OTEL_EXPORTER_OTLP_ENDPOINT set (as the README says),
    bundles from the session's compile server, two models: ``tiny`` and ``tiny-small`` (12 KV blocks)."""
    workdir, port = tmp_path_factory.mktemp("traced-exec"), free_port()
    server = ServiceProcess(
        "exec", kiln_command("exec-server", "--host", "127.0.0.1", "--port", str(port), "--compile-server",
                             compile_server.address, "--cache", str(workdir / "cache"), "--shutdown-grace-s",
                             str(GRACE_S), "--trusted-keys", str(signing_dir / "signing.pub")),
        f"127.0.0.1:{port}", workdir / "exec.log",
        otel_env(otlp_receiver.endpoint, OTEL_SERVICE_NAME="kiln-exec-faults", OTEL_METRIC_EXPORT_INTERVAL="200"))
    server.start()
    try:
        server.wait_healthy(120)
        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            load_model(stub, "tiny")
            load_model(stub, "tiny-small", kv_cache_bytes=12 * BLOCK_BYTES)
            yield server, stub
    finally:
        server.kill()


def traced_calls(receiver, address: str, root_name: str, calls) -> tuple[str, list]:
    """Run ``calls(stub, metadata)`` under a client root span whose W3C context ``metadata`` carries; returns the
    trace id and what ``calls`` returned. (A plain channel: an instrumented one's streams cannot be cancelled.)"""
    _, tracer = client_tracer(receiver.endpoint)
    with tracer.start_as_current_span(root_name) as root, grpc.insecure_channel(address, CHANNEL_OPTIONS) as channel:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        results = calls(exec_pb2_grpc.ExecServiceStub(channel), tuple(carrier.items()))
    return format(root.get_span_context().trace_id, "032x"), results


def server_spans(trace: list) -> list:
    return sorted((s for s in trace if s.kind == "SERVER" and s.name == "/kiln.v1.ExecService/Generate"),
                  key=lambda s: s.start_ns)


def test_a_rejected_generate_has_the_clients_status_on_its_server_span(traced_exec, otlp_receiver):
    def calls(stub, metadata):
        return [rpc_error(lambda: list(stub.Generate(exec_pb2.GenerateRequest(model="tiny", prompt_ids=[1],
                                                                               top_p=2.0), metadata=metadata))),
                rpc_error(lambda: list(stub.Generate(exec_pb2.GenerateRequest(model="nope", prompt_ids=[1]),
                                                     metadata=metadata)))]

    trace_id, errors = traced_calls(otlp_receiver, traced_exec[0].address, "rejected", calls)
    trace = otlp_receiver.wait_for(lambda r: len(server_spans(r.spans(trace_id))) == 2 and r.spans(trace_id))
    for span, error in zip(server_spans(trace), errors, strict=True):
        assert span.status == ("ERROR", f"{error.code().name}: {error.details()}")
        assert span.attributes[RPC_GRPC_STATUS_CODE] == error.code().value[0]
        assert span.events == [], "no 'Locally aborted' exception events"
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND]


def test_cancelled_generates_say_so_and_keep_their_last_forward_span(traced_exec, otlp_receiver):
    def calls(stub, metadata):
        received = []
        for n in range(1, 11):
            call = stub.Generate(exec_pb2.GenerateRequest(model="tiny", prompt_ids=prompt_of(5 + n), max_tokens=400,
                                                          temperature=0.8, seed=n, ignore_eos=True), metadata=metadata)
            tokens = []
            for response in call:
                tokens += response.token_ids
                if len(tokens) >= n:
                    break
            call.cancel()
            received.append(len(tokens))
        return received

    trace_id, received = traced_calls(otlp_receiver, traced_exec[0].address, "cancelled", calls)
    trace = otlp_receiver.wait_for(lambda r: len(server_spans(r.spans(trace_id))) == 10 and r.spans(trace_id))
    for span in server_spans(trace):
        assert span.status[0] == "ERROR" and span.status[1].startswith("CANCELLED: ended before it finished")
        assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.CANCELLED.value[0]
        assert [name for name, _ in span.events] == [CALL_ENDED_EARLY]
    requests = {s.span_id: s for s in trace if s.name == "text_completion tiny"}
    assert len(requests) == 10
    for request in requests.values():
        assert request.attributes[spans.CANCELLED] is True
        assert request.attributes[spans.GEN_AI_REQUEST_TEMPERATURE] == 0.8  # as sent, not 0.800000011920929

    def all_forward_spans(receiver):
        forward = [s for s in receiver.spans(trace_id) if s.name == spans.FORWARD]
        served = {r: [f for f in forward if r in {span_id for _, span_id in f.links}] for r in requests}
        return all(len(f) >= requests[r].attributes[spans.GEN_AI_USAGE_OUTPUT_TOKENS] for r, f in served.items()) \
            and served

    served = otlp_receiver.wait_for(all_forward_spans)
    time.sleep(0.5)  # the writer exports in batches: let a step that ran past a cancellation arrive too
    orphans = [s for s in otlp_receiver.spans() if s.name == spans.FORWARD and s.parent_span_id == ""
               and s.resource["service.name"] == "kiln-exec-faults"]
    assert not orphans, "a forward span outside every request's trace"
    forward = [s for s in otlp_receiver.spans(trace_id) if s.name == spans.FORWARD]
    assert all(f.parent_span_id in requests for f in forward)
    # The step that was running when a request was cancelled ends after its request span, and is still in its trace.
    assert any(max(f.end_ns for f in forward if f.parent_span_id == r) > requests[r].end_ns for r in served)
    assert all(got >= n for n, got in enumerate(received, start=1))


def test_preemptions_are_events_on_their_request_spans(traced_exec, otlp_receiver):
    def calls(stub, metadata):
        prompts = [prompt_of(n, salt) for salt, n in enumerate([20, 33, 47, 60])]

        def run(prompt):
            request = exec_pb2.GenerateRequest(model="tiny-small", prompt_ids=prompt, max_tokens=30, temperature=0,
                                               ignore_eos=True)
            return list(stub.Generate(request, metadata=metadata))[-1].usage.num_preemptions

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(run, prompts))

    trace_id, preemptions = traced_calls(otlp_receiver, traced_exec[0].address, "preempted", calls)
    trace = otlp_receiver.wait_for(
        lambda r: len([s for s in r.spans(trace_id) if s.name == "text_completion tiny-small"]) == 4
        and r.spans(trace_id))
    requests = [s for s in trace if s.name == "text_completion tiny-small"]
    assert sum(preemptions) > 0
    assert sorted(s.attributes[spans.NUM_PREEMPTIONS] for s in requests) == sorted(preemptions)
    for span in requests:
        events = [attributes for name, attributes in span.events if name == spans.PREEMPTION]
        assert len(events) == span.attributes[spans.NUM_PREEMPTIONS]


def test_metrics_are_off_with_only_the_shared_endpoint(traced_exec, otlp_receiver):
    server, stub = traced_exec
    generate(stub, "tiny", [1, 2, 3], max_tokens=4)
    time.sleep(1.0)  # five metric export intervals
    assert not [p for resource, p in otlp_receiver.histogram_points(FORWARD_DURATION)
                if resource["service.name"] == "kiln-exec-faults"]
    assert "Failed to export" not in server.log_path.read_text()


def test_sigterm_with_8_streams_in_flight_ends_each_within_the_grace(traced_exec, exec_stub, tiny_loaded):
    """Last in this module: it stops the traced exec server. Short requests finish with every token; long ones
    end with UNAVAILABLE saying why, holding a prefix of what they would have been, all within the grace."""
    server, stub = traced_exec
    requests = [exec_pb2.GenerateRequest(model="tiny", prompt_ids=prompt_of(4 + i, salt=i), temperature=0,
                                         ignore_eos=True, max_tokens=8 if i % 2 else 480) for i in range(8)]
    started = [0] * 8

    def run(i: int):
        tokens = []
        try:
            for response in stub.Generate(requests[i], timeout=60):
                tokens += response.token_ids
                started[i] = 1
            return tokens, None, time.monotonic()
        except grpc.RpcError as exc:
            return tokens, exc, time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(8)]
        wait_until(lambda: sum(started) == 8 or any(f.done() for f in futures), timeout_s=30)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        results = [f.result(timeout=30) for f in futures]
    assert server.process.wait(30) == 0
    assert time.monotonic() - signalled < GRACE_S + 10
    cut = 0
    for request, (tokens, error, ended) in zip(requests, results, strict=True):
        assert ended - signalled < GRACE_S + 2.0, "every stream ends at the end of the grace at the latest"
        # The session's exec server has the same model and weights: what the request would have been.
        reference = generate(exec_stub, "tiny", list(request.prompt_ids), max_tokens=request.max_tokens,
                             temperature=0, ignore_eos=True)[0]
        if error is None:
            assert tokens == reference
        else:
            cut += 1
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutdown grace" in error.details()
            assert tokens == reference[:len(tokens)]
    assert all(error is None for _, error, _ in results[1::2]), "the short requests finish"
    assert cut > 0, "the long requests cannot finish in the grace"


# --- smaller: Ctrl-C, --json numbers, collection without the test extra, the demo's LoadModel span ---

def test_ctrl_c_in_kiln_generate_exits_130_without_a_traceback(exec_server, exec_stub, tiny_loaded):
    start = model_info(exec_stub, "tiny").num_free_blocks
    proc = subprocess.Popen(kiln_command("generate", exec_server.address, "--model", "tiny", "--prompt-ids", "1,2,3",
                                         "--max-tokens", "490", "--ignore-eos"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        readable, _, _ = select.select([proc.stdout], [], [], 60)
        assert readable and proc.stdout.read(1), "no token came"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and b"interrupted" in stderr and b"Traceback" not in stderr, stderr.decode()
    wait_until(lambda: model_info(exec_stub, "tiny").num_free_blocks == start)


def test_json_output_prints_counts_as_numbers(exec_server, exec_stub, tiny_loaded, capsys):
    from kiln_cli import main

    generate(exec_stub, "tiny", [1, 2], max_tokens=2)
    assert main(["stats", exec_server.address, "--model", "tiny", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines and all(type(line["count"]) is int and type(line["batch_size"]) is int for line in lines)


def test_gpu_tests_collect_without_the_test_extra(tmp_path):
    """What `pip install -e .` leaves out of the test extra, made unimportable; `pytest -m gpu` still collects."""
    for module in ("jsonschema", "check_jsonschema", "grpc_tools", "kubernetes_validate"):
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text(f"raise ImportError('{module} is in the test extra')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:timeout",
                           "-p", "no:cacheprovider", str(ROOT / "tests")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode in (0, 5), proc.stdout[-3000:]  # 5: no GPU test selected here
    assert "error" not in proc.stdout.splitlines()[-1].lower(), proc.stdout[-3000:]
