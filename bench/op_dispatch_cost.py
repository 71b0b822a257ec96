"""Host time of one call of each of Kiln's custom ops against its own body called as a function: what the
dispatcher's registration adds to every call a step launched from Python makes (five a layer: the attention and
four FP8 products). Tiny tensors, so the body's own work is small and the difference is the registration's.

usage: python bench/op_dispatch_cost.py [--device cpu|cuda] [--calls 5000]
"""

import argparse
import statistics
import time

import torch

from kiln.attention import op as attention_op
from kiln.attention import reference as attention_reference
from kiln.quantization import fp8_mm as fp8_mm_op
from kiln.quantization.activation_quant import quantize_tokens
from kiln.quantization.fp8_linear import quantize_rows


def us_per_call(fn, calls: int) -> float:
    """Median over five rounds of the host's µs per call, with no sync between calls."""
    for _ in range(calls // 10):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    torch.set_grad_enabled(False)  # as every forward of the engine runs
    weight, weight_scale = quantize_rows(torch.randn(16, 128, device=args.device))
    # More rows than Kiln's decode-sized kernel takes (fp8_small_m.MAX_M, 128), so on CUDA too the op's body is
    # the _scaled_mm it is timed against.
    x, x_scale = quantize_tokens(torch.randn(160, 128, device=args.device))
    out_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q = torch.randn(8, 4, 16, device=args.device)
    kv = torch.randn(8, 2, 16, device=args.device)
    layer = torch.tensor(0)
    rows = [
        ("kiln::fp8_mm", lambda: fp8_mm_op.fp8_mm(x, x_scale, weight, weight_scale, out_dtype),
         lambda: torch._scaled_mm(x, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                                  out_dtype=out_dtype, use_fast_accum=x.is_cuda)),
        ("kiln::attention (no forward context)", lambda: attention_op.attention(q, kv, kv, layer, 0.25),
         lambda: attention_reference.causal_attention(q, kv, kv, 0.25, 0, 0, 0.0).contiguous()),
    ]
    print(f"{args.device}, torch {torch.__version__}, {args.calls} calls a round, median of 5 rounds")
    print("| op | the op, µs a call | its body called directly | added by the registration |")
    print("|---|---|---|---|")
    for name, through_op, direct in rows:
        op_us, body_us = us_per_call(through_op, args.calls), us_per_call(direct, args.calls)
        print(f"| {name} | {op_us:.1f} | {body_us:.1f} | {op_us - body_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
