"""Stage 3 — capture: one trace yields the joint graph *and* the plan.

Autograd sits above functionalization in the dispatcher, so we trace the user's forward once, on fake
tensors that require grad, under `FunctionalTensorMode`, inside one recording session (trace/tracer.py, or make_fx). At the end of
the forward we read the mutation and alias facts off the functional wrappers (trace/analysis.py), decide
which values need tangents, add those tangents as new graph placeholders, and call
`torch.autograd.grad` in the same session to trace the backward. Upstream traces the program two or
three times to get the same result.

    joint(primals_1.., tangents_1..) -> [mutated input values.., user outputs.., intermediate bases..,
                                         grad of primal 1.., grad of primal n]

Graph inputs that require grad are cloned before the program sees them (a mutation must not hit the
value we differentiate with respect to); the clones are dropped from the finished graph, where they
are no-ops.

This module drives the trace; what it reads off the inputs is in trace/inputs.py, the outputs in
trace/outputs.py, the traced backward in trace/backward.py, and what they share in trace/state.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.effects import _EffectType as EffectType
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, disable_fake_tensor_cache
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..errors import AotgradError, UnsupportedAliasingError, UnsupportedMutationError, UnsupportedOutputError
from ..plan import Captured, InputLayout, Plan
from ..signature import ambient, subclass_layout
from ..signature.inputs import storage_groups as shared_storage_groups
from ..torch_compat import compiling_session
from . import analysis
from .backward import _trace_backward
from .batch_norm import drop_unread_running_stats
from .cse import eliminate_common_subexpressions
from .higher_order_marks import missing_derivative
from .inputs import (
    _analyse_inputs,
    _analyse_leaf_views,
    _bump_versions,
    _check_storage_groups,
    _clone_for_grad,
    _offset_shift,
    _primal_name,
    _sharing_memory_with_detached,
    _user_leaves,
    _version,
)
from .modes import Functionalize, TraceHooks, overlaps_itself
from .outputs import _analyse_outputs
from .state import BACKWARD_MUTATION, INPUT_CLONE, NeedsSyntheticBase, NeedsTraining, _Forward, _node_of
from .tracer import LeanTracer
from .view_roundtrips import fold_view_roundtrips


def make_fake_mode(leaves: Sequence[Any]) -> FakeTensorMode:
    for x in leaves:
        if isinstance(x, FakeTensor):
            return x.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def fakeify(fake_mode: FakeTensorMode, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v if isinstance(v, FakeTensor) else fake_mode.from_tensor(v) for v in values]


def capture(
    fn: Callable,
    layout: InputLayout,
    leaves: Sequence[Any],
    primals: Sequence[torch.Tensor],
    *,
    training: bool,
    decompositions: dict | None,
    keep_inference_input_mutations: bool,
    storage_groups: Sequence[Sequence[int]] = (),
) -> Captured:
    """Trace `fn` once on fakes of `primals`; return the (joint or inference) graph and its plan."""
    fake_mode = make_fake_mode(primals)
    fake_primals = fakeify(fake_mode, primals)
    state: dict[str, Any] = {}

    def traced(primals):
        return _trace_body(
            fn, layout, leaves, primals, state,
            training=training,
            keep_in_graph=keep_inference_input_mutations and not training,
            storage_groups=storage_groups,
        )

    view_replay = torch._C._is_view_replay_enabled()
    torch._C._set_view_replay_enabled(True)
    # The caller's saved-tensor hooks (offloading, quantizing activations) are for the tensors the
    # compiled forward saves at run time, not for the trace's functional tensors.
    hooks_deferred = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        # Dispatch modes the caller has active (a FLOP counter, a logging mode) would see, and
        # interleave with, the trace's own modes; they see the compiled code's ops at run time.
        # torch's fake-tensor dispatch cache can hand back a stale storage offset (seen for
        # aten.copy of an input at a non-zero offset, after another program): the trace reads offsets.
        with (
            torch.utils._python_dispatch._disable_current_modes(),
            _no_fake_cache(fake_mode, fake_primals),
            _no_nan_checks(),
        ):
            gm = _record(traced, fake_primals, decompositions or {}, fake_mode)
    except (RuntimeError, ValueError, IndexError) as e:
        if isinstance(e, AotgradError):
            raise
        if storage_groups and not missing_derivative(e):
            # Inputs sharing memory were traced apart, which eager's aliasing checks (views taken
            # under no_grad, leaves written through views) can trip on: retry them as one base.
            raise NeedsSyntheticBase([list(g) for g in storage_groups]) from e
        mode = state.get("functionalize")
        if mode is not None and mode.aliased_metadata_op is not None:
            op, what = mode.aliased_metadata_op
            raise UnsupportedMutationError(
                f"aotgrad: the program calls {op} on {what}, which is a view or has views; functionalization "
                f"cannot follow those views afterwards ({type(e).__name__}: {str(e).splitlines()[0]}). Use the "
                "out-of-place view op (e.g. t() instead of t_()), or apply it to a .clone()."
            ) from e
        if not isinstance(e, RuntimeError):
            raise
        if "frozen storage" in str(e):
            raise UnsupportedMutationError(
                "aotgrad: the program mutates a view of an input after set_() replaced that input's "
                "storage; functionalization cannot follow the old view. Take the view after set_()."
            ) from e
        if any(sign in str(e) for sign in _FUNCTIONALIZATION_LIMITS):
            raise UnsupportedMutationError(
                "aotgrad: functionalization cannot express this in-place program "
                f"({str(e).splitlines()[0]}). Apply the in-place op to a .clone() instead."
            ) from e
        raise
    finally:
        torch._C._set_view_replay_enabled(view_replay)
        torch._C._autograd._saved_tensors_hooks_set_tracing(hooks_deferred)
    _finish_graph(gm, state["in_graph_mutated"])
    return Captured(gm, state["plan"], num_tangents=state["num_tangents"])


def _no_fake_cache(fake_mode, fake_primals):
    """The fake-tensor cache off while tracing a program with an input at a non-zero storage offset
    (where a stale cached offset changes what the trace records); on otherwise (it saves time)."""
    if any(isinstance(p, torch.Tensor) and p.storage_offset() != 0 for p in fake_primals):
        return disable_fake_tensor_cache(fake_mode)
    return contextlib.nullcontext()


def _no_nan_checks():
    """Anomaly mode checks each backward node's output for NaN, a data-dependent `.item()` the
    trace's fake tensors cannot answer; at run time it checks the compiled backward's outputs."""
    if not torch.is_anomaly_enabled() or not torch.is_anomaly_check_nan_enabled():
        return contextlib.nullcontext()
    return torch.autograd.set_detect_anomaly(True, check_nan=False)


@contextlib.contextmanager
def restoring_node_meta() -> Iterator[None]:
    """Put `torch.fx.traceback.current_meta` back as it was. torch's selective-checkpoint mode writes
    its tags there while a program is traced (upstream traces inside `preserve_node_meta`, which
    restores it): left behind, every node a later trace makes (Dynamo's, upstream Inductor's
    partitioner's) carried a checkpoint tag, and that partitioner failed on it."""
    import torch.fx.traceback as fx_traceback

    saved = fx_traceback.current_meta.copy()
    try:
        yield
    finally:
        fx_traceback.current_meta = saved


def _record(traced: Callable, fake_primals: list, decompositions: dict, fake_mode) -> torch.fx.GraphModule:
    """Run `traced` recording aten calls: with the lean recorder (trace/tracer.py) when it can, else make_fx."""
    with restoring_node_meta():
        return _record_once(traced, fake_primals, decompositions, fake_mode)


def _record_once(traced: Callable, fake_primals: list, decompositions: dict, fake_mode) -> torch.fx.GraphModule:
    recorder = LeanTracer(list(fake_primals), decompositions)
    try:
        with fake_mode, recorder:
            outputs = traced(list(fake_primals))
        return recorder.finish(outputs)
    except (AotgradError, NeedsSyntheticBase, NeedsTraining):
        raise
    except Exception:  # symbolic shapes, other higher-order ops...: make_fx knows them all
        pass
    with fake_mode:
        gm = make_fx(traced, decomposition_table=decompositions, _disable_torch_fn_metadata_mode=True)(
            list(fake_primals)
        )
    _refuse_bool_subtraction(gm)
    _keep_item_memos(gm, fake_primals)
    return gm


def _refuse_bool_subtraction(gm: torch.fx.GraphModule) -> None:
    """Under symbolic sizes make_fx records `aten.sub` of two bool tensors without running its check
    (with concrete sizes it raises while tracing). Eager's program cannot contain one (it raises
    first), so it is functionalization's write back through a bool view: raised here as the
    concrete trace raises it, and refused by name like it."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sub.Tensor):
        vals = [getattr(a, "meta", {}).get("val") for a in node.args[:2]]
        if all(isinstance(v, torch.Tensor) and v.dtype is torch.bool for v in vals):
            raise RuntimeError(f"Subtraction, the `-` operator, {_BOOL_SUBTRACTION} (node {node.name})")


def _keep_item_memos(gm: torch.fx.GraphModule, fake_primals: list) -> None:
    """make_fx stores a detached copy of each input as its placeholder's value, which forgets the
    symbol `.item()` of a 0-d input answers (Dynamo passes a float it made dynamic as such a tensor).
    The compiler re-runs the graph on those values (Inductor's fake propagation), so copy it over."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, primal in zip(placeholders, fake_primals):
        memo = getattr(primal, "item_memo", None)
        val = node.meta.get("val")
        if memo is not None and isinstance(val, FakeTensor) and val is not primal:
            val.item_memo = memo


# Messages of functionalization/autograd limits hit while tracing programs eager runs fine.
_BOOL_SUBTRACTION = "with two bool tensors is not supported"
_FUNCTIONALIZATION_LIMITS = (
    "mutation on a view chain",
    "Can't detach views in-place",
    "INTERNAL ASSERT FAILED",
    "more than one element of the written-to tensor",
    _BOOL_SUBTRACTION,  # scattering a write back through a bool view
)


def _trace_body(fn, layout, leaves, primals, state, *, training, keep_in_graph, storage_groups):
    mode = state["functionalize"] = Functionalize()
    # With grad mode on even for a call made under no_grad whose program turns it on (NeedsTraining):
    # the clones must carry the gradient path the program's enable_grad() region differentiates.
    with mode, torch.enable_grad() if training else contextlib.nullcontext():
        initial_token = _seed_effect_token(mode)
        funs = [FunctionalTensor.to_functional(p) for p in primals]
        bases = [_clone_for_grad(f, p) if training and f.requires_grad else f for f, p in zip(funs, primals)]
    _tag_input_clones(bases, funs)
    for k, (p, b) in enumerate(zip(primals, bases)):
        b._aotgrad_caller_leaf = p.requires_grad and p.is_leaf
        b._aotgrad_caller_view = p.requires_grad and p._is_view()  # traced as a clone, which is not a view
        b._aotgrad_name = _primal_name(layout, k)
        b._aotgrad_caller_meta = analysis.meta_of(p)  # differs from b's for an expand()ed input
        # Traced as a dense clone when it requires grad; writes into it must still be refused.
        b._aotgrad_in_overlapping = overlaps_itself(*b._aotgrad_caller_meta[:2])
    # Absolute storage offsets recorded on a clone are off by this much on the caller's tensor.
    shifts = [_offset_shift(p, b) for p, b in zip(primals, bases)]
    for k, (b, f) in enumerate(zip(bases, funs)):
        b._aotgrad_primal = (k, shifts[k])
        if b is not f:  # the graph input itself, for as_strided reads outside the copy (trace_modes)
            b._aotgrad_input_value, b._aotgrad_clone_mutations = f, analysis.mutation_count(b)
    before = [(b.grad_fn, analysis.mutation_count(b)) for b in bases]
    versions = [_version(b) for b in bases]
    user_leaves = _user_leaves(layout, leaves, bases, shifts, mode)
    leaf_grad_fns = {i: user_leaves[i].grad_fn for i in layout.leaf_views}
    args, kwargs = pytree.tree_unflatten(user_leaves, layout.spec)
    hooks = TraceHooks(dense_copies=[b._aotgrad_name for b in bases if b._aotgrad_in_overlapping and b.requires_grad])
    with mode, hooks, compiling_session():
        out = fn(*args, **kwargs)
    flat_out, out_spec = pytree.tree_flatten(out)
    subclass_layout.refuse_subclass_outputs(flat_out)  # retraced through the subclass stage
    if training:
        _refuse_sparse_outputs_requiring_grad(flat_out)
    if hooks.requires_grad_called:
        _refuse_requires_grad_on_shared_inputs(leaves, user_leaves, merged=bool(layout.leaf_views))
    with mode:  # reading a view's grad_fn may regenerate it (its base marked with requires_grad_() later)
        needs_autograd = not training and _outputs_need_autograd(flat_out, [*funs, *bases, *user_leaves])
    if needs_autograd:
        raise NeedsTraining  # outputs of an enable_grad() region, or marked with requires_grad_()

    fw = _Forward(out_spec=out_spec)
    _check_storage_groups(storage_groups, user_leaves, {id(b): n for b, (_, n) in zip(bases, before)})
    _analyse_inputs(fw, layout, leaves, primals, funs, bases, before, shifts, training, keep_in_graph)
    fw.memory_detached = _sharing_memory_with_detached(fw, layout, storage_groups)
    with mode:  # members of a mutated synthetic base regenerate lazily
        _analyse_leaf_views(fw, layout, user_leaves, leaf_grad_fns, shifts)
    _bump_versions(fw, bases, versions)
    try:
        with mode:  # reading autograd facts off views of mutated tensors replays view functions
            _analyse_outputs(fw, layout, flat_out, user_leaves, bases, shifts, training)
    except (RuntimeError, ValueError) as e:
        if isinstance(e, AotgradError):
            raise
        raise UnsupportedAliasingError(
            "aotgrad: an output is a view whose base was changed in place (e.g. by t_() or set_()) after "
            f"the view was taken, and its autograd history cannot be rebuilt ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). Return a .clone() of that view."
        ) from e

    grads: list = []
    num_tangents = 0
    if training:
        grads, num_tangents = _trace_backward(fw, primals, funs, bases, mode)
    _sink_effect_token(mode, initial_token)
    set_in_prologue = {a.primal for a in fw.prologue}
    grad_free = tuple(k for k, (p, g) in enumerate(zip(primals, grads))
                      if g is None and p.requires_grad and k not in set_in_prologue)
    if len(grad_free) == sum(p.requires_grad for p in primals):
        # Outputs of an autograd.Function require grad only if some input does; an output can
        # require grad in eager without a gradient path (a view taken under no_grad): keep the edges.
        grad_free = ()
    state["plan"] = Plan(
        layout=layout,
        mutations=tuple(fw.mutations),
        fw_outputs=tuple(fw.fw_outputs),
        out_spec=out_spec,
        out_sources=tuple(fw.out_sources),
        prologue=tuple(fw.prologue),
        epilogue=tuple(fw.epilogue),
        is_training=training,
        grad_free=grad_free,
        autocast=ambient.autocast_key(),
        grad_mode_at_call=torch.is_grad_enabled(),
    )
    state["num_tangents"] = num_tangents
    state["in_graph_mutated"] = {i for i, m in enumerate(fw.mutations) if m.kept_in_graph or m.in_backward}
    state["in_graph_mutated"] |= hooks.clone_coordinates  # as_strided offsets are relative to the clone
    with mode:
        inputs = [t for t in (*funs, *bases, *user_leaves) if isinstance(t, torch.Tensor)]
        _refuse_outputs_of_new_leaves(flat_out, inputs, [g for g, _ in before],
                                      any(isinstance(p, torch.Tensor) and p.requires_grad for p in primals))
        _refuse_writes_of_new_leaves(bases, inputs, [g for g, _ in before])
    return list(fw.fw_values) + list(grads)


def _outputs_need_autograd(flat_out, inputs: list) -> bool:
    """Does some output of a trace without autograd require grad through a history only a training
    graph gives it? Not an input returned as is, nor a view of an input without a grad_fn: one taken
    under no_grad of an input requiring grad (eager gives it requires_grad=True), or one the program
    marked with requires_grad_() (`ViewChain.requires_grad`); the run time rebuilds both from the
    caller's tensor the same way. So the user's inference_compiler gets those programs."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    known = {id(t) for t in tensors} | {id(t._base) for t in tensors if t._base is not None}
    for o in flat_out:
        if not isinstance(o, torch.Tensor) or not o.requires_grad or id(o) in known:
            continue
        if o.grad_fn is None and o._base is not None and id(o._base) in known:
            continue
        return True
    return False


def _refuse_requires_grad_on_shared_inputs(leaves, user_leaves, merged: bool = False) -> None:
    """requires_grad_() on an input that is a view or shares memory with another input: autograd
    then ties the gradient state of the tensors sharing that memory together; refused. So is any
    requires_grad_() where inputs sharing memory were merged into one base (`merged`): traced as
    views of that base, a view the program marks loses the mark (an output view came back without
    requires_grad)."""
    shared = {i for g in shared_storage_groups(leaves) for i in g}
    if merged:
        raise UnsupportedMutationError(
            f"aotgrad: the program calls requires_grad_() while inputs {sorted(shared)} share memory and one "
            "of them is written; aotgrad traces them as views of one base, where the mark is lost. Call "
            "requires_grad_() before the call, or pass separate tensors (.clone())."
        )
    for i, (x, u) in enumerate(zip(leaves, user_leaves)):
        if isinstance(x, torch.Tensor) and not x.requires_grad and u.requires_grad and (x._is_view() or i in shared):
            raise UnsupportedMutationError(
                f"aotgrad: the program calls requires_grad_() on input {i} (or on a tensor sharing its "
                "memory), which is a view or shares memory with another input. Call requires_grad_() on "
                "it before the call."
            )


def _refuse_sparse_outputs_requiring_grad(flat_out) -> None:
    """The compiled backward takes dense gradients; a sparse output's gradient arrives sparse
    (OpInfo `to_sparse`: torch's raw "unsupported memory format" error in the backward)."""
    for pos, o in enumerate(flat_out):
        if isinstance(o, torch.Tensor) and o.layout is not torch.strided and o.requires_grad:
            raise UnsupportedOutputError(
                f"aotgrad: output {pos} is a {o.layout} tensor that requires grad; aotgrad's compiled backward "
                "takes dense (strided) gradients. Return it dense and convert it outside the compiled function "
                "(e.g. call .to_sparse() on the result), or detach it."
            )


def _refuse_outputs_of_new_leaves(flat_out, inputs: list, input_grad_fns: list, any_grad: bool) -> None:
    """An output that requires grad only through a tensor the program itself made an autograd leaf
    (`t.requires_grad_()`) would come back detached: the compiled backward differentiates with
    respect to the inputs alone. Refuse it."""
    roots = {g for g in input_grad_fns if g is not None} | {t.grad_fn for t in inputs if t.grad_fn is not None}
    known = {id(t) for t in inputs}
    for pos, o in enumerate(flat_out):
        if isinstance(o, torch.Tensor) and o.grad_fn is not None and _only_new_leaves(o, roots, known, any_grad):
            raise UnsupportedOutputError(
                f"aotgrad: output {pos} requires grad only through a tensor the program marked with "
                "requires_grad_() (a new autograd leaf); the compiled backward differentiates with respect "
                "to the inputs. Create that tensor outside and pass it in as an input that requires grad."
            )


def _refuse_writes_of_new_leaves(bases, inputs: list, input_grad_fns: list) -> None:
    """An input written in place with a value that requires grad only through a tensor the program
    marked with requires_grad_() comes to require grad in eager (its history is that write); the
    compiled write carries no history. Refused (fuzz seed 1 program 9225)."""
    roots = {g for g in input_grad_fns if g is not None}
    known = {id(t) for t in inputs}
    for b, before in zip(bases, input_grad_fns):
        if b.requires_grad and b.grad_fn is not None and b.grad_fn is not before and _only_new_leaves(b, roots, known):
            raise UnsupportedMutationError(
                f"aotgrad: the program writes into {b._aotgrad_name} a value that requires grad only through a "
                "tensor it marked with requires_grad_() (a new autograd leaf), so in eager that input comes to "
                "require grad; the compiled write carries no autograd history. Create that tensor outside and "
                "pass it in as an input that requires grad."
            )


def _only_new_leaves(o: torch.Tensor, roots: set, known: set[int], any_grad: bool = True) -> bool:
    """Whether `o`'s autograd graph reaches a leaf the program made and no input, or, when no
    input requires grad (`roots` and `known` hold none that does), reaches no leaf at all (a view
    of a new leaf taken before it was marked: its edges lead nowhere). With an input that requires
    grad such an output is kept requiring grad by the run time (a no_grad view of that input)."""
    seen, todo, new_leaf, input_view = set(), [o.grad_fn], False, False
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if node in roots or id(leaf) in known:
            return False
        # A view taken under no_grad of a tensor that requires grad is an autograd leaf of the
        # input's too: the run time keeps such outputs requiring grad. A view of a tensor that does
        # not require grad, marked with requires_grad_(), is a new leaf like any other, and so is a
        # view of a new leaf taken before it was marked (fuzz seed 1 programs 2465, 15882).
        made = leaf is not None and (not leaf._is_view() or not leaf._base.requires_grad
                                     or (leaf._base.is_leaf and id(leaf._base) not in known))
        new_leaf |= made
        input_view |= leaf is not None and not made
        todo.extend(n for n, _ in node.next_functions)
    return new_leaf or (not input_view and not any_grad)


def _seed_effect_token(mode: FunctionalTensorMode):
    """Ops with ordered side effects (e.g. linalg error checks) are threaded through a token by
    functionalization; ours starts inside the graph, so the run time passes nothing extra."""
    token = torch.empty(0)
    mode._tokens[EffectType.ORDERED] = token
    return token


def _sink_effect_token(mode: FunctionalTensorMode, initial) -> None:
    """Keep the effectful ops alive: sink the last token (an impure op that DCE keeps)."""
    token = mode._tokens.get(EffectType.ORDERED)
    if token is not None and token is not initial:
        torch.ops.prims._sink_tokens.default([analysis.unwrap(token)])


def _tag_input_clones(bases, funs) -> None:
    for b, f in zip(bases, funs):
        if b is not f:
            _node_of(torch._from_functional_tensor(b.elem)).meta[INPUT_CLONE] = True


def _finish_graph(gm: torch.fx.GraphModule, in_graph_mutated: set[int]) -> None:
    """Flat signature, placeholders first, input clones dropped, dead code and repeats removed."""
    graph = gm.graph
    graph._codegen = torch.fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for n in placeholders:
        first.prepend(n)
    primal_nodes = [n for n in placeholders if n.name.startswith("primals")]
    for n in list(graph.nodes):
        if n.meta.get(INPUT_CLONE):
            src = next(a for a in n.all_input_nodes if a.op == "placeholder")
            k = primal_nodes.index(src)
            same = analysis.meta_of(src.meta["val"])[:2] == analysis.meta_of(n.meta["val"])[:2]
            if same and k not in in_graph_mutated:
                n.replace_all_uses_with(src)
                graph.erase_node(n)
    fold_view_roundtrips(graph)
    _copy_before_unviewable_views(graph)
    drop_unread_running_stats(graph)
    graph.eliminate_dead_code()
    eliminate_common_subexpressions(graph, keep_apart=(INPUT_CLONE, BACKWARD_MUTATION))
    graph.lint()
    gm.recompile()


def _copy_before_unviewable_views(graph: torch.fx.Graph) -> None:
    """Functionalization can apply a recorded `view` to an inner value laid out unlike the value the
    graph records for it (seen after in-place metadata ops); on real tensors that view would fail.
    Give such a view a contiguous copy to view (the graph is functional, so nothing sees the alias)."""
    for n in list(graph.nodes):
        if n.target is not torch.ops.aten.view.default or not isinstance(n.args[0], torch.fx.Node):
            continue
        src = n.args[0].meta.get("val")
        shape = torch.fx.node.map_arg(n.args[1], lambda a: a.meta.get("val"))
        if not isinstance(src, torch.Tensor) or src.is_contiguous() or not analysis.view_fails(src, shape):
            continue
        with graph.inserting_before(n):
            dense = graph.call_function(
                torch.ops.aten.clone.default, (n.args[0],), {"memory_format": torch.contiguous_format}
            )
        dense.meta["val"] = src.clone(memory_format=torch.contiguous_format)
        n.replace_input_with(n.args[0], dense)
