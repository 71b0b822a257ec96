"""Kiln's FP8 GEMM for decode-sized steps (torch.ops.kiln.fp8_mm runs it on CUDA where ``takes`` says).

On CUDA 12.9+ PyTorch hands a row-wise ``_scaled_mm`` to cuBLASLt, which runs every GEMM of 1–128 rows with one
128 x 128 tile: an FP8 decode layer took 2.81x its weight-read floor on the H200, longer than bf16's (BENCHMARKS.md,
"FP8 decode"). This kernel puts the weight first in the FP8 tensor-core dot ("swap A and B", as vLLM's and
CUTLASS's small-M configs do: the weight's rows are the dot's 64-row side, the few tokens the other) and, up to
SPLIT_M rows, pipelines DEEP_STAGES tiles deep and spreads the weight's K loops evenly over the SMs (stream-K, as
CUTLASS's Hopper GEMMs may schedule): Llama-3-8B's o and down have 64 tiles of 64 rows, q/k/v 96, fewer than the
H200's 132 SMs, and gate_up's 448 leave the last of four waves part-empty, where a tile a program left SMs without
weight to stream. A tile shared by two programs is finished by the one that ends last, in the same kernel (no
reduce kernel after). Past 64 rows the tokens are split instead, 64 a program, where the weight's row tiles times
the token tiles still fit one wave of SMs: the two programs of a weight tile read it once from HBM between them,
and twice as many SMs stream it (Llama-3-8B's o and down 9-20% faster at 96-128 rows on the H200; q/k/v, whose 96
row tiles would need two waves, 41-49% slower so, keep all tokens in a program).
"""

import torch
import triton
import triton.language as tl

from kiln import programmatic_launch
from kiln.multiprocessors import sm_count
from kiln.programmatic_launch import release, wait
from kiln.shared_memory import max_shared_bytes

BLOCK_N = 64  # weight rows per program: the FP8 dot's wgmma side
NUM_WARPS, NUM_STAGES = 4, 4
DEEP_STAGES = 6  # the pipeline's depth up to SPLIT_M rows, where the device's shared memory holds it
SPLIT_M = 32  # rows up to which the kernel takes every product, its K loops spread over the SMs
MAX_M = 128  # rows up to which it takes the products whose weight cuBLASLt's tiles spread thin
CUBLAS_TILE_N = 128  # weight rows a cuBLASLt FP8 tile covers at these sizes (nvjet_sm90_qqtst_128x128)
M_TILE = 64  # tokens a program takes past 64 rows, where the tiles fit one wave (tokens_a_program)
COUNTERS = 1 << 14  # tiles (weight tiles x token tiles) a device's counters cover: a vocabulary of 1M rows
_counters: dict[torch.device, torch.Tensor] = {}


# M (the step's tokens) is not specialised on (Triton would build a variant for 1, for multiples of 16 and for the
# rest): one build per layer shape and power-of-two BLOCK_M, before ready.
@triton.jit(do_not_specialize=["M", "UNITS"])
def _swap_ab_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, part_ptr, counters_ptr, res_ptr, M, N, K, UNITS,
                    stride_xm, stride_wn, stride_om, stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """out.T[N, M] = w[N, K] @ x.T[K, M], both operands FP8, times the token and row scales (plus the residual with
    RESIDUAL), stored as bf16; BLOCK_M tokens a program (grid axis 1).

    Stream-K (grid axis 0): the K loops of the weight's BLOCK_N-row tiles laid end to end, each program takes UNITS
    consecutive BLOCK_K steps of them, so that every program streams as many weight bytes whatever the tile count
    (UNITS = K // BLOCK_K: a tile a program). A tile whose K loop two or more programs share is finished by the one
    that ends last: each writes its float32 partial sums to its slot of ``part`` (two a program: its first tile's
    and its last's), counts itself in on ``counters`` (zeros between calls) and the one that counts the last adds
    the slots in program order (the same bits whichever ends last), finishes the tile and sets the counter back.
    With PDL it starts while the kernel before ends, and lets the next one start once its work is done."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    m_tile = tl.program_id(1)
    rm = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rb = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    slot_offsets = rb[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    steps = K // BLOCK_K
    tiles = tl.cdiv(N, BLOCK_N)
    start = pid * UNITS
    end = tl.minimum(start + UNITS, tiles * steps)
    wait(PDL)
    x_scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)
    unit = start
    while unit < end:
        tile = unit // steps
        first = unit - tile * steps
        last = tl.minimum(steps, first + end - unit)
        rn = tile * BLOCK_N + rb
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (first * BLOCK_K + rk)[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (first * BLOCK_K + rk)[:, None]
        w_mask, x_mask = rn[:, None] < N, rm[None, :] < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(first, last):
            acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), tl.load(x_ptrs, mask=x_mask, other=0.0), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc *= x_scale[None, :]
        if first == 0 and last == steps:
            _finish(acc, rn, rm, w_scale_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm, RESIDUAL)
        else:
            # The partial written by every thread before the count (CUDA's last-block pattern: barrier, then one
            # acquire-release atomic); the last reads the slots from L2 (.cg), never from a stale L1 line.
            slots = part_ptr + (m_tile * programs + pid) * 2 * BLOCK_N * BLOCK_M
            tl.store(slots + (unit != start).to(tl.int32) * BLOCK_N * BLOCK_M + slot_offsets, acc)
            tl.debug_barrier()
            tile_start = tile * steps
            sharers_first, sharers_last = tile_start // UNITS, (tile_start + steps - 1) // UNITS
            counter = counters_ptr + m_tile * tiles + tile
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == sharers_last - sharers_first:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for sharer in range(sharers_first, sharers_last + 1):
                    # a sharer's slot 0 holds its first tile's sums, 1 its last's
                    slot = (m_tile * programs + sharer) * 2 + (sharer * UNITS < tile_start).to(tl.int32)
                    acc += tl.load(part_ptr + slot * BLOCK_N * BLOCK_M + slot_offsets, cache_modifier=".cg")
                _finish(acc, rn, rm, w_scale_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm, RESIDUAL)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        unit = tile * steps + last
    release(PDL)


@triton.jit
def _finish(acc, rn, rm, w_scale_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm, RESIDUAL: tl.constexpr):
    """A tile's epilogue: times the row scales, plus the residual with RESIDUAL, one rounding to bf16."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    acc *= tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[:, None]
    if RESIDUAL:
        acc += tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(tl.bfloat16), mask=mask)


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def _block_k(k: int) -> int:
    return 256 if k % 256 == 0 else 128


def tokens_a_program(m: int, n: int, sms: int) -> int:
    """Tokens a program takes: M_TILE past M_TILE rows where the weight's row tiles times the token tiles fit the
    SMs (one wave), else all of them (BLOCK_M a power of two, at least 16). M_TILE is the tile of 33-64 rows, so
    this builds no variant of its own."""
    whole = _block_m(m)
    if whole > M_TILE and triton.cdiv(n, BLOCK_N) * triton.cdiv(m, M_TILE) <= sms:
        return M_TILE
    return whole


def takes(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether this kernel runs an [m, k] x [n, k] product: up to SPLIT_M rows always; up to MAX_M rows where
    cuBLASLt's 128-row tiles of the weight are fewer than the SMs, so that its one tile a program leaves SMs idle
    (H200 sweep, 48–128 rows, BENCHMARKS.md: Llama-3-8B's q/k/v, o and down 1.2–1.7x faster here, one split; gate_up's
    224 tiles stream at 3.3 TB/s in cuBLASLt against 2.5–3.0 here). Either way only where the pipeline's NUM_STAGES
    tiles of weight and tokens (a byte a value) fit the device's shared memory: 192 KB at 128 rows, which a Hopper
    has (227 KB) and an Ada (99 KB) has not."""
    if k % 128 or NUM_STAGES * (BLOCK_N + _block_m(m)) * _block_k(k) > max_shared_bytes(device):
        return False
    return m <= SPLIT_M or (m <= MAX_M and triton.cdiv(n, CUBLAS_TILE_N) < sm_count(device))


def stages(m: int, block_m: int, block_k: int, device: torch.device) -> int:
    """The pipeline's depth: DEEP_STAGES up to SPLIT_M rows where its tiles fit the device's shared memory (6 x 80 x
    256 bytes at 16 rows; on an H100 at 1–32 rows Llama-3-8B's q/k/v, o and down streamed fastest so, gate/up as
    fast as with NUM_STAGES), else NUM_STAGES (past SPLIT_M rows the 48–128-row sweep, which had no deeper pipeline,
    picked 4)."""
    fits = device.type != "cuda" or DEEP_STAGES * (BLOCK_N + block_m) * block_k <= max_shared_bytes(device)
    deep = m <= SPLIT_M and fits  # (TRITON_INTERPRET=1 runs CPU tensors: no shared memory to fit)
    return DEEP_STAGES if deep else NUM_STAGES


def counters(device: torch.device) -> torch.Tensor | None:
    """The zeroed counters the kernel's shared tiles count on, one set a device, made on its first product outside a
    CUDA-graph capture (fp8_mm makes them at the memory profile's run, before any capture: a capture would record
    the zeroing, not run it). None while capturing before then: the kernel then takes a tile a program."""
    found = _counters.get(device)
    if found is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        found = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return found


def spread(m: int, n: int, k: int, block_k: int, sms: int) -> int:
    """Programs the weight's K loops are spread over, a token tile: up to SPLIT_M rows one an SM (or one a BLOCK_K
    step where there are fewer), past them a tile a program."""
    tiles, steps = triton.cdiv(n, BLOCK_N), k // block_k
    return min(sms, tiles * steps) if m <= SPLIT_M else tiles


def small_m_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """FP8 ``q`` [M, K] with token scales [M] times the FP8 ``weight`` [N, K] with row scales [N] -> bf16 [M, N]
    (plus ``residual`` [M, N], rows contiguous, added in float32 before the one rounding), for a few rows M and K a
    multiple of 128. ``config`` (BLOCK_N, BLOCK_K, programs a token tile, num_warps, num_stages[, BLOCK_M: default
    all the tokens]) is for bench/fp8_gemm.py's sweep; None: this module's choice."""
    m, k = q.shape
    n = weight.shape[0]
    if config is None:
        block_k, sms = _block_k(k), sm_count(q.device)
        block_m = tokens_a_program(m, n, sms)
        config = (BLOCK_N, block_k, spread(m, n, k, block_k, sms), NUM_WARPS, stages(m, block_m, block_k, q.device),
                  block_m)
    block_n, block_k, programs, num_warps, num_stages, *block_m = config
    block_m = block_m[0] if block_m else _block_m(m)
    tiles, steps, token_tiles = triton.cdiv(n, block_n), k // block_k, triton.cdiv(m, block_m)
    units = triton.cdiv(tiles * steps, programs)
    shared = units % steps != 0
    found = counters(q.device) if shared else None
    if shared and (found is None or found.numel() < token_tiles * tiles):
        units, shared = steps, False  # a tile a program: no counters to share tiles on
    grid = (triton.cdiv(tiles * steps, units), token_tiles)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    part = torch.empty(grid[0] * grid[1] * 2 * block_n * block_m, dtype=torch.float32, device=q.device) if shared \
        else out
    pdl = programmatic_launch.enabled(q.device)
    res = out if residual is None else residual if residual.stride(-1) == 1 else residual.contiguous()
    _swap_ab_kernel[grid](
        q, scale, weight, weight_scale, out, part, found if shared else out, res, m, n, k, units, q.stride(0),
        weight.stride(0), out.stride(0), res.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        RESIDUAL=residual is not None, PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    return out
