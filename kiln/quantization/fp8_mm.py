"""``torch.ops.kiln.fp8_mm``: the FP8 linears' product, ``torch._scaled_mm`` with row-wise scales, or for decode-
sized steps on CUDA Kiln's own kernel (kiln.quantization.fp8_small_m: up to 32 rows, and up to 128 for a weight of
few rows), where cuBLASLt's 128 x 128 tiles leave the weights' bandwidth unused. On CUDA, cuBLASLt accumulates in
the tensor cores' own precision (``use_fast_accum``), as vLLM's CUTLASS FP8 kernels on Hopper do (their
``FP8FastAccum`` schedules), instead of adding the partial sums into float32 on the CUDA cores every few K blocks
(bench/fp8_gemm.py times both). An op of its own, opaque to Inductor: a compiled layer calls it where it called
``_scaled_mm``, and the product's shape picks the kernel at run time (a CUDA graph keeps the pick of its size).
"""

import torch

from kiln.dispatcher_op import dispatcher_op


def _fake(q, scale, weight, weight_scale, out_dtype, residual=None):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


@dispatcher_op("kiln::fp8_mm", "(Tensor q, Tensor scale, Tensor weight, Tensor weight_scale, ScalarType out_dtype, "
               "Tensor? residual=None) -> Tensor", _fake)
def fp8_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           out_dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``_scaled_mm(q, weight.t())`` with the token ``scale`` [M, 1] and row ``weight_scale`` [N], in ``out_dtype``
    (bf16 on CUDA, as cuBLASLt's row-wise product writes); with ``residual`` [M, N] of ``out_dtype``, plus it
    (kiln.quantization.residual_add: Kiln's kernel adds it before its one rounding, instead of a kernel after)."""
    if q.is_cuda:
        from kiln.quantization import fp8_small_m  # Triton: only where CUDA runs

        if fp8_small_m.takes(q.shape[0], weight.shape[0], q.shape[1], q.device):
            return fp8_small_m.small_m_mm(q, scale.reshape(-1).contiguous(), weight, weight_scale, residual)
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, -1), out_dtype=out_dtype,
                           use_fast_accum=q.is_cuda)
    return out if residual is None else out.add_(residual)
