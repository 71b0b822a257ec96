"""One decoder layer's GEMMs of Llama-3-8B in FP8 (activation quantize + torch._scaled_mm, row-wise scales) against
bfloat16 F.linear, eager, at decode and prefill token counts: what the FP8 linears buy before anything else.

usage: python bench/fp8_gemm.py [--tokens 1,32,2048]
"""

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kiln.quantization.fp8_linear import fp8_linear, quantize_rows

# (name, out_features, in_features) of Llama-3-8B's merged projections
GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,32,2048")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | GEMM | bf16 us | fp8 us (quantize + _scaled_mm) | bf16/fp8 |")
    print("|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for name, n, k in GEMMS:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q, scale = quantize_rows(w)
            bf16_us = do_bench(lambda x=x, w=w: F.linear(x, w), return_mode="median") * 1e3
            fp8_us = do_bench(lambda x=x, q=q, s=scale: fp8_linear(x, q, s, None, None), return_mode="median") * 1e3
            print(f"| {tokens} | {name} | {bf16_us:.1f} | {fp8_us:.1f} | {bf16_us / fp8_us:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
