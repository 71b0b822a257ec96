"""The rotary embedding of q and k taken into Kiln's attention op: ``kiln::attention(..., cos=, sin=)``.

transformers' Llama-style families rotate q and k (``x * cos + rotate_half(x) * sin``) in the piece before the
attention op, which Inductor runs as two kernels of its own (q's and k's); the op then launches a third that writes k
and v into the cache. On CUDA the compile's pass ``route_rotary`` gives the op q and k before their rotation and the
rotary tables, and the KV write's kernel rotates them as it reads them (kiln.attention.triton_kernels.write_kv): two
kernels fewer a layer, and k read once. The pass matches transformers' ``apply_rotary_pos_emb`` over the whole head
(cos and sin [1, T, D], halves rotated); any other form (a partial rotary, interleaved pairs, tables of another
shape) stays in the graph. Elsewhere the op rotates with ``rotate``, the same torch ops in the same order, so a routed
graph computes what the unrouted one did.
"""

import operator

import torch

from kiln.compilation.fx_values import ADDS, MULS, erase_unused, example_value


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` of ``x`` [T, H, D] at tables ``cos``/``sin`` [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def route_rotary(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Give each ``kiln::attention`` call of ``gm`` (a Dynamo graph) on ``devices`` whose q and k are both rotated
    by transformers' ``apply_rotary_pos_emb`` at the same tables its q and k before the rotation, and the tables;
    returns how many. The rotations' steps go, where nothing else reads them."""
    routed, attention = 0, (torch.ops.kiln.attention, torch.ops.kiln.attention.default)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in attention or len(node.args) < 2 or "cos" in node.kwargs:
            continue
        q, k = _rotated(_head_major(node.args[0])), _rotated(_head_major(node.args[1]))
        if q is None or k is None or q[1:] != k[1:] or not _on(q[0], devices):
            continue
        old_q, old_k = node.args[0], node.args[1]
        with gm.graph.inserting_before(node):
            new_q, new_k = _token_major(gm.graph, q[0]), _token_major(gm.graph, k[0])
            cos, sin = (_first(gm.graph, table) for table in q[1:])
        node.args = (new_q, new_k, *node.args[2:])
        node.kwargs = {**node.kwargs, "cos": cos, "sin": sin}
        erase_unused(old_q)
        erase_unused(old_k)
        routed += 1
    if routed:
        gm.recompile()
    return routed


def _head_major(node) -> torch.fx.Node | None:
    """X where ``node`` is ``X[0].transpose(0, 1)`` (the op's [T, H, D] of transformers' [1, H, T, D]), read by
    nothing else; else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "transpose"
            and tuple(node.args[1:]) == (0, 1) and len(node.users) == 1):
        return None
    first = node.args[0]
    if not (first.op == "call_function" and first.target is operator.getitem and first.args[1] == 0
            and len(first.users) == 1):
        return None
    return first.args[0]


def _rotated(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, cos, sin) where ``node`` is ``x * cos.unsqueeze(1) + cat((-x[..., D/2:], x[..., :D/2]), -1) *
    sin.unsqueeze(1)``, x [1, H, T, D] and the tables [1, T, D] of its dtype, read by nothing but the sum; else None."""
    if node is None or node.op != "call_function" or node.target not in ADDS or len(node.args) != 2:
        return None
    for straight, turned in (node.args, tuple(reversed(node.args))):
        turned_parts = _product(turned)
        if turned_parts is None:
            continue
        for half_turn, sin in (turned_parts, tuple(reversed(turned_parts))):
            x = _turned_half(half_turn)
            straight_parts = _product(straight)
            if x is None or straight_parts is None or x not in straight_parts:
                continue
            cos = straight_parts[1] if straight_parts[0] is x else straight_parts[0]
            tables = _table(cos), _table(sin)
            if None not in tables and _fits(x, *tables):
                return x, *tables
    return None


def _product(node) -> tuple | None:
    """The two factors of ``node`` where it is a product read only once; else None."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in MULS \
            and len(node.args) == 2 and not node.kwargs and len(node.users) == 1:
        return node.args
    return None


def _turned_half(node) -> torch.fx.Node | None:
    """x where ``node`` is ``cat((-x[..., D/2:], x[..., :D/2]), dim=-1)`` (transformers' ``rotate_half``)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.cat
            and len(node.users) == 1):
        return None
    parts = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not (isinstance(parts, (tuple, list)) and len(parts) == 2 and dim == -1):
        return None
    negated, first = parts
    if not (negated.op == "call_function" and negated.target is operator.neg):
        return None
    second = negated.args[0]
    x, value = _slice_of(second), example_value(first)
    if x is None or _slice_of(first) is not x or value is None:
        return None
    half = example_value(x).shape[-1] // 2
    return x if (_bounds(second) == (half, None) and _bounds(first) == (None, half)) else None


def _slice_of(node) -> torch.fx.Node | None:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple) \
            and len(node.args[1]) == 2 and node.args[1][0] is Ellipsis and isinstance(node.args[1][1], slice):
        return node.args[0]
    return None


def _bounds(node) -> tuple:
    cut = node.args[1][1]
    return (cut.start if cut.start else None, cut.stop) if cut.step in (None, 1) else ("step",)


def _table(node) -> torch.fx.Node | None:
    """T where ``node`` is ``T.unsqueeze(1)``."""
    if isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "unsqueeze" \
            and tuple(node.args[1:]) == (1,):
        return node.args[0]
    return None


def _fits(x: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node) -> bool:
    """x [1, H, T, D] with D even, the tables [1, T, D] of its dtype and device."""
    value, tables = example_value(x), (example_value(cos), example_value(sin))
    if value is None or None in tables or value.dim() != 4 or value.shape[0] != 1 or value.shape[-1] % 2:
        return False
    return all(t.dim() == 3 and t.shape[0] == 1 and t.shape[-1] == value.shape[-1] and t.dtype == value.dtype
               and t.device == value.device for t in tables)


def _on(x: torch.fx.Node, devices: tuple[str, ...]) -> bool:
    return example_value(x).device.type in devices


def _token_major(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """``x[0].transpose(0, 1)``: [1, H, T, D] as the op's [T, H, D]."""
    first = graph.call_function(operator.getitem, (x, 0))
    turned = graph.call_method("transpose", (first, 0, 1))
    value = example_value(x)
    with value.fake_mode:
        first.meta["example_value"] = value[0]
        turned.meta["example_value"] = value[0].transpose(0, 1)
    return turned


def _first(graph: torch.fx.Graph, table: torch.fx.Node) -> torch.fx.Node:
    """``table[0]``: [1, T, D] as [T, D]."""
    first = graph.call_function(operator.getitem, (table, 0))
    value = example_value(table)
    with value.fake_mode:
        first.meta["example_value"] = value[0]
    return first
