"""`as_strided_scatter` with a correct derivative, for graphs aotgrad differentiates again.

torch's derivative of `as_strided_scatter(self, src, ...)` with respect to `self` (2.11 and 2.13)
passes the gradient of the scattered region, where it should pass the gradient of the rest:
`as_strided_scatter(x, s, [2], [1], 1)` with output gradient `[0, 1, 2, 3]` gives `x` the gradient
`[0, 1, 2, 0]` instead of `[0, 0, 0, 3]`. Eager never differentiates the op itself: an in-place
write through an `as_strided` view records `CopySlices`, whose derivative is right. Functionalization
turns that write into `as_strided_scatter`, so a backward graph that wrote through such a view
(autograd's own backward of an `as_strided` view does) has one, and its second derivative came out
wrong: 4x eager's on fuzz program 29/116 (`a.abs().as_strided((), (), 2).sub_(...)`, then squared).

Before a backward (or recompute) graph is traced again for its derivative, each such node (not one
the program called itself, `node_meta.EXPLICIT_SCATTER`: eager differentiates that with torch's
formula, so aotgrad does too) becomes
`where(mask, as_strided_scatter(zeros_like(self), src, ...), self)`: the same values bit for bit,
and the derivatives of `where` and of the scatter into a tensor that needs none are right.
"""

from __future__ import annotations

import torch
import torch.fx

from ..node_meta import EXPLICIT_SCATTER

aten = torch.ops.aten


def _rewritable(node: torch.fx.Node) -> bool:
    """Only where `zeros_like(self)` addresses the same elements as `self` does: no storage offset
    of its own, dense, non-overlapping (what functional graphs scatter into)."""
    if node.meta.get(EXPLICIT_SCATTER):  # the program called it: eager differentiates torch's formula
        return False
    self_val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(self_val, torch.Tensor):
        return False
    try:
        return self_val.storage_offset() == 0 and self_val.is_contiguous()
    except RuntimeError:  # symbolic sizes that cannot be decided here
        return False


def differentiable_scatters(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` (in place) with each `as_strided_scatter` written so that autograd differentiates it
    correctly."""
    changed = False
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=aten.as_strided_scatter.default)):
        if not _rewritable(node):
            continue
        self_node, src = node.args[0], node.args[1]
        geometry = tuple(node.args[2:]) + tuple(node.kwargs.values())
        with graph.inserting_before(node):
            zeros = graph.call_function(aten.zeros_like.default, (self_node,))
            scattered = graph.call_function(aten.as_strided_scatter.default, (zeros, src, *geometry))
            no = graph.call_function(aten.zeros_like.default, (self_node,), {"dtype": torch.bool})
            yes = graph.call_function(aten.ones_like.default, (src,), {"dtype": torch.bool})
            mask = graph.call_function(aten.as_strided_scatter.default, (no, yes, *geometry))
            out = graph.call_function(aten.where.self, (mask, scattered, self_node))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm
