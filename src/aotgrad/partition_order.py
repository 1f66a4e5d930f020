"""The order of the backward graph: each recomputed value made where the backward first needs it.

`extract_graph` copies nodes in joint order, and in the joint graph every forward op comes before
every backward op, so a backward graph that recomputes forward values (min-cut partitions) would
compute all of them at its start and hold them until their last use: its live peak would then be
above eager's, whose autograd engine recomputes nothing and frees each node's saved values as it
goes. `sink_recomputation` keeps the backward's own ops (those reading a tangent) and every op with
a side effect in their order and moves each other op to just before its first user, as the autograd
engine would run them (upstream calls the same idea `reordering_to_mimic_autograd_engine`).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from .capture_state import BACKWARD_MUTATION

__all__ = ["sink_recomputation"]


def _anchored(node: Node, tangent_dependent: set[Node]) -> bool:
    """Ops that keep their place: the backward proper, side effects, random ops (their order is the
    random stream's order)."""
    if node.op != "call_function" or node in tangent_dependent:
        return node.op != "get_attr"
    if node.meta.get(BACKWARD_MUTATION) or node.is_impure():
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def sink_recomputation(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Reorder `gm` (a backward graph) in place so that ops not reading a tangent run just before
    their first user; everything else keeps its relative order. Returns `gm`."""
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    tangents = [n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if not tangents:
        return gm
    dependent: set[Node] = set()
    for n in nodes:  # graph order is topological: one pass marks every descendant
        if n in tangents or any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    emitted: set[Node] = set()
    order: list[Node] = []

    def emit_with_inputs(root: Node) -> None:
        todo, stack = [], [root]
        while stack:
            n = stack.pop()
            if n in emitted or n in todo:
                continue
            todo.append(n)
            stack.extend(a for a in n.all_input_nodes if a not in emitted)
        for n in sorted(todo, key=index.__getitem__):  # the original order is a topological one
            emitted.add(n)
            order.append(n)

    for n in nodes:
        if n.op == "placeholder" or n.op == "output" or _anchored(n, dependent):
            emit_with_inputs(n)
    if order == nodes:
        return gm
    assert len(order) == len(nodes), "aotgrad internal error: backward reordering lost nodes"
    cursor = order[0]
    for n in order[1:]:
        cursor.append(n)
        cursor = n
    graph.lint()
    gm.recompile()
    return gm
