"""Kiln's FP8 GEMM for decode-sized steps (torch.ops.kiln.fp8_mm runs it on CUDA where ``takes`` says).

On CUDA 12.9+ PyTorch hands a row-wise ``_scaled_mm`` to cuBLASLt, which runs every GEMM of 1–128 rows with one
128 x 128 tile: an FP8 decode layer took 2.81x its weight-read floor on the H200, longer than bf16's (BENCHMARKS.md,
"FP8 decode"). This kernel puts the weight first in the FP8 tensor-core dot ("swap A and B", as vLLM's and
CUTLASS's small-M configs do: the weight's rows are the dot's 64-row side, the few tokens the other) and, up to
SPLIT_M rows, pipelines DEEP_STAGES tiles deep and splits K so that more SMs stream weight bytes where the weight's
rows are very few (until a quarter of the SMs have a program), the partial sums added by a second kernel. Past 64
rows the tokens are split instead, 64 a program, where the weight's row tiles times the token tiles still fit one
wave of SMs: the two programs of a weight tile read it once from HBM between them, and twice as many SMs stream it
(Llama-3-8B's o and down 9-20% faster at 96-128 rows on the H200; q/k/v, whose 96 row tiles would need two waves,
41-49% slower so, keep all tokens in a program).
"""

import torch
import triton
import triton.language as tl

from kiln import programmatic_launch
from kiln.multiprocessors import sm_count
from kiln.programmatic_launch import prefetch_l2, release, wait
from kiln.shared_memory import max_shared_bytes

BLOCK_N = 64  # weight rows per program: the FP8 dot's wgmma side
NUM_WARPS, NUM_STAGES = 4, 4
DEEP_STAGES = 6  # the pipeline's depth up to SPLIT_M rows, where the device's shared memory holds it
SPLIT_M = 32  # rows up to which the kernel takes every product, K split as split_k says
MAX_M = 128  # rows up to which it takes the products whose weight cuBLASLt's tiles spread thin
CUBLAS_TILE_N = 128  # weight rows a cuBLASLt FP8 tile covers at these sizes (nvjet_sm90_qqtst_128x128)
MAX_SPLIT_K = 8
M_TILE = 64  # tokens a program takes past 64 rows, where the tiles fit one wave (tokens_a_program)
REDUCE_BLOCK = 256  # outputs a reduce program sums: a 1-row step of N 4096 still spreads over 16 programs


# M (the step's tokens) is not specialised on (Triton would build a variant for 1, for multiples of 16 and for the
# rest): one build per layer shape and power-of-two BLOCK_M, before ready.
@triton.jit(do_not_specialize=["M"])
def _swap_ab_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, part_ptr, res_ptr, M, N, K, stride_xm,
                    stride_wn, stride_om, stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """out.T[N, M] = w[N, K] @ x.T[K, M] over this program's 1/SPLIT_K of K (K a multiple of SPLIT_K * BLOCK_K), both
    operands FP8, times the token scales; with SPLIT_K 1 times the row scales too (plus the residual with RESIDUAL)
    and stored as bf16, else float32 partials [SPLIT_K, M, N] for reduce_kernel. With PDL it starts while the kernel
    before ends, asks the L2 for its first PREFETCH weight tiles meanwhile (no kernel writes the weight), and lets the
    next one start once its K loop is done."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    per_split = K // SPLIT_K
    if PREFETCH:
        lines = tl.arange(0, BLOCK_K // 128) * 128  # a byte of each 128-byte line of a row's tile
        first = w_ptr + tl.minimum(rn, N - 1)[:, None] * stride_wn + split * per_split + lines[None, :]
        for tile in tl.static_range(PREFETCH):
            prefetch_l2(first + tile * BLOCK_K)
    wait(PDL)
    rk = split * per_split + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]
    w_mask, x_mask = rn[:, None] < N, rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, per_split, BLOCK_K):
        acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), tl.load(x_ptrs, mask=x_mask, other=0.0), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    release(PDL)
    acc *= tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)[None, :]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K == 1:
        acc *= tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[:, None]
        if RESIDUAL:
            acc += tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(tl.bfloat16), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def reduce_kernel(part_ptr, w_scale_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm, SPLIT_K: tl.constexpr,
                  BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = the sum over the splits of part[s, m, n], times the row scale of n (plus residual[m, n] with
    RESIDUAL), as bf16. Small: with PDL the next kernel may start as soon as it has waited for the GEMM."""
    wait(PDL)
    release(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + m * N + rn, mask=rn < N, other=0.0)
    acc *= tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    if RESIDUAL:
        acc += tl.load(res_ptr + m * stride_rm + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(tl.bfloat16), mask=rn < N)


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


def split_k(n: int, k: int, block_k: int, sms: int) -> int:
    """The fewest splits of K that give a quarter of the SMs a program (at most MAX_SPLIT_K; each split whole
    BLOCK_Ks). With DEEP_STAGES, Llama-3-8B's o and down (64 tiles: half an H100's SMs) streamed their weights 8–17%
    faster unsplit than split in two with the reduce after, at 1–32 rows (bench/fp8_gemm.py --streamed,
    BENCHMARKS.md); splitting to two programs an SM made the H200's decode step slower (4.14 against 3.46 ms at bs 1:
    the partials and the reduce cost more than the extra programs gave)."""
    tiles, splits = triton.cdiv(n, BLOCK_N), 1
    while tiles * splits < sms // 4 and splits < MAX_SPLIT_K and k % (block_k * splits * 2) == 0:
        splits *= 2
    return splits


def stages(m: int, block_m: int, block_k: int, device: torch.device) -> int:
    """The pipeline's depth: DEEP_STAGES up to SPLIT_M rows where its tiles fit the device's shared memory (6 x 80 x
    256 bytes at 16 rows; on an H100 at 1–32 rows Llama-3-8B's q/k/v, o and down streamed fastest so, gate/up as
    fast as with NUM_STAGES), else NUM_STAGES (past SPLIT_M rows the 48–128-row sweep, which had no deeper pipeline,
    picked 4)."""
    fits = device.type != "cuda" or DEEP_STAGES * (BLOCK_N + block_m) * block_k <= max_shared_bytes(device)
    deep = m <= SPLIT_M and fits  # (TRITON_INTERPRET=1 runs CPU tensors: no shared memory to fit)
    return DEEP_STAGES if deep else NUM_STAGES


def prefetched_tiles(block_n: int, block_k: int, per_split: int) -> int:
    """Weight tiles a program asks the L2 for before its wait: programmatic_launch.PREFETCH_BYTES of them, at most its
    split's."""
    return min(programmatic_launch.PREFETCH_BYTES // (block_n * block_k), per_split // block_k)


def small_m_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """FP8 ``q`` [M, K] with token scales [M] times the FP8 ``weight`` [N, K] with row scales [N] -> bf16 [M, N]
    (plus ``residual`` [M, N], rows contiguous, added in float32 before the one rounding), for a few rows M and K a
    multiple of 128. ``config`` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, BLOCK_M:
    default all the tokens]) is for bench/fp8_gemm.py's sweep; None: this module's choice. Past SPLIT_M rows K is not
    split: the float32 partials (splits x M x N) cost more than the programs gain (every best config of the
    48–128-row sweep had one split)."""
    m, k = q.shape
    n = weight.shape[0]
    if config is None:
        block_k, sms = _block_k(k), sm_count(q.device)
        splits = split_k(n, k, block_k, sms) if m <= SPLIT_M else 1
        block_m = tokens_a_program(m, n, sms)
        config = (BLOCK_N, block_k, splits, NUM_WARPS, stages(m, block_m, block_k, q.device), block_m)
    block_n, block_k, splits, num_warps, num_stages, *block_m = config
    block_m = block_m[0] if block_m else _block_m(m)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=q.device) if splits > 1 else out
    pdl = programmatic_launch.enabled(q.device)
    prefetch = prefetched_tiles(block_n, block_k, k // splits) if pdl else 0
    res = out if residual is None else residual if residual.stride(-1) == 1 else residual.contiguous()
    _swap_ab_kernel[(triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))](
        q, scale, weight, weight_scale, out, part, res, m, n, k, q.stride(0), weight.stride(0), out.stride(0),
        res.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits,
        RESIDUAL=residual is not None, PDL=pdl, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=pdl)
    if splits > 1:
        reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            part, weight_scale, out, res, m, n, out.stride(0), res.stride(0), SPLIT_K=splits, BLOCK=REDUCE_BLOCK,
            RESIDUAL=residual is not None, PDL=pdl, launch_pdl=pdl)
    return out
