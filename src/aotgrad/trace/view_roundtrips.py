"""Fold view round trips: a value read back through views of what a scatter or a view chain made.

An in-place op on a view (`x.view(a)[..., :n] *= mask`, the relative-position shift of Funnel and
Transformer-XL) is functionalized into scatters that rebuild the base (`slice_scatter` per view
step), and each later read of the view replays the views on the rebuilt base. The backward of
such a write (autograd's `CopySlices`) does the same with the gradient. Every read-back equals a
value the graph already has: the slice of a `slice_scatter` over the same range is the scattered
source, a reshape back to a value's own shape is that value, two permutes that undo each other are
their input. Left in, Inductor composes each read-back's index through every reshape of the chain
(floor-divisions and moduli nested per step) and can spend minutes simplifying one index (measured:
a 40-line function with one `*=` on the shifted view took over 300 s to compile under both Inductor
and aotgrad, 10 s written out of place).

`fold_view_roundtrips(graph)` replaces each such read with the value it equals. The rules are over
values (the layout may differ: the graph is functional; recorded layouts downstream are redone, and
a `view` that can no longer view its new input gets a contiguous copy from
`capture._copy_before_unviewable_views` afterwards):

- `view(x, s)` (and `_unsafe_view`, `alias`, `clone`) read through to the first value of shape `s`
  up the chain of such ops: they keep row-major element order, so equal shape means equal value;
  `copy(dst, src)` of one shape is `src`;
- `permute(y, p)` where `y` is (through that chain) `permute(z, q)` and `p` undoes `q`: `z`;
- `slice(x, d, a, b, k)` where `x` is `slice_scatter(base, src, d, a, b, k)` (or
  `slice_backward(src, ..., d, a, b, k)`): `src`; `select` of `select_scatter` alike; a slice, a
  scatter or a `slice_backward` over a whole dimension is its input;
- `slice_scatter(x, src, range)` where `x` is a scatter over the same range: a scatter into that
  scatter's base (the first write is overwritten whole);
- a size read off a scatter is read off its base, and one equal to an input's size off the input,
  so that sizes saved for the backward keep no folded chain alive.

Symbolic sizes are compared without adding a guard (equal for every value of the symbols). It never
replaces a value that reaches a graph output, one with a tag later stages read, an input clone or a
backward mutation, nor any value whose memory is written in place somewhere in the graph.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch.fx import Graph, Node

from .analysis import view_fails
from .cse import _DISTINGUISHING_META, _note_writes, _root, _values_reaching_outputs
from .state import BACKWARD_MUTATION, INPUT_CLONE

__all__ = ["fold_view_roundtrips"]

log = logging.getLogger("aotgrad.trace")

aten = torch.ops.aten
_SAME_ORDER = {aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.clone.default}
_LAYOUT_READERS = {aten.as_strided.default, aten.as_strided_scatter.default}  # read strides, not values


def fold_view_roundtrips(graph: Graph) -> int:
    """Point the readers of each read-back at the value it equals; returns how many were folded.
    The folded nodes are left for dead-code elimination. All or nothing: a fold that raises (a
    fake op refusing a new layout while recorded layouts are redone) is undone, and the graph,
    correct unfolded, goes on as traced."""
    before = {node: (node.target, node.args, node.kwargs, node.meta.get("val")) for node in graph.nodes}
    try:
        return _fold(graph)
    except Exception as ex:  # noqa: BLE001 -- an optimisation: its failure must not fail the compile
        _restore(before)
        log.warning("view round trips left unfolded (%s: %s); values are unchanged, a compiler may be "
                    "slower on the read-backs", type(ex).__name__, ex)
        return 0


def _restore(before: dict) -> None:
    for node, (target, args, kwargs, val) in before.items():
        node.target, node.args, node.kwargs = target, args, kwargs
        if val is None:
            node.meta.pop("val", None)
        else:
            node.meta["val"] = val


def _fold(graph: Graph) -> int:
    writes: dict[Node, int] = {}
    for node in graph.nodes:
        _note_writes(node, writes)
    written = set(writes)
    reaches_output = _values_reaching_outputs(graph)
    relaid: set[Node] = set()  # nodes whose readers now read a value laid out unlike the recorded one
    folded = 0
    input_sizes: list[Node] = []  # sizes read off the graph's inputs, in graph order
    for node in list(graph.nodes):
        if node.target is aten.sym_size.int:
            folded += _size_from_base(node, written) or _size_from_inputs(node, input_sizes)
            continue
        if not _replaceable(node, reaches_output, written):
            continue
        if node.target is aten.slice_scatter.default and _equal_value(node) is None:
            if _drop_overwritten_scatter(node, written):
                relaid.add(node)
                folded += 1
            continue
        same = _equal_value(node)
        if same is None or same is node or _root(same) in written or not _same_kind(same, node):
            continue
        if not _same_layout(_layout(same), _layout(node)):
            relaid.update(node.users)
        node.replace_all_uses_with(same)
        folded += 1
    if relaid:
        _refresh_layouts(graph, relaid)
    return folded


def _refresh_layouts(graph: Graph, start: set[Node]) -> None:
    """Recompute the recorded value (`meta['val']`, a fake tensor) of `start` and of every reader
    whose input's layout changed: a scatter follows its base's strides, a permute then views what
    it gets, so a folded read can change the strides recorded downstream, and later stages (the
    unviewable-view copies, the partitioner, Inductor) read them. A `view` its input can no longer
    take is recorded as the view of a contiguous copy, which capture then inserts."""
    changed = set(start)
    for node in graph.nodes:
        if node not in changed or node.op != "call_function":
            continue
        old = node.meta.get("val")
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        if node.target is aten.view.default and not args[0].is_contiguous() and view_fails(args[0], args[1]):
            args = (args[0].contiguous(), *args[1:])
        new = node.target(*args, **kwargs)
        node.meta["val"] = new
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
            changed.update(node.users)
        elif not _same_layout(_layout_of(new), _layout_of(old)):
            changed.update(node.users)


def _replaceable(node: Node, reaches_output: set[Node], written: set[Node]) -> bool:
    if node.op != "call_function" or node in reaches_output or _root(node) in written or node.kwargs:
        return False
    if node.target is aten.clone.default:
        return False  # looked through, kept: a clone is where a later stage may want a dense copy
    if node.meta.get(INPUT_CLONE) or node.meta.get(BACKWARD_MUTATION):
        return False
    if any(node.meta.get(k) for k in _DISTINGUISHING_META):
        return False
    if _shape(node) is None:
        return False
    return not any(u.target in _LAYOUT_READERS for u in node.users)


def _equal_value(node: Node) -> Node | None:
    """A node computed before `node` whose value equals `node`'s, by the rules of the module docstring."""
    target, args = node.target, node.args
    if target in _SAME_ORDER and isinstance(args[0], Node):
        return _same_shape_up(args[0], _shape(node))
    if target is aten.permute.default:
        inner = _same_shape_up(args[0], _shape(args[0]))
        if inner is not None and inner.target is aten.permute.default and _undoes(args[1], inner.args[1]):
            return inner.args[0] if _same_shape(inner.args[0], node) else None
        return args[0] if list(_dims(args[1], len(_shape(node)))) == list(range(len(_shape(node)))) else None
    if target is aten.copy.default and isinstance(args[1], Node):
        return args[1] if _same_shape(args[1], node) else None
    if target is aten.slice.Tensor and _whole(args[0], _slice_range(args[0], args[1:])):
        return args[0]
    if target is aten.slice_scatter.default and _whole(args[0], _slice_range(args[0], args[2:])):
        return args[1] if _same_shape(args[1], node) else None
    if target is aten.slice_backward.default and _whole(node, _slice_range(node, args[2:])):
        return args[0] if isinstance(args[0], Node) and _same_shape(args[0], node) else None
    if target is aten.slice.Tensor:
        scatter = _scatter_under(args[0], aten.slice_scatter.default)
        if scatter is not None and _same_range(_slice_range(scatter, scatter.args[2:]), _slice_range(args[0], args[1:])):
            return scatter.args[1] if _same_shape(scatter.args[1], node) else None
        padded = _scatter_under(args[0], aten.slice_backward.default)
        if padded is not None and _same_range(_slice_range(padded, padded.args[2:]), _slice_range(args[0], args[1:])):
            return padded.args[0] if _same_shape(padded.args[0], node) else None
    if target is aten.select.int:
        scatter = _scatter_under(args[0], aten.select_scatter.default)
        if scatter is not None and _same_range(_select_at(scatter, scatter.args[2:]), _select_at(args[0], args[1:])):
            return scatter.args[1] if _same_shape(scatter.args[1], node) else None
    return None


def _drop_overwritten_scatter(node: Node, written: set[Node]) -> int:
    """`slice_scatter(slice_scatter(b, s1, r), s2, r)` writes `s2` over all of `s1`: scatter into `b`
    (and `slice_scatter(slice_backward(s1, r), s2, r)`, a scatter into zeros, is `slice_backward(s2, r)`)."""
    padded = _scatter_under(node.args[0], aten.slice_backward.default)
    if padded is not None and _same_range(_slice_range(padded, padded.args[2:]), _slice_range(node.args[0], node.args[2:])):
        src = node.args[1]
        if _same_shape(padded, node) and _same_shape(padded.args[0], src) and _same_kind(src, node):
            node.target = aten.slice_backward.default
            node.args = (node.args[1], padded.args[1], *padded.args[2:])
            return 1
    inner = _scatter_under(node.args[0], aten.slice_scatter.default)
    if inner is None or _root(inner.args[0]) in written:
        return 0
    if not _same_range(_slice_range(inner, inner.args[2:]), _slice_range(node.args[0], node.args[2:])):
        return 0
    if not _same_shape(inner.args[0], node):
        return 0
    node.replace_input_with(node.args[0], inner.args[0])
    return 1


def _size_from_base(node: Node, written: set[Node]) -> int:
    """A size read off a scatter is its base's size: read there, so the scatter can die."""
    scatter = node.args[0]
    if not isinstance(scatter, Node) or scatter.target not in (aten.slice_scatter.default, aten.select_scatter.default):
        return 0
    if _root(scatter.args[0]) in written:  # an in-graph `set_` could change the base's size
        return 0
    node.replace_input_with(scatter, scatter.args[0])
    return 1


def _size_from_inputs(node: Node, input_sizes: list[Node]) -> int:
    """A size read off an intermediate that equals one read off an input earlier: read the input's.
    Sizes saved for the backward otherwise keep a folded chain's last views (and what they view) alive."""
    source, size = node.args[0], node.meta.get("val")
    if isinstance(source, Node) and source.op == "placeholder":
        input_sizes.append(node)
        return 0
    if not isinstance(size, torch.SymInt):
        return 0
    for earlier in input_sizes:
        if _shapes_equal((earlier.meta.get("val"),), (size,)):
            node.replace_all_uses_with(earlier)
            return 1
    return 0


def _scatter_under(value, scatter_op) -> Node | None:
    """The `scatter_op` node equal to `value` (through same-order ops of one shape), if any."""
    if not isinstance(value, Node):
        return None
    found = _same_shape_up(value, _shape(value), want=scatter_op)
    return found if found is not None and found.target is scatter_op else None


def _same_shape_up(value: Node, shape, want=None) -> Node | None:
    """The furthest node up `value`'s chain of same-order ops (`_SAME_ORDER`) whose shape is `shape`
    (or, given `want`, the first such node whose target is `want`)."""
    found = None
    node = value
    for _ in range(1000):
        if not isinstance(node, Node) or _shape(node) is None:
            break
        if _shapes_equal(_shape(node), shape):
            found = node
            if want is not None and node.target is want:
                return node
        if node.op != "call_function" or node.target not in _SAME_ORDER or not isinstance(node.args[0], Node):
            break
        node = node.args[0]
    return found


def _slice_range(value: Node, args) -> tuple[int, int, int, int] | None:
    """(dim, start, stop, step) of a slice over `value`, clamped to its size as ATen clamps them."""
    shape = _shape(value)
    dim = args[0] if len(args) > 0 else 0
    start = args[1] if len(args) > 1 else None
    stop = args[2] if len(args) > 2 else None
    step = args[3] if len(args) > 3 else 1
    if not isinstance(dim, int) or not isinstance(step, int) or isinstance(start, Node) or isinstance(stop, Node):
        return None
    dim = dim % len(shape)
    size = shape[dim]
    return dim, _bound(0 if start is None else start, size), _bound(size if stop is None else stop, size), step


def _select_at(value: Node, args) -> tuple[int, int] | None:
    shape = _shape(value)
    dim, index = args[0], args[1]
    if not isinstance(dim, int) or not isinstance(index, int):
        return None
    dim = dim % len(shape)
    return dim, index + shape[dim] if index < 0 else index


def _bound(i, size):
    """A slice bound as ATen reads it before clamping (negative from the end, past the end the end):
    two bounds that compare equal here clamp to one value, symbolic sizes included."""
    if isinstance(i, int) and i >= 2**62:
        return size
    if isinstance(i, int) and i < 0:
        i = i + size
    if isinstance(i, int) and isinstance(size, int):
        return min(max(i, 0), size)
    return i


def _whole(value: Node, bounds) -> bool:
    """Whether a slice with these bounds takes all of `value` (a no-op slice, `x[:, 2:, :]`'s last)."""
    if bounds is None:
        return False
    dim, start, stop, step = bounds
    return step == 1 and _shapes_equal((start, stop), (0, _shape(value)[dim]))


def _same_range(a, b) -> bool:
    return a is not None and b is not None and _shapes_equal(a, b)


def _same_shape(a, b) -> bool:
    return _shapes_equal(_shape(a), _shape(b))


def _shapes_equal(a, b) -> bool:
    """Equal for every value of the graph's symbols, asked without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a is None or b is None or len(a) != len(b):
        return False
    return all(x == y if isinstance(x, int) and isinstance(y, int) else statically_known_true(x == y)
               for x, y in zip(a, b))


def _undoes(p, q) -> bool:
    n = len(p)
    p, q = list(_dims(p, n)), list(_dims(q, n))
    return len(q) == n and [q[p[i]] for i in range(n)] == list(range(n))


def _dims(perm, n: int):
    return (d % n for d in perm)


def _same_kind(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and (va.dtype, va.device) == (vb.dtype, vb.device)


def _layout(node: Node):
    val = node.meta.get("val")
    return _layout_of(val) if isinstance(val, torch.Tensor) else None


def _layout_of(val: torch.Tensor):
    return tuple(val.shape), tuple(val.stride()), (val.storage_offset(),)


def _same_layout(a, b) -> bool:
    return a is not None and b is not None and all(_shapes_equal(x, y) for x, y in zip(a, b))


def _shape(value) -> tuple | None:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
