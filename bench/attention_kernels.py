"""Microbenchmark of Kiln's Triton attention kernels on one CUDA device (Llama-3-8B attention shapes).

Decode is memory-bound, so it is reported as achieved GB/s of KV cache read against the device's copy bandwidth;
prefill as TFLOP/s of causal attention. Run from the repository root: ``python -m bench.attention_kernels``.
``--decode-tiles 32,4,2:64,4,3`` times the decode kernels at each tile (context tokens a loop step, warps, stages)
over a bfloat16 and an FP8 cache at serving's batch sizes, each output checked against the first tile's; with
``--decode-waves 4,8`` at each count of programs an SM the splits aim at too (``DECODE_WAVES``).
``--prefill-tiles 128,32,8,2:64,32,4,2`` times the prefill kernel at each tile (query tokens a program, context
tokens a step, warps, stages) and each way of reading the step's own tokens and ordering its programs instead, each
output checked against the first run's.
"""

import argparse
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from kiln.attention import triton_kernels
from kiln.attention.forward_context import AttentionMetadata
from kiln.attention.triton_kernels import paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
MAX_MODEL_LEN = 8192  # block-table width, as a server sizes it; decode's split count depends on it


def make_step(seq_lens: list[int], query_lens: list[int], fp8_cache: bool = False):
    """Arguments of one attention call over sequences whose blocks are scattered at random over the cache; with
    ``fp8_cache``, an FP8 cache and its per-head scales."""
    width = MAX_MODEL_LEN // BLOCK_SIZE
    num_blocks = len(seq_lens) * width
    block_tables = torch.randperm(num_blocks, device="cuda").view(len(seq_lens), width).to(torch.int32)
    slots = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        positions = torch.arange(seq_len - query_len, seq_len, device="cuda")
        slots.append(block_tables[i, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    num_tokens = sum(query_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        num_seqs=len(seq_lens),
    )
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    if fp8_cache:
        kv_scale = torch.full((2, NUM_KV_HEADS), 0.05, device="cuda")
        return q, k, v, kv_cache.to(torch.float8_e4m3fn), meta, HEAD_DIM**-0.5, 0, 0.0, kv_scale
    return q, k, v, kv_cache, meta, HEAD_DIM**-0.5


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written): the ceiling for memory-bound kernels."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def wall_us_per_call(fn, calls: int = 200) -> float:
    """Wall time of back-to-back eager calls: the host's launch cost wherever it exceeds the GPU's time."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def bench_decode(batch: int, context: int) -> None:
    """Time one decode step of ``batch`` sequences of ``context`` tokens, eager (L2 flushed) and as a CUDA graph."""
    args = make_step([context] * batch, [1] * batch)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    eager_ms = do_bench(lambda: paged_attention(*args), return_mode="median")
    graph_ms = do_bench_cudagraph(lambda: paged_attention(*args), return_mode="median")
    wall_us = wall_us_per_call(lambda: paged_attention(*args))
    print(
        f"| decode | {batch} | {context} | {kv_bytes / 2**20:.1f} MiB | {eager_ms * 1e3:.1f} µs "
        f"| {kv_bytes / eager_ms / 1e6:.0f} GB/s | {graph_ms * 1e3:.1f} µs | {kv_bytes / graph_ms / 1e6:.0f} GB/s "
        f"| {wall_us:.1f} µs |"
    )


def bench_prefill(batch: int, length: int) -> None:
    """Time a prefill of ``batch`` fresh sequences of ``length`` tokens."""
    args = make_step([length] * batch, [length] * batch)
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * length * (length + 1) // 2
    ms = do_bench(lambda: paged_attention(*args), return_mode="median")
    print(f"| prefill | {batch} | {length} | | {ms * 1e3:.1f} µs | {flops / ms / 1e9:.1f} TFLOP/s | | | |")


# Decode steps the decode sweep times (batch, context): a lone request, and serving's batches at its contexts.
DECODE_SWEEP_CASES = [(1, 1024), (32, 1024), (64, 512), (128, 384), (128, 1024)]


def sweep_decode_tiles(tiles: list[tuple[int, int, int]], waves: list[int]) -> None:
    """Each decode tile's time (replayed from a CUDA graph) at each of DECODE_SWEEP_CASES over a bfloat16 and an FP8
    cache, at each count of programs an SM the splits aim at, as µs and the KV read's GB/s; and each output's largest
    difference from the first run's."""
    cases = [(batch, context, fp8) for fp8 in (False, True) for batch, context in DECODE_SWEEP_CASES]
    steps = {case: make_step([case[1]] * case[0], [1] * case[0], case[2]) for case in cases}
    print("| tile | programs an SM | " + " | ".join(f"{'FP8' if fp8 else 'bf16'} {batch} x {context} µs (GB/s)"
                                                   for batch, context, fp8 in cases) + " | largest difference |")
    print("|---|---|" + "---|" * (len(cases) + 1))
    first = {}
    for tile, wave in ((tile, wave) for tile in tiles for wave in waves):
        triton_kernels.DECODE_TILE = triton_kernels.DECODE_TILE_ONE_SPLIT = triton_kernels.DECODE_TILE_FP8 = tile
        triton_kernels.DECODE_WAVES = wave
        cells, diff = [], 0.0
        for (batch, context, fp8), args in steps.items():
            out = paged_attention(*args).float()
            diff = max(diff, (out - first.setdefault((batch, context, fp8), out)).abs().max().item())
            ms = do_bench_cudagraph(lambda args=args: paged_attention(*args), return_mode="median")
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (1 if fp8 else DTYPE.itemsize)
            cells.append(f"{ms * 1e3:.1f} ({kv_bytes / ms / 1e6:.0f})")
        print(f"| {tile} | {wave} | " + " | ".join(cells) + f" | {diff:.4f} |", flush=True)


# Prefill steps the sweep times: fresh prompts, a chunk over a cached prefix, and decodes beside a long chunk.
SWEEP_CASES = {"1 x 2,048": ([2048], [2048]), "8 x 512": ([512] * 8, [512] * 8), "4 x 128": ([128] * 4, [128] * 4),
               "1,024 new over 1,024 cached": ([2048], [1024]),
               "16 decodes + 2,032": ([1024] * 16 + [2032], [1] * 16 + [2032])}


def sweep_prefill_tiles(tiles: list[tuple[int, ...]]) -> None:
    """Each tile's time at each of SWEEP_CASES, with the step's own keys and values read from the cache or from its
    k/v (``PREFILL_STEP_KV``) and the query blocks taken in order or heaviest first (``PREFILL_HEAVY_FIRST``); and
    each output's largest difference from the first run's."""
    steps = {name: make_step(*case) for name, case in SWEEP_CASES.items()}
    flops = {name: sum(4 * NUM_HEADS * HEAD_DIM * q * (s - q + (q + 1) / 2) for s, q in zip(*case, strict=True))
             for name, case in SWEEP_CASES.items()}
    print("| tile | step KV from k/v | heaviest first | " + " | ".join(f"{name} µs (TFLOP/s)" for name in steps)
          + " | largest difference |")
    print("|---|---|---|" + "---|" * (len(steps) + 1))
    first = {}
    for tile in tiles:
        for step_kv, heavy_first in [(False, False), (False, True), (True, False), (True, True)]:
            triton_kernels.PREFILL_CONFIG = tile
            triton_kernels.PREFILL_STEP_KV = step_kv
            triton_kernels.PREFILL_HEAVY_FIRST = heavy_first
            cells, diff = [], 0.0
            for name, args in steps.items():
                out = paged_attention(*args).float()
                diff = max(diff, (out - first.setdefault(name, out)).abs().max().item())
                ms = do_bench(lambda args=args: paged_attention(*args), return_mode="median")
                cells.append(f"{ms * 1e3:.1f} ({flops[name] / ms / 1e9:.0f})")
            print(f"| {tile} | {step_kv} | {heavy_first} | " + " | ".join(cells) + f" | {diff:.4f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prefill-tiles", help="colon-separated tiles, each BLOCK_M,BLOCK_N,num_warps,num_stages")
    p.add_argument("--decode-tiles", help="colon-separated tiles, each BLOCK_N,num_warps,num_stages")
    p.add_argument("--decode-waves", default=str(triton_kernels.DECODE_WAVES),
                   help="with --decode-tiles: comma-separated programs an SM the decode's splits aim at")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.decode_tiles:
        sweep_decode_tiles([tuple(int(v) for v in tile.split(",")) for tile in args.decode_tiles.split(":")],
                           [int(v) for v in args.decode_waves.split(",")])
    if args.prefill_tiles:
        sweep_prefill_tiles([tuple(int(v) for v in tile.split(",")) for tile in args.prefill_tiles.split(":")])
    if args.decode_tiles or args.prefill_tiles:
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device copy bandwidth: {copy_bandwidth():.0f} GB/s")
    print(f"Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} d={HEAD_DIM} block={BLOCK_SIZE} {DTYPE}; eager: do_bench, L2 flushed;")
    print("graph: do_bench_cudagraph, L2 not flushed (small working sets may be served from L2);")
    print("wall: back-to-back eager calls, host launch cost included\n")
    print("| step | batch | context | KV read | eager | eager KV GB/s | graph | graph KV GB/s | wall/call |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch, context in [(1, 1024), (32, 1024), (1, 8192), (64, 4096), (256, 1024)]:
        bench_decode(batch, context)
    bench_prefill(4, 2048)
    bench_prefill(32, 256)


if __name__ == "__main__":
    main()
