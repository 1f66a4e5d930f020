"""Common-subexpression elimination on a captured graph.

A joint graph computes many values twice: the backward recomputes what the forward already had
(an attention mask per layer, the `full` scalars of every decomposed op), and a decomposition
repeats itself wherever it is used. Left in, each copy is one more node for the partitioner to
weigh and for the graph compiler to schedule and code-generate (measured on the demo's GPT-2: the
backward went to Inductor with 603 nodes, upstream's with 430).

`eliminate_common_subexpressions(graph)` keeps the first of any set of nodes that call the same
operator on the same arguments and points the others' readers at it. In a functional graph that
changes no value. What it never merges:

- operators that draw random numbers (`nondeterministic_seeded`), write into an argument (mutable
  schema) or have other side effects (`resize_storage_bytes_`), or are not plain aten/prims/custom
  operators (higher-order operators, Python functions on symbolic sizes), and effect tokens;
- reads of a value on either side of a write the graph keeps in place (`_note_writes`);
- nodes whose tags the partitioner reads and that differ (activation-checkpoint decisions, names
  given with `checkpoint_name`), and nodes capture tagged (input clones, backward mutations);
- two values that each reach a graph output (the output itself, or a view on its way there):
  eager returns distinct tensors, and an in-place op on one output must not show in the other.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx import Graph, Node

# Meta entries that make two otherwise equal nodes different for later stages: torch.utils.checkpoint's
# selective-checkpoint tags, partition_ops.NAME_KEY (spelled out, so cse imports no partitioner), and
# higher_order.SAVED_UNPACK.
_DISTINGUISHING_META = ("recompute", "ac_graph_id", "aotgrad_checkpoint_names", "aotgrad_saved_unpack")
_NEVER_MERGED = {torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default}


class _Unhashable(Exception):
    pass


def eliminate_common_subexpressions(graph: Graph, keep_apart: tuple[str, ...] = ()) -> int:
    """Merge repeated computations in `graph` in place; return how many nodes were removed.
    Nodes with a truthy `meta[k]` for any `k` in `keep_apart` are left alone."""
    reaches_output = _values_reaching_outputs(graph)
    first_of: dict[tuple, Node] = {}
    writes: dict[Node, int] = {}  # per root value: in-graph writes seen so far (see _note_writes)
    removed = 0
    for node in list(graph.nodes):
        _note_writes(node, writes)
        if not _mergeable(node, keep_apart):
            continue
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs),
                   tuple(node.meta.get(k) for k in _DISTINGUISHING_META),
                   tuple(writes.get(_root(n), 0) for n in node.all_input_nodes))
            hash(key)
        except (_Unhashable, TypeError):
            continue
        kept = first_of.setdefault(key, node)
        if kept is node:
            continue
        if node in reaches_output:
            if kept in reaches_output:
                continue  # two outputs (or views of two outputs) must stay two tensors
            reaches_output.add(kept)
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        removed += 1
    return removed


def _note_writes(node: Node, writes: dict[Node, int]) -> None:
    """Count a write the graph keeps in place (FSDP's `aotgrad.set_`, `resize_storage_bytes_`,
    `fsdp.copy_`, a backward mutation's `copy_`) against the root of the value written: a read of
    it after the write is not the same computation as one before (an FSDP2 unshard, reshard and
    unshard again of one parameter reads two different all-gathers)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return
    schema = node.target._schema
    written = [a for a, arg in zip(node.args, schema.arguments)
               if isinstance(a, Node) and arg.alias_info is not None and arg.alias_info.is_write]
    if not written and node.is_impure() and node.args and isinstance(node.args[0], Node):
        written = [node.args[0]]  # resize_storage_bytes_'s schema does not mark what it changes
    for a in written:
        root = _root(a)
        writes[root] = writes.get(root, 0) + 1


def _root(node: Node) -> Node:
    """The value `node` is a view of, through any chain of views (itself if none)."""
    seen = 0
    while (source := _viewed(node)) is not None and seen < 1000:
        node, seen = source, seen + 1
    return node


def _mergeable(node: Node, keep_apart: tuple[str, ...]) -> bool:
    if node.op != "call_function" or any(node.meta.get(k) for k in keep_apart) or node.is_impure():
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target in _NEVER_MERGED:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _values_reaching_outputs(graph: Graph) -> set[Node]:
    """Graph outputs and the nodes they view, through view ops and `getitem` (of any multi-output op,
    which keeps two outputs from one `var_mean` apart as well)."""
    out: set[Node] = set()
    for value in graph.output_node().all_input_nodes:
        node = value
        while node not in out:
            out.add(node)
            source = _viewed(node)
            if source is None:
                break
            node = source
    return out


def _viewed(node: Node) -> Node | None:
    """The node whose memory `node` is a view of, if it is one."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.target is operator.getitem:
        return node.args[0]
    target = node.target
    if target in _VIEWS_WITHOUT_ALIAS_ANNOTATION:
        return node.args[0]
    if isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns):
        return node.args[0]
    return None


# `_unsafe_view` returns a view but its schema says it does not (so autograd treats it as a fresh
# tensor). `reshape` of a non-contiguous tensor decomposes to `clone` + `_unsafe_view`: two such
# reshapes returned must keep two clones.
_VIEWS_WITHOUT_ALIAS_ANNOTATION = {torch.ops.aten._unsafe_view.default}


def _frozen(value):
    """A hashable stand-in for an argument, equal only for arguments that give the same result:
    `1`, `1.0` and `True` differ (they change result dtypes), and so do `0.0` and `-0.0`."""
    if isinstance(value, Node):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in sorted(value.items())))
    if isinstance(value, float):
        return (float, repr(value))
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value), value)
    raise _Unhashable
