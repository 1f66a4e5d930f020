"""Export: `aot_export_module` (a module's whole step as one functional graph a caller runs itself) and
`aot_export_joint_simple` (a function's joint or forward graph, for programs that need no epilogue).

`aot_export_module`'s graph takes `(*parameters, *buffers, *user_inputs)` and returns
`(*new values of mutated inputs, *user_outputs[, *gradients])`; a `GraphSignature` names which
placeholder is which parameter or buffer, which output is whose new value or gradient. Nothing runs
around the graph, so whatever aotgrad's run time would do (apply a mutation, rebuild a view) must be
expressible inside it; the rest is refused with an `AotgradError`.

Built on the single capture (capture.py): the plan says which graph outputs are new input values and
how each user output is made. With `trace_joint`, the joint graph's tangent inputs are replaced by
`ones_like(loss)` (zeros for the other differentiable values), so its gradient outputs are those of
the scalar loss.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import export_pre_dispatch
from . import inputs as inputs_stage
from .api import DATA_DEPENDENT, _data_dependent_error, _functional_call
from .capture import capture
from .capture_state import NeedsSyntheticBase, NeedsTraining
from .dynamic_shapes import export_context, export_leaves
from .errors import (
    DataDependentError,
    UnsupportedInputError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)
from .plan import (
    AliasOfGraphOutput,
    AliasOfOutput,
    AliasOfPrimal,
    BumpVersion,
    CopyInto,
    FromLeaf,
    GraphOutput,
    InputItself,
    MutatedInputValue,
    SameAs,
    UserOutput,
    ViewChain,
)

aten = torch.ops.aten


@dataclass
class BackwardSignature:
    gradients_to_parameters: dict[str, str]
    gradients_to_user_inputs: dict[str, str]
    loss_output: str


@dataclass
class GraphSignature:
    """Names of the exported graph's inputs and outputs (upstream's field names)."""

    parameters: list[str]
    buffers: list[str]
    user_inputs: list[str]
    user_outputs: list[str]
    inputs_to_parameters: dict[str, str]
    inputs_to_buffers: dict[str, str]
    buffers_to_mutate: dict[str, str]
    parameters_to_mutate: dict[str, str]
    user_inputs_to_mutate: dict[str, str]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    backward_signature: BackwardSignature | None = None
    input_tokens: list[str] = field(default_factory=list)
    output_tokens: list[str] = field(default_factory=list)


def aot_export_module(
    mod: nn.Module,
    args,
    *,
    decompositions: dict | None = None,
    trace_joint: bool,
    output_loss_index: int | None = None,
    pre_dispatch: bool = False,
    dynamic_shapes: bool | None = None,
    kwargs: dict | None = None,
) -> tuple[torch.fx.GraphModule, GraphSignature]:
    """Export `mod(*args, **kwargs)` as one functional aten graph and its `GraphSignature`.

    With `trace_joint`, output `output_loss_index` must be a scalar loss and no other output may
    require grad; the graph also returns the loss's gradient for each parameter and user input that
    requires grad. Mutated buffers (and user inputs) come back as extra leading outputs; metadata
    mutations, mutated parameters that require grad, inputs sharing memory, and outputs the graph
    cannot express are refused."""
    params = list(mod.named_parameters(remove_duplicate=False))
    buffers = list(mod.named_buffers(remove_duplicate=False))
    state = [t for _, t in params + buffers]
    names = [n for n, _ in params + buffers]
    if len({id(t) for t in state}) != len(state):
        raise UnsupportedInputError("aotgrad.aot_export_module: the module holds one tensor under two names "
                                    "(tied weights); export needs each parameter and buffer once.")
    fn = _functional_call(mod, names, len(state))
    leaves, in_spec = inputs_stage.flatten_call((*state, *tuple(args)), dict(kwargs or {}))
    for i, x in enumerate(leaves[len(state):]):
        if not isinstance(x, torch.Tensor):
            raise UnsupportedInputError(f"aotgrad.aot_export_module: user input {i} is a {type(x).__name__}; "
                                        "the graph takes tensors only (bind it with functools.partial).")
    leaves = export_leaves(leaves, len(state), dynamic_shapes)  # symbolic sizes (dynamic_shapes.py)
    kinds = ["parameter"] * len(params) + ["buffer"] * len(buffers) + ["user input"] * (len(leaves) - len(state))
    if pre_dispatch:  # the pre-dispatch aten graph, traced on its own (export_pre_dispatch.py)
        gm, fields = export_pre_dispatch.export(fn, leaves, in_spec, names, kinds, trace_joint, decompositions)
        return gm, GraphSignature(**fields)
    layout, captured = _capture_for_export(fn, leaves, in_spec, trace_joint, decompositions)
    if layout.leaf_views or any(not isinstance(s, FromLeaf) for s in layout.primal_sources) or (
        list(layout.leaf_primal) != list(range(len(leaves)))
    ):
        raise UnsupportedInputError(_SHARED_INPUTS)
    return _export_graph(captured, leaves, names, kinds, in_spec, trace_joint, output_loss_index)


_SHARED_INPUTS = ("aotgrad.aot_export_module: inputs share memory (a tensor passed twice, or views of one "
                  "tensor); pass independent tensors (.clone()).")


def _capture_for_export(fn, leaves: list, spec, trace_joint: bool, decompositions: dict | None):
    """The single capture, with no run time around it: mutations stay graph outputs."""
    inputs_stage.check_supported(leaves)
    layout = inputs_stage.layout_for(leaves, spec)
    primals = inputs_stage.primal_values(layout, leaves)
    try:
        with torch.enable_grad() if trace_joint else torch.no_grad(), export_context(leaves):
            captured = capture(fn, layout, leaves, primals, training=trace_joint,
                               decompositions=decompositions, keep_inference_input_mutations=False,
                               storage_groups=inputs_stage.storage_groups(leaves))
    except NeedsTraining:  # aot_function retraces with autograd; an inference export cannot
        raise UnsupportedOutputError(
            "aotgrad.aot_export_module: with trace_joint=False an output requires grad through autograd "
            "history the program made itself (an enable_grad() region, or requires_grad_()); the exported "
            "inference graph cannot carry it. Export with trace_joint=True, or return it .detach()ed."
        ) from None
    except NeedsSyntheticBase:  # aot_function merges them into one base; the export's inputs stay apart
        raise UnsupportedInputError(_SHARED_INPUTS) from None
    except DATA_DEPENDENT as e:
        raise DataDependentError(
            f"aotgrad.aot_export_module: {_data_dependent_error(e).args[0].removeprefix('aotgrad: ').split(';')[0]}; "
            "with exact sizes the graph cannot hold it. Export with dynamic_shapes=True (an unbacked symbol "
            "stands for the value; a branch on it still cannot be exported: use torch.cond)."
        ) from e
    return layout, captured




def _export_graph(captured, leaves, names, kinds, in_spec, trace_joint, loss_index):
    """Rewire the captured graph's outputs (and, for a joint graph, its tangent inputs) for export."""
    plan, gm = captured.plan, captured.graph
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    primal_nodes = placeholders[: len(leaves)]
    tangents = placeholders[len(leaves):]
    for i, node in enumerate(primal_nodes):  # upstream's export names its inputs arg0_1, arg1_1, ...
        node._rename(f"arg{i}_1")
        node.target = node.name
    out_node = graph.output_node()
    fw_values = list(out_node.args[0][: plan.num_fw_outputs])
    grads = list(out_node.args[0][plan.num_fw_outputs:]) if trace_joint else []

    _check_epilogue(plan, kinds, names, [getattr(x, "requires_grad", False) for x in leaves], trace_joint)
    # New values of mutated inputs, in input order.
    mutated = {fo.kind.primal: fw_values[i] for i, fo in enumerate(plan.fw_outputs)
               if isinstance(fo.kind, MutatedInputValue)}
    # User outputs, views rebuilt inside the graph.
    user_nodes: list = []
    for pos, src in enumerate(plan.out_sources[: plan.out_spec.num_leaves]):
        user_nodes.append(_output_node(graph, out_node, src, pos, fw_values, primal_nodes, user_nodes, mutated))

    if trace_joint:
        _seed_loss(graph, plan, fw_values, tangents, user_nodes, loss_index)

    sig_names = {n: n.name for n in primal_nodes}
    outputs = [mutated[k] for k in sorted(mutated)] + user_nodes
    grad_pairs = [(k, g) for k, g in enumerate(grads) if g is not None]
    outputs += [g for _, g in grad_pairs]
    with graph.inserting_before(out_node):
        graph.output(tuple(outputs))
    graph.erase_node(out_node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()

    def named(kind):
        return {sig_names[primal_nodes[k]]: names[k] for k in range(len(names)) if kinds[k] == kind}

    def mutation_map(kind):
        return {mutated[k].name: (names[k] if k < len(names) else sig_names[primal_nodes[k]])
                for k in sorted(mutated) if kinds[k] == kind}

    backward = None
    if trace_joint:
        backward = BackwardSignature(
            gradients_to_parameters={g.name: names[k] for k, g in grad_pairs if kinds[k] == "parameter"},
            gradients_to_user_inputs={g.name: sig_names[primal_nodes[k]] for k, g in grad_pairs
                                      if kinds[k] == "user input"},
            loss_output=user_nodes[loss_index].name,
        )
    signature = GraphSignature(
        parameters=[n for n, k in zip(names, kinds) if k == "parameter"],
        buffers=[n for n, k in zip(names, kinds) if k == "buffer"],
        user_inputs=[sig_names[p] for p, k in zip(primal_nodes, kinds) if k == "user input"],
        user_outputs=[n.name for n in user_nodes],
        inputs_to_parameters=named("parameter"),
        inputs_to_buffers=named("buffer"),
        buffers_to_mutate=mutation_map("buffer"),
        parameters_to_mutate=mutation_map("parameter"),
        user_inputs_to_mutate=mutation_map("user input"),
        in_spec=in_spec,
        out_spec=plan.out_spec,
        backward_signature=backward,
    )
    return gm, signature


def _check_epilogue(plan, kinds, names, requires_grad, trace_joint) -> None:
    """Only new values can leave an exported graph: refuse what the run time would do besides."""

    def who(k):
        return f"{kinds[k]} {names[k]!r}" if k < len(names) else f"{kinds[k]} {k - len(names)}"

    if plan.prologue:
        raise UnsupportedMutationError(f"aotgrad.aot_export_module: the program sets requires_grad on "
                                       f"{who(plan.prologue[0].primal)}; an exported graph cannot.")
    for action in plan.epilogue:
        if not isinstance(action, (CopyInto, BumpVersion)):
            k = getattr(action, "primal", getattr(action, "leaf", 0))
            raise UnsupportedMutationError(
                f"aotgrad.aot_export_module: the program changes the metadata or storage of {who(k)} "
                f"({type(action).__name__}); an exported graph returns new values only. Use out-of-place ops.")
    for k, m in enumerate(plan.mutations):
        if m.in_backward:
            raise UnsupportedMutationError(f"aotgrad.aot_export_module: the backward mutates {who(k)}; "
                                           "an exported graph has no place for it.")
        if m.data and trace_joint and requires_grad[k]:
            raise UnsupportedMutationError(f"aotgrad.aot_export_module: the program mutates {who(k)}, which "
                                           "requires grad, in a joint export. Clone it first.")


def _output_node(graph, out_node, src, pos, fw_values, primal_nodes, done, mutated):
    """The node of user output `pos`. An input (or a view of one) the program wrote into is read
    from its new value (`mutated`, per primal; export's leaves are its primals): the graph input
    still holds the old one."""
    if isinstance(src, GraphOutput):
        return fw_values[src.index]
    if isinstance(src, InputItself):
        return mutated.get(src.leaf, primal_nodes[src.leaf])
    if isinstance(src, SameAs):
        return done[src.position]
    base = {AliasOfPrimal: lambda s: mutated.get(s.primal, primal_nodes[s.primal]),
            AliasOfGraphOutput: lambda s: fw_values[s.index],
            AliasOfOutput: lambda s: done[s.position]}.get(type(src))
    if base is None:
        raise UnsupportedOutputError(f"aotgrad.aot_export_module: output {pos} is not a tensor the graph "
                                     f"computes ({type(src).__name__}); return tensors only.")
    with graph.inserting_before(out_node):
        return _replay(graph, base(src), src.chain)


def _replay(graph: torch.fx.Graph, node: torch.fx.Node, chain: ViewChain) -> torch.fx.Node:
    """The view ops of `chain` as graph nodes (as_strided when no faithful chain exists)."""
    if chain.as_strided is not None:
        size, stride, offset = chain.as_strided
        node = graph.call_function(aten.as_strided.default, (node, list(size), list(stride), offset))
    for step in chain.steps:
        node = graph.call_function(step.op, (node, *step.args), dict(step.kwargs))
        if step.item is not None:
            node = graph.call_function(operator.getitem, (node, step.item))
    if chain.detach:
        node = graph.call_function(aten.detach.default, (node,))
    return node


def _seed_loss(graph, plan, fw_values, tangents, user_nodes, loss_index) -> None:
    """Replace the joint graph's tangent inputs: ones for the loss, zeros for the rest."""
    if loss_index is None:
        raise UnsupportedOutputError("aotgrad.aot_export_module: trace_joint=True needs output_loss_index, "
                                     "the position of the scalar loss among the outputs.")
    n_user = len(user_nodes)
    if not 0 <= loss_index < n_user:
        raise UnsupportedOutputError(f"aotgrad.aot_export_module: output_loss_index {loss_index} is out of "
                                     f"range for {n_user} outputs.")
    loss = user_nodes[loss_index]
    val = loss.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        raise UnsupportedOutputError(f"aotgrad.aot_export_module: output {loss_index}, the loss, must be a "
                                     "scalar tensor.")
    diff = [i for i, fo in enumerate(plan.fw_outputs) if fo.differentiable]
    loss_fw = [i for i, fo in enumerate(plan.fw_outputs)
               if isinstance(fo.kind, UserOutput) and fo.kind.position == loss_index]
    if not loss_fw or loss_fw[0] not in diff:
        raise UnsupportedOutputError(f"aotgrad.aot_export_module: output {loss_index}, the loss, does not "
                                     "require grad.")
    for i in diff:
        kind = plan.fw_outputs[i].kind
        if isinstance(kind, UserOutput) and kind.position != loss_index:
            raise UnsupportedOutputError(
                f"aotgrad.aot_export_module: output {kind.position} requires grad but is not the loss; a "
                "joint export differentiates the loss only. Return it .detach()ed.")
    for i, tangent in zip(diff, tangents):
        fill = aten.ones_like.default if i == loss_fw[0] else aten.zeros_like.default
        with graph.inserting_after(fw_values[i]):
            seed = graph.call_function(fill, (fw_values[i],))
        seed.meta["val"] = tangent.meta.get("val")
        tangent.replace_all_uses_with(seed)
        graph.erase_node(tangent)


def aot_export_joint_simple(
    func: Callable,
    args,
    *,
    trace_joint: bool,
    num_params_buffers: int = 0,
    decompositions: dict | None = None,
) -> torch.fx.GraphModule:
    """Trace `func(*args)` into one graph with no run-time wrapping: the joint forward+backward graph
    (`primals_*`, `tangents_*` -> forward outputs, then one gradient per input) when `trace_joint`,
    else the forward graph. For programs that need no epilogue: no input mutations, and outputs that
    are plain tensors not aliasing anything (anything else raises an `AotgradError`)."""
    leaves, spec = inputs_stage.flatten_call(tuple(args), {})
    _, captured = _capture_for_export(func, leaves, spec, trace_joint, decompositions)
    plan = captured.plan
    for k, m in enumerate(plan.mutations):
        if m.any or m.in_backward:
            raise UnsupportedMutationError(
                f"aotgrad.aot_export_joint_simple: the program mutates graph input {k}; an exported graph "
                "has no epilogue to apply it. Use aot_function, or clone the input first."
            )
    for i, src in enumerate(plan.out_sources):
        kind = plan.fw_outputs[src.index].kind if isinstance(src, GraphOutput) else None
        if not isinstance(kind, UserOutput) or kind.position != i:
            raise UnsupportedOutputError(
                f"aotgrad.aot_export_joint_simple: output {i} aliases an input or another output, or is "
                "not a tensor; an exported graph cannot rebuild it. Return a .clone()."
            )
    return captured.graph
