"""Experiment: prefill kernel variants (step KV from k/v, heaviest blocks first) x tiles, on the attention shapes of
Llama-3-8B. Each output checked against the first variant's."""
import sys
sys.path.insert(0, "bench")
import torch
from triton.testing import do_bench
from attention_kernels import make_step, NUM_HEADS, HEAD_DIM
from kiln.attention import triton_kernels
from kiln.attention.triton_kernels import paged_attention

torch.manual_seed(0)
cases = {"1x2048": ([2048], [2048]), "8x512": ([512] * 8, [512] * 8), "4x128": ([128] * 4, [128] * 4),
         "1x(1024+1024)": ([2048], [1024]), "16dec+2032": ([1024] * 16 + [2032], [1] * 16 + [2032])}
steps = {name: make_step(*c) for name, c in cases.items()}
flops = {name: sum(4 * NUM_HEADS * HEAD_DIM * q * (s - q + (q + 1) / 2) for s, q in zip(*c)) for name, c in cases.items()}
tiles = [tuple(int(v) for v in t.split(",")) for t in (sys.argv[1] if len(sys.argv) > 1 else "64,32,4,2").split(":")]
variants = [(False, False), (False, True), (True, False), (True, True)]
print("| tile | step_kv | heavy_first | " + " | ".join(f"{n} µs (TFLOP/s)" for n in cases) + " | max diff |")
print("|---|---|---|" + "---|" * (len(cases) + 1))
first = {}
for tile in tiles:
    for step_kv, heavy in variants:
        triton_kernels.PREFILL_CONFIG = tile
        triton_kernels.PREFILL_STEP_KV = step_kv
        triton_kernels.PREFILL_HEAVY_FIRST = heavy
        cells, diff = [], 0.0
        for name, args in steps.items():
            out = paged_attention(*args).float()
            diff = max(diff, (out - first.setdefault(name, out)).abs().max().item())
            ms = do_bench(lambda args=args: paged_attention(*args), return_mode="median")
            cells.append(f"{ms * 1e3:.1f} ({flops[name] / ms / 1e9:.0f})")
        print(f"| {tile} | {step_kv} | {heavy} | " + " | ".join(cells) + f" | {diff:.4f} |", flush=True)
