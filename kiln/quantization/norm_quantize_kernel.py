"""Kiln's Triton kernel for an RMSNorm and the per-token FP8 quantize of its output, with the residual add before it.

Inductor writes this fusion as a looped reduction that reads each row three times (the sum of squares, the amax of
the normed row, the float8 values): on an H100 its two kernels took 51.1 µs a layer of a 2,048-token FP8 prefill of
Llama-3-8B, where their bytes, each read and written once, take ~28 at its copy bandwidth (BENCHMARKS.md). Here a
program holds its row in registers: one read of the input (and residual), one write of the sum, the float8 row and
its scale. The values are the torch ops' of kiln.quantization.norm_quantize, rounded where they round: the sum and
the normed row to the activation's dtype, the weight's product too (the weight has the activation's dtype), then the
quantize of kiln.quantization.activation_quant in float32. Width and strides are specialised, as in
kiln.quantization.quantize_kernel: 16-byte loads, 35 registers at 8 warps (76 with 2-byte loads, the timings above).
"""

import torch
import triton
import triton.language as tl

from kiln.programmatic_launch import follows, leads, release, wait
from kiln.quantization.activation_quant import FP8, MIN_SCALE
from kiln.quantization.quantize_kernel import FP8_MAX


@triton.jit
def _rms_norm_quantize_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, q_ptr, scale_ptr, width, stride_x, stride_res,
                              stride_sum, stride_q, eps, min_scale, ADD: tl.constexpr, BLOCK: tl.constexpr,
                              LEAD: tl.constexpr, FOLLOW: tl.constexpr):
    release(LEAD)  # the GEMM after it starts now, and streams its weight while this runs (programmatic_launch)
    wait(FOLLOW)  # launched with PDL itself: the kernel before it has ended
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / width + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), 0) / FP8_MAX, min_scale)
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def num_warps(width: int) -> int:
    """Warps a program: 16 values of a 4,096-wide row a thread (8 warps), at least 4 and at most 16 warps."""
    return max(4, min(16, triton.next_power_of_2(width) // 512))


def rms_norm_quantize_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                           warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` [M, K] (plus ``residual`` [M, K]), rows contiguous, ``weight`` [K] -> (float8 [M, K], float32 scale
    [M, 1], the sum [M, K] or None without ``residual``). ``warps`` is for a sweep; None: ``num_warps(K)``."""
    m, width = x.shape
    q = torch.empty(m, width, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    total = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if m == 0:
        return q, scale, total
    block = triton.next_power_of_2(width)
    warps = warps or num_warps(width)
    follow = follows(m, warps, x.device)
    res, out = (x, x) if residual is None else (residual, total)
    _rms_norm_quantize_kernel[(m,)](x, res, weight, out, q, scale, width, x.stride(0), res.stride(0), out.stride(0),
                                    q.stride(0), eps, MIN_SCALE, ADD=residual is not None, BLOCK=block,
                                    LEAD=leads(m, x.device), FOLLOW=follow, num_warps=warps, launch_pdl=follow)
    return q, scale, total
