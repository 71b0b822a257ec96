"""What a model's decoder linears are made of, from the compile config and the model config: the model's dtype, FP8
quantized at load from the model-dtype weights ("dynamic"), or FP8 as an FP8 checkpoint stores them.

A model config with an honoured ``quantization_config`` is FP8 whatever the compile config asks (the checkpoint
decides, as in vLLM). Its code factors are a key factor (kiln.model.factors): FP8 layers are other code.
"""

import functools
from dataclasses import dataclass

import torch

from kiln.errors import InvalidArgument
from kiln.quantization import checkpoint_formats
from kiln.quantization.checkpoint_formats import Fp8Checkpoint

QUANTIZATIONS = ("", "fp8")  # the compile config's field: empty is none


@dataclass(frozen=True)
class Fp8Quantization:
    checkpoint: Fp8Checkpoint | None  # None: quantized at load from the model-dtype weights

    @property
    def static_activations(self) -> bool:
        return self.checkpoint is not None and self.checkpoint.static_activations

    def code_factors(self) -> dict:
        return {"method": "fp8", "activations": "static" if self.static_activations else "dynamic"}


def quantization_of(config: object, requested: str = "") -> Fp8Quantization | None:
    """The quantization a model is built with: its checkpoint's, else the requested one (None for none)."""
    stored = getattr(config, "quantization_config", None)
    if stored:
        return Fp8Quantization(checkpoint_formats.parse(stored))
    return Fp8Quantization(None) if requested == "fp8" else None


def fp8_unsupported(device: str) -> str | None:
    """Why ``device`` cannot run FP8 GEMMs, or None: CUDA needs compute capability 8.9 (Ada, Hopper) or later; the
    CPU needs a torch whose _scaled_mm runs there."""
    if device == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            return (f"this CUDA device ({torch.cuda.get_device_name()}) is compute capability "
                    f"{'.'.join(map(str, capability))}; FP8 GEMMs need 8.9 or later (Ada, Hopper)")
        return None
    return _cpu_fp8_unsupported()


@functools.cache
def _cpu_fp8_unsupported() -> str | None:
    probe = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(probe, probe.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch {torch.__version__} has no FP8 GEMM on the CPU ({str(exc).splitlines()[0][:120]})"
    return None


def check_head(quantization: Fp8Quantization | None, quantize_head: bool) -> None:
    """INVALID_ARGUMENT naming ``quantize_head`` when the head is asked for in FP8 of a model that is not FP8."""
    if quantize_head and quantization is None:
        raise InvalidArgument("quantize_head: the head is quantized only in an FP8 model "
                              "(config.quantization 'fp8', or an FP8 checkpoint)")


def check_supported(quantization: Fp8Quantization | None, device: str, field: str) -> None:
    """INVALID_ARGUMENT naming ``field`` when the model is FP8 and the device cannot run it."""
    if quantization is not None:
        why = fp8_unsupported(device)
        if why:
            raise InvalidArgument(f"{field}: fp8 asked for, but {why}")
