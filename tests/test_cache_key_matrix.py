"""The artifact key is exactly the generated code: a matrix of perturbations through the real compile server.

Same-key rows must give the session's tiny key (paths, ports, cwd, env noise, cache dirs, field order, aliases,
restarts, weights, fields no forward reads, an Inductor patch equal to the default); new-key rows must change it, and
the factors the server returns with the key say which factor did. Keys come from ``Compile`` with ``key_only``: the
real server computes and looks up the key but compiles nothing. Two more compile servers run as child processes,
each from its own copy of the Kiln sources: one with only noise changed (restart, cwd, port, store, cache dirs,
environment, a comment in the piecewise backend), one with real factors changed (an Inductor option by environment
variable, the CPU ISA, the thread count, a statement in the piecewise backend). Versions and GPUs that cannot change
on this machine are simulated in-process on the factors, and the rows say so. Load rows: a LoadModel through the
real execute server refuses a bundle whose factors are not those asked for, naming the factor.
"""

import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path

import grpc
import pytest
from conftest import ANOTHER_TORCH, TINY_CONFIG, TINY_MODEL

from exec_service.startup.fetch import FetchedBundle, check_factors
from kiln.compilation import cache_key, compiler_caches
from kiln.compilation.config import CompileConfig
from kiln.errors import FailedPrecondition
from kiln.model.causal_lm import transformers_model
from kiln.model.factors import model_config_factors
from kiln.model.spec import resolve
from kiln.store import bundle
from kiln_cli.service_process import ServiceProcess, free_port
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = json.loads(json.dumps(resolve(TINY_MODEL, "cpu").config.to_dict()))


def key_of(stub, model=TINY_MODEL, config=TINY_CONFIG) -> compile_pb2.CompileResult:
    events = list(stub.Compile(compile_pb2.CompileRequest(model=model, config=config, key_only=True)))
    assert len(events) == 1 and events[0].HasField("result")
    return events[0].result


def factors_of(result: compile_pb2.CompileResult) -> dict:
    return json.loads(result.key_factors_json)


def config_json(**changes) -> common_pb2.ModelSpec:
    raw = copy.deepcopy(BASE_CONFIG)
    for name, value in changes.items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    return common_pb2.ModelSpec(config_json=json.dumps(raw))


def compile_config(**fields) -> common_pb2.CompileConfig:
    config = copy.deepcopy(TINY_CONFIG)
    for name, value in fields.items():
        if name == "compile_sizes":
            config.compile_sizes[:] = value
        elif name == "splitting_ops":
            config.splitting_ops.ops[:] = value
        else:
            setattr(config, name, value)
    return config


# ---------------------------------------------------------------------------------------------- same key, in-process

SAME_KEY = {
    "preset as config_json": (config_json(), TINY_CONFIG),
    "fields in reverse order": (common_pb2.ModelSpec(config_json=json.dumps(dict(reversed(BASE_CONFIG.items())))),
                                TINY_CONFIG),
    "token ids (bos, eos, pad)": (config_json(bos_token_id=7, eos_token_id=[8, 9], pad_token_id=0), TINY_CONFIG),
    "initializer_range": (config_json(initializer_range=0.5), TINY_CONFIG),
    "use_cache": (config_json(use_cache=False), TINY_CONFIG),
    "tie_word_embeddings": (config_json(tie_word_embeddings=True), TINY_CONFIG),
    "attention_dropout": (config_json(attention_dropout=0.1), TINY_CONFIG),
    "output options": (config_json(output_hidden_states=True, output_attentions=True, return_dict=False),
                       TINY_CONFIG),
    "saved-from fields": (config_json(architectures=["Other"], transformers_version="4.0.0", _name_or_path="/x",
                                      torch_dtype="bfloat16"), TINY_CONFIG),
    "label maps and problem_type": (config_json(id2label={"0": "a"}, label2id={"a": 0},
                                                problem_type="regression"), TINY_CONFIG),
    "alias: head_dim given, equal to its default": (config_json(head_dim=16), TINY_CONFIG),
    "alias: rope_theta at the top level": (config_json(rope_parameters=None, rope_theta=10000.0), TINY_CONFIG),
    "alias: rope_scaling for rope_parameters": (
        config_json(rope_parameters=None, rope_scaling={"rope_type": "default", "rope_theta": 10000.0}), TINY_CONFIG),
    "alias: dtype unset is float32 on CPU": (common_pb2.ModelSpec(preset="tiny-llama", dtype=""), TINY_CONFIG),
    "alias: dtype float32 spelled out": (common_pb2.ModelSpec(preset="tiny-llama", dtype="float32"), TINY_CONFIG),
    "compile sizes repeated": (TINY_MODEL, compile_config(compile_sizes=[8, 8])),
    "splitting ops spelled out": (TINY_MODEL, compile_config(splitting_ops=["kiln::attention"])),
    "device unset on a CPU server": (TINY_MODEL, compile_config(device="")),
    "Inductor patch equal to the default": (TINY_MODEL, compile_config(
        inductor_config_patches_json=json.dumps({"max_autotune": False, "cpp.simdlen": None}))),
}


def test_key_only_answers_a_stored_bundle_as_a_hit(compile_stub, tiny_key):
    result = key_of(compile_stub)
    assert result.key.digest == tiny_key and result.cache_hit and result.num_pieces == 2
    assert cache_key.digest(factors_of(result)) == tiny_key


@pytest.mark.parametrize("row", SAME_KEY)
def test_same_key(compile_stub, tiny_key, row):
    model, config = SAME_KEY[row]
    result = key_of(compile_stub, model, config)
    assert result.key.digest == tiny_key, cache_key.differences(factors_of(result), factors_of(key_of(compile_stub)))


def test_same_key_for_weights_and_paths(compile_stub, tiny_key, tmp_path):
    """A saved HF directory with real (seeded) weights keys as the preset does, wherever it is moved."""
    transformers_model(resolve(TINY_MODEL, "cpu"), "cpu", seed=123).save_pretrained(tmp_path / "tiny")
    assert key_of(compile_stub, common_pb2.ModelSpec(hf_dir=str(tmp_path / "tiny"))).key.digest == tiny_key
    moved = tmp_path / "elsewhere" / "deeper"
    moved.parent.mkdir()
    (tmp_path / "tiny").rename(moved)
    assert key_of(compile_stub, common_pb2.ModelSpec(hf_dir=str(moved))).key.digest == tiny_key


# ----------------------------------------------------------------------------------------------- new key, in-process

# One perturbation per architecture field the tiny model's forward reads; the test below holds the table to that set.
ARCHITECTURE_FIELDS = {
    "model_type": "mistral",
    "attention_bias": True,
    "mlp_bias": True,
    "head_dim": 32,
    "hidden_act": "gelu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "num_attention_heads": 8,
    "num_hidden_layers": 3,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
    "vocab_size": 1024,
    "is_encoder_decoder": True,
}

NEW_KEY = {
    "dtype bfloat16": (common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16"), TINY_CONFIG, "dtype"),
    "dtype float16": (common_pb2.ModelSpec(preset="tiny-llama", dtype="float16"), TINY_CONFIG, "dtype"),
    "a compile size more": (TINY_MODEL, compile_config(compile_sizes=[8, 16]), "compile_config.compile_sizes"),
    "no compile sizes": (TINY_MODEL, compile_config(compile_sizes=[]), "compile_config.compile_sizes"),
    "symbolic range": (TINY_MODEL, compile_config(max_compiled_tokens=256),
                       "compile_config.max_compiled_tokens"),
    "split ops: full graph": (TINY_MODEL, compile_config(splitting_ops=[]), "compile_config.splitting_ops"),
    "Inductor patch max_autotune": (TINY_MODEL, compile_config(
        inductor_config_patches_json=json.dumps({"max_autotune": True})), "compiler.inductor.max_autotune"),
    "Inductor patch coordinate_descent_tuning": (TINY_MODEL, compile_config(
        inductor_config_patches_json=json.dumps({"coordinate_descent_tuning": True})),
        "compiler.inductor.coordinate_descent_tuning"),
    "Inductor patch cpp.simdlen": (TINY_MODEL, compile_config(
        inductor_config_patches_json=json.dumps({"cpp.simdlen": 256})), "compiler.inductor.cpp.simdlen"),
    **{f"architecture field {name}": (config_json(**{name: value}), TINY_CONFIG, f"model_config.{name}")
       for name, value in ARCHITECTURE_FIELDS.items()},
}


def test_every_field_the_forward_reads_has_a_new_key_row():
    assert set(model_config_factors(resolve(TINY_MODEL, "cpu"))) == set(ARCHITECTURE_FIELDS)


@pytest.mark.parametrize("row", NEW_KEY)
def test_new_key(compile_stub, tiny_key, row):
    model, config, factor = NEW_KEY[row]
    result = key_of(compile_stub, model, config)
    # A new key, whether or not another test compiled the same config into the session's store before this one (run
    # after tests/test_exec_service.py, "no compile sizes" was a hit).
    assert result.key.digest != tiny_key
    changed = {name for name, _, _ in cache_key.differences(factors_of(result), factors_of(key_of(compile_stub)))}
    assert any(name == factor or name.startswith(factor + ".") for name in changed), changed


def test_kiln_code_hash_follows_statements_not_comments(tmp_path):
    """Every Kiln module the compile reaches is hashed by its syntax tree: the backend too, not three files."""
    from kiln.compilation.code_hash import code_modules, kiln_code_hash

    assert {"compile_service.pipeline", "compile_service.piecewise_backend", "kiln.model.causal_lm",
            "kiln.attention.op", "kiln.compilation.piecewise"} <= set(code_modules())
    assert not {"kiln.store.artifact_store", "tracing.spans", "kiln.compilation.cache_key"} & set(code_modules())
    tree = copy_sources(tmp_path / "comment", edit_comment)
    assert kiln_code_hash(tree) == kiln_code_hash()
    tree = copy_sources(tmp_path / "statement", edit_statement)
    assert kiln_code_hash(tree) != kiln_code_hash()


# ---------------------------------------------------------- versions and GPUs: simulated in-process on the factors

SIMULATED = {
    "torch": ("environment", "torch", ANOTHER_TORCH),
    "torch git version": ("environment", "torch_git", "0" * 40),
    "triton": ("environment", "triton", "3.6.0"),
    "python": ("environment", "python", "3.12.3"),
    "transformers": ("environment", "transformers", "5.17.0"),
    "machine": ("environment", "machine", "aarch64"),
}
SIMULATED_GPU = {"device_type": "cuda", "cuda": "13.0", "compute_capability": "9.0", "gpu_name": "NVIDIA H200"}


@pytest.mark.parametrize("row", SIMULATED)
def test_new_key_for_another_version_simulated(compile_stub, tiny_key, row):
    """Simulated: this machine has one torch, Triton, Python; the stored factors are edited instead, and both the
    key and the load check move."""
    group, name, value = SIMULATED[row]
    factors = factors_of(key_of(compile_stub))
    factors[group][name] = value
    assert cache_key.digest(factors) != tiny_key
    fetched = FetchedBundle(cache_key.digest(factors), Path("/nonexistent"), factors, "test")
    with pytest.raises(FailedPrecondition, match=re.escape(f"{name} {value}, this process has")):
        check_factors(fetched, resolve(TINY_MODEL, "cpu"), CompileConfig.from_proto(TINY_CONFIG), by_key=True)


@pytest.mark.parametrize("name", ["cuda", "compute_capability", "gpu_name"])
def test_new_key_for_another_gpu_simulated(compile_stub, name):
    """Simulated: no GPU here, so an H200's environment factors are written out and one of them changed."""
    factors = factors_of(key_of(compile_stub))
    factors["environment"] |= SIMULATED_GPU
    other = copy.deepcopy(factors)
    other["environment"][name] = {"cuda": "12.8", "compute_capability": "10.0", "gpu_name": "NVIDIA B200"}[name]
    assert cache_key.digest(factors) != cache_key.digest(other)


# ------------------------------------------------------------------ other processes: restarts, env, cwd, Kiln code

def copy_sources(dest: Path, edit) -> Path:
    """The Kiln packages copied to ``dest``, with ``edit`` applied to the piecewise backend's source."""
    for package in ("kiln", "kiln_cli", "compile_service", "exec_service", "tracing", "protos"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    backend = dest / "compile_service" / "piecewise_backend.py"
    backend.write_text(edit(backend.read_text()))
    return dest


def edit_comment(source: str) -> str:
    edited = source.replace('"""A torch.compile backend', '"""A compile backend', 1)
    return "# a comment the key must not see\n" + edited


def edit_statement(source: str) -> str:
    marker = "        self.stats = SplitStats()\n"
    assert marker in source
    return source.replace(marker, marker + "        self.tuned = False\n", 1)


def start_server(name: str, tree: Path, tmp: Path, signing_key: Path, env: dict) -> ServiceProcess:
    """``kiln compile-server`` from the sources in ``tree``, run in its own cwd with ``env`` over a clean one."""
    port, cwd = free_port(), tmp / f"{name}-cwd"
    cwd.mkdir()
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "OTEL_", "ATEN_", "OMP_"))}
    command = f"cd {cwd} && exec {sys.executable} -m kiln_cli compile-server --host 127.0.0.1 --port {port} " \
              f"--store {tmp / f'{name}-store'} --signing-key {signing_key}"
    server = ServiceProcess(name, ["/bin/sh", "-c", command], f"127.0.0.1:{port}", tmp / f"{name}.log",
                            env={**clean, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", **env})
    server.start()
    return server


def lower_cpu_isa() -> str:
    """An ATEN_CPU_CAPABILITY below this host's (it can only lower it): AVX2 on an AVX-512 host, none on an AVX2 one."""
    return "default" if compiler_caches.partition_factors("cpu")["cpu_capability"] == "AVX2" else "avx2"


@pytest.fixture(scope="module")
def other_servers(tmp_path_factory, signing_dir):
    """Two compile servers as child processes, started together: one with noise only, one with real factors."""
    tmp = tmp_path_factory.mktemp("key-matrix")
    # Another path to this process's Inductor cache: a cold one would spend ~16 s of CI re-probing the CPU ISA.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    (tmp / "inductor-cache").symlink_to(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    key = signing_dir / "signing.key"
    noise = start_server("noise", copy_sources(tmp / "noise-src", edit_comment), tmp, key, {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-cache"), "TRITON_CACHE_DIR": str(tmp / "triton-cache"),
        "TORCHINDUCTOR_WORKER_LOGPATH": str(tmp / "worker.log"), "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "KILN_UNRELATED": "1", "LANG": "C",
        "OTEL_SDK_DISABLED": "true"})
    factors = start_server("factors", copy_sources(tmp / "factors-src", edit_statement), tmp, key, {
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "ATEN_CPU_CAPABILITY": lower_cpu_isa(), "OMP_NUM_THREADS": "1"})
    servers = {"noise": noise, "factors": factors}
    try:
        for server in servers.values():
            server.wait_healthy(timeout=120)
        channels = {name: grpc.insecure_channel(s.address) for name, s in servers.items()}
        yield {name: compile_pb2_grpc.CompileServiceStub(channel) for name, channel in channels.items()}
        for channel in channels.values():
            channel.close()
    finally:
        for server in servers.values():
            server.kill()


def test_same_key_after_restart_elsewhere_with_noise(other_servers, tiny_key):
    """Another process (a restart), another cwd, port, store, Inductor and Triton cache dirs, unrelated environment
    variables, Inductor options torch keeps out of its own key (a worker count, a log path), Kiln installed at
    another path with a comment edited in the piecewise backend: the same key."""
    result = key_of(other_servers["noise"])
    assert result.key.digest == tiny_key and not result.cache_hit  # its own, empty store


# Each factor the second child process changed, and the only factors that may differ because of it.
PROCESS_FACTORS = {
    "Inductor option by environment (TORCHINDUCTOR_MAX_AUTOTUNE)": {"compiler.inductor.max_autotune"},
    "CPU ISA (ATEN_CPU_CAPABILITY)": {"environment.cpu_isa", "environment.inductor_vec_isa"},
    "thread count (OMP_NUM_THREADS)": {"environment.cpu_threads"},
    "Kiln code (a statement in the piecewise backend)": {"kiln_code"},
}


@pytest.mark.parametrize("row", PROCESS_FACTORS)
def test_new_key_from_another_process(compile_stub, other_servers, tiny_key, row):
    result = key_of(other_servers["factors"])
    assert result.key.digest != tiny_key
    changed = {name for name, _, _ in cache_key.differences(factors_of(result), factors_of(key_of(compile_stub)))}
    assert PROCESS_FACTORS[row] <= changed
    assert changed == set().union(*PROCESS_FACTORS.values())  # nothing else moved


def test_compile_caches_are_partitioned_by_cpu_isa(other_servers, tiny_compiles, tmp_path):
    """The session's compile used this process's partition; the process with a lower ISA would use another one."""
    lower = factors_of(key_of(other_servers["factors"]))["environment"]
    here = compiler_caches.partition_factors("cpu")
    other = {"cpu_capability": lower["cpu_isa"], "inductor_vec_isa": lower["inductor_vec_isa"],
             "machine": lower["machine"]}
    assert compiler_caches.partition_name(other) != compiler_caches.partition_name(here)
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    configured = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    written = configured / compiler_caches.partition_name(here) / compiler_caches.PARTITION_FILE
    assert json.loads(written.read_text()) == here
    saved = {v: os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    os.environ.pop("TRITON_CACHE_DIR", None)
    try:
        with compiler_caches.partitioned_caches("cpu") as inside:
            assert Path(cache_dir()) == inside == tmp_path / "inductor" / compiler_caches.partition_name(here)
            assert os.environ["TRITON_CACHE_DIR"] == str(inside / "triton")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
        assert "TRITON_CACHE_DIR" not in os.environ
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)


# ------------------------------------------------------------------- every load checks every factor (exec server)

def forge(source: Path, store: Path, factors: dict, signer, key: str | None = None) -> str:
    """A copy of the bundle at ``source`` stored under ``key`` (default: the digest of ``factors``) with ``factors``
    as its key_factors.json, signed by the trusted key: a wrong store entry that the signature cannot catch (the
    compile service signed what it was asked to), only the factors can."""
    key = key or cache_key.digest(factors)
    shutil.copytree(source, store / key)
    (store / key / bundle.KEY_FACTORS).write_text(json.dumps(factors))
    manifest = bundle.read_manifest(store / key)
    bundle.write_manifest(store / key, key=key, **{k: v for k, v in manifest.__dict__.items()
                                                    if k not in ("files", "key")})
    bundle.sign(store / key, signer)
    return key


def computed_key(model: common_pb2.ModelSpec, config: common_pb2.CompileConfig) -> str:
    compile_cfg = CompileConfig.from_proto(config)
    return cache_key.digest(cache_key.key_factors(resolve(model, compile_cfg.device), compile_cfg))


def load_error(exec_stub, name: str, model, config, key: str = "") -> grpc.RpcError:
    request = exec_pb2.LoadModelRequest(name=name, model=model, config=config,
                                        key=common_pb2.ArtifactKey(digest=key) if key else None)
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.LoadModel(request))
    return exc.value


LOAD_ROWS = {
    # row: (model, config, the message names)
    "another model config": (config_json(num_hidden_layers=3), TINY_CONFIG,
                             "model_config.num_hidden_layers 2, the request asks for 3"),
    "another dtype": (common_pb2.ModelSpec(preset="tiny-llama", dtype="bfloat16"), TINY_CONFIG,
                      "dtype float32, the request asks for bfloat16"),
    "another compile config": (TINY_MODEL, compile_config(compile_sizes=[16]),
                               "compile_config.compile_sizes [8], the request asks for [16]"),
    "another Inductor patch": (TINY_MODEL, compile_config(inductor_config_patches_json='{"max_autotune": true}'),
                               "Inductor option max_autotune False, the request asks for True"),
}


@pytest.mark.parametrize("row", LOAD_ROWS)
def test_load_refuses_a_bundle_stored_under_the_key_of_another_request(exec_stub, exec_cache, compile_store, tiny_key,
                                                                       signer, row):
    """The tiny bundle, factors and all, stored in the exec server's own store under the key the request computes
    to: the server finds it there, and refuses it, naming the factor."""
    model, config, message = LOAD_ROWS[row]
    tiny_factors = json.loads((compile_store / tiny_key / bundle.KEY_FACTORS).read_text())
    forge(compile_store / tiny_key, exec_cache, tiny_factors, signer, computed_key(model, config))
    error = load_error(exec_stub, f"forged-{row.replace(' ', '-')}", model, config)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert message in error.details()


def test_load_by_key_checks_kiln_code_and_the_digest(exec_stub, exec_cache, compile_store, tiny_key, signer):
    tiny_factors = json.loads((compile_store / tiny_key / bundle.KEY_FACTORS).read_text())
    other_code = forge(compile_store / tiny_key, exec_cache, tiny_factors | {"kiln_code": "0" * 64}, signer)
    error = load_error(exec_stub, "forged-code", TINY_MODEL, TINY_CONFIG, other_code)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and f"kiln_code {'0' * 64}, this process has" in \
        error.details()
    renamed = forge(compile_store / tiny_key, exec_cache, tiny_factors, signer, "e" * 64)
    error = load_error(exec_stub, "forged-digest", TINY_MODEL, TINY_CONFIG, renamed)
    assert error.code() == grpc.StatusCode.DATA_LOSS and "not to the key it is stored under" in error.details()
