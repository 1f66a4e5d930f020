"""What the traced backward marks for the differentiable backward (higher_order/).

Capture records these facts while it traces; `higher_order/` reads them. They live here, below
both, so the trace does not import the stage built on top of it.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from .tracer import ENGINE_UNPACK, NO_GRAD

# Meta key on the `detach` nodes autograd's backward made of saved values (see `tag_saved_unpacks`).
SAVED_UNPACK = "aotgrad_saved_unpack"


def tag_saved_unpacks(graph: torch.fx.Graph, last_forward: torch.fx.Node | None) -> None:
    """Tag the `detach` nodes autograd made of the values it saved for the backward.

    Capture traces `autograd.grad` without `create_graph`, so a saved tensor reaches its backward
    formula detached: the joint graph's backward reads `detach(detach(tanh))` (one when autograd
    saved the output in the forward, one when the backward unpacked it) where eager's double
    backward reads `tanh` with its history. Tagged: a `detach` recorded after `last_forward` and not
    computed from a tangent; in the forward, the `detach` of a saved output that the program's own
    `autograd.grad(create_graph=True)` unpacked (`tracer.ENGINE_UNPACK`: autograd gave it the
    output's history, the graph does not), and a `detach` that only tagged nodes read. The
    differentiable backward drops them (`_undetach`); the program's own `detach`es stay. trace/cse.py
    keeps tagged and untagged nodes apart."""
    if last_forward is None:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    boundary = order[last_forward]
    from_tangents = set(n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    detach = torch.ops.aten.detach.default
    for node in graph.nodes:
        if order[node] <= boundary:
            continue
        node.meta.pop(NO_GRAD, None)  # the whole backward is traced with grad mode off
        if any(a in from_tangents for a in node.all_input_nodes):
            from_tangents.add(node)
        elif node.op == "call_function" and node.target is detach:
            node.meta[SAVED_UNPACK] = True
    for node in reversed([n for n in graph.nodes if order[n] <= boundary]):
        if node.op != "call_function" or node.target is not detach:
            continue
        if node.meta.get(ENGINE_UNPACK) or (node.users and all(
                u.op != "output" and (order[u] > boundary or u.meta.get(SAVED_UNPACK)) for u in node.users)):
            node.meta[SAVED_UNPACK] = True


_NO_DERIVATIVE = re.compile(r"derivative for (\S+) is not implemented")


def missing_derivative(e: BaseException) -> bool:
    """An operator autograd cannot differentiate: `_call_differentiably` decomposes it and retries,
    so capture must pass the error on as it is (not retry inputs sharing memory as one base)."""
    return _NO_DERIVATIVE.search(str(e)) is not None
