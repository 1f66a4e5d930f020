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
from torch.fx.passes.reinplace import reinplace as fx_reinplace

log = logging.getLogger("aotgrad.inplace_graphs")

_PASS_META = ("fake_result", "node_idx", "view_of")


def keep_inplace_ops(gm: torch.fx.GraphModule) -> bool:
    """Re-inplace `gm` where safe, in place; return whether it was rewritten.

    The pass propagates the placeholders' fake values (`meta["val"]`); a graph it cannot handle
    (no fake value on an input, an operator it does not know) stays functional, which runs the
    same: logged, never an error."""
    values = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    if any(v is None for v in values):
        log.debug("aotgrad: a graph input has no fake value; graph left functional")
        return False
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    trial = torch.fx.GraphModule(gm, graph)
    try:
        fx_reinplace(trial, *values)
    except Exception as e:  # the functional graph is a correct fallback
        log.debug("aotgrad: torch.fx reinplace failed (%s: %s); graph left functional", type(e).__name__, e)
        return False
    for node in graph.nodes:
        for key in _PASS_META:
            node.meta.pop(key, None)
    changed = [n.target for n in graph.nodes] != [n.target for n in gm.graph.nodes]
    if changed:
        gm.graph = graph
        gm.recompile()
    return changed
