"""The compile service through its real gRPC server: compile, hit, fetch, list, delete, and every bad input."""

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
import torch
from conftest import TINY_CONFIG, TINY_MODEL, compile_result
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kiln.compilation.counters import compile_counts
from kiln.model.spec import resolve
from kiln.store import bundle
from protos import common_pb2, compile_pb2


def test_concurrent_identical_compiles_compile_once(tiny_compiles, compile_store):
    hits = sorted(r.cache_hit for r in tiny_compiles)
    assert hits == [False, True]
    assert tiny_compiles[0].key.digest == tiny_compiles[1].key.digest
    assert (compile_store / tiny_compiles[0].key.digest / bundle.MANIFEST).is_file()
    assert not list((compile_store / ".staging").iterdir())


def test_split_gives_a_piece_pair_per_kind_of_layer(tiny_compiles):
    result = next(r for r in tiny_compiles if not r.cache_hit)
    # tiny-llama: two layers of one kind, compiled once, split at its attention call into two pieces.
    assert (result.num_pieces, result.num_splits) == (2, 1)
    phases = {t.phase for t in result.timings}
    assert {"key", "build", "examples", "trace", "split", "inductor", "save"} <= phases


def test_a_layer_runs_one_gemm_per_projection_group():
    """q/k/v and gate/up hold one weight each (kiln.model.merged_projections); in the graph Dynamo traces for a layer,
    each group's slices are one product after the compile service's pass: 7 linear calls become 4."""

    from compile_service.pipeline import _layer_examples
    from kiln.compilation.config import CompileConfig
    from kiln.model.causal_lm import build_model
    from kiln.model.merged_projections import merge_identical_linears

    resolved = resolve(TINY_MODEL, "cpu")
    module = build_model(resolved, "cpu")
    attention, mlp = module.layers.steps[0].layer.self_attn, module.layers.steps[0].layer.mlp
    assert attention.q_proj.weight is attention.k_proj.weight is attention.v_proj.weight
    assert mlp.gate_proj.weight is mlp.up_proj.weight and mlp.down_proj.weight is not mlp.up_proj.weight
    (step, inputs), = _layer_examples(module, resolved, CompileConfig(max_compiled_tokens=64))
    counts = []

    def count_linears(gm, example_inputs):
        def linears():
            return sum(n.op == "call_function" and n.target is torch._C._nn.linear for n in gm.graph.nodes)

        before = linears()
        counts.append((before, before - merge_identical_linears(gm)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, backend=count_linears, fullgraph=True)(*inputs)
    assert counts == [(7, 4)]


def tiny_with(**fields) -> common_pb2.ModelSpec:
    return common_pb2.ModelSpec(config_json=json.dumps(
        json.loads(json.dumps(resolve(TINY_MODEL, "cpu").config.to_dict())) | fields))


@pytest.mark.parametrize("model_type, layers, kinds", [
    ("llama", (2, 4), 1),
    # Qwen2 with its first layer global and the others local: two kinds, whatever the number of layers.
    ("qwen2", (3, 5), 2),
])
def test_compiles_do_not_grow_with_the_number_of_layers(compile_stub, model_type, layers, kinds):
    """Dynamo traces one layer per kind and Inductor compiles its two pieces once, for few layers as for more: the
    layer's compiled code runs for every layer of its kind with that layer's weights as inputs."""
    config = common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=128)
    windows = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1) if model_type == "qwen2" else {}
    counts = set()
    for n in layers:
        before = compile_counts()
        result = compile_result(compile_stub, tiny_with(model_type=model_type, num_hidden_layers=n, **windows), config)
        assert not result.cache_hit
        delta = compile_counts() - before
        counts.add((delta.dynamo_graphs, delta.inductor_compiles, result.num_pieces, result.num_splits))
    assert counts == {(kinds, 2 * kinds, 2 * kinds, kinds)}


def test_a_compile_runs_on_the_compile_thread_which_outlives_it(compile_stub, monkeypatch):
    """Issue 23: the exit of a thread that had just compiled Llama-3-8B crashed the compile service (SIGSEGV in the
    event loop's thread). Compiles run on the one compile thread, which is still there once the call is done."""
    from compile_service import pipeline

    threads = []
    compile_into = pipeline._compile_into

    def recorded(*args):
        threads.append(threading.current_thread())
        return compile_into(*args)

    monkeypatch.setattr(pipeline, "_compile_into", recorded)
    for width in (80, 96):  # two new keys: two compiles
        assert not compile_result(compile_stub, tiny_with(intermediate_size=width)).cache_hit
    assert len(threads) == 2 and threads[0] is threads[1], threads
    assert threads[0].name.startswith("compile") and threads[0].is_alive()


def test_second_compile_is_a_hit_without_inductor(compile_stub, tiny_key):
    before = compile_counts()
    result = compile_result(compile_stub)
    assert result.cache_hit and result.key.digest == tiny_key
    assert compile_counts() - before == type(before)(0, 0)


def test_compile_streams_progress_per_piece_and_size(compile_stub):
    config = common_pb2.CompileConfig()
    config.CopyFrom(TINY_CONFIG)
    config.compile_sizes.append(4)
    events = list(compile_stub.Compile(compile_pb2.CompileRequest(model=TINY_MODEL, config=config)))
    inductor = [(e.progress.region, e.progress.piece, e.progress.num_pieces, e.progress.size) for e in events
                if e.HasField("progress") and e.progress.phase == "inductor"]
    assert inductor == [("layer0", i, 2, s) for s in ("symbolic", "4", "8") for i in (1, 2)]
    assert not events[-1].result.cache_hit


def test_full_graph_when_splitting_ops_empty(compile_stub):
    config = common_pb2.CompileConfig()
    config.CopyFrom(TINY_CONFIG)
    config.splitting_ops.SetInParent()
    del config.compile_sizes[:]
    result = compile_result(compile_stub, config=config)
    assert (result.num_pieces, result.num_splits) == (1, 0)  # the layer whole


FRESH_PROCESS_LOAD = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from kiln.store.bundle import load_compiled
    from kiln.compilation.counters import compile_counts
    from kiln.model.causal_lm import build_model
    from kiln.model.spec import resolve
    from kiln.store.signing import TrustedKeys
    from protos import common_pb2
    model = build_model(resolve(common_pb2.ModelSpec(preset="tiny-llama"), "cpu"), "cpu", seed=7)
    before = compile_counts()
    bundle_dir = Path(sys.argv[1])
    traces, trace = [], torch.fx.Tracer.trace  # an FX trace patches nn.Module.__call__ for every thread
    torch.fx.Tracer.trace = lambda self, *a, **k: traces.append(type(self).__name__) or trace(self, *a, **k)
    fn = load_compiled(bundle_dir, bundle_dir.name, TrustedKeys.load(sys.argv[2]))
    torch.fx.Tracer.trace = trace
    out = {}
    with torch.no_grad():
        for n in (8, 5, 1):
            ids = torch.randint(0, 512, (n,)); pos = torch.arange(n)
            got, want = model.logits(fn(model, ids, pos)), model.logits(model(ids, pos))
            out[n] = [list(got.shape), (got - want).abs().max().item()]
    delta = compile_counts() - before
    print(json.dumps({"sizes": out, "dynamo_graphs": delta.dynamo_graphs, "inductor": delta.inductor_compiles,
                      "fx_traces": traces}))
""")


def test_fresh_process_loads_without_dynamo_or_fx_and_matches_eager(compile_store, tiny_key, signing_dir):
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_LOAD, str(compile_store / tiny_key),
                           str(signing_dir / "signing.pub")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["dynamo_graphs"] == 0 and report["inductor"] == 0
    # No FX trace while loading either: it would break a forward of another model running beside the load.
    assert report["fx_traces"] == []
    for n, (shape, maxdiff) in report["sizes"].items():
        assert shape == [int(n), 512]
        assert maxdiff < 1e-4, f"{n} tokens: logits differ by {maxdiff}"


def test_get_artifact_streams_the_files_in_bounded_chunks(compile_stub, compile_store, tiny_key, tmp_path,
                                                          trusted_keys):
    key = common_pb2.ArtifactKey(digest=tiny_key)
    chunks = list(compile_stub.GetArtifact(compile_pb2.GetArtifactRequest(key=key, chunk_bytes=64 * 1024)))
    header, data = chunks[0].header, [c.data for c in chunks[1:]]
    assert len(data) > 2 and all(len(d) == 64 * 1024 for d in data[:-1]) and 0 < len(data[-1]) <= 64 * 1024
    assert header.manifest_json == (compile_store / tiny_key / bundle.MANIFEST).read_text()
    assert header.signature_json == (compile_store / tiny_key / bundle.SIGNATURE).read_text()
    manifest = json.loads(header.manifest_json)
    assert manifest["key"] == tiny_key and sum(len(d) for d in data) == header.total_bytes
    expected = b"".join((compile_store / tiny_key / name).read_bytes() for name in sorted(manifest["files"]))
    assert hashlib.sha256(b"".join(data)).digest() == hashlib.sha256(expected).digest()
    (tmp_path / "b").mkdir()
    bundle.write_chunks(header.manifest_json, header.signature_json, iter(data), tmp_path / "b")
    assert bundle.verify_signed(tmp_path / "b", tiny_key, trusted_keys).key == tiny_key


@pytest.mark.parametrize(("call", "digest", "extra", "code", "message"), [
    ("GetArtifact", "xyz", {}, grpc.StatusCode.INVALID_ARGUMENT, "key.digest: 'xyz' is not a 64-character hex"),
    ("GetArtifact", "AB" * 32, {}, grpc.StatusCode.INVALID_ARGUMENT, "key.digest"),
    ("GetArtifact", "0" * 64, {}, grpc.StatusCode.NOT_FOUND, "Compile it first"),
    ("GetArtifact", None, {"chunk_bytes": 64 << 20}, grpc.StatusCode.INVALID_ARGUMENT, "chunk_bytes"),
    ("GetArtifact", None, {"chunk_bytes": 1}, grpc.StatusCode.INVALID_ARGUMENT, "chunk_bytes: 1 is outside"),
    ("GetArtifact", None, {"chunk_bytes": -5}, grpc.StatusCode.INVALID_ARGUMENT, "chunk_bytes"),
    ("DeleteArtifact", "xyz", {}, grpc.StatusCode.INVALID_ARGUMENT, "key.digest"),
    ("DeleteArtifact", "0" * 64, {}, grpc.StatusCode.NOT_FOUND, "no artifact"),
])
def test_artifact_calls_name_a_bad_key_or_chunk_size(compile_stub, tiny_key, call, digest, extra, code, message):
    request = getattr(compile_pb2, f"{call}Request")(key=common_pb2.ArtifactKey(digest=digest or tiny_key), **extra)
    with pytest.raises(grpc.RpcError) as err:
        if call == "GetArtifact":
            list(compile_stub.GetArtifact(request))  # a stream: its status comes with the first read
        else:
            compile_stub.DeleteArtifact(request)
    assert err.value.code() == code and message in err.value.details()


def test_list_and_delete(compile_stub, tiny_key):
    listed = {a.key.digest: a for a in compile_stub.ListArtifacts(compile_pb2.ListArtifactsRequest()).artifacts}
    info = listed[tiny_key]
    assert info.model == "tiny-llama" and info.num_pieces == 2 and info.size_bytes > 0
    assert info.last_used_unix >= info.created_unix and "sizes=8" in info.config_summary
    # Delete something else than the shared bundle: a full-graph compile made by another test or here.
    config = common_pb2.CompileConfig()
    config.CopyFrom(TINY_CONFIG)
    config.splitting_ops.SetInParent()
    del config.compile_sizes[:]
    doomed = compile_result(compile_stub, config=config).key
    freed = compile_stub.DeleteArtifact(compile_pb2.DeleteArtifactRequest(key=doomed)).freed_bytes
    assert freed > 0
    remaining = {a.key.digest for a in compile_stub.ListArtifacts(compile_pb2.ListArtifactsRequest()).artifacts}
    assert doomed.digest not in remaining and tiny_key in remaining
    with pytest.raises(grpc.RpcError) as err:
        compile_stub.DeleteArtifact(compile_pb2.DeleteArtifactRequest(key=doomed))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_corrupted_bundle_is_detected_and_recompiled(compile_stub, compile_store, tiny_key):
    compiled = compile_store / tiny_key / bundle.compiled_layer_file(0)
    data = bytearray(compiled.read_bytes())
    data[len(data) // 2] ^= 0xFF
    compiled.write_bytes(bytes(data))
    result = compile_result(compile_stub)
    assert not result.cache_hit and result.key.digest == tiny_key
    assert bundle.verify(compile_store / tiny_key).key == tiny_key
    assert compile_result(compile_stub).cache_hit


def _config(**fields) -> common_pb2.CompileConfig:
    config = common_pb2.CompileConfig()
    config.CopyFrom(TINY_CONFIG)
    for name, value in fields.items():
        if name == "splitting_ops":
            config.splitting_ops.ops[:] = value
        elif name == "compile_sizes":
            config.compile_sizes[:] = value
        else:
            setattr(config, name, value)
    return config


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize("model, config, code, field", [
    (common_pb2.ModelSpec(preset="no-such-model"), TINY_CONFIG, grpc.StatusCode.NOT_FOUND, "model.preset"),
    (common_pb2.ModelSpec(hf_dir="/no/such/dir"), TINY_CONFIG, grpc.StatusCode.NOT_FOUND, "model.hf_dir"),
    (common_pb2.ModelSpec(config_json="{not json"), TINY_CONFIG, grpc.StatusCode.INVALID_ARGUMENT,
     "model.config_json"),
    (common_pb2.ModelSpec(config_json=json.dumps({"model_type": "bert"})), TINY_CONFIG,
     grpc.StatusCode.INVALID_ARGUMENT, "model_type"),
    (common_pb2.ModelSpec(config_json=json.dumps({"model_type": "no-such-arch"})), TINY_CONFIG,
     grpc.StatusCode.INVALID_ARGUMENT, "model_type"),
    (TINY_MODEL, _config(compile_sizes=[4096]), grpc.StatusCode.INVALID_ARGUMENT, "config.compile_sizes"),
    (TINY_MODEL, _config(compile_sizes=[0]), grpc.StatusCode.INVALID_ARGUMENT, "config.compile_sizes"),
    (TINY_MODEL, _config(compile_sizes=[-3]), grpc.StatusCode.INVALID_ARGUMENT, "config.compile_sizes"),
    (TINY_MODEL, _config(splitting_ops=["aten::mm"]), grpc.StatusCode.INVALID_ARGUMENT, "config.splitting_ops"),
    (TINY_MODEL, _config(max_num_batched_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT,
     "config.max_num_batched_tokens"),
    (TINY_MODEL, _config(inductor_config_patches_json='{"no_such_option": 1}'), grpc.StatusCode.INVALID_ARGUMENT,
     "config.inductor_config_patches_json"),
    (TINY_MODEL, _config(device="tpu"), grpc.StatusCode.INVALID_ARGUMENT, "config.device"),
    (common_pb2.ModelSpec(preset="tiny-llama", dtype="int4"), TINY_CONFIG, grpc.StatusCode.INVALID_ARGUMENT,
     "model.dtype"),
])
def test_bad_input_gets_its_status(compile_stub, model, config, code, field):
    with pytest.raises(grpc.RpcError) as err:
        compile_result(compile_stub, model=model, config=config)
    assert err.value.code() == code
    assert field in err.value.details()


def test_a_config_torch_cannot_build_is_the_callers_error_and_leaves_store_clean(compile_stub, compile_store,
                                                                                tiny_key):
    before = sorted(p.name for p in compile_store.iterdir())
    broken = dict(LLAMA, num_key_value_heads=3)  # 4 query heads cannot group over 3 KV heads
    with pytest.raises(grpc.RpcError) as err:
        compile_result(compile_stub, model=common_pb2.ModelSpec(config_json=json.dumps(broken)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "model config: num_attention_heads 4 is not a multiple of num_key_value_heads 3"
    assert sorted(p.name for p in compile_store.iterdir()) == before
    assert not list((compile_store / ".staging").iterdir())
    assert compile_result(compile_stub).cache_hit  # the server is still serving


def test_health_and_reflection(compile_server):
    with grpc.insecure_channel(compile_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="kiln.v1.CompileService")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "kiln.v1.CompileService" in services and "grpc.health.v1.Health" in services


def test_cli_compile_reports_key_and_timings(compile_server, tiny_key):
    proc = subprocess.run([sys.executable, "-m", "kiln_cli", "compile", "tiny-llama", "--server",
                           compile_server.address, "--device", "cpu", "--compile-sizes", "8",
                           "--max-compiled-tokens", "128", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["key"]["digest"] == tiny_key and result["cache_hit"] is True
    proc = subprocess.run([sys.executable, "-m", "kiln_cli", "compile", "nope", "--server", compile_server.address],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "NOT_FOUND" in proc.stderr and "Traceback" not in proc.stderr
