"""What Kiln's compile passes read of a Dynamo graph's nodes: the example tensor Dynamo traced each with, and a node
seen as rows of a width (a view the passes insert, its example set, so that later passes and Inductor see its
shape)."""

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
