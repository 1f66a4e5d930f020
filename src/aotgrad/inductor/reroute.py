"""One FX call swapped for another: how `cpu_scatter.py` and `avg_pool_backward.py` send an op
Inductor would compile wrongly to a custom op that calls aten."""

from __future__ import annotations

import torch.fx


def replace_call(gm: torch.fx.GraphModule, node: torch.fx.Node, target, args: tuple) -> torch.fx.Node:
    """`target(*args)` in `node`'s place, with its metadata (the fake value Inductor plans from)."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new
