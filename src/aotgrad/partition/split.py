"""Activation splitting: land a memory budget between two whole-tensor plans.

The budget menu of `partition_mincut` is made of exact min-cuts, and a min-cut saves or recomputes
whole tensors. Where the activations are few and big (an MLP whose hidden activations all have one
size, a CNN whose activations are multiples of 1/7 of the range) no whole-tensor plan lies within 5%
of a requested point. This module closes such gaps by saving *part* of one activation:

    X = op(A, W)   becomes   X = cat([op(A[:m], W), op(A[m:], W)], 0)

in (a copy of) the joint graph, for a value X that the nearest plan below the request ("lo")
recomputes in the backward. The head `op(A[:m], W)` is forced saved (it is its own tensor, not a
view, so it keeps no more than m rows alive); the tail is recomputed in the backward from the slice
of A that lo's backward has anyway, and the backward rebuilds X with `cat`. The plan saves about
lo's bytes plus m rows of X; m is chosen so that this lands on the requested point.

Why a rewrite of the joint graph rather than of the backward only: the backward recomputes X and
everything lo recomputes downstream of it from X's inputs; with the forward itself computing X in
two row blocks, the same min-cut machinery (a forced value, the unlocked expensive nodes of lo)
yields the split plan exactly, and the forward and backward graphs are extracted as usual.

Only a value whose op is *provably row-separable along dim 0* is split - row i of the output
depends only on row i of the row operands, and on whole non-row operands:

- pointwise ops (the `pointwise` tag), with every tensor operand either of the output's rank with
  dim 0 of the output's size (sliced) or broadcast along dim 0 (lower rank, or dim 0 of size 1;
  passed whole);
- `mm` (the first operand is the row operand), `addmm` (the second; a 2-d bias with the rows is
  sliced too, a broadcast bias passed whole), `bmm` (both operands along the batch), and
  `convolution` (the input along the batch).

Reductions over dim 0, batch norm in training mode, softmax along dim 0, random ops, ops reading a
mutated value, views and multi-output ops are never split; then the nearest whole plan is taken, as
without splitting. Pointwise ops compute every element the same way whatever the block, so their
split values are bitwise those of eager; a row block of a matmul or convolution is computed by the
same kernels on fewer rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx import GraphModule, Node

from .graph import _Candidate, _candidate, _Joint, _recomputed
from .ops import _packet_name, _val, estimate_flops, op_class

__all__ = ["row_split_positions", "split_rows", "land_by_splitting"]

_aten = torch.ops.aten
# Ops whose output rows come from the rows of these positional operands (dim 0) and whole others.
_ROW_OPS: dict[str, tuple[int, ...]] = {"mm": (0,), "addmm": (1,), "bmm": (0, 1), "convolution": (0,)}
_TRIES = 4  # split candidates tried per request, the most expensive to recompute per byte first


def _rows(node: Node) -> int | None:
    """dim 0 of the node's tensor value, when it is a concrete int >= 2 (else None: nothing to split)."""
    v = _val(node)
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or not isinstance(v.shape[0], int):
        return None
    return v.shape[0] if v.shape[0] >= 2 else None


def row_split_positions(node: Node) -> tuple[int, ...] | None:
    """The positional operands to slice along dim 0 to compute `node` in row blocks, or None when
    `node` is not provably row-separable (see the module docstring)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    n = _rows(node)
    if n is None or any(isinstance(a, Node) for a in node.kwargs.values()):
        return None
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in a) for a in node.args):
        return None
    out = _val(node)
    name, cls = _packet_name(node.target), op_class(node)
    if name in _ROW_OPS and cls in ("matmul", "conv"):
        rows = _ROW_OPS[name]
        if name == "convolution" and (len(node.args) < 7 or not isinstance(node.args[6], bool)):
            return None
        for i in rows:
            v = _val(node.args[i]) if i < len(node.args) else None
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
                return None
        if name == "addmm":
            bias = _val(node.args[0])
            if not isinstance(bias, torch.Tensor):
                return None
            if bias.dim() == 2 and bias.shape[0] == n:
                return (0, *rows)
            if bias.dim() == 2 and bias.shape[0] != 1:
                return None
        return rows
    if cls != "pointwise" or torch.Tag.pointwise not in node.target.tags:
        return None
    rows = []
    for i, a in enumerate(node.args):
        v = _val(a)
        if not isinstance(v, torch.Tensor):
            continue  # a number or symbolic scalar: the same for every row
        if v.dim() == out.dim() and v.shape[0] == n:
            rows.append(i)
        elif not (v.dim() < out.dim() or v.shape[0] == 1):
            return None
    return tuple(rows) if rows else None


def _fake_run(target: Any, args: tuple, kwargs: dict) -> Any:
    """The value of `target(*args)` on the fake tensors of the nodes in `args` (shapes for the cut)."""
    from torch._guards import detect_fake_mode

    vals = torch.fx.node.map_arg(args, _val)
    mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    if mode is None:
        raise ValueError("no fake mode to compute the shapes of a split value in")
    with mode:
        return target(*vals, **kwargs)


def _add(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict, meta: dict) -> Node:
    node = graph.call_function(target, args, kwargs)
    node.meta = {**meta, "val": _fake_run(target, args, kwargs)}
    return node


def split_rows(gm: GraphModule, name: str, m: int) -> tuple[GraphModule, str, str] | None:
    """A copy of the joint module where node `name` is computed as `cat([op(rows[:m]), op(rows[m:])])`;
    returns (module, head node name, tail node name), or None if the node is not row-separable.
    The original module is left as it is (callers may still hold its nodes)."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    x = next((n for n in graph.nodes if n.name == name), None)
    positions = None if x is None else row_split_positions(x)
    n = None if x is None else _rows(x)
    if positions is None or n is None or not 1 <= m < n:
        return None
    meta = {k: v for k, v in x.meta.items() if k != "val"}
    try:
        with graph.inserting_before(x):
            blocks = []
            for start, end in ((0, m), (m, n)):
                args = list(x.args)
                for i in positions:
                    args[i] = _add(graph, _aten.slice.Tensor, (x.args[i], 0, start, end), {}, {})
                blocks.append(_add(graph, x.target, tuple(args), dict(x.kwargs), meta))
            joined = _add(graph, _aten.cat.default, (blocks, 0), {}, dict(x.meta))
    except Exception:  # no fake mode, or the fake run refused a block: do not split
        return None
    x.replace_all_uses_with(joined)
    graph.erase_node(x)
    graph.lint()
    return GraphModule(gm, graph), blocks[0].name, blocks[1].name


def land_by_splitting(j: _Joint, lo: _Candidate, hi: _Candidate, target: float, whole: _Candidate
                      ) -> tuple[_Joint, _Candidate, dict] | None:
    """A plan nearer `target` bytes than the whole-tensor plan `whole`, saving lo's values plus the
    first m rows of one value X that lo recomputes; None if there is none.

    lo and hi are the whole plans nearest below and above the request. For the gap between them the
    split plans form a fixed ladder, lo + k * (bytes of a row of X) for k = 1..n-1: X is the first of
    the candidates in an order that does not depend on the request - read by the backward,
    row-separable, at least as big as the gap (so the ladder spans it), finest rows first, then most
    FLOPs per byte (saving rows of a matmul output spares their recomputation). The request takes
    the rung nearest it; since picking the nearest point of a fixed set is monotone, and the rungs lie
    strictly between lo and hi, the saved bytes still never grow as the budget falls. The rung is
    solved exactly and taken only if the cut saves exactly what the ladder predicts (otherwise the
    next candidate is tried, then the whole plan is kept)."""
    gap, need = hi.bytes - lo.bytes, target - lo.bytes
    recomputed = set(_recomputed(j, lo.saved))
    candidates = []
    for x in j.region:
        n = _rows(x)
        if n is None or x not in recomputed or x not in j.required or x in lo.forced or x in j.decisions:
            continue
        if j.bytes[x] % n or j.bytes[x] < gap or row_split_positions(x) is None:
            continue
        candidates.append(x)
    candidates.sort(key=lambda x: (j.bytes[x] // _rows(x), -estimate_flops(x) / max(j.bytes[x], 1), j.index[x]))
    for x in candidates[:_TRIES]:
        n = _rows(x)
        row = j.bytes[x] // n
        m = min(max(round(need / row), 1), n - 1)
        predicted = lo.bytes + m * row
        if predicted >= hi.bytes or abs(predicted - target) >= abs(whole.bytes - target):
            return None  # the ladder's nearest rung is no nearer than the whole plan
        split = split_rows(j.joint, x.name, m)
        if split is None:
            continue
        gm, head, tail = split
        j2 = _Joint(gm, j.num_fwd_outputs, j.policy)
        by_name = {v.name: v for v in gm.graph.nodes}
        unlocked = [by_name[tail if u is x else u.name] for u in lo.unlocked]
        forced = [by_name[f.name] for f in lo.forced] + [by_name[head]]
        plan = _candidate(j2, unlocked, forced=forced)
        if plan.bytes == predicted:
            return j2, plan, {"value": x.name, "rows_saved": m, "rows": n}
    return None
