"""The RMSNorm and per-token FP8 quantize before an FP8 product on one GPU: Kiln's kernel
(kiln.quantization.norm_quantize_kernel) at each count of warps a program against Inductor's fusion of the same
torch ops, each replayed from a CUDA graph.

Two cases at a hidden size (Llama-3-8B's 4,096 by default): the norm alone (before q/k/v, the layer's input) and the
residual add before it (after o, before gate/up). Inductor compiles each row count with static shapes (its best
case: a layer's piece is compiled once for every token count). Prints µs and the TB/s of the bytes read and
written, and the warps Kiln picks. What a whole layer spends is bench/layer_kernels.py's to say.

usage: python bench/norm_quantize_kernel.py [--rows 1,32,128,512,2048] [--warps 4,8,16,32] [--width 4096]
"""

import argparse
import functools

import torch
from quantize_kernel import time_us

from kiln.quantization.norm_quantize import rms_norm_quantize_tokens
from kiln.quantization.norm_quantize_kernel import num_warps, rms_norm_quantize_rows

EPS = 1e-5


def inductor_fusion(added: bool):
    """Inductor's kernel for the torch ops: the sum, the norm and its quantize (the layer reads all three)."""
    if added:
        def fn(x, residual, weight):
            total = x + residual
            return (*rms_norm_quantize_tokens(total, weight, EPS), total)
    else:
        def fn(x, residual, weight):
            return rms_norm_quantize_tokens(x, weight, EPS)
    return torch.compile(fn, dynamic=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,128,512,2048")
    p.add_argument("--warps", default="4,8,16,32")
    p.add_argument("--width", type=int, default=4096)
    args = p.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    width = args.width
    print(f"{torch.cuda.get_device_name()}, width {width}, µs (TB/s), each replayed from a CUDA graph")
    print("| case | rows | Inductor | " + " | ".join(f"{w} warps" for w in warps) + " | pick |")
    print("|---" * (len(warps) + 4) + "|")
    weight = (torch.rand(width, device="cuda") + 0.5).to(torch.bfloat16)
    for added in (False, True):
        for m in (int(r) for r in args.rows.split(",")):
            torch.manual_seed(m)
            x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x) if added else None
            moved = m * width * ((3 * 2 if added else 2) + 1)  # bf16 in (and the sum out), float8 out
            cells = [time_us(functools.partial(inductor_fusion(added), x, residual, weight), moved)]
            for w in warps:
                cells.append(time_us(functools.partial(rms_norm_quantize_rows, x, weight, EPS, residual, w), moved))
            case = "add and norm" if added else "norm"
            print(f"| {case} | {m} | " + " | ".join(cells) + f" | {num_warps(width)} |", flush=True)


if __name__ == "__main__":
    main()
