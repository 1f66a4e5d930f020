"""Stage 4 — partition: split the joint graph into a forward and a backward graph.

A partitioner has upstream's partitioner signature
`partition_fn(joint_module, joint_inputs, *, num_fwd_outputs) -> (fw_module, bw_module)`:

- the joint graph's placeholders are `primals_*` then `tangents_*`; its output is a flat list, the
  first `num_fwd_outputs` entries are forward outputs, the rest the gradient of each primal;
- the forward module returns its outputs followed by the values it saves for the backward;
- the backward module takes the saved values then the tangents, and returns the gradients.

`default_partition` saves whatever forward value the backward reads. Nodes tagged as backward
mutations (a backward that writes into a graph input) always go to the backward graph.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx
from torch.fx import Graph, GraphModule, Node

from ..trace.state import BACKWARD_MUTATION


def _flat_outputs(graph: Graph) -> list[Node | None]:
    out = graph.output_node().args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _ancestors(roots: Iterable[Node | None], stop: set[Node] = frozenset()) -> set[Node]:
    seen: set[Node] = set()
    stack = [r for r in roots if isinstance(r, Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            continue
        stack.extend(n.all_input_nodes)
    return seen


def extract_graph(
    joint: Graph, inputs: list[Node], outputs: list, side_effects: list[Node] = ()
) -> GraphModule:
    """A new graph computing `outputs` (and `side_effects`) from `inputs`, in joint order."""
    needed = _ancestors(list(outputs) + list(side_effects), stop=set(inputs))
    new = Graph()
    env: dict[Node, Node] = {}
    for node in inputs:
        p = new.placeholder(node.name)
        p.meta = dict(node.meta)
        env[node] = p
    for node in joint.nodes:
        if node in env or node not in needed or node.op in ("placeholder", "output"):
            if node.op == "placeholder" and node in needed and node not in env:
                raise RuntimeError(f"aotgrad internal error: {node.name} needed but not an input")
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    new.output([env[o] if isinstance(o, Node) else o for o in outputs])
    # Root on the joint module so constants the trace stored as attributes (get_attr) come along.
    return GraphModule(joint.owning_module or torch.nn.Module(), new)


def _is_backward_mutation(node: Node) -> bool:
    return bool(node.meta.get(BACKWARD_MUTATION))


def default_partition(
    joint_module: GraphModule, _joint_inputs=None, *, num_fwd_outputs: int, **_ignored
) -> tuple[GraphModule, GraphModule]:
    """Forward = what the forward outputs need; save every forward value the backward reads."""
    graph = joint_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if not n.name.startswith("tangents")]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    outs = _flat_outputs(graph)
    fw_outs, bw_outs = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
    tangent_dependent = _descendants(tangents)
    fw_effects, bw_effects = side_effects(graph, tangent_dependent)

    fw_nodes = _ancestors(list(fw_outs) + fw_effects, stop=set(tangents))
    fw_nodes -= tangent_dependent
    bw_needed = _ancestors(list(bw_outs) + bw_effects, stop=fw_nodes)
    saved = [n for n in graph.nodes if n in fw_nodes and n in bw_needed and _used_by(n, bw_needed - fw_nodes)]
    saved += [p for p in primals if p in bw_needed and p not in fw_nodes]
    saved += [o for o in bw_outs if o in fw_nodes]
    return build_partition(graph, primals, tangents, fw_outs, bw_outs, saved, bw_effects, fw_effects)


def side_effects(graph: Graph, tangent_dependent: set[Node]) -> tuple[list[Node], list[Node]]:
    """Impure nodes no output depends on (token sinks, mutations kept in the graph), split into those
    the forward runs and those the backward runs (tagged backward mutations, or needing tangents)."""
    fw, bw = [], []
    for n in graph.nodes:
        if n.op != "call_function" or n.users or not n.is_impure():
            continue
        (bw if _is_backward_mutation(n) or n in tangent_dependent else fw).append(n)
    return fw, bw


def build_partition(graph, primals, tangents, fw_outs, bw_outs, saved, bw_effects, fw_effects=()):
    """Forward/backward modules from a choice of saved values (shared by all partitioners)."""
    saved = _items_not_tuples(saved, list(bw_outs) + list(bw_effects), tangents)
    saved = _order_saved(graph, saved + symbol_bindings(graph, saved, tangents))
    fw_module = extract_graph(graph, primals, list(fw_outs) + saved, fw_effects)
    bw_module = extract_graph(graph, saved + tangents, list(bw_outs), bw_effects)
    return fw_module, bw_module


def _items_not_tuples(saved: list[Node], bw_roots: list, tangents: list[Node]) -> list[Node]:
    """A multi-output op (native_layer_norm, sdpa...) is saved as the items the backward reads,
    never as the tuple: graph compilers (Inductor) only return tensors and symbolic ints."""
    multi = [n for n in saved if isinstance(n.meta.get("val"), (tuple, list))]
    if not multi:
        return saved
    reads = _ancestors(bw_roots, stop=set(saved) | set(tangents))
    out = [n for n in saved if n not in multi]
    for n in multi:
        out += [u for u in n.users if u.target is operator.getitem and u in reads]
    return out


def symbol_bindings(graph: Graph, saved: list[Node], tangents: list[Node]) -> list[Node]:
    """Forward nodes whose value is exactly a symbol that the backward's inputs have in their sizes,
    one per symbol, for the forward to save as a plain symbolic int.

    Graph compilers read a graph's symbols off its symbolic-int inputs (Inductor checks its cache's
    guards on them alone), so every symbol in a saved tensor's or a tangent's shape must arrive as
    one. A symbol no forward node yields as such gets a `sym_size`/`sym_stride` node on a primal."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    wanted = set()
    for n in list(saved) + list(tangents):
        val = n.meta.get("val")
        if isinstance(val, (torch.Tensor, torch.SymInt)):
            wanted |= free_symbols(val)
    if not wanted:
        return []
    backward_only = _descendants(tangents)
    forward = [n for n in graph.nodes if n not in backward_only]
    found: dict = {}
    for n in forward:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr in wanted:
            found.setdefault(val.node.expr, n)
    for n in forward:
        val = n.meta.get("val")
        if len(found) == len(wanted) or n.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        for reader, values in ((torch.ops.aten.sym_size.int, val.shape), (torch.ops.aten.sym_stride.int, val.stride())):
            for dim, v in enumerate(values):
                if isinstance(v, torch.SymInt) and v.node.expr in wanted and v.node.expr not in found:
                    with graph.inserting_after(n):
                        node = graph.call_function(reader, (n, dim))
                    node.meta["val"] = v
                    found[v.node.expr] = node
    saved_set = set(saved)
    return [n for n in found.values() if n not in saved_set]


def _order_saved(graph: Graph, saved: list[Node]) -> list[Node]:
    """Tensors first, then non-tensor values (symbolic ints), each in graph order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    uniq = sorted(set(saved), key=order.__getitem__)
    is_tensor = [isinstance(n.meta.get("val"), torch.Tensor) for n in uniq]
    return [n for n, t in zip(uniq, is_tensor) if t] + [n for n, t in zip(uniq, is_tensor) if not t]


def _descendants(roots: list[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _used_by(node: Node, consumers: set[Node]) -> bool:
    return any(u in consumers for u in node.users)


def _view_root(node):
    """The node a chain of aten view ops starts from (the node itself if it is no view)."""
    while isinstance(node, Node) and node.op == "call_function":
        target = node.target
        if target is operator.getitem:
            node = node.args[0]
            continue
        schema = getattr(target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or schema.is_mutable:
            return node
        node = node.args[0]
    return node


def reads_of_mutated_in_graph(graph: Graph) -> set[Node]:
    """Nodes that read a tensor some op in the graph mutates in place (`fsdp.copy_`,
    `inductor.resize_storage_bytes_`, a backward mutation's `copy_`), through views or not.

    Their value depends on when they run relative to the mutation, so a partitioner must save
    them, never recompute them in the backward: by then the tensor may hold other data, or none."""
    mutated: set[Node] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for arg, spec in zip(n.args, schema.arguments):
            if spec.alias_info is not None and spec.alias_info.is_write and isinstance(arg, Node):
                mutated.add(_view_root(arg))
    readers: set[Node] = set()
    stack = list(mutated)
    seen: set[Node] = set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        for u in t.users:
            if u.op != "call_function":
                continue
            if _view_root(u) is not u:  # a view: its readers read the mutated storage too
                stack.append(u)
            elif not getattr(getattr(u.target, "_schema", None), "is_mutable", False):
                readers.add(u)
    return readers


def clone_saved_inputs(fw_module: GraphModule, num_fwd_outputs: int, primal_indices: set[int]) -> None:
    """The epilogue mutates some graph inputs after the forward; a backward that reads one of them
    (or a view of one) must see the value from before the mutation, so save a clone instead."""
    if not primal_indices:
        return
    graph = fw_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    targets = {placeholders[i] for i in primal_indices}
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    for i in range(num_fwd_outputs, len(outs)):
        if _view_root(outs[i]) in targets:
            with graph.inserting_before(out_node):
                clone = graph.call_function(torch.ops.aten.clone.default, (outs[i],))
                clone.meta = dict(outs[i].meta)
            outs[i] = clone
    out_node.args = (outs,)
    fw_module.recompile()


def flows_from(gm: torch.fx.GraphModule, sources: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """For each node, a bitmask of the `sources` its value flows from."""
    flows = {node: 1 << j for j, node in enumerate(sources)}
    for node in gm.graph.nodes:
        if node not in flows:
            mask = 0
            for arg in node.all_input_nodes:
                mask |= flows.get(arg, 0)
            flows[node] = mask
    return flows
