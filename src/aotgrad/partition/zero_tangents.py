"""Backward graphs specialised for outputs that get no gradient.

When only some outputs of a compiled function get a gradient (a model returning the loss and the
logits, of which only the loss is backpropagated; a differentiable backward whose weight gradients
`autograd.grad(..., inputs=x)` discards), autograd gives the others None, and the backward graph
gets zeros for them: it then multiplies those zeros through matmuls and adds the results. Eager
does the same work only where its own formulas materialise zeros; in a force-field step the
zeros cost four of the step's 27 large matmuls.

`specialise(gm, zero)` copies the backward graph with the tangents at `zero` known to be zero,
propagates that through the operators where the result is known (a product with zero is zero, a
sum with zero is the other operand, a view or reduction of zero is zero) and drops what no output
reads any more. The run time compiles one such graph per set of None tangents (compile/compile.py) and
keeps the calling convention: the zero tangents are still passed, and ignored.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

log = logging.getLogger("aotgrad.zero_tangents")

aten = torch.ops.aten
prims = torch.ops.prims

# Zero whenever any tensor argument is zero (products).
_PRODUCTS = {aten.mm.default, aten.bmm.default, aten.mul.Tensor, aten.matmul.default, aten.dot.default}
# Zero when the first argument is zero: the result is linear in it (views, reductions, casts, and
# the backward formulas whose first argument is the incoming gradient).
_LINEAR_IN_FIRST = {
    aten.neg.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.clone.default,
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten._to_copy.default, prims.convert_element_type.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.cumsum.default, aten.silu_backward.default,
    aten.threshold_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
    aten.gelu_backward.default, aten.native_dropout_backward.default, aten.index_select.default,
    aten.unsqueeze_copy.default, aten.view_copy.default, aten.permute_copy.default, aten.t_copy.default,
    aten.expand_copy.default, aten.squeeze_copy.dim, aten.detach.default,
}
_SUMS = {aten.add.Tensor, aten.sub.Tensor}


def _static(val) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in (*val.shape, *val.stride()))


def _same_meta(a, b) -> bool:
    return (_static(a) and _static(b) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and a.stride() == b.stride())


def specialise(gm: torch.fx.GraphModule, zero: set[int]) -> torch.fx.GraphModule | None:
    """A copy of `gm` with the placeholders at positions `zero` known to be zero, simplified; None
    when that removes no operator (the plain backward then serves) or a size is symbolic."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    placeholders = graph.find_nodes(op="placeholder")
    zeros = {placeholders[k] for k in zero}
    if not all(_static(p.meta.get("val")) for p in zeros):
        return None
    before = _work(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        known = [a for a in node.all_input_nodes if a in zeros]
        if not known:
            continue
        val = node.meta.get("val")
        first = node.args[0] if node.args else None
        if node.target in _PRODUCTS or (node.target in _LINEAR_IN_FIRST and first in zeros):
            if _static(val):
                zeros.add(node)
            continue
        if node.target in _SUMS and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
            a, b = node.args
            other = b if a in zeros else a
            if a in zeros and b in zeros and _static(val):
                zeros.add(node)
            elif other is b and node.target is aten.sub.Tensor:
                continue  # 0 - b: not worth a neg
            elif isinstance(other, torch.fx.Node) and _same_meta(other.meta.get("val"), val):
                node.replace_all_uses_with(other, propagate_meta=False)
    _materialise(graph, zeros)
    graph.eliminate_dead_code()
    after = _work(graph)
    if after >= before:
        return None
    log.debug("backward specialised for zero tangents %s: %d -> %d operators", sorted(zero), before, after)
    return torch.fx.GraphModule(gm, graph)


_FACTORIES = {aten.full.default, aten.empty_strided.default, aten.fill.Scalar}


def _work(graph: torch.fx.Graph) -> int:
    """Operators other than the zero factories `_materialise` adds."""
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target not in _FACTORIES)


def _materialise(graph: torch.fx.Graph, zeros: set[torch.fx.Node]) -> None:
    """Where a zero value is still read (by an operator not simplified above, or the output), read a
    freshly made zero tensor of its size, dtype, device and strides instead."""
    for node in zeros:
        if node.op == "placeholder":
            continue
        users = [u for u in node.users if u not in zeros]
        if not users:
            continue
        val = node.meta["val"]
        factory = {"dtype": val.dtype, "device": val.device, "pin_memory": False}
        with graph.inserting_after(node):
            if val.is_contiguous():
                z = graph.call_function(aten.full.default, (list(val.shape), 0), factory)
            else:
                z = graph.call_function(aten.empty_strided.default, (list(val.shape), list(val.stride())), factory)
                z.meta["val"] = val
                with graph.inserting_after(z):
                    z = graph.call_function(aten.fill.Scalar, (z, 0))
        z.meta["val"] = val
        for u in users:
            u.replace_input_with(node, z)
