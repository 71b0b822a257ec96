"""An RMSNorm whose output an FP8 product quantizes, run as one op: ``kiln::rms_norm_quantize``, or with the residual
add before the norm ``kiln::add_rms_norm_quantize``.

The norms before q/k/v and gate/up feed only their products' per-token quantize. Inductor fuses the norm, the add
before it and the quantize into one kernel, but as a looped reduction over each row three times (its sum of
squares, the normed row's amax, the float8 values); on CUDA the compile's pass ``route_norm_quantize`` gives the
chain to Kiln's Triton kernel (kiln.quantization.norm_quantize_kernel), which reads each row once. The pass matches
the RMSNorm that transformers' Llama-style families write (float32 variance, ``x * rsqrt(var + eps)`` rounded to the
activation's dtype, times a weight of that dtype); any other norm (Gemma's ``1 + weight``, a norm something else also
reads) is left to Inductor. Elsewhere the ops' code is the same torch ops, so a routed graph computes what the
unrouted one did.
"""

import operator

import torch

from kiln.compilation.fx_values import ADDS, MULS, erase_unused, example_value, through_views
from kiln.dispatcher_op import dispatcher_op
from kiln.quantization.activation_quant import FP8, QUANTIZE_TOKENS, quantize_tokens

MAX_WIDTH = 16384  # widest row the kernel's program holds in registers (Llama-3.1-70B's 8,192 hidden size fits)


def rms_norm_quantize_tokens(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tokens`` of transformers' Llama RMSNorm of ``x`` [..., K] as rows [M, K]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return quantize_tokens((weight * h.to(x.dtype)).reshape(-1, x.shape[-1]))


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    return rows.new_empty(rows.shape, dtype=FP8), rows.new_empty((rows.shape[0], 1), dtype=torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@dispatcher_op("kiln::rms_norm_quantize", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
               lambda x, weight, eps: _quantized_rows(x))
def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_quantize_tokens(x, weight, eps)``: Kiln's Triton kernel on CUDA, the torch ops elsewhere."""
    if x.is_cuda:
        from kiln.quantization.norm_quantize_kernel import rms_norm_quantize_rows  # Triton: only where CUDA runs

        return rms_norm_quantize_rows(_rows(x), weight, eps)[:2]
    return rms_norm_quantize_tokens(x, weight, eps)


def _fake_add(x, residual, weight, eps):
    return *_quantized_rows(x), torch.empty_like(x, memory_format=torch.contiguous_format)


@dispatcher_op("kiln::add_rms_norm_quantize",
               "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)", _fake_add)
def add_rms_norm_quantize(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x + residual`` and ``rms_norm_quantize`` of it: (float8 rows, scales, the sum in x's shape)."""
    if x.is_cuda:
        from kiln.quantization.norm_quantize_kernel import rms_norm_quantize_rows

        q, scale, total = rms_norm_quantize_rows(_rows(x), weight, eps, _rows(residual))
        return q, scale, total.view(x.shape)
    total = x + residual
    return (*rms_norm_quantize_tokens(total, weight, eps), total)


def route_norm_quantize(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Give each per-token quantize of ``gm`` (a Dynamo graph) on ``devices`` whose input is a Llama-style RMSNorm
    (of a residual add, where the add is of two tensors alike) the norm-and-quantize op; returns how many. The norm's
    steps go with it; the add's other readers read the op's sum."""
    routed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in QUANTIZE_TOKENS:
            continue
        norm = _rms_norm(through_views(node.args[0]))
        if norm is None or not _fits(norm, node.args[0], devices):
            continue
        x, weight, eps, chain = norm
        added = _residual_add(x)
        if added is not None and _read_before(x, node, chain):
            continue  # the sum read before the norm's quantize: it cannot come from the op
        with gm.graph.inserting_before(node):
            if added is None:
                fused = gm.graph.call_function(rms_norm_quantize, (x, weight, eps))
            else:
                fused = gm.graph.call_function(add_rms_norm_quantize, (*added, weight, eps))
                total = gm.graph.call_function(operator.getitem, (fused, 2))
                total.meta["example_value"] = example_value(x)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        rows = node.args[0]
        gm.graph.erase_node(node)
        erase_unused(rows)
        if added is not None:
            fused.meta["example_value"] = (*node.meta["example_value"], example_value(x))
            x.replace_all_uses_with(total)
            gm.graph.erase_node(x)
        routed += 1
    if routed:
        gm.recompile()
    return routed


def _read_before(x: torch.fx.Node, node: torch.fx.Node, chain: set) -> bool:
    """Whether a reader of ``x`` outside ``chain`` comes before ``node`` in the graph (as it stands now, with the ops
    earlier matches inserted)."""
    readers = set(x.users) - chain
    for current in x.graph.nodes:
        if current is node:
            return False
        if current in readers:
            return True
    return False


def _call(node, op: str, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == op and node.target in targets


def _other(node: torch.fx.Node, one) -> object | None:
    """The argument of a two-argument ``node`` that is not ``one``."""
    a, b = node.args
    return b if a is one else a if b is one else None


def _rms_norm(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float, set] | None:
    """(x, weight, eps, the norm's nodes) where ``node`` is ``weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) +
    eps)).to(x.dtype)`` with ``h = x.to(float32)`` and nothing else reads a step of it; else None."""
    if not _call(node, "call_function", MULS) or len(node.args) != 2 or len(node.users) != 1:
        return None
    for weight, cast in (node.args, tuple(reversed(node.args))):
        if _call(cast, "call_method", ("to",)) and len(cast.users) == 1 and len(cast.args) == 2 \
                and isinstance(weight, torch.fx.Node):
            break
    else:
        return None
    normed = cast.args[0]
    if not _call(normed, "call_function", MULS) or len(normed.args) != 2 or len(normed.users) != 1:
        return None
    rsqrt = next((a for a in normed.args if _call(a, "call_function", (torch.rsqrt,))), None)
    h = _other(normed, rsqrt) if rsqrt is not None else None
    if h is None or len(rsqrt.users) != 1 or not _call(h, "call_method", ("to",)) or h.args[1:] != (torch.float32,):
        return None
    shifted = rsqrt.args[0]
    if not _call(shifted, "call_function", ADDS) or len(shifted.users) != 1 or len(shifted.args) != 2:
        return None
    variance, eps = shifted.args
    if not isinstance(eps, float) or not _call(variance, "call_method", ("mean",)) or len(variance.users) != 1 \
            or variance.args[1:] != (-1,) or variance.kwargs != {"keepdim": True}:
        return None
    square = variance.args[0]
    if not _call(square, "call_method", ("pow",)) or square.args != (h, 2) or len(square.users) != 1 \
            or set(h.users) != {square, normed}:
        return None
    x = h.args[0]
    if not isinstance(x, torch.fx.Node) or cast.args[1] != getattr(example_value(x), "dtype", None):
        return None
    return x, weight, eps, {node, cast, normed, rsqrt, shifted, variance, square, h}


def _fits(norm: tuple, rows: torch.fx.Node, devices: tuple[str, ...]) -> bool:
    """x on ``devices``, its last dimension contiguous and the rows' width, at most MAX_WIDTH; the weight [width] of
    x's dtype."""
    x, weight, _, _ = norm
    value, w, out = example_value(x), example_value(weight), example_value(rows)
    if value is None or w is None or out is None or not isinstance(value.shape[-1], int):
        return False
    width = value.shape[-1]
    return value.device.type in devices and value.stride(-1) == 1 and width <= MAX_WIDTH \
        and w.dtype == value.dtype and tuple(w.shape) == (width,) and out.shape[-1] == width


def _residual_add(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b) where ``x`` is ``a + b`` of two tensors of x's shape and dtype; else None."""
    if not _call(x, "call_function", ADDS) or len(x.args) != 2 or x.kwargs:
        return None
    values = [example_value(a) for a in x.args]
    total = example_value(x)
    if any(v is None or v.dtype != total.dtype or [str(d) for d in v.shape] != [str(d) for d in total.shape]
           or v.stride(-1) != 1 for v in values):
        return None
    return x.args
