"""Projections that read the same input, kept as one weight matrix: attention's q/k/v, the MLP's gate/up.

A decode step multiplies a few rows by each weight matrix, so its time is reading the weights plus a fixed cost per
GEMM: on the H200 cuBLAS reads Llama-3-8B's k and v projections at ~38 % of the bandwidth and adds split-K
reductions (BENCHMARKS.md, the per-layer kernel table). With a group's weights in one matrix, each projection module
becomes a slice of the group's product; in a compiled layer the group's identical products are one GEMM
(``merge_identical_linears``), as vLLM's merged linear layers and gpt-fast's ``wqkv`` are. Eager runs (the memory
profile, the eager runtime mode) multiply by each projection's own rows, as before.
"""

import torch
import torch.nn.functional as F

from kiln.quantization.activation_quant import QUANTIZE_TOKENS
from kiln.quantization.fp8_mm import fp8_mm

# (the layer's submodule, its projections that read one input), as transformers' dense decoders name them.
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class ProjectionSlice(torch.nn.Module):
    """Rows ``start:end`` of a group's merged weight (and bias): the projection that used to own them."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, start: int, end: int):
        super().__init__()
        self.weight = weight  # the group's Parameter, shared by its slices like tied embeddings
        self.bias = bias
        self.start, self.end = start, end
        self.in_features, self.out_features = weight.shape[1], end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the group's one product, sliced: merge_identical_linears keeps one
            return F.linear(x, self.weight, self.bias)[..., self.start:self.end]
        bias = None if self.bias is None else self.bias[self.start:self.end]
        return F.linear(x, self.weight[self.start:self.end], bias)


def merge_projections(layers: list[torch.nn.Module]) -> int:
    """Give each decoder layer's groups one weight; returns how many groups were merged. A group is merged only where
    its modules are plain Linears over the same input size, dtype and device, all with a bias or none."""
    merged = 0
    for layer in layers:
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            projections = [getattr(parent, name, None) for name in names]
            if not _mergeable(projections):
                continue
            weight = torch.nn.Parameter(torch.cat([p.weight.detach() for p in projections]), requires_grad=False)
            bias = None
            if projections[0].bias is not None:
                bias = torch.nn.Parameter(torch.cat([p.bias.detach() for p in projections]), requires_grad=False)
            start = 0
            for name, projection in zip(names, projections, strict=True):
                end = start + projection.out_features
                setattr(parent, name, ProjectionSlice(weight, bias, start, end))
                start = end
            merged += 1
    return merged


def _mergeable(projections: list) -> bool:
    if not all(type(p) is torch.nn.Linear for p in projections):
        return False
    first = projections[0]
    return all(p.in_features == first.in_features and p.weight.dtype == first.weight.dtype
               and p.weight.device == first.weight.device and (p.bias is None) == (first.bias is None)
               for p in projections)


def merge_identical_linears(gm: torch.fx.GraphModule) -> int:
    """Make the graph's identical products one: ``linear`` calls on the same input, weight and bias, and FP8 products
    with the activation quantize before them (kiln.quantization.fp8_linear); returns how many calls went.

    A group's slices each ask for the group's whole product (ProjectionSlice, Fp8Linear); this leaves one GEMM per
    group. Neither Dynamo nor Inductor does it: an FP8 group traced without this pass runs three ``_scaled_mm``.
    The pass is common-subexpression elimination over the graph's pure calls, in order, so a quantize chain is one
    before the products that read it are compared."""
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if not _pure(node):
            continue
        signature = (node.op, node.target, node.args, tuple(sorted(node.kwargs.items())))
        try:
            first = seen.setdefault(signature, node)
        except TypeError:  # an argument that cannot be hashed (a list of tensors' sizes is fine; a slice is not)
            signature = (node.op, node.target, repr(node.args), repr(sorted(node.kwargs.items())))
            first = seen.setdefault(signature, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            removed += node.target in LINEAR_TARGETS
    if removed:
        gm.recompile()
    return removed


LINEAR_TARGETS = (F.linear, torch._C._nn.linear, torch._scaled_mm, fp8_mm)
# Custom ops whose result is a function of their arguments alone: the FP8 product and the quantize before it.
_PURE_OPS = (*LINEAR_TARGETS, *QUANTIZE_TOKENS)
# Calls whose result is not a function of their arguments alone: random numbers, and ops that read state.
_STATEFUL = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "seed", "grad", "autocast")
# The operator module's functions that change their first argument (``x += y`` on a tensor traces to iadd).
_MUTATING_OPERATORS = frozenset({"setitem", "delitem", "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imod",
                                 "imul", "imatmul", "ior", "ipow", "irshift", "isub", "itruediv", "ixor"})


def _pure(node: torch.fx.Node) -> bool:
    """Whether two calls of ``node``'s target on the same arguments are the same value: torch and operator functions
    and tensor methods, not in-place (a trailing underscore), not random, no custom op but the FP8 product and
    quantize (the attention op reads the step's KV cache)."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        module = getattr(node.target, "__module__", "") or ""
        if node.target not in _PURE_OPS and (
                isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
                or not module.startswith(("torch", "_operator"))):
            return False
        if node.is_impure() or name in _MUTATING_OPERATORS:
            return False
    else:
        return False
    return not name.endswith("_") and not any(word in name for word in _STATEFUL)
