"""Dynamic FP8: a decoder layer's bfloat16 linears made FP8 once, at load, each weight row with its own scale.

Every linear of the layer is quantized (attention's q/k/v and o, the MLP's gate/up and down, whatever a family names
them); the embedding and the head stay in the model's dtype, the head unless asked (``quantize_head``). A merged
group (kiln.model.merged_projections) is quantized projection by projection and merged after (a row's scale is its
own, so it is the same as quantizing the merged matrix).
Layers are quantized one at a time, so a model whose bfloat16 weights would not fit the device loads (a 70B on one
H200): kiln.model.causal_lm materialises, initialises and quantizes each layer in turn.
"""

from collections.abc import Callable

import torch

from kiln.errors import InvalidArgument
from kiln.model.merged_projections import GROUPS
from kiln.quantization.fp8_linear import Fp8Linear, frozen, quantize_rows

# cuBLASLt's FP8 GEMM takes inner and outer sizes that are multiples of 16.
FP8_ALIGNMENT = 16


def quantize_layer(layer: torch.nn.Module, prefix: str = "", static_activations: bool = False,
                   ignores: Callable[[str], bool] = lambda name: False) -> int:
    """Replace every Linear of ``layer`` (but those ``ignores`` names, as ``prefix.name``) by an Fp8Linear, then
    merge its groups; returns how many weights were quantized. The model-dtype weights are released as each is
    replaced. ``static_activations``: each linear gets an input scale of 1 (dummy weights for a model whose
    checkpoint has static activations: its compiled code takes one)."""
    linears = [(parent, name, child) for parent_name, parent in layer.named_modules()
               for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and not ignores(".".join(filter(None, (prefix, parent_name, name))))]
    for parent, name, linear in linears:
        _check_aligned(linear.weight, name)
        weight, scale = quantize_rows(linear.weight.detach())
        setattr(parent, name, Fp8Linear(frozen(weight), frozen(scale), linear.bias,
                                        _input_scale(weight, static_activations)))
    merge_fp8_groups(layer)
    return len(linears)


def _input_scale(weight: torch.Tensor, static: bool) -> torch.nn.Parameter | None:
    return frozen(torch.ones(1, device=weight.device)) if static else None


def _check_aligned(weight: torch.Tensor, name: str, field: str = "config.quantization") -> None:
    out_features, in_features = weight.shape
    if out_features % FP8_ALIGNMENT or in_features % FP8_ALIGNMENT:
        raise InvalidArgument(f"{field}: fp8 needs every linear's sizes to be multiples of "
                              f"{FP8_ALIGNMENT}; {name} is {out_features}x{in_features}")


def merge_fp8_groups(layer: torch.nn.Module) -> int:
    """Give each of the layer's groups of Fp8Linears (q/k/v, gate/up) one weight, as merge_projections does for
    model-dtype linears: weights, row scales and biases stacked; a static input scale, the group's largest (they read
    one input; vLLM takes the largest too). Returns how many groups were merged."""
    merged = 0
    for parent_name, names in GROUPS:
        parent = getattr(layer, parent_name, None)
        parts = [getattr(parent, name, None) for name in names]
        if not all(type(p) is Fp8Linear and p.whole for p in parts) or \
                len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1 or \
                len({p.input_scale is None for p in parts}) != 1:
            continue
        weight = frozen(torch.cat([p.weight.detach() for p in parts]))
        scale = frozen(torch.cat([p.weight_scale.detach() for p in parts]))
        bias = None if parts[0].bias is None else frozen(torch.cat([p.bias.detach() for p in parts]))
        input_scale = None if parts[0].input_scale is None else \
            frozen(torch.stack([p.input_scale.detach().reshape(()) for p in parts]).amax().reshape(1))
        start = 0
        for name, part in zip(names, parts, strict=True):
            setattr(parent, name, Fp8Linear(weight, scale, bias, input_scale, start, start + part.out_features))
            start += part.out_features
        merged += 1
    return merged


def quantize_head(causal_lm: torch.nn.Module) -> None:
    """Make the model's head (its output embeddings) an Fp8Linear: float8 rows with their scales, its input quantized
    per token. A head tied to the embedding gets an FP8 copy of its own; the embedding stays as it is."""
    head = causal_lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise InvalidArgument(f"quantize_head: this model's head is a {type(head).__name__}, not a linear "
                              f"layer Kiln quantizes")
    _check_aligned(head.weight, "lm_head", "quantize_head")
    weight, scale = quantize_rows(head.weight.detach())
    causal_lm.set_output_embeddings(Fp8Linear(frozen(weight), frozen(scale), head.bias, None))
