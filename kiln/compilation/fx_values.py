"""What Kiln's compile passes read of a Dynamo graph's nodes: the example tensor Dynamo traced each with, and a node
seen as rows of a width (a view the passes insert, its example set, so that later passes and Inductor see its
shape), and the views and dead chains they look through or erase."""

import operator

import torch


def example_value(node) -> torch.Tensor | None:
    """The tensor Dynamo traced ``node`` with; None for anything else (a constant, a symbolic size, a tuple)."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def as_rows(graph: torch.fx.Graph, node: torch.fx.Node, width: int) -> torch.fx.Node:
    """``node`` as [tokens, width]: itself when 2-D, else a reshape at the graph's insertion point."""
    value = example_value(node)
    if value.dim() == 2:
        return node
    view = graph.call_method("reshape", (node, -1, width))
    with value.fake_mode:
        view.meta["example_value"] = value.reshape(-1, width)
    return view


VIEWS = ("reshape", "view", "contiguous", "unsqueeze", "squeeze", "flatten")
ADDS = (operator.add, torch.add)  # how a traced graph spells a + b
MULS = (operator.mul, torch.mul)


def through_views(node: torch.fx.Node) -> torch.fx.Node:
    """What ``node`` is a chain of views of, where nothing else reads the chain."""
    while node.op == "call_method" and node.target in VIEWS and len(node.users) == 1:
        node = node.args[0]
    return node


def erase_unused(node: torch.fx.Node) -> None:
    """Erase ``node`` and the chain of calls it was made of (views, products, a norm's steps), as far as nothing else
    reads them."""
    pending, erased = [node], set()
    while pending:
        current = pending.pop()
        if current in erased or current.users or current.op not in ("call_function", "call_method"):
            continue
        inputs = current.all_input_nodes
        current.graph.erase_node(current)
        erased.add(current)
        pending.extend(inputs)
