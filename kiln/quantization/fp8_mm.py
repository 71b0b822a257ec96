"""``torch.ops.kiln.fp8_mm``: the FP8 linears' product, ``torch._scaled_mm`` with row-wise scales, or for up to
SMALL_M rows on CUDA Kiln's own kernel (kiln.quantization.fp8_small_m), where cuBLASLt's one 128 x 128 tile leaves
the weights' bandwidth unused. On CUDA, cuBLASLt accumulates in the tensor cores' own precision
(``use_fast_accum``), as vLLM's CUTLASS FP8 kernels on Hopper do (their ``FP8FastAccum`` schedules), instead of
adding the partial sums into float32 on the CUDA cores every few K blocks (bench/fp8_gemm.py times both). An op of
its own, opaque to Inductor: a compiled layer calls it where it called ``_scaled_mm``, and the row count picks the
kernel at run time (a CUDA graph keeps the pick of its size).
"""

import torch

from kiln.dispatcher_op import dispatcher_op

SMALL_M = 32  # rows up to which Kiln's kernel runs


def _fake(q, scale, weight, weight_scale, out_dtype):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


@dispatcher_op("kiln::fp8_mm", "(Tensor q, Tensor scale, Tensor weight, Tensor weight_scale, ScalarType out_dtype) "
               "-> Tensor", _fake)
def fp8_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``_scaled_mm(q, weight.t())`` with the token ``scale`` [M, 1] and row ``weight_scale`` [N], in ``out_dtype``
    (bf16 on CUDA, as cuBLASLt's row-wise product writes)."""
    if q.is_cuda and q.shape[0] <= SMALL_M and q.shape[1] % 128 == 0:
        from kiln.quantization.fp8_small_m import small_m_mm  # Triton: only where CUDA runs

        return small_m_mm(q, scale.reshape(-1).contiguous(), weight, weight_scale)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, -1), out_dtype=out_dtype,
                            use_fast_accum=q.is_cuda)
