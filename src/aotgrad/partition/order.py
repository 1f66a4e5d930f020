"""The order of the backward graph: each recomputed value made where the backward first needs it.

`extract_graph` copies nodes in joint order, and in the joint graph every forward op comes before
every backward op, so a backward graph that recomputes forward values (min-cut partitions) would
compute all of them at its start and hold them until their last use: its live peak would then be
above eager's, whose autograd engine recomputes nothing and frees each node's saved values as it
goes. `sink_recomputation` keeps the backward's own ops (those reading a tangent) and every op with
a side effect in their order and moves each other op to just before its first user, as the autograd
engine would run them (upstream calls the same idea `reordering_to_mimic_autograd_engine`).
Then a recomputed pointwise value read again late (a chain's link, read at once to make the next
link and late by its own derivative) is made again just before that late read, where its inputs are
alive there anyway, instead of being held in between (`_remake_for_late_users`).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from ..trace.state import BACKWARD_MUTATION
from .ops import op_class

__all__ = ["REMADE_FROM", "sink_recomputation"]

# meta key of a value `_remake_for_late_users` made again: the name of the node it copies (the
# recomputed forward op: a count of the backward's recomputation counts the copies too).
REMADE_FROM = "aotgrad_remade_from"


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
    their first user; everything else keeps its relative order; then remake cheap recomputed values
    for their late users (`_remake_for_late_users`). Returns `gm`."""
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
    assert len(order) == len(nodes), "aotgrad internal error: backward reordering lost nodes"
    moved = order != nodes
    if moved:
        cursor = order[0]
        for n in order[1:]:
            cursor.append(n)
            cursor = n
    if _remake_for_late_users(graph, dependent) or moved:
        graph.lint()
        gm.recompile()
    return gm


def _remakeable(node: Node, dependent: set[Node]) -> bool:
    """A recomputed pointwise op with one tensor output: cheap to run again, its own storage."""
    return (node.op == "call_function" and node not in dependent and len(node.users) > 1
            and isinstance(node.meta.get("val"), torch.Tensor) and op_class(node) == "pointwise"
            and not _anchored(node, dependent))


def _remake_for_late_users(graph: torch.fx.Graph, dependent: set[Node]) -> bool:
    """Give the late users of a recomputed pointwise value their own copy of it, made just before
    them, where every input of the op is alive there anyway (read at or after that point).

    A recomputed chain (x -> sin -> cos -> ... in the forward) reads each link twice: at once, to
    make the next link, and late, where the backward reaches the link's own derivative. Held from
    the first read to the last, every link of the chain is alive when the backward starts on it:
    twice the bytes where the op's input would serve, since that input is kept for the backward's
    own late read. Made again from it, the value lives only around its late read. Only where
    backward work (an op reading a tangent) runs between two reads: the copy costs one pointwise op."""
    nodes = list(graph.nodes)
    pos: dict[Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    work_before = [0]
    for n in nodes:
        work_before.append(work_before[-1] + (n in dependent))

    def backward_work_between(a: Node, b: Node) -> bool:
        return work_before[int(pos[b])] - work_before[int(pos[a]) + 1] > 0

    def alive_at(value: Node, user: Node, skip: set[Node]) -> bool:
        if value.op == "get_attr":
            return True
        return any(w not in skip and pos[w] >= pos[user] for w in value.users)

    changed = False
    for n in nodes:
        if not _remakeable(n, dependent):
            continue
        users = sorted(n.users, key=pos.__getitem__)
        holder, copies = n, {n}
        for prev, u in zip(users, users[1:]):
            if not backward_work_between(prev, u):
                continue
            if not all(alive_at(a, u, copies) for a in n.all_input_nodes):
                continue
            with graph.inserting_before(u):
                copy = graph.node_copy(n)
            copy.meta = {**n.meta, REMADE_FROM: n.meta.get(REMADE_FROM, n.name)}
            pos[copy] = pos[u] - 0.5
            for w in users[users.index(u):]:
                w.replace_input_with(holder, copy)
            holder = copy
            copies.add(copy)
            changed = True
    return changed
