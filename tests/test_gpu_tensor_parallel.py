"""Tensor parallelism on CUDA through the real servers: two ranks, one GPU each (NCCL for the sharded layers'
all-reduce, gloo for the step broadcast), with CUDA graphs (full and piecewise, captured on both ranks in lockstep)
and without, judged token by token by transformers; and a rank killed mid-generate (docs/tensor-parallel.md).

Tiny Llama and Qwen2 at the GPU shapes of tests/test_gpu_families.py (4 heads, 2 KV heads: one per rank). Two ranks
sum the o and down projections in another order than one GPU's matmul does, so in bfloat16 their greedy tokens
may part from one rank's where two logits are within rounding: each token is judged by tests/greedy_judge.py (within
rounding of the best logit of transformers' float64 model reading the same context), as one rank's tokens are in
test_gpu_families.py.

    NCCL_NVLS_ENABLE=0 python -m pytest -m gpu tests/test_gpu_tensor_parallel.py     # two GPUs or more
"""

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from greedy_judge import assert_each_token_near_the_best
from test_gpu_families import COMPARED, MAX_TOKENS, PROMPTS, gpu_model_dir
from test_model_families import reference_attention
from test_tensor_parallel import killed_mid_stream, model_info, rank_pids

from protos import common_pb2, exec_pb2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can put a shared host's GPUs out of service


def load(stub, name: str, path, dtype: str, graphs: bool, tensor_parallel_size: int) -> exec_pb2.ModelSizing:
    mode = exec_pb2.RUNTIME_MODE_CUDAGRAPH if graphs else exec_pb2.RUNTIME_MODE_COMPILED
    request = exec_pb2.LoadModelRequest(
        name=name, model=common_pb2.ModelSpec(hf_dir=str(path), dtype=dtype), weights=str(path),
        config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=256), max_model_len=512,
        max_num_seqs=8, runtime_mode=mode, tensor_parallel_size=tensor_parallel_size, kv_cache_bytes=256 << 20,
        **(dict(capture_sizes=[1, 2, 4, 8], piecewise_capture_sizes=[16, 64, 256]) if graphs else {}))
    return list(stub.LoadModel(request))[-1].ready


def generate_all(stub, name: str, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    def generate(prompt):
        return [t for r in stub.Generate(exec_pb2.GenerateRequest(
            model=name, prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for t in r.token_ids]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: decode batches of several sizes
        return list(pool.map(generate, PROMPTS))


@pytest.mark.parametrize("graphs", [True, False], ids=["cudagraph", "compiled"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_two_gpus_follow_transformers(gpu_stub, tmp_path, model_type, graphs):
    from transformers import AutoConfig, AutoModelForCausalLM

    gpu_model_dir(model_type, tmp_path)
    name = f"gpu-tp2-{model_type}-{'graphs' if graphs else 'compiled'}"
    sizing = load(gpu_stub, name, tmp_path, "bfloat16", graphs, 2)
    try:
        assert sizing.tensor_parallel_size == 2 and sizing.num_kv_blocks > 0
        assert sizing.runtime_mode == ("cudagraph" if graphs else "compiled")
        outputs = generate_all(gpu_stub, name)
        stats = gpu_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=name)).stats
        paths = {s.path for s in stats}
        assert paths >= {"full_graph", "mixed_graph"} if graphs else paths == {"compiled"}
    finally:
        gpu_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
    attention = reference_attention(AutoConfig.from_pretrained(tmp_path))
    served = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, **attention).to("cuda").eval()
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        assert len(got) == MAX_TOKENS
        assert_each_token_near_the_best(served, prompt, got, COMPARED)


def test_a_killed_gpu_rank_fails_the_model_and_a_reload_serves(gpu_stub, tmp_path):
    gpu_model_dir("llama", tmp_path)
    name = "gpu-tp2-killed"
    before = rank_pids()
    load(gpu_stub, name, tmp_path, "bfloat16", True, 2)
    (pid,) = rank_pids() - before
    outcome = killed_mid_stream(gpu_stub, name, PROMPTS[0], pid, 120)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert "rank 1 of 2" in outcome["details"], outcome
    listed = model_info(gpu_stub, name)
    assert listed.state == exec_pb2.MODEL_STATE_FAILED and "rank 1 of 2" in listed.error
    gpu_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
    load(gpu_stub, name, tmp_path, "bfloat16", True, 2)
    try:
        assert all(len(tokens) == MAX_TOKENS for tokens in generate_all(gpu_stub, name))
    finally:
        gpu_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))
