"""One decoder layer's GEMMs of Llama-3-8B in FP8 (row-wise scales, torch._scaled_mm) against bfloat16 F.linear, at
decode and prefill token counts: the GEMM alone (input quantized beforehand), the quantize and GEMM compiled (as in a
Kiln layer, the quantize fused into one kernel), and eager (the quantize as separate kernels).

usage: python bench/fp8_gemm.py [--tokens 1,32,2048]
"""

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kiln.quantization.fp8_linear import fp8_linear, quantize_rows, quantize_tokens

# (name, out_features, in_features) of Llama-3-8B's merged projections
GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def us(fn) -> float:
    return do_bench(fn, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,32,2048")
    args = p.parse_args()
    compiled = torch.compile(fp8_linear, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | GEMM | bf16 us | fp8 _scaled_mm us | fp8 compiled (quantize + GEMM) us | fp8 eager us "
          "| bf16 / fp8 GEMM |")
    print("|---|---|---|---|---|---|---|")
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
            fused = us(lambda x=x, q=q, s=scale: compiled(x, q, s, None, None))
            eager = us(lambda x=x, q=q, s=scale: fp8_linear(x, q, s, None, None))
            print(f"| {tokens} | {name} | {bf16:.1f} | {gemm:.1f} | {fused:.1f} | {eager:.1f} | {bf16 / gemm:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
