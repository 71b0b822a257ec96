"""No check-then-use on client-named paths: a file or a directory under a model root swapped for a link out of it,
again and again while the real servers read it, is refused or read as it was checked, never followed."""

import json
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import TINY_MODEL, BackgroundServer

from kiln.model.roots import ModelRoots
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2}
INSIDE_VOCAB, OUTSIDE_VOCAB = 128, 256
# Names no check reads: a directory this long to check leaves a wide window between the check and the read.
PADDING = 20_000


class Swapper:
    """Swaps ``path`` for a link to ``outside`` and back, by renames, until stopped: a file atomically (its real
    bytes kept under a hard link), a directory through a moment when the path names nothing."""

    def __init__(self, path: Path, outside: Path):
        self.path, self.outside, self.stop, self.swaps = path, outside, threading.Event(), 0
        self.aside, self.tmp = path.with_name(f".{path.name}.real"), path.with_name(f".{path.name}.tmp")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        directory = self.path.is_dir()
        if not directory:
            os.link(self.path, self.aside)
        while not self.stop.is_set():
            if directory:
                os.rename(self.path, self.aside)
                os.symlink(self.outside, self.path)
                time.sleep(0.001)
                os.unlink(self.path)
                os.rename(self.aside, self.path)
            else:
                os.symlink(self.outside, self.tmp)
                os.rename(self.tmp, self.path)
                time.sleep(0.001)
                os.link(self.aside, self.tmp)
                os.rename(self.tmp, self.path)
            self.swaps += 1
            time.sleep(0.001)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def model_dir(root: Path, vocab: int, padding: int = 0) -> Path:
    root.mkdir(parents=True)
    for i in range(padding):
        (root / f"pad{i:05d}").touch()
    (root / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": vocab}))  # last: a tmpfs lists it first
    return root


def test_a_config_json_swapped_for_a_link_is_never_read_outside_the_root(tmp_path, signer):
    from compile_service.server import CompileServerSettings, start_compile_server

    root = tmp_path / "root"
    model = model_dir(root / "model", INSIDE_VOCAB, PADDING)
    outside = model_dir(tmp_path / "outside", OUTSIDE_VOCAB)
    server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", tmp_path / "store", signer, model_roots=(root,))))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    stub = compile_pb2_grpc.CompileServiceStub(channel)
    vocabs, refused = [], []
    try:
        with Swapper(model / "config.json", outside / "config.json") as swapper:
            for _ in range(12):
                request = compile_pb2.CompileRequest(model=common_pb2.ModelSpec(hf_dir=str(model)), key_only=True,
                                                     config=common_pb2.CompileConfig(device="cpu"))
                try:
                    (event,) = stub.Compile(request, timeout=60)
                except grpc.RpcError as exc:
                    refused.append((exc.code(), exc.details()))
                    continue
                vocabs.append(json.loads(event.result.key_factors_json)["model_config"]["vocab_size"])
        assert swapper.swaps > 10, "the path was hardly swapped: no race was run"
    finally:
        channel.close()
        server.stop()
    assert OUTSIDE_VOCAB not in vocabs, f"read outside the root: {vocabs}"
    assert all(code == grpc.StatusCode.PERMISSION_DENIED for code, _ in refused), refused
    assert INSIDE_VOCAB in vocabs


def test_a_weights_directory_swapped_for_a_link_is_loaded_as_checked_or_refused(tmp_path, signer, trusted_keys):
    """The weights directory itself swapped for a link to a checkpoint outside the roots (one that does not match
    the model, so reading it would fail the load as FAILED_PRECONDITION): every LoadModel is ready or refused."""
    from exec_service.server import ExecServerSettings, start_exec_server
    from kiln.model.causal_lm import transformers_model
    from kiln.model.spec import resolve

    root = tmp_path / "root"
    transformers_model(resolve(TINY_MODEL, "cpu"), "cpu").save_pretrained(root / "weights")
    other = resolve(common_pb2.ModelSpec(config_json=json.dumps({**LLAMA, "vocab_size": OUTSIDE_VOCAB})), "cpu")
    transformers_model(other, "cpu").save_pretrained(tmp_path / "outside")
    server = BackgroundServer(lambda: start_exec_server(ExecServerSettings(
        "127.0.0.1:0", trusted_keys, None, cache_dir=tmp_path / "cache", model_roots=(root,))))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    stub = exec_pb2_grpc.ExecServiceStub(channel)
    outcomes = []
    try:
        with Swapper(root / "weights", tmp_path / "outside"):
            # At least 6 loads, and on until one lands between swaps (on a loaded host every try can meet a swap).
            for i in range(40):
                if i >= 6 and "ready" in outcomes:
                    break
                request = exec_pb2.LoadModelRequest(name=f"w{i}", model=TINY_MODEL, weights=str(root / "weights"),
                                                    runtime_mode=exec_pb2.RUNTIME_MODE_EAGER)
                try:
                    list(stub.LoadModel(request, timeout=120))
                    outcomes.append("ready")
                    stub.UnloadModel(exec_pb2.UnloadModelRequest(name=f"w{i}"))
                except grpc.RpcError as exc:
                    outcomes.append(f"{exc.code().name}: {exc.details()}")
    finally:
        channel.close()
        server.stop()
    allowed = ("PERMISSION_DENIED", "NOT_FOUND: weights", "INVALID_ARGUMENT: weights")
    assert all(o == "ready" or o.startswith(allowed) for o in outcomes), outcomes
    assert "ready" in outcomes


def test_a_checked_directory_reads_what_was_checked_after_the_swap(tmp_path):
    """The race without its luck: check, swap the file and then the directory for links out of the root, read."""
    root = tmp_path / "root"
    model = model_dir(root / "model", INSIDE_VOCAB)
    outside = model_dir(tmp_path / "outside", OUTSIDE_VOCAB)
    pinned = ModelRoots([root]).check_dir(str(model), "model.hf_dir")
    (model / "config.json").unlink()
    os.symlink(outside / "config.json", model / "config.json")
    assert json.loads(pinned.read("config.json", 1 << 20))["vocab_size"] == INSIDE_VOCAB
    os.rename(model, root / "elsewhere")
    os.symlink(outside, model)
    assert json.loads((pinned.view / "config.json").read_text())["vocab_size"] == INSIDE_VOCAB
    with pytest.raises(Exception, match="not under a model root") as refused:
        ModelRoots([root]).check_dir(str(model), "model.hf_dir")
    assert refused.value.code == "PERMISSION_DENIED"
    view = pinned.view
    pinned.close()
    assert not view.exists()
