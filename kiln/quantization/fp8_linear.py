"""An FP8 linear layer: float8_e4m3fn weights with one scale per output row, activations quantized per token.

The product is ``torch.ops.kiln.fp8_mm``: ``torch._scaled_mm`` (cuBLASLt row-wise scaling on Hopper, oneDNN on the
CPU, so the CPU runs the real path), or for decode-sized steps on CUDA Kiln's own kernel (kiln.quantization.fp8_mm,
fp8_small_m). The activation quantize is ``torch.ops.kiln.quantize_tokens``, which a compiled layer fuses into the
kernel that makes the activation, or runs as Kiln's own kernel where that fusion is slow
(kiln.quantization.activation_quant; docs/fp8.md).

Weights are module tensors like any other: a compiled layer takes them as call inputs, never as constants. (Not
torchao's Float8 config: it runs on CUDA of compute capability 8.9+ only, and its weights are tensor subclasses;
docs/fp8.md.)
"""

import torch

import kiln.quantization.norm_quantize  # noqa: F401  (registers the norm ops a compiled FP8 layer calls)
from kiln.quantization.activation_quant import FP8, FP8_MAX, MIN_SCALE
from kiln.quantization.fp8_mm import fp8_mm


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (float8 [N, K], float32 scale [N]): each row scaled so that its largest |value| is 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] with a calibrated per-tensor ``scale`` (a checkpoint's input_scale) -> (float8, [M, 1])."""
    scale = scale.float().reshape(1, 1)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.expand(x.shape[0], 1).contiguous()


def quantize_input(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic per-token quantize of a product's input [M, K]: ``kiln::quantize_tokens`` where it is traced (a
    compiled layer fuses it, or routes it to Kiln's kernel: activation_quant), and run eagerly on CUDA Kiln's kernel:
    one launch where the torch ops are eight, for the FP8 head, which runs eagerly after each step's graph."""
    if rows.is_cuda and rows.stride(-1) == 1 and not torch.compiler.is_compiling():
        return torch.ops.kiln.quantize_kernel(rows, None)
    return torch.ops.kiln.quantize_tokens(rows)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] times float8 ``weight`` [N, K] with row scales ``weight_scale`` [N] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_input(rows) if input_scale is None else quantize_static(rows, input_scale)
    # cuBLASLt's row-wise scaling writes bfloat16 only; the CPU writes any dtype.
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    out = fp8_mm(q, scale, weight, weight_scale, out_dtype)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Fp8Linear(torch.nn.Module):
    """Rows ``start:end`` of a float8 weight (all of it for a lone projection; a slice of a merged group's, see
    kiln.model.merged_projections), with their scales, bias and the static input scale when the checkpoint has one.

    Compiled, each slice asks for the group's whole product and takes its columns: ``merge_identical_linears`` keeps
    one product per group. Eager, each multiplies by its own rows."""

    def __init__(self, weight: torch.nn.Parameter, weight_scale: torch.nn.Parameter, bias: torch.nn.Parameter | None,
                 input_scale: torch.nn.Parameter | None = None, start: int = 0, end: int | None = None):
        super().__init__()
        self.weight = weight
        self.weight_scale = weight_scale
        self.bias = bias
        self.input_scale = input_scale
        self.start, self.end = start, weight.shape[0] if end is None else end
        self.in_features, self.out_features = weight.shape[1], self.end - start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole or torch.compiler.is_compiling():
            out = fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale)
            return out if self.whole else out[..., self.start:self.end]
        rows = slice(self.start, self.end)
        bias = None if self.bias is None else self.bias[rows]
        return fp8_linear(x, self.weight[rows], self.weight_scale[rows], bias, self.input_scale)

    def dequantized(self) -> torch.Tensor:
        """This projection's weight as float32: what a plain-torch reference multiplies by."""
        rows = slice(self.start, self.end)
        return self.weight[rows].float() * self.weight_scale[rows, None].float()


def frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)
