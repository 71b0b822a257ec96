"""The activations' per-token FP8 quantize on one GPU: Kiln's kernel (kiln.quantization.quantize_kernel) at each of
a list of configs against Inductor's fusion of the same torch ops, each replayed from a CUDA graph.

Two cases, at Llama-3-8B's widths: SiLU(gate) x up of the MLP's 14,336 (gate and up the halves of the merged
gate/up product, as a layer reads them) and the attention output's 4,096 (o's input). Prints µs and the TB/s of the
bytes read and written, and the config Kiln picks for each row count. A replay reads its input right after the replay
before, so part of it is still in L2 (of the 14,336 case's 117 MB at 2,048 rows, up to the L2's 50 MB): a config
that rereads its row from L2 gains less here than inside a layer, where the input comes from HBM. With --after-gemm
each replay first writes the input as a layer does (the FP8 gate/up GEMM for SiLU x up, a copy of a fresh tensor
for the attention output), and the cell is the pair's time less the writer's alone. What a whole layer spends is
bench/layer_kernels.py's to say.

usage: python bench/quantize_kernel.py [--rows 1,32,512,2048] [--configs 2048:0:4,16384:1:32:1,...] [--after-gemm]
"""

import argparse
import functools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kiln.quantization.activation_quant import FP8, quantize_tokens
from kiln.quantization.quantize_kernel import _config, quantize_rows_fp8

CASES = (("silu x up", 14336, True), ("attention out", 4096, False))
HIDDEN = 4096  # the gate/up GEMM's K with --after-gemm (Llama-3-8B's hidden size)
CONFIGS = "16384:1:16,16384:1:32,4096:0:8,4096:0:4,2048:0:4,2048:0:8,1024:0:4,1024:0:2,512:0:2"


def parse_config(text: str) -> tuple[int, bool, int]:
    """block:one_pass:warps."""
    block, one_pass, warps = text.split(":")
    return int(block), one_pass == "1", int(warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,512,2048")
    p.add_argument("--configs", default=CONFIGS, help="block:one_pass:warps, comma-separated")
    p.add_argument("--after-gemm", action="store_true", help="each replay writes the input first, as a layer does")
    args = p.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    after = ", after the kernel that writes the input (the pair less the writer)" if args.after_gemm else ""
    print(f"{torch.cuda.get_device_name()}, µs (TB/s), each replayed from a CUDA graph{after}")
    print("| case | rows | Inductor | " + " | ".join(f"({b}, {int(o)}, {w})" for b, o, w in configs) + " | pick |")
    print("|---" * (len(configs) + 4) + "|")
    for name, width, glu in CASES:
        for m in (int(r) for r in args.rows.split(",")):
            cells = row_cells(m, width, glu, configs, args.after_gemm)
            pick = _config(m, width)
            print(f"| {name} | {m} | " + " | ".join(cells) + f" | {pick} |", flush=True)


def input_writer(m: int, width: int, glu: bool):
    """(the input [m, 2 x width] or [m, width] bf16, a function that rewrites it as a layer's kernel before does):
    the FP8 gate/up GEMM of a 4,096-wide hidden state for SiLU x up, a copy for the attention output."""
    if glu:
        hidden = torch.randn(m, HIDDEN, device="cuda").to(FP8)
        weight = torch.randn(2 * width, HIDDEN, device="cuda").to(FP8)
        scale_x = torch.full((m, 1), 0.01, device="cuda")
        scale_w = torch.full((1, 2 * width), 0.01, device="cuda")
        out = torch.empty(m, 2 * width, device="cuda", dtype=torch.bfloat16)
        return out, lambda: torch._scaled_mm(hidden, weight.t(), scale_x, scale_w, out_dtype=torch.bfloat16,
                                             use_fast_accum=True, out=out)
    source = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(source)
    return out, lambda: out.copy_(source)


def row_cells(m: int, width: int, glu: bool, configs: list[tuple[int, bool, int]], after_gemm: bool) -> list[str]:
    """Inductor's fusion, then Kiln's kernel at each config, on ``m`` rows of ``width``."""
    torch.manual_seed(m)
    if after_gemm:
        merged, writer = input_writer(m, width, glu)
        writer()
    else:
        merged, writer = torch.randn(m, (2 if glu else 1) * width, device="cuda", dtype=torch.bfloat16), None
    if glu:
        x, up = merged[:, :width], merged[:, width:]
        fused = torch.compile(lambda g, u: quantize_tokens(F.silu(g) * u), dynamic=False)
        inductor = functools.partial(fused, x, up)
    else:
        x, up = merged, None
        inductor = functools.partial(torch.compile(quantize_tokens, dynamic=False), x)
    moved = m * width * (2 * (2 if glu else 1) + 1)  # bf16 in, float8 out
    writer_us = replay_us(writer) if writer else 0.0
    cells = [time_us(inductor, moved, writer, writer_us)]
    for config in configs:
        block, one_pass, *_ = config
        if one_pass and block < width:
            cells.append("-")  # one pass over a row wider than the block: not a config of this width
            continue
        cells.append(time_us(functools.partial(quantize_rows_fp8, x, up, config), moved, writer, writer_us))
    return cells


def replay_us(fn) -> float:
    fn()
    return do_bench_cudagraph(fn, rep=50) * 1e3


def time_us(fn, moved: int, writer=None, writer_us: float = 0.0) -> str:
    us = replay_us(fn if writer is None else lambda: (writer(), fn())) - writer_us
    return f"{us:.1f} ({moved / us / 1e6:.2f})"


if __name__ == "__main__":
    main()
