"""FP8 checkpoints: which quantization_config a Kiln model honours, and the tensors each decoder linear then stores.

Honoured: compressed-tensors FP8 (``quant_method: compressed-tensors``, ``format: float-quantized``, one config group
of 8-bit float weights per channel or per tensor, activations dynamic per token or static per tensor: the
"-FP8-dynamic" and "-FP8" checkpoints llm-compressor writes) and transformers' own ``fp8`` method (block-wise weight
scales, dynamic activations). Anything else is refused naming the field and its value, before a model is built.

Kiln computes every FP8 linear with one scale per output row (kiln.quantization.fp8_linear): a per-tensor scale is
that scale on every row (exact); block-wise weights are dequantized block by block and quantized again per row at load
(one more rounding, within the bound tests/test_fp8.py states).
"""

import math
import re
from dataclasses import dataclass

from kiln.errors import InvalidArgument, quote

COMPRESSED_TENSORS = "compressed-tensors"
TRANSFORMERS_FP8 = "fp8"
HONOURED_METHODS = (COMPRESSED_TENSORS, TRANSFORMERS_FP8)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 linears."""

    method: str  # compressed-tensors or fp8
    weight_scales: str  # channel, tensor or block
    static_activations: bool  # an input_scale per linear (compressed-tensors' static per-tensor activations)
    block: tuple[int, int] = (0, 0)  # fp8: rows x columns of weight per scale
    ignore: tuple[str, ...] = ()  # modules left unquantized: names, or "re:" patterns (compressed-tensors)

    def ignores(self, module_name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:") and re.match(entry[3:], module_name) or entry == module_name \
                    or module_name.endswith("." + entry):
                return True
        return False

    def scale_names(self) -> tuple[str, ...]:
        """What a quantized linear stores beside ``weight`` (and its bias)."""
        if self.method == TRANSFORMERS_FP8:
            return ("weight_scale_inv",)
        return ("weight_scale", "input_scale") if self.static_activations else ("weight_scale",)

    def scale_shape(self, name: str, out_features: int, in_features: int) -> tuple[int, ...]:
        if name == "weight_scale_inv":
            return (math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1]))
        if name == "weight_scale" and self.weight_scales == "channel":
            return (out_features, 1)
        return (1,)

    def code_factors(self) -> dict:
        """What of the format changes the compiled code: static activations add an input per linear."""
        return {"activations": "static" if self.static_activations else "dynamic"}


def parse(config: object) -> Fp8Checkpoint:
    """A config's ``quantization_config`` (a dict, or transformers' config object), or InvalidArgument naming the
    first field Kiln does not honour."""
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(raw, dict):
        raise _refused("", raw, "is not an object")
    method = raw.get("quant_method")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(raw)
    if method == TRANSFORMERS_FP8:
        return _transformers_fp8(raw)
    raise _refused("quant_method", method, f"honoured: {', '.join(HONOURED_METHODS)} (FP8 only)")


def _refused(field: str, value: object, why: str) -> InvalidArgument:
    name = f"quantization_config.{field}" if field else "quantization_config"
    return InvalidArgument(f"model config {name}={quote(value)}: {why}")


def _expect(raw: dict, field: str, allowed: tuple, prefix: str = "") -> object:
    value = raw.get(field)
    if value not in allowed:
        raise _refused(prefix + field, value, f"honoured: {', '.join(map(repr, allowed))}")
    return value


def _compressed_tensors(raw: dict) -> Fp8Checkpoint:
    _expect(raw, "format", ("float-quantized",))
    _expect(raw, "quantization_status", ("compressed",))
    for field in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if raw.get(field):
            raise _refused(field, raw[field], "not implemented; Kiln serves FP8 linears only")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refused("config_groups", groups, "Kiln serves one config group (every Linear alike)")
    (group_name, group), = groups.items()
    at = f"config_groups.{group_name}."
    if not isinstance(group, dict):
        raise _refused(at[:-1], group, "is not an object")
    if group.get("targets") != ["Linear"]:
        raise _refused(at + "targets", group.get("targets"), "honoured: ['Linear']")
    if group.get("output_activations") is not None:
        raise _refused(at + "output_activations", group["output_activations"], "output quantization is not "
                       "implemented")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refused(at + "weights", weights, "FP8 weights are needed")
    _float8(weights, at + "weights.")
    _expect(weights, "dynamic", (False,), at + "weights.")
    strategy = _expect(weights, "strategy", ("channel", "tensor"), at + "weights.")
    activations = group.get("input_activations")
    if not isinstance(activations, dict):
        raise _refused(at + "input_activations", activations, "weight-only FP8 is not implemented; FP8 "
                       "activations (dynamic or static) are")
    _float8(activations, at + "input_activations.")
    dynamic = _expect(activations, "dynamic", (True, False), at + "input_activations.")
    _expect(activations, "strategy", ("token",) if dynamic else ("tensor",), at + "input_activations.")
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refused("ignore", ignore, "is not a list of module names")
    return Fp8Checkpoint(COMPRESSED_TENSORS, strategy, static_activations=not dynamic, ignore=tuple(ignore))


def _float8(args: dict, at: str) -> None:
    _expect(args, "num_bits", (8,), at)
    _expect(args, "type", ("float",), at)
    _expect(args, "symmetric", (True,), at)
    if args.get("group_size") is not None:
        raise _refused(at + "group_size", args["group_size"], "group scales are not implemented")


# What transformers' FineGrainedFP8Config gives a field its config.json leaves out.
FP8_DEFAULTS = {"activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "float"}


def _transformers_fp8(raw: dict) -> Fp8Checkpoint:
    raw = {**FP8_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    _expect(raw, "activation_scheme", ("dynamic",))
    _expect(raw, "scale_fmt", ("float",))
    if raw.get("dequantize"):
        raise _refused("dequantize", raw["dequantize"], "serve the dequantized weights as a bfloat16 checkpoint")
    if raw.get("modules_to_convert"):
        raise _refused("modules_to_convert", raw["modules_to_convert"], "only the decoder's linears are FP8 in Kiln")
    block = raw["weight_block_size"]
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 1 << 16 for b in block)):
        raise _refused("weight_block_size", block, "two positive integers (rows, columns) are needed")
    ignore = raw.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refused("modules_to_not_convert", ignore, "is not a list of module names")
    return Fp8Checkpoint(TRANSFORMERS_FP8, "block", static_activations=False, block=tuple(block),
                         ignore=tuple(ignore))
