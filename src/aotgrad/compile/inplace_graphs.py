"""`disable_functionalization=True`: hand compilers graphs that keep the program's in-place ops.

Upstream traces without functionalization when asked, so its compilers see `add_`, `relu_`, ...
aotgrad always traces functionally (its mutation and aliasing analysis needs it) and, when the
keyword is given, re-inplaces each graph just before its compiler gets it, with torch's own
`torch.fx.passes.reinplace`: an out-of-place op whose first argument (and every alias of it) is
not read afterwards and is not a graph input becomes its in-place variant. What the program did to
its inputs is still done by the run time's epilogue, so results are unchanged.

The pass also re-inplaces out-of-place ops the program wrote that way (it cannot tell them apart):
that is what upstream's pass does too, and what Inductor does on its own.
"""

from __future__ import annotations

import logging

import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.fx.passes.reinplace import reinplace as fx_reinplace

log = logging.getLogger("aotgrad.inplace_graphs")

_PASS_META = ("fake_result", "node_idx", "view_of")


def keep_inplace_ops(gm: torch.fx.GraphModule) -> bool:
    """Re-inplace `gm` where safe, in place; return whether it was rewritten.

    The pass propagates the placeholders' fake values (`meta["val"]`). It does not check everything
    an in-place op needs: its result must have the out-of-place result's shape, dtype and strides
    (no broadcasting into `self`), `self` must not overlap itself (an expanded tensor) nor share memory
    with another argument. Nodes it rewrote against that are hidden from it and the pass is run
    again. A graph it cannot handle stays functional, which runs the same: logged, never an error."""
    values = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    if any(v is None for v in values):
        log.debug("aotgrad: a graph input has no fake value; graph left functional")
        return False
    hidden: set[str] = set()
    for _ in range(_MAX_TRIES):
        graph = _reinplaced_copy(gm, values, hidden)
        if graph is None:
            return False
        bad = {n.name for n in graph.nodes if n.name not in hidden and _unsafe_rewrite(n, gm)}
        if not bad:
            break
        hidden |= bad
    else:
        log.debug("aotgrad: re-inplacing kept producing unsafe in-place ops; graph left functional")
        return False
    for node in graph.nodes:
        if isinstance(node.target, _Hidden):
            node.target = node.target.op
        for key in _PASS_META:
            node.meta.pop(key, None)
    changed = [n.target for n in graph.nodes] != [n.target for n in gm.graph.nodes]
    if changed:
        gm.graph = graph
        gm.recompile()
    return changed


_MAX_TRIES = 4


class _Hidden:
    """An op the pass must leave alone: not an OpOverload, so it finds no in-place variant."""

    def __init__(self, op):
        self.op = op
        self.__name__ = getattr(op, "__name__", "hidden")

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def _reinplaced_copy(gm: torch.fx.GraphModule, values: list, hidden: set[str]) -> torch.fx.Graph | None:
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for node in graph.nodes:
        if node.name in hidden:
            node.target = _Hidden(node.target)
    try:
        fx_reinplace(torch.fx.GraphModule(gm, graph), *values)
    except Exception as e:  # the functional graph is a correct fallback
        log.debug("aotgrad: torch.fx reinplace failed (%s: %s); graph left functional", type(e).__name__, e)
        return None
    return graph


def _unsafe_rewrite(node: torch.fx.Node, original: torch.fx.GraphModule) -> bool:
    """Whether the pass turned `node` into an in-place op that does not compute what it did."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if not node.target._schema.is_mutable or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    before = next((n for n in original.graph.nodes if n.name == node.name), None)
    if before is None or before.target is node.target:
        return False  # in place in the program's graph already (copy_ into an input...)
    out = node.meta.get("val")
    target = node.args[0].meta.get("fake_result")
    if not isinstance(out, torch.Tensor) or not isinstance(target, torch.Tensor):
        return True
    if (out.shape, out.dtype, out.stride()) != (target.shape, target.dtype, target.stride()):
        return True
    if not is_non_overlapping_and_dense(target):
        return True
    # Aliasing as the rewritten graph has it (the pass rewires later reads to `self`): another
    # argument that is `self` or a view of the same buffer may overlap what the op writes.
    root = _buffer_of(node.args[0])
    return any(_buffer_of(arg) is root for arg in node.all_input_nodes[1:])


def _buffer_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose buffer `node` is, through views and in-place ops (which return `self`)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
        returns = node.target._schema.returns
        if not returns or returns[0].alias_info is None or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node
