"""The activations' per-token FP8 quantize on one GPU: Kiln's kernel (kiln.quantization.quantize_kernel) at each of
a list of configs against Inductor's fusion of the same torch ops, each replayed from a CUDA graph.

Two cases, at Llama-3-8B's widths: SiLU(gate) x up of the MLP's 14,336 (gate and up the halves of the merged
gate/up product, as a layer reads them) and the attention output's 4,096 (o's input). Prints µs and the TB/s of the
bytes read and written, and the config Kiln picks for each row count. A replay reads its input right after the replay
before, so part of it is still in L2 (of the 14,336 case's 117 MB at 2,048 rows, up to the L2's 50 MB): a config
that rereads its row from L2 gains less here than inside a layer, where the input comes from HBM. What a layer
spends is bench/layer_kernels.py's to say.

usage: python bench/quantize_kernel.py [--rows 1,32,512,2048] [--configs 2048:0:4,1024:0:4,...]
"""

import argparse
import functools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kiln.quantization.activation_quant import quantize_tokens
from kiln.quantization.quantize_kernel import _config, quantize_rows_fp8

CASES = (("silu x up", 14336, True), ("attention out", 4096, False))
CONFIGS = "16384:1:16,16384:1:32,4096:0:8,4096:0:4,2048:0:4,2048:0:8,1024:0:4,1024:0:2,512:0:2"


def parse_config(text: str) -> tuple[int, bool, int]:
    block, one_pass, warps = text.split(":")
    return int(block), one_pass == "1", int(warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,512,2048")
    p.add_argument("--configs", default=CONFIGS, help="block:one_pass:warps, comma-separated")
    args = p.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    print(f"{torch.cuda.get_device_name()}, µs (TB/s), each replayed from a CUDA graph")
    print("| case | rows | Inductor | " + " | ".join(f"({b}, {int(o)}, {w})" for b, o, w in configs) + " | pick |")
    print("|---" * (len(configs) + 4) + "|")
    for name, width, glu in CASES:
        for m in (int(r) for r in args.rows.split(",")):
            print(f"| {name} | {m} | " + " | ".join(row_cells(m, width, glu, configs)) + f" | {_config(m, width)} |",
                  flush=True)


def row_cells(m: int, width: int, glu: bool, configs: list[tuple[int, bool, int]]) -> list[str]:
    """Inductor's fusion, then Kiln's kernel at each config, on ``m`` rows of ``width``."""
    torch.manual_seed(m)
    if glu:
        merged = torch.randn(m, 2 * width, device="cuda", dtype=torch.bfloat16)
        x, up = merged[:, :width], merged[:, width:]
        fused = torch.compile(lambda g, u: quantize_tokens(F.silu(g) * u), dynamic=False)
        inductor = functools.partial(fused, x, up)
    else:
        x, up = torch.randn(m, width, device="cuda", dtype=torch.bfloat16), None
        inductor = functools.partial(torch.compile(quantize_tokens, dynamic=False), x)
    moved = m * width * (2 * (2 if glu else 1) + 1)  # bf16 in, float8 out
    cells = [time_us(inductor, moved)]
    for config in configs:
        block, one_pass, _ = config
        if one_pass and block < width:
            cells.append("-")  # one pass over a row wider than the block: not a config of this width
            continue
        cells.append(time_us(functools.partial(quantize_rows_fp8, x, up, config), moved))
    return cells


def time_us(fn, moved: int) -> str:
    fn()
    us = do_bench_cudagraph(fn, rep=50) * 1e3
    return f"{us:.1f} ({moved / us / 1e6:.2f})"


if __name__ == "__main__":
    main()
