"""FP8 on the H200: the row-wise _scaled_mm, what Inductor makes of a quantized layer, tiny families served in FP8
with an FP8 KV cache in CUDA graphs, judged against the bfloat16 model.

    python -m pytest -m gpu tests/test_gpu_fp8.py -s     # -s prints the agreement measured per family
"""

import pytest
import torch
from fp8_reference import fake_quantized
from test_gpu_families import PROMPTS, gpu_model_dir

from protos import common_pb2, exec_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_TOKENS = 24
# Greedy FP8 tokens that are the bfloat16 model's best next token too (teacher-forced on FP8's output), at least:
# below the CPU bench's 0.9x on a trained model (BENCHMARKS.md, FP8 accuracy) because a random tiny model's top
# logits are close together.
MIN_AGREEMENT = 0.6


def test_scaled_mm_rowwise_is_the_dequantized_product():
    from kiln.quantization.fp8_linear import fp8_linear, quantize_rows

    torch.manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    q, scale = quantize_rows(w)
    expected = fake_quantized(x, None) @ (q.float() * scale[:, None]).T
    got = fp8_linear(x, q, scale, None, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_inductor_fuses_the_activation_quantize_into_the_norm():
    """The RMSNorm and the per-token quantize after it are one Triton kernel; the GEMM is _scaled_mm."""
    from torch._inductor.utils import run_and_get_code

    from kiln.quantization.fp8_linear import fp8_linear, quantize_rows

    q, scale = quantize_rows(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16))
    norm = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def layer(x):
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * norm
        return fp8_linear(h, q, scale, None, None)

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    _, (code, *_) = run_and_get_code(torch.compile(layer), x)
    kernels = [line for line in code.splitlines() if "@triton.jit" in line or "def triton_" in line]
    print("\n".join(line for line in code.splitlines() if "def triton_" in line or "scaled_mm" in line))
    assert "scaled_mm" in code
    fused = [line for line in code.splitlines() if line.startswith("def triton_") and "mean" in line
             and ("amax" in line or "abs" in line)]
    assert fused, kernels


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])  # gemma2: head_dim 256, soft caps
def test_family_fp8_with_fp8_kv_in_cuda_graphs_agrees_with_bf16(gpu_stub, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    gpu_model_dir(model_type, tmp_path)
    name = f"fp8-{model_type}"
    request = exec_pb2.LoadModelRequest(
        name=name, model=common_pb2.ModelSpec(hf_dir=str(tmp_path), dtype="bfloat16"), weights=str(tmp_path),
        config=common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=256, quantization="fp8"),
        max_model_len=512, max_num_seqs=8, runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH, kv_cache_bytes=64 << 20,
        capture_sizes=[1, 2, 4, 8], kv_cache_dtype="fp8_e4m3")
    ready = list(gpu_stub.LoadModel(request))[-1].ready
    assert ready.quantization == "fp8" and ready.kv_cache_dtype == "float8_e4m3fn"
    try:
        bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager")
        bf16 = bf16.to("cuda").eval()
        agree = total = 0
        for prompt in PROMPTS:
            got = [t for r in gpu_stub.Generate(exec_pb2.GenerateRequest(
                model=name, prompt_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
                for t in r.token_ids]
            with torch.no_grad():
                logits = bf16(torch.tensor([prompt + got], device="cuda")).logits[0, len(prompt) - 1:-1]
            agree += int((logits.argmax(-1).cpu() == torch.tensor(got)).sum())
            total += len(got)
        print(f"{model_type}: FP8 + FP8 KV greedy tokens the bf16 model's best: {agree}/{total}")
        assert agree / total >= MIN_AGREEMENT, f"{model_type}: {agree}/{total} agree"
        stats = gpu_stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=name)).stats
        assert any(s.runtime_mode == "cudagraph" for s in stats)
    finally:
        gpu_stub.UnloadModel(exec_pb2.UnloadModelRequest(name=name))


@pytest.mark.parametrize("seq_lens, query_lens, layer", [
    ([37, 300, 1], [1, 1, 1], {}),  # decode
    ([40, 129], [40, 33], {}),  # prefill over a cached prefix
    ([77, 20, 150], [1, 20, 16], dict(window=32)),  # mixed, windowed
    ([64, 200], [1, 64], dict(softcap=50.0)),  # capped
], ids=["decode", "prefill", "mixed-window", "softcap"])
def test_fp8_kv_kernels_match_the_reference(seq_lens, query_lens, layer):
    """An FP8 cache with a scale per kv head: the Triton kernels write and read it as the CPU reference does."""
    from test_attention_triton import make_case, relative_error

    from kiln.attention import reference, triton_kernels

    torch.manual_seed(len(seq_lens))
    case = make_case(seq_lens, query_lens, 8, 2, 128, 16, torch.bfloat16, **layer)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]], device="cuda")  # keys' scales, values' per kv head
    cache = (case.kv_cache.float() / scales[:, None, None, :, None]).to(torch.float8_e4m3fn)
    expected_cache = cache.clone()
    expected = reference.paged_attention(case.q, case.k, case.v, expected_cache, case.meta, case.scale, **layer,
                                         kv_scale=scales)
    got = triton_kernels.paged_attention(case.q, case.k, case.v, cache, case.meta, case.scale, **layer,
                                         kv_scale=scales)
    written = case.meta.slot_mapping[case.meta.slot_mapping >= 0]
    for side in (0, 1):
        stored, wanted = (c[side].view(-1, 2, 128)[written].float() for c in (cache, expected_cache))
        assert (stored - wanted).abs().max() <= wanted.abs().max() * 2 ** -3  # at most a rounding tie apart
    assert relative_error(got, expected) < 2e-2
