"""One decoder layer's GEMMs of Llama-3-8B in FP8 (row-wise scales) against bfloat16 F.linear, at decode and prefill
token counts, to find the FP8 product a decode-sized step should use (issue 24: FP8 decode is no faster than bf16):

- ``torch._scaled_mm`` alone (input quantized beforehand), as Kiln's layers call it, and with ``use_fast_accum``;
- cuBLASLt's tensor-wise FP8 GEMM at unit scales, the row and token scales multiplied into its output after;
- ``_scaled_mm`` with its operands swapped, out.T = W @ x.T: the weight's rows are cuBLASLt's M (thousands) and the
  tokens its N, padded to 16 (its smallest), so a decode step is not a 1-row GEMM to cuBLASLt's kernel heuristics;
- the quantize and GEMM compiled (as in a Kiln layer, the quantize fused into one kernel);
- weight-only candidates for few tokens: the FP8 weight read once and widened to bf16 in registers, the activation
  left in bf16 (no quantize), each at the fastest of a few tile configs: a dot with the tokens first, a dot with the
  weight first ("swap A and B", optionally split over K with a reduce kernel after), and a GEMV without a dot for
  up to 4 tokens;
- the swap-AB kernel with both operands FP8 (W8A8 as ``_scaled_mm``: the quantized activation and the weight go into
  the FP8 tensor-core dot unwidened). ``--graphs`` times it against bf16, ``_scaled_mm`` and the weight-only
  swap-AB, all replayed from CUDA graphs, as a served step runs them: the figures that decide what replaces
  ``_scaled_mm`` for decode-sized steps (cuBLASLt runs every row-wise FP8 GEMM of 1–32 rows with one 128 x 128 tile,
  BENCHMARKS.md);
- the FP8 swap-AB product with its operands' tiles loaded by the Hopper's TMA (``--streamed``'s last column), where
  Kiln's kernel has every thread issue asynchronous copies;
- Kiln's kernel over weights of 8 to 448 tiles (``--ramp``): its fixed start and what a program streams a second.

With TRITON_INTERPRET=1 and --check, it runs the candidates on the CPU against the dequantized product instead.

usage: python bench/fp8_gemm.py [--tokens 1,32,2048]
       python bench/fp8_gemm.py --graphs --tokens 1,4,16,32
       python bench/fp8_gemm.py --streamed --tokens 1,8,32 [--gemms down,o,head]
       python bench/fp8_gemm.py --ramp 8,16,32,64,96,132,264,448 --tokens 1
       TRITON_INTERPRET=1 python bench/fp8_gemm.py --check
"""

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.quantization.activation_quant import quantize_tokens
from kiln.quantization.fp8_linear import fp8_linear, quantize_rows
from kiln.quantization.fp8_small_m import M_TILE, REDUCE_BLOCK, SPLIT_M, reduce_kernel, small_m_mm

# (name, out_features, in_features) of Llama-3-8B's merged projections
GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
HEAD = ("head", 128256, 4096)  # the FP8 head (--quantize-head), a step's largest product: --streamed --gemms head
MAX_WEIGHT_ONLY_TOKENS = 64  # the candidate is for decode-sized steps
# (BLOCK_N, BLOCK_K, num_warps, num_stages) the candidate is timed at
CONFIGS = ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4))


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDE_F32: tl.constexpr):
    """out[M, N] = x[M, K] @ (w[N, K] widened).T * scale[N]: each program BLOCK_N output columns, over all K. The
    weight is widened to x's dtype (bf16 tensor cores), or to float32 under the CPU interpreter (``WIDE_F32``), whose
    bfloat16 products are wrong."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        if WIDE_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: tuple) -> torch.Tensor:
    """x [M, K] (M <= MAX_WEIGHT_ONLY_TOKENS) times float8 ``weight`` [N, K] with row scales [N] -> [M, N]."""
    block_n, block_k, num_warps, num_stages = config[0], config[1], config[-2], config[-1]
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _weight_only_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages, WIDE_F32=not x.is_cuda)
    return out


@triton.jit
def _split_k_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's [start, end) of K, split SPLIT_K ways (grid axis 1) in whole BLOCK_K tiles."""
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    start = tl.program_id(1) * per_split
    return start, tl.minimum(start + per_split, K)


@triton.jit
def _swap_ab_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    WIDE_F32: tl.constexpr):
    """out.T[N, M] = (w[N, K] widened) @ x.T[K, M] * scale[N], over this program's 1/SPLIT_K of K: the weight is the
    dot's first operand (widened in registers, BLOCK_N >= 64 rows for Hopper's wgmma), the few tokens its second
    (vLLM's and CUTLASS's "swap A and B" for small M). SPLIT_K > 1 writes float32 partials [SPLIT_K, M, N].
    (Both operands FP8, unwidened: kiln.quantization.fp8_small_m.)"""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_start, k_end = _split_k_range(K, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + ks[:, None], mask=(rm[None, :] < M) & (ks[:, None] < K),
                     other=0.0)
        if WIDE_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K == 1:
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
        out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], out, mask=mask)
    else:
        tl.store(part_ptr + split * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _tma_swap_ab_kernel(x_desc, x_scale_ptr, w_desc, w_scale_ptr, out_ptr, M, N, K, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Kiln's FP8 swap-AB product (kiln.quantization.fp8_small_m, unsplit) with both operands' tiles loaded by the
    Hopper's TMA from host tensor descriptors instead of every thread's asynchronous copies: one thread issues a
    tile's load, out-of-bounds tokens arrive as zeros."""
    off_n = tl.program_id(0) * BLOCK_N
    off_m = tl.program_id(1) * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(w_desc.load([off_n, k]), x_desc.load([off_m, k]).T, acc)
    rn = off_n + tl.arange(0, BLOCK_N)
    rm = off_m + tl.arange(0, BLOCK_M)
    acc *= tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)[None, :]
    acc *= tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[:, None]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The same product for M <= BLOCK_M <= 4 tokens without a dot: products summed in float32 registers."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_start, k_end = _split_k_range(K, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(part_ptr + split * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


MAX_GEMV_TOKENS = 4
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
SWAP_AB_CONFIGS = ((64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 4, 3), (128, 128, 1, 8, 4),
                   (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (64, 256, 4, 4, 3), (128, 128, 4, 8, 3),
                   (64, 128, 8, 4, 4))
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) of the swap-AB kernel with both operands FP8
FP8_DOT_CONFIGS = ((64, 128, 1, 4, 4), (64, 256, 1, 4, 4), (128, 128, 1, 4, 4), (128, 256, 1, 8, 3),
                   (64, 128, 2, 4, 4), (64, 256, 2, 4, 4), (64, 128, 4, 4, 5), (64, 256, 4, 4, 4),
                   (128, 128, 4, 4, 4), (128, 256, 4, 8, 3), (64, 128, 8, 4, 4), (64, 256, 8, 4, 3))
# A wider grid for --streamed: the split, K tile and pipeline depth around Kiln's picks, at 64 weight rows a program
# (the FP8 wgmma's side), and at 32 (twice the programs without a split, so no reduce kernel); and unsplit pipelines
# deeper than Kiln's six 16 KB tiles (a Hopper's shared memory holds 2 KB of K a weight row and token row at 32
# rows), for the H200, whose o and down (64 programs) need ~1.4x the H100's bytes in flight a program
STREAMED_CONFIGS = tuple((block_n, block_k, splits, 4, stages) for block_n in (64, 32) for block_k in (128, 256, 512)
                         for splits in (1, 2, 4, 8) for stages in (3, 4, 6)
                         if block_k * stages <= 1536 and (block_n == 64 or splits <= 2)) \
    + ((64, 128, 1, 4, 12), (64, 256, 1, 4, 8), (64, 512, 1, 4, 4))
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the TMA-loaded swap-AB kernel, around Kiln's unsplit pick (64, 256, 4,
# 6); a TMA box is at most 256 elements a side
TMA_CONFIGS = ((64, 256, 4, 6), (64, 256, 4, 8), (64, 128, 4, 8), (64, 128, 4, 12), (128, 256, 4, 4), (128, 256, 8, 4),
               (128, 128, 8, 8), (32, 256, 4, 8))
GEMV_CONFIGS = ((16, 512, 1, 4, 3), (32, 256, 1, 4, 3), (8, 1024, 1, 4, 2), (16, 512, 4, 4, 3), (32, 256, 4, 4, 3),
                (16, 256, 8, 4, 4), (64, 128, 1, 4, 4), (32, 512, 2, 8, 3))


def _launch_split(kernel, x, weight, scale, config, block_m, **constexprs) -> torch.Tensor:
    block_n, block_k, split_k, num_warps, num_stages = config
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, scale, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages, **constexprs)
    if split_k > 1:  # Kiln's split-K reduce, without a residual (its output is bf16, as x is here)
        reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](part, scale, out, out, m, n, out.stride(0), 0,
                                                          SPLIT_K=split_k, BLOCK=REDUCE_BLOCK, RESIDUAL=False,
                                                          PDL=False)
    return out


def swap_ab(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: tuple) -> torch.Tensor:
    """x [M, K] (M <= MAX_WEIGHT_ONLY_TOKENS) times float8 ``weight`` [N, K] with row scales [N] -> [M, N]."""
    return _launch_split(_swap_ab_kernel, x, weight, scale, config, max(16, triton.next_power_of_2(x.shape[0])),
                         WIDE_F32=not x.is_cuda)


def fp8_swap_ab(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                config: tuple | None) -> torch.Tensor:
    """The FP8 activation ``xq`` [M, K] with token scales [M, 1] times the float8 ``weight`` [N, K] with row scales
    [N] -> bf16 [M, N]: Kiln's swap-AB kernel with both operands FP8 at ``config`` (None: the one it picks)."""
    return small_m_mm(xq, x_scale.reshape(-1).contiguous(), weight, scale, config=config)


def tma_swap_ab(xq: torch.Tensor, token_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                config: tuple) -> torch.Tensor:
    """``fp8_swap_ab`` (token scales [M]) with TMA loads, at ``config`` (BLOCK_N, BLOCK_K, num_warps, num_stages);
    K a multiple of BLOCK_K."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_k, num_warps, num_stages = config
    m, k = xq.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    _tma_swap_ab_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        TensorDescriptor.from_tensor(xq, [block_m, block_k]), token_scale,
        TensorDescriptor.from_tensor(weight, [block_n, block_k]), scale, out, m, n, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages, num_warps=num_warps)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: tuple) -> torch.Tensor:
    """The same for M <= MAX_GEMV_TOKENS."""
    return _launch_split(_gemv_kernel, x, weight, scale, config, triton.next_power_of_2(x.shape[0]))


def unit_scaled(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's tensor-wise FP8 GEMM at unit scales, the row and token scales applied to its output after (the
    multiply is one more elementwise op, which a compiled layer fuses into the next)."""
    one = torch.ones((), device=xq.device)
    return torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16) * x_scale * w_scale


def swapped(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
            fast_accum: bool = False) -> torch.Tensor:
    """out = (q @ xq.T).T with the token count padded to a multiple of 16, row scales as ``scale_a`` [N, 1] and the
    token scales as ``scale_b`` [1, M]; the transposed output is read back as [M, N] (a compiled layer fuses the
    copy into the next op)."""
    pad = -xq.shape[0] % 16
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad, 1)])
    out = torch._scaled_mm(q, xq.t(), scale_a=w_scale.reshape(-1, 1), scale_b=x_scale.reshape(1, -1),
                           out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out.t()[: out.shape[1] - pad]


def best_of(fn, configs, timer=None) -> tuple[float, tuple | None]:
    """The fastest config's µs (``timer``, default ``us``) and the config; configs the GPU cannot run (shared
    memory) are skipped."""
    timer = timer or us
    timed = {}
    for config in configs:
        try:
            timed[config] = timer(lambda c=config: fn(c))
        except triton.runtime.errors.OutOfResources:
            continue
    if not timed:
        return float("inf"), None
    config = min(timed, key=timed.get)
    return timed[config], config


def us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=30, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """µs of ``fn`` replayed from a CUDA graph, as a served step runs it (no launch cost, L2 warm)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def in_graphs(tokens: list[int]) -> None:
    """bf16's ``F.linear``, ``_scaled_mm`` (fast accumulation), Kiln's FP8-dot swap-AB kernel at the config it picks
    and at the best of FP8_DOT_CONFIGS, and the weight-only swap-AB (bf16 activation, no quantize) at the best of
    SWAP_AB_CONFIGS, each replayed from CUDA graphs: µs and the weight's bytes per second."""
    print("| tokens | GEMM | FP8 weight MB | bf16 us (TB/s) | _scaled_mm us (TB/s) "
          "| FP8-dot swap-AB, Kiln's pick us (TB/s) | best config us (TB/s), config "
          "| weight-only swap-AB us (TB/s), config | _scaled_mm / Kiln's pick |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in tokens:
        for name, n, k in GEMMS:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, scale = quantize_rows(w)
            xq, x_scale = quantize_tokens(x)
            w_scale = scale.reshape(1, -1)
            bf16 = graph_us(lambda x=x, w=w: F.linear(x, w))
            gemm = graph_us(lambda a=xq, s=x_scale, q=q, t=w_scale: torch._scaled_mm(
                a, q.t(), scale_a=s, scale_b=t, out_dtype=torch.bfloat16, use_fast_accum=True))
            picked = graph_us(lambda a=xq, s=x_scale, q=q, t=scale: fp8_swap_ab(a, s, q, t, None))
            timed, config = best_of(lambda c, a=xq, s=x_scale, q=q, t=scale: fp8_swap_ab(a, s, q, t, c),
                                    [c for c in FP8_DOT_CONFIGS if k % (c[1] * c[2]) == 0], graph_us)
            wo, wo_config = best_of(lambda c, x=x, q=q, t=scale: swap_ab(x, q, t, c), SWAP_AB_CONFIGS, graph_us)
            mb = n * k / 1e6
            print(f"| {m} | {name} | {mb:.1f} | {bf16:.1f} ({2 * mb / bf16:.2f}) | {gemm:.1f} ({mb / gemm:.2f}) | "
                  f"{picked:.1f} ({mb / picked:.2f}) | {timed:.1f} ({mb / timed:.2f}), {config} | "
                  f"{wo:.1f} ({mb / wo:.2f}), {wo_config} | {gemm / picked:.2f}x |", flush=True)


def streamed_us(fn, copies: int) -> float:
    """µs a call of ``fn(i)``, the products over ``copies`` weights replayed in turn from one CUDA graph, so that
    each reads its weight from HBM as a served step does (a step streams 32 layers' weights; one weight replayed
    alone sits in the 50 MB L2 when it is smaller)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=30, return_mode="median") * 1e3 / copies


def streamed_weights(n: int, k: int, l2: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of an FP8 weight [n, k] with its row scales, enough that together they pass twice the L2 (at least
    two): replayed in turn, each product reads its weight from HBM."""
    return [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            for _ in range(max(2, 1 + 2 * l2 // (n * k)))]


def streamed_row(m: int, name: str, n: int, k: int, l2: int) -> str:
    """One GEMM's row of the --streamed table."""
    weights = streamed_weights(n, k, l2)
    copies = len(weights)
    xq, x_scale = quantize_tokens(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    token_scale = x_scale.reshape(-1).contiguous()
    gemm = streamed_us(lambda i: torch._scaled_mm(xq, weights[i][0].t(), scale_a=x_scale,
                                                  scale_b=weights[i][1].reshape(1, -1), out_dtype=torch.bfloat16,
                                                  use_fast_accum=True), copies)
    picked = streamed_us(lambda i: small_m_mm(xq, token_scale, *weights[i]), copies)
    configs = [c for c in STREAMED_CONFIGS if c[2] == 1 or m <= SPLIT_M]  # (past SPLIT_M rows K is not split)
    if m > M_TILE:  # the tokens split too, 64 a program, as Kiln splits them where its tiles fit one wave
        configs += [(*c, M_TILE) for c in configs]
    best, config = best_of(lambda c: lambda i: small_m_mm(xq, token_scale, *weights[i], config=c),
                           [c for c in configs if k % (c[1] * c[2]) == 0], lambda make: streamed_us(make(), copies))
    tma, tma_config = best_of(lambda c: lambda i: tma_swap_ab(xq, token_scale, *weights[i], c),
                              [c for c in TMA_CONFIGS if k % c[1] == 0 and m <= SPLIT_M],
                              lambda make: streamed_us(make(), copies))
    mb = n * k / 1e6
    tma_cell = "-" if tma_config is None else f"{tma:.1f} ({mb / tma:.2f}), {tma_config}"
    return (f"| {m} | {name} | {mb:.1f} | {copies} | {gemm:.1f} ({mb / gemm:.2f}) | {picked:.1f} ({mb / picked:.2f}) "
            f"| {best:.1f} ({mb / best:.2f}) | {config} | {picked / best:.2f}x | {tma_cell} |")


def streamed(tokens: list[int], names: list[str]) -> None:
    """Kiln's FP8 kernel at its own pick and at each of STREAMED_CONFIGS, and ``_scaled_mm``, each GEMM replayed
    over enough copies of its weight to exceed the L2: µs and the weight's TB/s, the pick against the best."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, L2 {l2 / 1e6:.0f} MB; µs a product, each GEMM over copies of its "
          "weight replayed in turn from one CUDA graph")
    print("| tokens | GEMM | FP8 weight MB | copies | _scaled_mm us (TB/s) | Kiln's pick us (TB/s) "
          "| best config us (TB/s) | best config | pick / best | TMA loads: best us (TB/s), config |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in tokens:
        for name, n, k in (*GEMMS, HEAD):
            if name in names:
                print(streamed_row(m, name, n, k, l2), flush=True)


def ramp(tokens: int, programs: list[int]) -> None:
    """Kiln's FP8 kernel at its own pick over weights of 64 x P rows (P programs of one 64-row tile; K 4,096 and
    14,336, Llama-3-8B's), streamed from HBM as ``streamed`` does: where P programs fit the SMs at once, the time of
    one program's tile stream plus a fixed start (per-SM rate the limit) or the bytes at the HBM's rate (the HBM the
    limit); the µs, TB/s and GB/s an SM in use tell which, and the fixed start is what a small kernel before could
    hide."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, L2 {l2 / 1e6:.0f} MB; {tokens} token(s), Kiln's pick, µs a "
          "product over copies of the weight replayed in turn from one CUDA graph")
    print("| K | programs (64-row tiles) | weight MB | µs | TB/s | GB/s an SM in use |")
    print("|---|---|---|---|---|---|")
    for k in (4096, 14336):
        xq, x_scale = quantize_tokens(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))
        token_scale = x_scale.reshape(-1).contiguous()
        for count in programs:
            n = 64 * count
            weights = streamed_weights(n, k, l2)
            copies = len(weights)
            t = streamed_us(lambda i, w=weights, a=xq, s=token_scale: small_m_mm(a, s, *w[i]), copies)
            mb = n * k / 1e6
            print(f"| {k} | {count} | {mb:.1f} | {t:.2f} | {mb / t:.2f} | {mb / t / min(count, sms) * 1e3:.1f} |",
                  flush=True)


def check() -> None:
    """The candidates against the dequantized product, on whatever device the interpreter or CUDA gives."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for m, n, k in ((1, 48, 96), (3, 64, 300), (5, 64, 300), (16, 40, 512), (33, 16, 64), (4, 72, 1024)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        q, scale = quantize_rows(torch.randn(n, k, device=device) * 0.02)
        want = x.float() @ (q.float() * scale[:, None]).t()
        candidates = [(weight_only, c) for c in CONFIGS[:2]] + [(swap_ab, c) for c in SWAP_AB_CONFIGS[::4]]
        if m <= MAX_GEMV_TOKENS:
            candidates += [(gemv, c) for c in GEMV_CONFIGS[::3]]
        for fn, config in candidates:
            got = fn(x, q, scale, config).float()
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2, msg=lambda e, f=fn, c=config, shape=(m, n, k):
                                       f"{f.__name__} {c} at {shape}: {e}")
        xq, x_scale = quantize_tokens(x)
        want = (xq.float() * x_scale) @ (q.float() * scale[:, None]).t()
        for config in [c for c in FP8_DOT_CONFIGS[::3] if k % (c[1] * c[2]) == 0]:  # its Ks: whole splits
            got = fp8_swap_ab(xq, x_scale, q, scale, config).float()
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2, msg=lambda e, c=config, shape=(m, n, k):
                                       f"fp8_swap_ab {c} at {shape}: {e}")
        if k % 16 == 0 and (device == "cpu" or torch.cuda.get_device_capability()[0] >= 9):  # TMA: 16-byte rows
            for config in [c for c in TMA_CONFIGS if k % c[1] == 0]:
                got = tma_swap_ab(xq, x_scale.reshape(-1).contiguous(), q, scale, config).float()
                torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2, msg=lambda e, c=config, shape=(m, n, k):
                                           f"tma_swap_ab {c} at {shape}: {e}")
        if k % 16 == 0 and n % 16 == 0:  # cuBLASLt's FP8 shapes
            for fast in (False, True):
                got = swapped(xq, x_scale, q, scale, fast).float()
                torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2, msg=lambda e, shape=(m, n, k):
                                           f"swapped _scaled_mm at {shape}: {e}")
    print("weight-only candidates (dot, swap-AB, GEMV; split-K too), the FP8-dot swap-AB (its loads by TMA too) and "
          "the swapped _scaled_mm: equal to the dequantized product within bf16 rounding")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,32,2048")
    p.add_argument("--check", action="store_true", help="check the candidates' values only (CPU: TRITON_INTERPRET=1)")
    p.add_argument("--streamed", action="store_true",
                   help="Kiln's FP8 kernel over a grid of configs, each GEMM streaming its weights from HBM in a graph")
    p.add_argument("--gemms", default=",".join(name for name, _, _ in GEMMS),
                   help="with --streamed: which GEMMs (head: the FP8 head too)")
    p.add_argument("--graphs", action="store_true",
                   help="bf16, _scaled_mm, the FP8-dot and the weight-only swap-AB kernels, timed in CUDA graphs")
    p.add_argument("--ramp", default="", help="Kiln's kernel over 64 x P-row weights for these P (e.g. "
                   "8,16,32,64,96,132,264,448), at the first of --tokens: its fixed start and per-program rate")
    args = p.parse_args()
    if args.check:
        check()
        return
    if args.streamed:
        streamed([int(t) for t in args.tokens.split(",")], args.gemms.split(","))
        return
    if args.ramp:
        ramp(int(args.tokens.split(",")[0]), [int(p) for p in args.ramp.split(",")])
        return
    if args.graphs:
        in_graphs([int(t) for t in args.tokens.split(",")])
        return
    compiled = torch.compile(fp8_linear, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "µs are triton.testing.do_bench medians (L2 flushed before each call)")
    print("| tokens | GEMM | bf16 us | fp8 _scaled_mm us | fast accum us | tensor-wise, unit scales us "
          "| swapped us | swapped, fast accum us | fp8 compiled (quantize + GEMM) us | weight-only Triton us (config) "
          "| swap-AB us (config) | GEMV us (config) | bf16 / best fp8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for name, n, k in GEMMS:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q, scale = quantize_rows(w)
            xq, x_scale = quantize_tokens(x)
            w_scale = scale.reshape(1, -1)
            bf16 = us(lambda x=x, w=w: F.linear(x, w))
            gemm = us(lambda a=xq, s=x_scale, q=q, t=w_scale: torch._scaled_mm(a, q.t(), scale_a=s, scale_b=t,
                                                                             out_dtype=torch.bfloat16))
            fast = us(lambda a=xq, s=x_scale, q=q, t=w_scale: torch._scaled_mm(
                a, q.t(), scale_a=s, scale_b=t, out_dtype=torch.bfloat16, use_fast_accum=True))
            unit = us(lambda a=xq, s=x_scale, q=q, t=w_scale: unit_scaled(a, s, q, t))
            swap = us(lambda a=xq, s=x_scale, q=q, t=scale: swapped(a, s, q, t))
            swap_fast = us(lambda a=xq, s=x_scale, q=q, t=scale: swapped(a, s, q, t, True))
            fused = us(lambda x=x, q=q, s=scale: compiled(x, q, s, None, None))
            cells, best = [], min(gemm, fast, unit, swap, swap_fast, fused)
            for fn, configs, most in ((weight_only, CONFIGS, MAX_WEIGHT_ONLY_TOKENS),
                                      (swap_ab, SWAP_AB_CONFIGS, MAX_WEIGHT_ONLY_TOKENS),
                                      (gemv, GEMV_CONFIGS, MAX_GEMV_TOKENS)):
                if tokens > most:
                    cells.append("-")
                    continue
                timed, config = best_of(lambda c, f=fn, x=x, q=q, s=scale: f(x, q, s, c), configs)
                cells.append(f"{timed:.1f} {config}" if config else "none ran")
                best = min(best, timed)
            print(f"| {tokens} | {name} | {bf16:.1f} | {gemm:.1f} | {fast:.1f} | {unit:.1f} | {swap:.1f} | "
                  f"{swap_fast:.1f} | {fused:.1f} | {' | '.join(cells)} | {bf16 / best:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
