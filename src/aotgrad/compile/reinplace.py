"""Re-inplacing: put custom ops' mutations back in place in the graphs handed to a compiler.

Functionalization turns a custom op that mutates its arguments, `mylib.fill_(buf)`, into the
functional `auto_functionalized_v2(mylib.fill_, _all_bases=[buf])`: at run time that clones every
base, runs the op on the clones and returns them. The graph stays correct when later code still
reads the old `buf`, but where nothing does, the clone is a wasted allocation and copy.

`reinplace(gm, writable_inputs)` rewrites each such node into plain aten/custom calls:

    buf_1 = clone(buf)            # only for a base whose old value is still needed
    mylib.fill_(buf)              # the op itself, on the base (or on a view rebuilt from it)

and every reader of the node's "new value of base i" then reads the base. A base is mutated in
place when, after the call, no node reads it or any alias of it (views of the same storage), it is
not a graph output, the op's other arguments do not alias it, and it is not a graph input, unless
its index is in `writable_inputs` (inputs whose new value the run time copies back into the
caller's tensor anyway). Nodes with the older `auto_functionalized` and out= operators are left as
they are: their functional form runs correctly as is.

The pass runs in the compile stage, after partitioning: partitioners see functional graphs. A
compiler that re-inplaces on its own (Inductor) asks for functional graphs with
`compilers.wants_functional_graphs`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._prims_common import compute_required_storage_length, is_non_overlapping_and_dense_or_false
from torch.fx import Graph, GraphModule, Node

from ..torch_compat import is_out

aten = torch.ops.aten


def reinplace(gm: GraphModule, writable_inputs: Iterable[int] = ()) -> int:
    """Rewrite the graph's functionalized custom-op calls; return how many bases now mutate in place."""
    graph = gm.graph
    calls = [n for n in graph.nodes if _is_rewritable(n)]
    if not calls:
        return 0
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    writable = {placeholders[i] for i in writable_inputs if i < len(placeholders)}
    in_place = 0
    for node in calls:
        order = {n: i for i, n in enumerate(graph.nodes)}
        bases = list(node.kwargs["_all_bases"])
        mutate = [b is None or _can_mutate(node, b, writable, order) for b in bases]
        _rewrite(graph, node, mutate)
        in_place += sum(m for b, m in zip(bases, mutate) if b is not None)
    graph.lint()
    gm.recompile()
    return in_place


def _is_rewritable(node: Node) -> bool:
    if node.op != "call_function" or node.target is not auto_functionalized_v2:
        return False
    op = node.args[0]
    return isinstance(op, torch._ops.OpOverload) and not is_out(op)


# -- when a base may be mutated in place --------------------------------------------------------------


def _is_view(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # an item of split/unbind/chunk is a view of their input
        return isinstance(node.args[0], Node) and _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable)


def _storage_root(node: Node) -> Node:
    while _is_view(node) and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _aliases(root: Node) -> set[Node]:
    """`root` and every view of it (transitively)."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if _is_view(u) and u.args and u.args[0] is n)
    return seen


def _can_mutate(call: Node, base: Node, writable: set[Node], order: dict[Node, int]) -> bool:
    root = _storage_root(base)
    if root.op == "get_attr" or (root.op == "placeholder" and root not in writable):
        return False
    aliases = _aliases(root)
    for alias in aliases:
        for user in alias.users:
            if user is call or user in aliases:
                continue
            if order[user] > order[call]:  # reads the old value after the op (the output node too)
                return False
    same_storage = [b for b in call.kwargs["_all_bases"] if b is not None and _storage_root(b) is root]
    return len(same_storage) == 1 and not any(_storage_root(a) is root for a in _tensor_args(call))


def _tensor_args(call: Node) -> list[Node]:
    """The op's own (read-only) tensor arguments."""
    found: list[Node] = []
    for k, v in call.kwargs.items():
        if k == "_all_bases":
            continue
        torch.fx.node.map_arg(v, lambda n: found.append(n))
    return found


# -- the rewrite --------------------------------------------------------------------------------------


def _rewrite(graph: Graph, call: Node, mutate: list[bool]) -> None:
    """Replace `call` by the mutable op on its bases (`mutate[i]`) or on clones of them."""
    op: torch._ops.OpOverload = call.args[0]
    kwargs = dict(call.kwargs)
    with graph.inserting_before(call):
        bases = [
            b if b is None or m else _clone_preserving_strides(graph, b)
            for b, m in zip(kwargs.pop("_all_bases"), mutate)
        ]
        op_kwargs = _op_kwargs(graph, op._schema, kwargs, bases)
        result = graph.call_function(op, (), op_kwargs)
        result.meta["val"] = _first_results(op._schema, call.meta.get("val"))
    num_results = max(1, len(op._schema.returns))
    for user in list(call.users):
        index = user.args[1]
        if index >= num_results:
            replacement = bases[index - num_results]
        elif len(op._schema.returns) == 1:
            replacement = result
        else:
            with graph.inserting_before(user):
                replacement = graph.call_function(operator.getitem, (result, index))
            replacement.meta = dict(user.meta)
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(call)


def _first_results(schema, val):
    if not isinstance(val, (tuple, list)):
        return None
    if len(schema.returns) == 0:
        return None
    if len(schema.returns) == 1:
        return val[0]
    return tuple(val[: len(schema.returns)])


def _clone_preserving_strides(graph: Graph, base: Node) -> Node:
    """A copy of `base` with its sizes, strides (and, through a flat buffer, overlap) kept."""
    val = base.meta.get("val")
    if val is None or is_non_overlapping_and_dense_or_false(val):
        return _fake_call(graph, aten.clone.default, (base,), {"memory_format": torch.preserve_format})
    needed = compute_required_storage_length(val.size(), val.stride(), val.storage_offset())
    flat = _fake_call(graph, aten.as_strided.default, (base, [needed], [1]))
    buffer = _fake_call(graph, aten.clone.default, (flat,))
    return _fake_call(graph, aten.as_strided.default, (buffer, list(val.size()), list(val.stride())))


def _op_kwargs(graph: Graph, schema, kwargs: dict, bases: list) -> dict:
    """The mutable op's keyword arguments: read-only ones as recorded, mutated ones rebuilt from the
    (cloned or original) bases with the view recipe auto-functionalization wrote into `kwargs`."""
    out = {}
    for arg in schema.arguments:
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        if not mutated:
            if arg.name in kwargs:
                out[arg.name] = kwargs[arg.name]
            continue
        if torch._library.utils.is_tensorlist_like_type(arg.type):
            length = kwargs[f"_{arg.name}_length"]
            out[arg.name] = None if length is None else [
                _view_of_base(graph, kwargs, f"_{arg.name}_{i}", bases) for i in range(length)
            ]
        else:
            out[arg.name] = _view_of_base(graph, kwargs, f"_{arg.name}", bases)
    return out


def _view_of_base(graph: Graph, kwargs: dict, prefix: str, bases: list):
    index = kwargs[f"{prefix}_base_index"]
    if index is None:
        return None
    base = bases[index]
    if f"{prefix}_alias" in kwargs:
        return _fake_call(graph, aten.alias.default, (base,))
    if f"{prefix}_storage_offset" in kwargs:
        size, stride = kwargs[f"{prefix}_size"], kwargs[f"{prefix}_stride"]
        offset = kwargs[f"{prefix}_storage_offset"]
        return _fake_call(graph, aten.as_strided.default, (base, size, stride, offset))
    if f"{prefix}_slice_dim" in kwargs:
        dim, start, end = (kwargs[f"{prefix}_slice_{k}"] for k in ("dim", "start", "end"))
        return _fake_call(graph, aten.slice.Tensor, (base, dim, start, end))
    return base


def _fake_call(graph: Graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    """A new node, with `meta["val"]` computed on the fake values of its inputs (compilers read it)."""
    node = graph.call_function(target, args, kwargs or {})
    vals, kwvals = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta.get("val"))
    if isinstance(vals[0], torch.Tensor):
        node.meta["val"] = target(*vals, **kwvals)
    return node
