"""Kiln's Triton kernel for an activation's per-token FP8 quantize, of the activation itself or of SiLU(gate) × up.

A program a token. A row that fits ONE_PASS_MAX elements and is wider than half of it (an MLP's SiLU x up) is read once
into the registers of 32 warps: its amax, scale and float8 values come from the same load. A narrower row (the
attention output) past FEW_ROWS is read twice in blocks by four warps, the second time from L2. A row wider than
ONE_PASS_MAX (Llama-3.1-70B's 28,672) takes two passes. Timed after the GEMM that writes the input, as in a layer
(bench/quantize_kernel.py --after-gemm, H100, 2,048 rows): SiLU x up of 14,336 in one pass of 32 warps 51.8 µs
(2.84 TB/s), 86.3 Inductor's fusion; the 4,096-wide attention output in two passes of four 10.0 µs. A one-pass program
holds 32 registers a thread, so two programs of 1,024 threads share an SM and one's loads fly while the other reduces
(a program an SM looping over the rows, kept while a program held 53 registers and filled an SM, took 76.1 µs: the
2,048-token step 29.75 against 29.41 ms).

The values are those of kiln.quantization.activation_quant's torch ops, computed in float32 as Inductor's fused kernels
compute them (SiLU and the product not rounded to the activation's dtype between them): the scale max(amax / 448,
MIN_SCALE), x / scale clamped to ±448.

Only the row count goes unspecialised: a layer's widths and row strides are the same at every step, and Triton,
knowing them multiples of 16, reads a row with 16-byte loads. Unspecialised they were read 2 bytes at a time: 32 loads
a thread of SiLU x up where 4 do, 53 registers where 32 do (bench/kernel_sass.py).
"""

import torch
import triton
import triton.language as tl

from kiln.programmatic_launch import follows, leads, release, wait
from kiln.quantization.activation_quant import FP8, MIN_SCALE

FP8_MAX = tl.constexpr(448.0)
ONE_PASS_MAX = 16384  # widest row held in registers (Llama-3-8B's 14,336 MLP width)
LOOP_BLOCK = 4096  # elements per step of a row too wide for one pass
FEW_ROWS = 32  # up to this many rows a program reads its row in one pass where it fits
MANY_ROWS_CONFIG = (2048, False, 4)  # past FEW_ROWS, a row of at most ONE_PASS_MAX / 2 (_config's fields)


@triton.jit
def _activation(x_row, up_row, cols, width, GLU: tl.constexpr):
    mask = cols < width
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if GLU:
        up = tl.load(up_row + cols, mask=mask, other=0.0)
        x = x * tl.sigmoid(x) * up.to(tl.float32)
    return x


@triton.jit
def _one_pass(x_row, up_row, q_row, scale_at, width, min_scale, GLU: tl.constexpr, BLOCK: tl.constexpr):
    """One row read once: its amax, scale and float8 values from the same load."""
    cols = tl.arange(0, BLOCK)
    y = _activation(x_row, up_row, cols, width, GLU)
    scale = tl.maximum(tl.max(tl.abs(y), 0) / FP8_MAX, min_scale)
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cols < width)
    tl.store(scale_at, scale)


@triton.jit
def _quantize_kernel(x_ptr, up_ptr, q_ptr, scale_ptr, width, stride_x, stride_up, stride_q, min_scale,
                     GLU: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, LEAD: tl.constexpr,
                     FOLLOW: tl.constexpr):
    release(LEAD)  # the GEMM after it starts now, and streams its weight while this runs (programmatic_launch)
    wait(FOLLOW)  # launched with PDL itself: the kernel before it has ended
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    up_row = up_ptr + row * stride_up
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        _one_pass(x_row, up_row, q_row, scale_ptr + row, width, min_scale, GLU, BLOCK)
    else:
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, width, BLOCK):
            amax = tl.maximum(amax, tl.abs(_activation(x_row, up_row, start + cols, width, GLU)))
        scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, min_scale)
        for start in range(0, width, BLOCK):
            y = _activation(x_row, up_row, start + cols, width, GLU)
            q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=start + cols < width)
        tl.store(scale_ptr + row, scale)


def _config(m: int, width: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_PASS, num_warps) for ``m`` rows of ``width``: one pass by as many warps as the load can use where
    the row fits (in CUDA graphs, SiLU x up of 14,336 at 1 row: 4.4 µs with 32 warps against 5.1 with 16 on the
    H200, and Inductor's 4.9; a 4,096 row 1.7 µs with 8 warps), except a narrow row past FEW_ROWS:
    MANY_ROWS_CONFIG."""
    block = triton.next_power_of_2(width)
    if m > FEW_ROWS and block <= ONE_PASS_MAX // 2:
        return MANY_ROWS_CONFIG
    if block > ONE_PASS_MAX:
        return LOOP_BLOCK, False, 8
    return block, True, max(4, min(32, block // 512))


def quantize_rows_fp8(x: torch.Tensor, up: torch.Tensor | None = None,
                      config: tuple[int, bool, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (with ``up`` [M, K]: SiLU(x) × up), rows contiguous -> (float8 [M, K], float32 scale [M, 1]).
    ``config`` (BLOCK, ONE_PASS, num_warps) is for a sweep; None: this module's choice."""
    m, width = x.shape
    q = torch.empty(m, width, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block, one_pass, num_warps = config or _config(m, width)
    other = x if up is None else up
    follow = follows(m, num_warps, x.device)
    strides = (x.stride(0), other.stride(0), q.stride(0))
    _quantize_kernel[(m,)](x, other, q, scale, width, *strides, MIN_SCALE, GLU=up is not None, BLOCK=block,
                           ONE_PASS=one_pass, LEAD=leads(m, x.device), FOLLOW=follow, num_warps=num_warps,
                           launch_pdl=follow)
    return q, scale
