"""A layer's last residual add taken into the FP8 product before it: ``residual + down(x)`` as ``kiln::fp8_mm`` with
``residual``.

A compiled layer ends with the residual add after its last linear. Nothing after it in the layer's graph reads the
product, so Inductor runs the add as a kernel of its own: one launch of ~15 a decode layer (1.1 µs at batch 1 on an
H100, BENCHMARKS.md). Kiln's FP8 kernel, which runs the decode-sized products, adds the residual in its epilogue
instead, before its one rounding to bf16; past those sizes the op adds it after ``_scaled_mm``, the one kernel
Inductor ran. Only an add that the graph's output alone reads is taken: the add after o feeds the next RMSNorm, and
Inductor already fuses it into that norm's kernel. The product must reach the add through views only (no bias, no
all-reduce of a tensor-parallel shard, no cast), so the fused op computes what the graph did, rounded once.
"""

import torch

from kiln.compilation.fx_values import ADDS, as_rows, example_value
from kiln.quantization.fp8_mm import fp8_mm

_VIEWS = ("reshape", "view")


def fuse_residual_add(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Give each FP8 product of ``gm`` (a Dynamo graph) on ``devices`` the residual added to it where only the
    graph's output reads the sum; returns how many."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    fused = 0
    for add in list(gm.graph.nodes):
        if add.op != "call_function" or add.target not in ADDS or len(add.args) != 2 or add.kwargs \
                or [user.op for user in add.users] != ["output"]:
            continue
        for side, residual in (add.args, tuple(reversed(add.args))):
            product = _product_under(side)
            if product is not None and _fits(product, residual, add, order, devices):
                _fuse(gm.graph, add, side, product, residual)
                fused += 1
                break
    if fused:
        gm.recompile()
    return fused


def _product_under(node) -> torch.fx.Node | None:
    """The ``kiln::fp8_mm`` call (with no residual yet) that ``node`` is a view of, or a dtype no-op of, with nothing
    else reading the chain; else None."""
    while isinstance(node, torch.fx.Node) and len(node.users) == 1:
        if node.op == "call_function" and node.target is fp8_mm:
            return node if len(node.args) == 5 and not node.kwargs else None
        if node.op != "call_method" or node.target not in (*_VIEWS, "to"):
            return None
        if node.target == "to" and not _same_dtype(node, node.args[0]):
            return None
        node = node.args[0]
    return None


def _same_dtype(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    ea, eb = example_value(a), example_value(b)
    return ea is not None and eb is not None and ea.dtype == eb.dtype


def _fits(product: torch.fx.Node, residual, add: torch.fx.Node, order: dict, devices: tuple[str, ...]) -> bool:
    """The residual is a tensor as the sum is (dtype, shape), as many elements as the product, on ``devices``, and
    exists before the product runs. Sizes are compared as their symbols' text: comparing them as symbolic sizes
    would add guards to a graph already traced."""
    out, res, total = example_value(product), example_value(residual), example_value(add)
    return out is not None and res is not None and total is not None and out.device.type in devices \
        and out.dtype == res.dtype == total.dtype and [str(d) for d in res.shape] == [str(d) for d in total.shape] \
        and str(res.numel()) == str(out.numel()) and order[residual] < order[product]


def _fuse(graph: torch.fx.Graph, add: torch.fx.Node, side: torch.fx.Node, product: torch.fx.Node,
          residual: torch.fx.Node) -> None:
    """``product`` takes ``residual`` as rows of its width; the add's readers read ``side`` (the product's views)."""
    with graph.inserting_before(product):
        rows = as_rows(graph, residual, example_value(product).shape[-1])
    product.args = (*product.args, rows)
    add.replace_all_uses_with(side)
    graph.erase_node(add)
