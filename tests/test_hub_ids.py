"""Hub ids (``org/name[@revision]``) resolved from a Hugging Face cache laid out as huggingface_hub lays it out
(``models--org--name/{blobs,snapshots/<commit>,refs/main}``), with downloads off: real compile and execute
services load, compile and generate from it, and refuse what is not there with a status naming the field."""

import hashlib
import os
from pathlib import Path

import grpc
import pytest
from conftest import TINY_CONFIG, BackgroundServer, compile_result, load_model
from text_model import write_text_model

from kiln.model.hub import HubCache
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln_cli.compile_commands import model_spec
from protos import common_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

REPO = "kiln-test/tiny-text"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, files: Path) -> Path:
    """``files`` as one snapshot of REPO in a cache at ``cache``: content-named blobs, the snapshot's entries
    relative symlinks to them, refs/main naming the commit."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in sorted(files.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, monkeypatch_module):
    from transformers import AutoConfig, AutoModelForCausalLM

    files = write_text_model(tmp_path_factory.mktemp("hub-files"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(files))
    model.save_pretrained(files)  # safetensors beside the config: weights from the Hub id too
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch_module.setattr(constants, "HF_HUB_OFFLINE", True)
    return lay_out_cache(tmp_path_factory.mktemp("hf-cache"), files)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def hub_exec(hub_cache, compile_server, tiny_key, trusted_keys, tmp_path_factory):
    from exec_service.server import ExecServerSettings, start_exec_server

    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address,
                                  cache_dir=tmp_path_factory.mktemp("hub-exec-cache"), hub=HubCache(hub_cache))
    server = BackgroundServer(lambda: start_exec_server(settings))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield exec_pb2_grpc.ExecServiceStub(channel)
    channel.close()
    server.stop()


def test_a_hub_id_loads_from_the_cache_with_its_weights_and_tokenizer(hub_exec, hub_cache):
    from transformers import AutoTokenizer

    events = load_model(hub_exec, "", model=common_pb2.ModelSpec(hub_id=REPO), weights=REPO)
    assert events[-1].ready.vocab_size == 512
    models = {m.name: m for m in hub_exec.ListModels(exec_pb2.ListModelsRequest()).models}
    assert models["tiny-text"].state == exec_pb2.MODEL_STATE_READY  # named after the repository
    responses = list(hub_exec.Generate(exec_pb2.GenerateRequest(
        model="tiny-text", prompt="hello kiln", max_tokens=4, temperature=0, ignore_eos=True)))
    token_ids = [t for r in responses for t in r.token_ids]
    tokenizer = AutoTokenizer.from_pretrained(hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT)
    assert responses[-1].usage.prompt_tokens == len(tokenizer.encode("hello kiln"))  # the snapshot's tokenizer
    # The stream holds back a character whose bytes have not all come (decode writes U+FFFD for it).
    assert "".join(r.text for r in responses) == tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_a_revision_names_a_branch_or_a_commit(hub_exec, revision):
    load_model(hub_exec, f"rev-{revision[:8]}", model=common_pb2.ModelSpec(hub_id=f"{REPO}@{revision}"))


@pytest.mark.parametrize(("hub_id", "code", "says"), [
    ("kiln-test/not-cached", grpc.StatusCode.NOT_FOUND, "downloads nothing"),
    (f"{REPO}@v9", grpc.StatusCode.NOT_FOUND, "downloads nothing"),
    ("../etc", grpc.StatusCode.INVALID_ARGUMENT, "not a Hub id"),
    ("org/name/extra", grpc.StatusCode.INVALID_ARGUMENT, "not a Hub id"),
])
def test_what_the_cache_lacks_is_refused_and_nothing_downloads(hub_exec, hub_id, code, says):
    with pytest.raises(grpc.RpcError) as refused:
        load_model(hub_exec, "absent", model=common_pb2.ModelSpec(hub_id=hub_id))
    assert refused.value.code() == code
    assert refused.value.details().startswith("model.hub_id: ") and says in refused.value.details()


def test_a_snapshot_entry_outside_the_cache_is_refused(hub_exec, hub_cache, tmp_path):
    """The cache is the root of what a Hub id may read, even on a loopback server that reads any directory."""
    elsewhere = tmp_path / "config.json"
    elsewhere.write_text("{}")
    snapshot = hub_cache / "models--kiln-test--escape" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(elsewhere)
    with pytest.raises(grpc.RpcError) as refused:
        load_model(hub_exec, "escape", model=common_pb2.ModelSpec(hub_id=f"kiln-test/escape@{COMMIT}"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details().startswith("model.hub_id: ")


def test_a_server_without_a_cache_refuses_hub_ids(exec_stub):
    with pytest.raises(grpc.RpcError) as refused:
        load_model(exec_stub, "no-hub", model=common_pb2.ModelSpec(hub_id=REPO))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--hub-cache" in refused.value.details()


def test_the_compile_service_resolves_a_hub_id_to_the_same_key(hub_cache, compile_store, signer, tiny_key):
    from compile_service.server import CompileServerSettings, start_compile_server

    settings = CompileServerSettings("127.0.0.1:0", compile_store, signer, hub=HubCache(hub_cache))
    server = BackgroundServer(lambda: start_compile_server(settings))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    try:
        result = compile_result(compile_pb2_grpc.CompileServiceStub(channel),
                                model=common_pb2.ModelSpec(hub_id=REPO), config=TINY_CONFIG)
    finally:
        channel.close()
        server.stop()
    assert result.cache_hit and result.key.digest == tiny_key  # the tiny-llama config under another name


def test_the_cli_reads_org_name_as_a_hub_id(tmp_path, monkeypatch):
    assert model_spec("Qwen/Qwen2.5-0.5B", "").hub_id == "Qwen/Qwen2.5-0.5B"
    assert model_spec("Qwen/Qwen2.5-0.5B@main", "").hub_id == "Qwen/Qwen2.5-0.5B@main"
    assert model_spec("tiny-llama", "").preset == "tiny-llama"
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_spec("org/name", "").hf_dir == str(tmp_path / "org" / "name")  # a local directory wins
