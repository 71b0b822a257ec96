"""Tensor parallelism on the CPU through the real servers: tiny Llama, Qwen2 and windowed Mistral models over two
gloo ranks (two processes), token for token what one rank gives, and the refusals and failures around it
(docs/tensor-parallel.md)."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from kiln.model.presets import TINY
from protos import common_pb2, exec_pb2
from tests.conftest import TINY_MODEL, load_model

PROMPTS = [[1, 5, 9, 200, 17], [3, 3, 40, 11, 7, 90, 123, 6, 2, 8, 64], [77]]
MAX_TOKENS = 12


def greedy(stub, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, timeout: float = 120) -> list[int]:
    request = exec_pb2.GenerateRequest(model=model, prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True)
    return [t for response in stub.Generate(request, timeout=timeout) for t in response.token_ids]


def greedy_all(stub, model: str) -> list[list[int]]:
    """Every prompt at once, so that the steps batch prefills and decodes of several sequences."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: greedy(stub, model, p), PROMPTS))


def model_info(stub, name: str) -> exec_pb2.ModelInfo:
    (info,) = [m for m in stub.ListModels(exec_pb2.ListModelsRequest()).models if m.name == name]
    return info


def rank_pids() -> set[int]:
    """This process's children that are ranks (the session's exec server runs in this process)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"exec_service.startup.rank_worker" in cmdline:
            pids.add(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def tp2_loaded(exec_stub, tiny_loaded) -> exec_pb2.ModelSizing:
    """The tiny Llama over two ranks, its bundle compiled for them; the sizing of its ready event."""
    return load_model(exec_stub, "tiny-tp2", tensor_parallel_size=2)[-1].ready


def test_two_ranks_greedy_equal_one_rank(exec_stub, tp2_loaded):
    assert tp2_loaded.tensor_parallel_size == 2
    assert tp2_loaded.key.digest  # compiled, not eager
    assert greedy_all(exec_stub, "tiny-tp2") == greedy_all(exec_stub, "tiny")


def test_sixteen_streams_with_a_cancellation(exec_stub, tp2_loaded):
    prompts = [[(11 * i + 7 * j) % 500 + 3 for j in range(3 + i)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda p: greedy(exec_stub, "tiny", p, max_tokens=24), prompts))
    cancelled = exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny-tp2", prompt_ids=prompts[0], max_tokens=400,
                                                            temperature=0.0, ignore_eos=True), timeout=60)
    assert next(cancelled).token_ids
    with ThreadPoolExecutor(15) as pool:
        running = [pool.submit(greedy, exec_stub, "tiny-tp2", p, 24) for p in prompts[1:]]
        cancelled.cancel()
        assert [r.result() for r in running] == expected[1:]
    deadline = time.monotonic() + 10  # the cancellation reaches the engine on its own
    while (listed := model_info(exec_stub, "tiny-tp2")).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listed.state == exec_pb2.MODEL_STATE_READY and listed.num_running == 0
    assert listed.num_free_blocks == tp2_loaded.num_kv_blocks  # the cancelled stream's blocks came back
    assert greedy(exec_stub, "tiny-tp2", prompts[0]) == greedy(exec_stub, "tiny", prompts[0])


# The other families with Llama's layer shapes: Qwen2's q/k/v have biases; Mistral's window of 8 tokens is shorter
# than the prompts and outputs, so its blocks fall out of the window (a null block in every rank's cache).
FAMILIES = {
    "qwen2": dict(TINY, model_type="qwen2"),
    "mistral": dict(TINY, model_type="mistral", sliding_window=8),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_greedy_equal_one_rank_in_other_families(exec_stub, family):
    model = common_pb2.ModelSpec(config_json=json.dumps(FAMILIES[family]))
    load_model(exec_stub, f"{family}-tp1", model=model)
    sizing = load_model(exec_stub, f"{family}-tp2", model=model, tensor_parallel_size=2)[-1].ready
    assert sizing.tensor_parallel_size == 2 and sizing.kv_window == (8 if family == "mistral" else 0)
    try:
        assert greedy_all(exec_stub, f"{family}-tp2") == greedy_all(exec_stub, f"{family}-tp1")
    finally:
        for name in (f"{family}-tp1", f"{family}-tp2"):
            exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))


def test_two_ranks_eager_equal_one_rank(exec_stub, tiny_loaded):
    load_model(exec_stub, "tiny-tp2-eager", tensor_parallel_size=2, runtime_mode=exec_pb2.RUNTIME_MODE_EAGER)
    try:
        assert greedy_all(exec_stub, "tiny-tp2-eager") == greedy_all(exec_stub, "tiny")
    finally:
        exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-tp2-eager"))


def test_kv_heads_that_do_not_divide_are_refused(exec_stub):
    with pytest.raises(grpc.RpcError) as info:
        load_model(exec_stub, "tiny-tp4", tensor_parallel_size=4)  # 2 KV heads
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_key_value_heads 2" in info.value.details() and "tensor_parallel_size" in info.value.details()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has the GPUs for two ranks")
def test_cuda_ranks_beyond_the_hosts_gpus_are_refused(exec_stub):
    """One GPU per rank: on a host with fewer (none here, where config.device 'cuda' is refused on its own too)."""
    request = exec_pb2.LoadModelRequest(name="tiny-tp2-cuda", model=TINY_MODEL, tensor_parallel_size=2,
                                        config=common_pb2.CompileConfig(device="cuda", max_compiled_tokens=128))
    with pytest.raises(grpc.RpcError) as info:
        list(exec_stub.LoadModel(request))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details()
    assert "tensor_parallel_size: 2 ranks need 2 GPUs" in details, details
    assert f"this host has {torch.cuda.device_count()}" in details, details


def test_a_family_without_a_test_over_ranks_is_refused(exec_stub):
    with pytest.raises(grpc.RpcError) as info:
        load_model(exec_stub, "gemma-tp2", model=common_pb2.ModelSpec(config_json=json.dumps(
            dict(TINY, model_type="gemma", head_dim=16))), tensor_parallel_size=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not 'gemma'" in info.value.details()


def test_bundle_for_two_ranks_refused_on_one(exec_stub, tp2_loaded):
    with pytest.raises(grpc.RpcError) as info:
        load_model(exec_stub, "tiny-tp2-as-1", key=common_pb2.ArtifactKey(digest=tp2_loaded.key.digest))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tensor_parallel_size 2" in info.value.details()


def killed_mid_stream(stub, model: str, prompt: list[int], pid: int, timeout: float) -> dict:
    """Kill rank process ``pid`` once a long greedy Generate of ``model`` has streamed its first token; what the
    stream ended with (``code`` and ``details`` of its error, if any). The stream must not hang."""
    first_token = threading.Event()
    outcome: dict = {}

    def stream() -> None:
        request = exec_pb2.GenerateRequest(model=model, prompt_ids=prompt, max_tokens=400, temperature=0.0,
                                           ignore_eos=True)
        try:
            for _ in stub.Generate(request, timeout=timeout):
                first_token.set()
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
        first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(timeout)
    os.kill(pid, signal.SIGKILL)
    reader.join(timeout)
    assert not reader.is_alive(), "the stream hung after its rank died"
    return outcome


def test_killed_rank_fails_the_model_and_a_reload_serves(exec_stub, tp2_loaded):
    before = rank_pids()
    load_model(exec_stub, "tiny-tp2-killed", tensor_parallel_size=2)
    (pid,) = rank_pids() - before
    expected = greedy(exec_stub, "tiny", PROMPTS[0], max_tokens=400)
    outcome = killed_mid_stream(exec_stub, "tiny-tp2-killed", PROMPTS[0], pid, 60)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert "rank 1 of 2" in outcome["details"] and "-9" in outcome["details"]
    with pytest.raises(grpc.RpcError) as info:  # a new request hears the same at once
        greedy(exec_stub, "tiny-tp2-killed", PROMPTS[1], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    listed = model_info(exec_stub, "tiny-tp2-killed")
    assert listed.state == exec_pb2.MODEL_STATE_FAILED and "rank 1 of 2" in listed.error

    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-tp2-killed"))
    deadline = time.monotonic() + 30
    while pid in rank_pids() and time.monotonic() < deadline:  # the killed rank is reaped, none is left behind
        time.sleep(0.1)
    assert pid not in rank_pids()
    load_model(exec_stub, "tiny-tp2-killed", tensor_parallel_size=2)
    assert greedy(exec_stub, "tiny-tp2-killed", PROMPTS[0], max_tokens=400) == expected
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-tp2-killed"))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    """The tiny Llama saved by transformers, with other weights than the dummy ones."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-tp-checkpoint")
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY.items()})).save_pretrained(path)
    return path


def test_two_ranks_read_a_checkpoint_shard_by_shard(exec_stub, checkpoint_dir, tp2_loaded):
    load_model(exec_stub, "ckpt-tp1", weights=str(checkpoint_dir))
    load_model(exec_stub, "ckpt-tp2", weights=str(checkpoint_dir), tensor_parallel_size=2)
    try:
        expected = greedy_all(exec_stub, "ckpt-tp1")
        assert expected != greedy_all(exec_stub, "tiny")  # the checkpoint's weights, not the dummy ones
        assert greedy_all(exec_stub, "ckpt-tp2") == expected
    finally:
        for name in ("ckpt-tp1", "ckpt-tp2"):
            exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))


def test_the_70b_preset_fits_an_h200_as_one_of_two_shards(monkeypatch):
    """The memory check before anything is allocated counts a rank's shard: Llama-3.1-70B's bfloat16 weights
    (131.4 GiB) are refused on the 100 GiB an H200 has left beside a KV cache, one of two shards goes on to be built
    (its dummy weights are cut layer by layer, so no rank holds the whole model)."""
    from kiln.errors import ResourceExhausted
    from kiln.model import causal_lm
    from kiln.model.spec import resolve

    resolved = resolve(common_pb2.ModelSpec(preset="llama-3.1-70b", dtype="bfloat16"), "cpu")
    skeleton = causal_lm._skeleton(resolved)
    monkeypatch.setattr(causal_lm, "available_bytes", lambda device: 100 << 30)
    with pytest.raises(ResourceExhausted, match="take 131.4 GiB, the cuda has 100.0 GiB free"):
        causal_lm._check_fits(skeleton, resolved, "cuda", None)
    causal_lm._check_fits(skeleton, resolved, "cuda", None, ranks=2)
    with pytest.raises(ResourceExhausted, match="one of 2 shards"):
        monkeypatch.setattr(causal_lm, "available_bytes", lambda device: 60 << 30)
        causal_lm._check_fits(skeleton, resolved, "cuda", None, ranks=2)
