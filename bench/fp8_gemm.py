"""One decoder layer's GEMMs of Llama-3-8B in FP8 (row-wise scales) against bfloat16 F.linear, at decode and prefill
token counts, to find the FP8 product a decode-sized step should use (issue 24: FP8 decode is no faster than bf16):

- ``torch._scaled_mm`` alone (input quantized beforehand), as Kiln's layers call it, and with ``use_fast_accum``;
- the quantize and GEMM compiled (as in a Kiln layer, the quantize fused into one kernel), and eager;
- a weight-only candidate for few tokens: the FP8 weight read once and widened to bf16 in registers, the activation
  left in bf16 (no quantize), one Triton kernel (below), at the fastest of a few tile configs.

With TRITON_INTERPRET=1 and --check, it runs the candidate on the CPU against the dequantized product instead.

usage: python bench/fp8_gemm.py [--tokens 1,32,2048]
       TRITON_INTERPRET=1 python bench/fp8_gemm.py --check
"""

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.quantization.fp8_linear import fp8_linear, quantize_rows, quantize_tokens

# (name, out_features, in_features) of Llama-3-8B's merged projections
GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
MAX_WEIGHT_ONLY_TOKENS = 64  # the candidate is for decode-sized steps
# (BLOCK_N, BLOCK_K, num_warps, num_stages) the candidate is timed at
CONFIGS = ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4))


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDE_F32: tl.constexpr):
    """out[M, N] = x[M, K] @ (w[N, K] widened).T * scale[N]: each program BLOCK_N output columns, over all K. The
    weight is widened to x's dtype (bf16 tensor cores), or to float32 under the CPU interpreter (``WIDE_F32``), whose
    bfloat16 products are wrong."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        if WIDE_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: tuple) -> torch.Tensor:
    """x [M, K] (M <= MAX_WEIGHT_ONLY_TOKENS) times float8 ``weight`` [N, K] with row scales [N] -> [M, N]."""
    block_n, block_k, num_warps, num_stages = config
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _weight_only_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages, WIDE_F32=not x.is_cuda)
    return out


def us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median") * 1e3


def check() -> None:
    """The candidate against the dequantized product, on whatever device the interpreter or CUDA gives."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for m, n, k in ((1, 48, 96), (5, 64, 300), (16, 40, 512), (33, 16, 64)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        q, scale = quantize_rows(torch.randn(n, k, device=device) * 0.02)
        want = x.float() @ (q.float() * scale[:, None]).t()
        for config in CONFIGS[:2]:
            got = weight_only(x, q, scale, config).float()
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    print("weight-only candidate: equal to the dequantized product within bf16 rounding")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,32,2048")
    p.add_argument("--check", action="store_true", help="check the candidate's values only (CPU: TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.check:
        check()
        return
    compiled = torch.compile(fp8_linear, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| tokens | GEMM | bf16 us | fp8 _scaled_mm us | fast accum us | fp8 compiled (quantize + GEMM) us "
          "| fp8 eager us | weight-only Triton us (config) | bf16 / best fp8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for name, n, k in GEMMS:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q, scale = quantize_rows(w)
            xq, x_scale = quantize_tokens(x)
            w_scale = scale.reshape(1, -1)
            bf16 = us(lambda x=x, w=w: F.linear(x, w))
            gemm = us(lambda a=xq, s=x_scale, q=q, t=w_scale: torch._scaled_mm(a, q.t(), scale_a=s, scale_b=t,
                                                                             out_dtype=torch.bfloat16))
            fast = us(lambda a=xq, s=x_scale, q=q, t=w_scale: torch._scaled_mm(
                a, q.t(), scale_a=s, scale_b=t, out_dtype=torch.bfloat16, use_fast_accum=True))
            fused = us(lambda x=x, q=q, s=scale: compiled(x, q, s, None, None))
            eager = us(lambda x=x, q=q, s=scale: fp8_linear(x, q, s, None, None))
            candidate, best = "-", min(gemm, fast, fused)
            if tokens <= MAX_WEIGHT_ONLY_TOKENS:
                timed = {c: us(lambda x=x, q=q, s=scale, c=c: weight_only(x, q, s, c)) for c in CONFIGS}
                config = min(timed, key=timed.get)
                candidate, best = f"{timed[config]:.1f} {config}", min(best, timed[config])
            print(f"| {tokens} | {name} | {bf16:.1f} | {gemm:.1f} | {fast:.1f} | {fused:.1f} | {eager:.1f} | "
                  f"{candidate} | {bf16 / best:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
