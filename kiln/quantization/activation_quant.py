"""The per-token FP8 quantize of an FP8 linear's input, and which kernel runs it in a compiled layer.

``kiln::quantize_tokens`` is composite: compiled, it decomposes into the torch ops of ``quantize_tokens``, which
Inductor fuses into the kernel that makes the activation (the RMSNorm before q/k/v and gate/up). Two producers leave
that fusion nothing to gain and Inductor a slow kernel: SiLU(gate) × up before down, which Inductor writes as an amax
reduction and a second pass over the row (on the H200, 139 µs a layer for a 2,048-token prefill of Llama-3-8B, where
the bytes need ~35; BENCHMARKS.md), and the output of an op it cannot see into (the attention, before o). On CUDA the
compile's pass ``route_activation_quantize`` gives those two ``kiln::quantize_kernel``, Kiln's Triton kernel
(kiln.quantization.quantize_kernel), one program a token. Elsewhere the graph is left as it was; the op's own CPU
code is the torch ops.
"""

import operator

import torch
import torch.nn.functional as F

from kiln.compilation.fx_values import MULS, as_rows, erase_unused, example_value, through_views
from kiln.dispatcher_op import dispatcher_op

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest activation scale: a row of zeros quantizes to zeros instead of 0/0 (vLLM's bound as well).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (float8 [M, K], float32 scale [M, 1]), one scale per token (row)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) × up in float32, as Inductor's fused kernel computes it before the quantize (not rounded to the
    activation's dtype between the ops, as eager rounds them)."""
    return F.silu(gate.float()) * up.float()


torch.library.define("kiln::quantize_tokens", "(Tensor x) -> (Tensor, Tensor)")
torch.library.impl("kiln::quantize_tokens", "CompositeImplicitAutograd")(quantize_tokens)


def _fake(x, up):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@dispatcher_op("kiln::quantize_kernel", "(Tensor x, Tensor? up) -> (Tensor, Tensor)", _fake)
def quantize_kernel(x: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tokens(x)``, or with ``up`` ``quantize_tokens(silu_mul(x, up))``, for 2-D ``x`` (and ``up``) whose
    rows are contiguous: Kiln's Triton kernel on CUDA, the torch ops elsewhere."""
    if x.is_cuda:
        from kiln.quantization.quantize_kernel import quantize_rows_fp8  # Triton: only where CUDA runs

        return quantize_rows_fp8(x, up)
    return quantize_tokens(x if up is None else silu_mul(x, up))


QUANTIZE_TOKENS = (torch.ops.kiln.quantize_tokens, torch.ops.kiln.quantize_tokens.default)


def route_activation_quantize(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Give ``kiln::quantize_kernel`` each per-token quantize of ``gm`` (a Dynamo graph) on ``devices`` whose input is
    SiLU(gate) × up or an opaque op's output (a custom op, a graph input); returns how many. The SiLU and product
    nodes go with it where nothing else reads them."""
    routed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in QUANTIZE_TOKENS:
            continue
        rows = node.args[0]
        if not _matrix_on(rows, devices):
            continue
        source = through_views(rows)
        glu = _silu_mul_operands(source)
        if glu is not None and not _same_rows(glu, rows):
            glu = None
        if glu is None and not _opaque(source):
            continue
        with gm.graph.inserting_before(node):
            args = (rows, None) if glu is None else tuple(as_rows(gm.graph, g, _shape(rows)[-1]) for g in glu)
            fused = gm.graph.call_function(quantize_kernel, args)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        erase_unused(rows)
        routed += 1
    if routed:
        gm.recompile()
    return routed


def _shape(node) -> tuple:
    return tuple(example_value(node).shape)


def _matrix_on(node, devices: tuple[str, ...]) -> bool:
    value = example_value(node)
    return value is not None and value.dim() == 2 and value.device.type in devices and value.stride(-1) == 1


def _same_rows(operands: tuple[torch.fx.Node, torch.fx.Node], rows: torch.fx.Node) -> bool:
    """Whether gate and up have one shape, rows contiguous in their last dimension, as wide as ``rows``: their
    product reshaped is ``rows``, so each reshaped to rows of that width is the kernel's operand."""
    values = [example_value(operand) for operand in operands]
    return isinstance(_shape(rows)[-1], int) and all(v is not None and v.stride(-1) == 1 for v in values) and \
        [str(d) for d in values[0].shape] == [str(d) for d in values[1].shape] and \
        str(values[0].shape[-1]) == str(_shape(rows)[-1]) and values[0].device == example_value(rows).device


def _silu_mul_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(gate, up) where ``node`` is ``silu(gate) * up`` (either order) and nothing else reads the SiLU."""
    if node.op != "call_function" or node.target not in MULS or len(node.users) != 1:
        return None
    for silu, up in (node.args, reversed(node.args)):
        if isinstance(silu, torch.fx.Node) and silu.op == "call_function" and silu.target is F.silu \
                and len(silu.users) == 1 and not silu.kwargs.get("inplace") and isinstance(up, torch.fx.Node):
            return silu.args[0], up
    return None


def _opaque(node: torch.fx.Node) -> bool:
    """Whether Inductor has no kernel to fuse the quantize into: a graph input, or a custom op's result (an item of
    its outputs included)."""
    if node.op == "placeholder":
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket) \
        and str(node.target).split(".")[0] not in ("aten", "prims")
