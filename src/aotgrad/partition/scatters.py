"""Gradient scatters accumulated into one buffer instead of summed from one buffer each.

Decomposed, `select_backward` (Inductor's table) scatters the gradient of `x[i]` into a fresh zero
tensor of `x`'s size, and the backward sums those tensors where `x` was read more than once:
attention's `q, k, v = qkv[0], qkv[1], qkv[2]` gives `add(add(scatter(zeros, dq, 0), scatter(zeros,
dk, 1)), scatter(zeros, dv, 2))`, two or three buffers of the whole `qkv` alive at once. Eager's
kernel accumulates the three slices into one. When the scattered slices are distinct, each summand
is zero wherever the other wrote, so the sum is the second scatter applied to the first:
`scatter(scatter(zeros, dq, 0), dk, 1)`, one buffer replaced by the next (`nest_zero_scatters`).

Rewritten only where that is exact: `select_scatter` chains on a zero factory (`full(.., 0)` or
`zeros`, through `alias`), both along the same constant dim, at constant indices no two alike,
summed by a plain `add` (alpha 1) of operands with the add's own shape, dtype, device and contiguous
strides. The only difference is the sign of a zero (`0 + -0.0` is `+0.0`, a scatter keeps `-0.0`).
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch.fx import Node

log = logging.getLogger("aotgrad.partition.scatters")

aten = torch.ops.aten

__all__ = ["nest_zero_scatters"]


def _static_tensor(node: object) -> torch.Tensor | None:
    """The node's value where it is a tensor with concrete sizes and strides, else None."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor) or val.layout is not torch.strided:
        return None
    if not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
        return None
    return val


def _zero_factory(node: Node) -> bool:
    """`full(size, 0)` or `zeros(size)`, possibly behind `alias` (a decomposition's `new_zeros`)."""
    while node.op == "call_function" and node.target is aten.alias.default:
        node = node.args[0]
    if node.op != "call_function":
        return False
    if node.target is aten.zeros.default:
        return True
    return node.target is aten.full.default and len(node.args) == 2 and node.args[1] == 0 \
        and not isinstance(node.args[1], bool)


def _scatter_chain(node: object) -> tuple[int, list[tuple[Node, int]]] | None:
    """(dim, [(source, index), ...] in scatter order) where `node` is a chain of `select_scatter`s
    onto a zero factory, all along one constant dim at distinct constant indices; else None."""
    if not isinstance(node, Node):
        return None
    chain: list[tuple[Node, int]] = []
    dim = None
    while node.op == "call_function" and node.target is aten.select_scatter.default:
        if len(node.args) != 4 or node.kwargs:
            return None
        base, src, d, i = node.args
        val, base_val, src_val = _static_tensor(node), _static_tensor(base), _static_tensor(src)
        if val is None or base_val is None or src_val is None or type(d) is not int or type(i) is not int:
            return None
        if not -val.dim() <= d < val.dim():
            return None
        d %= val.dim()
        size = val.shape[d]
        if not -size <= i < size or base_val.shape != val.shape or src_val.dtype != val.dtype:
            return None
        if dim is not None and d != dim:
            return None
        dim = d
        chain.append((src, i % size))
        node = base
    if not chain or not _zero_factory(node):
        return None
    if len({i for _, i in chain}) != len(chain):
        return None
    return dim, chain[::-1]


def _same_layout(*vals: torch.Tensor) -> bool:
    """All of one shape, dtype and device, contiguous: the add's result and a scatter's agree."""
    first = vals[0]
    return all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device
               and v.is_contiguous() for v in vals)


def _rewrite(graph: torch.fx.Graph, add: Node) -> bool:
    """Replace `add(x, y)` of two zero-based scatter chains over distinct slices by the shorter
    chain's scatters applied to the other operand; drop what no longer has a reader."""
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1 or set(add.kwargs) - {"alpha"}:
        return False
    x, y = add.args
    cx, cy = _scatter_chain(x), _scatter_chain(y)
    if cx is None or cy is None or cx[0] != cy[0]:
        return False
    if {i for _, i in cx[1]} & {i for _, i in cy[1]}:
        return False
    vals = [_static_tensor(x), _static_tensor(y), _static_tensor(add)]
    if any(v is None for v in vals) or not _same_layout(*vals):
        return False
    (kept, (dim, onto)), dropped = ((x, cy), y) if len(cy[1]) <= len(cx[1]) else ((y, cx), x)
    new = kept
    with graph.inserting_before(add):
        for src, i in onto:
            new = graph.call_function(aten.select_scatter.default, (new, src, dim, i))
            new.meta = dict(add.meta)
    add.replace_all_uses_with(new)
    graph.erase_node(add)
    _erase_unread(graph, dropped)
    return True


def _erase_unread(graph: torch.fx.Graph, node: Node) -> None:
    """Erase `node` and, up its chain, each scatter / alias / factory left without a reader."""
    while (node.op == "call_function" and not node.users
           and node.target in (aten.select_scatter.default, aten.alias.default, aten.full.default,
                               aten.zeros.default)):
        base = node.args[0] if node.target in (aten.select_scatter.default, aten.alias.default) else None
        graph.erase_node(node)
        if not isinstance(base, Node):
            return
        node = base


def nest_zero_scatters(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, each sum of zero-based `select_scatter` chains over distinct slices of one
    dim into a single chain (module docstring), in graph order so that a sum of three nests whole.
    Returns `gm`."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.add.Tensor and _rewrite(graph, node):
            count += 1
    if count:
        log.debug("nested %d sums of zero-based select_scatters", count)
        graph.lint()
        gm.recompile()
    return gm
