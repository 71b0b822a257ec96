"""A decode layer's quantize -> FP8 GEMM pairs of Llama-3-8B, replayed from a CUDA graph, with the GEMM's weight
prefetch (kiln.programmatic_launch) off and at several sizes: what the HBM streams while the small kernel runs.

Each pair is the layer's own: the RMSNorm-and-quantize before q/k/v, the attention output's quantize before o, the
residual add, RMSNorm and quantize before gate/up, the SiLU x up quantize before down. The pairs run over enough
copies of the weight to exceed the L2, one after another in one graph, as a step streams its layers' weights. Columns:
programmatic launch off; on, the quantize releasing the GEMM only as it ends (prefetch 0, Kiln's launch before the
prefetch); on, released as it starts, each GEMM program asking the L2 for its first KB of weight before its wait.

usage: python bench/weight_prefetch.py [--tokens 1,8,32] [--kb 0,32,64,128,256,512]
"""

import argparse

import torch
from fp8_gemm import streamed_us, streamed_weights

from kiln import programmatic_launch
from kiln.quantization.fp8_small_m import small_m_mm
from kiln.quantization.norm_quantize_kernel import rms_norm_quantize_rows
from kiln.quantization.quantize_kernel import quantize_rows_fp8

HIDDEN, INTERMEDIATE = 4096, 14336
# (GEMM, out_features, in_features, the kernel that writes its input)
PAIRS = (("qkv", 6144, HIDDEN, "norm"), ("o", HIDDEN, HIDDEN, "quantize"),
         ("gate_up", 2 * INTERMEDIATE, HIDDEN, "add-norm"), ("down", HIDDEN, INTERMEDIATE, "silu"))


def pair(m: int, k: int, producer: str, weights: list):
    """fn(i): the producer over fresh activations, then the product with ``weights[i]``."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

    def run(i: int) -> torch.Tensor:
        if producer == "norm":
            q, scale, _ = rms_norm_quantize_rows(x, norm, 1e-5)
        elif producer == "add-norm":
            q, scale, _ = rms_norm_quantize_rows(x, norm, 1e-5, other)
        elif producer == "silu":
            q, scale = quantize_rows_fp8(x, other)
        else:
            q, scale = quantize_rows_fp8(x)
        return small_m_mm(q, scale.reshape(-1), *weights[i])
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,32")
    p.add_argument("--kb", default="0,32,64,128,256,512", help="weight KB a GEMM program prefetches (0: none)")
    args = p.parse_args()
    sizes = [int(kb) for kb in args.kb.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, L2 {l2 / 1e6:.0f} MB; µs a quantize + GEMM pair, replayed in turn over "
          "copies of the weight from one CUDA graph (the GEMM's weight MB / µs in parentheses)")
    print("| tokens | GEMM | input from | no PDL | " + " | ".join(f"PDL, prefetch {kb} KB" for kb in sizes) + " |")
    print("|---|---|---|---|" + "---|" * len(sizes))
    for m in map(int, args.tokens.split(",")):
        for name, n, k, producer in PAIRS:
            weights = streamed_weights(n, k, l2)
            fn = pair(m, k, producer, weights)
            mb = n * k / 1e6
            cells = []
            for pdl, kb in [(False, 0)] + [(True, kb) for kb in sizes]:
                programmatic_launch.ENABLED, programmatic_launch.PREFETCH_BYTES = pdl, kb * 1024
                us = streamed_us(fn, len(weights))
                cells.append(f"{us:.1f} ({mb / us:.2f})")
            print(f"| {m} | {name} | {producer} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
