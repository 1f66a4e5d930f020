"""Stage 3 — capture: one trace yields the joint graph *and* the plan.

Autograd sits above functionalization in the dispatcher, so we trace the user's forward once, on fake
tensors that require grad, under `FunctionalTensorMode`, inside one recording session (tracer.py, or make_fx). At the end of
the forward we read the mutation and alias facts off the functional wrappers (analysis.py), decide
which values need tangents, add those tangents as new graph placeholders, and call
`torch.autograd.grad` in the same session to trace the backward. Upstream traces the program two or
three times to get the same result.

    joint(primals_1.., tangents_1..) -> [mutated input values.., user outputs.., intermediate bases..,
                                         grad of primal 1.., grad of primal n]

Graph inputs that require grad are cloned before the program sees them (a mutation must not hit the
value we differentiate with respect to); the clones are dropped from the finished graph, where they
are no-ops.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.effects import _EffectType as EffectType
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, disable_fake_tensor_cache
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_slot,
    make_fx,
    track_tensor_tree,
)
from torch.utils import _pytree as pytree

from . import analysis
from .cse import eliminate_common_subexpressions
from .errors import (
    AotgradError,
    BackwardMutationError,
    InplaceOnLeafError,
    UnsupportedAliasingError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)
from .plan import (
    AliasOfGraphOutput,
    AliasOfLeaf,
    AliasOfOutput,
    AliasOfPrimal,
    BumpVersion,
    Captured,
    Constant,
    CopyInto,
    Detach,
    FwOutput,
    GraphOutput,
    InputItself,
    InputLayout,
    InputMutation,
    IntermediateBase,
    MutatedInputValue,
    Plan,
    Restride,
    RestrideLeaf,
    SameAs,
    SetRequiresGrad,
    SetToOutput,
    SetToPrimal,
    StorageOfLeaf,
    UserOutput,
)
from .trace_modes import Functionalize, TraceHooks, elements_per_root_element, overlaps_itself
from .tracer import LeanTracer

INPUT_CLONE = "aotgrad_input_clone"
BACKWARD_MUTATION = "aotgrad_backward_mutation"


class NeedsSyntheticBase(Exception):
    """Raised inside capture when inputs sharing a storage were mutated: retrace with a merged base."""

    def __init__(self, groups):
        super().__init__(groups)
        self.groups = groups


@dataclass
class _Forward:
    """What the traced forward produced, before tangents are added."""

    fw_values: list = field(default_factory=list)  # traced tensors returned by the forward graph
    fw_outputs: list = field(default_factory=list)  # FwOutput per value
    fw_functional: list = field(default_factory=list)  # the functional tensor per value (for autograd)
    out_sources: list = field(default_factory=list)
    out_spec: Any = None
    mutations: list = field(default_factory=list)
    epilogue: list = field(default_factory=list)
    prologue: list = field(default_factory=list)
    relayout: set = field(default_factory=set)  # primals whose functional value changed layout
    restrided: set = field(default_factory=set)  # synthetic bases with a member's metadata mutated
    memory_detached: set = field(default_factory=set)  # primals sharing memory with one detach_()ed


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
        if storage_groups:
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


def _record(traced: Callable, fake_primals: list, decompositions: dict, fake_mode) -> torch.fx.GraphModule:
    """Run `traced` recording aten calls: with the lean recorder (tracer.py) when it can, else make_fx."""
    recorder = LeanTracer(list(fake_primals), decompositions)
    try:
        with fake_mode, recorder:
            outputs = traced(list(fake_primals))
        return recorder.finish(outputs)
    except (AotgradError, NeedsSyntheticBase):
        raise
    except Exception:  # symbolic shapes, other higher-order ops...: make_fx knows them all
        pass
    with fake_mode:
        gm = make_fx(traced, decomposition_table=decompositions, _disable_torch_fn_metadata_mode=True)(
            list(fake_primals)
        )
    _keep_item_memos(gm, fake_primals)
    return gm


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



def _recorder():
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)


def _node_of(t: torch.Tensor) -> torch.fx.Node:
    mode = _recorder()
    if isinstance(mode, LeanTracer):
        return mode.node_of(t)
    return get_proxy_slot(t, mode.tracer).proxy.node


def _last_node() -> torch.fx.Node:
    mode = _recorder()
    graph = mode.graph if isinstance(mode, LeanTracer) else mode.tracer.graph
    return next(reversed(graph.nodes))


# Messages of functionalization/autograd limits hit while tracing programs eager runs fine.
_FUNCTIONALIZATION_LIMITS = (
    "mutation on a view chain",
    "Can't detach views in-place",
    "INTERNAL ASSERT FAILED",
    "more than one element of the written-to tensor",
    "with two bool tensors is not supported",  # scattering a write back through a bool view
)


def _trace_body(fn, layout, leaves, primals, state, *, training, keep_in_graph, storage_groups):
    mode = state["functionalize"] = Functionalize()
    with mode:
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
    with mode, hooks:
        out = fn(*args, **kwargs)
    flat_out, out_spec = pytree.tree_flatten(out)

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
    )
    state["num_tangents"] = num_tangents
    state["in_graph_mutated"] = {i for i, m in enumerate(fw.mutations) if m.kept_in_graph or m.in_backward}
    state["in_graph_mutated"] |= hooks.clone_coordinates  # as_strided offsets are relative to the clone
    return list(fw.fw_values) + list(grads)


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


def _clone_for_grad(f: FunctionalTensor, primal: torch.Tensor) -> FunctionalTensor:
    """A copy the program may mutate, with the input's strides (clone() keeps them only when the input
    is dense), so metadata read off it maps to the caller's tensor by a shift of the storage offset."""
    if is_non_overlapping_and_dense_or_false(primal) or torch._debug_has_internal_overlap(primal) == 1:
        return f.clone()
    out = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
    out.copy_(f)  # analysis counts mutations from after this one (capture._trace_body)
    return out


def _offset_shift(primal: torch.Tensor, base: FunctionalTensor) -> int | None:
    if primal.stride() != base.stride():
        return None  # an overlapping input: no storage mapping (checked where it is needed)
    return primal.storage_offset() - base.storage_offset()


def _shifted(name: str, shift: int | None, size, stride, offset) -> tuple:
    if shift is None:
        raise _overlapping_input(name)
    return size, stride, offset + shift


def _overlapping_input(name: str) -> AotgradError:
    return UnsupportedAliasingError(
        f"aotgrad: {name} has overlapping memory (e.g. an expand()) and requires grad; aotgrad cannot "
        "replay a metadata mutation or an as_strided alias of it. Pass a .contiguous() copy."
    )


def _no_storage_coordinates(what: str) -> AotgradError:
    return UnsupportedAliasingError(
        f"aotgrad: {what} would need as_strided in the caller's storage after a data mutation of an "
        "input that is not contiguous or not at storage offset 0, whose layout functionalization does not "
        "keep. Pass a .contiguous() input (or a .clone()), or return a .clone()."
    )


def _user_leaves(layout: InputLayout, leaves, bases, shifts, mode) -> list:
    """The flat arguments the program sees: graph inputs, constants and views of synthetic bases."""
    out = []
    for i in range(layout.num_leaves):
        if i in layout.constants:
            out.append(layout.constants[i])
        elif i in layout.leaf_views:
            v = layout.leaf_views[i]
            shift = shifts[v.primal] or 0
            with mode:
                view = bases[v.primal].as_strided(v.size, v.stride, v.offset - shift)
            view._aotgrad_shares_input_memory = True
            view._aotgrad_name = f"input {i}"
            view._aotgrad_caller_not_view = not leaves[i]._is_view()
            view._aotgrad_member_leaf = i  # views of it inherit this (trace_modes._note_views)
            out.append(view)
        else:
            out.append(bases[layout.leaf_primal[i]])
    # Duplicated synthetic-base members must stay the same object.
    for i, v in layout.leaf_views.items():
        first = next(j for j, w in layout.leaf_views.items() if w is v)
        out[i] = out[first]
    return out


def _check_storage_groups(groups, user_leaves, counts_before: dict[int, int]) -> None:
    """Inputs that share a storage but were traced as separate graph inputs must not be mutated."""
    mutated = [list(g) for g in groups if any(_leaf_mutated(user_leaves[i], counts_before) for i in g)]
    if mutated:
        raise NeedsSyntheticBase(mutated)


def _sharing_memory_with_detached(fw, layout, groups) -> set[int]:
    """Primals traced apart from an input in their memory that the program detach_()es."""
    detached = {a.primal for a in fw.epilogue if isinstance(a, Detach)}
    out: set[int] = set()
    for g in groups:
        members = {layout.leaf_primal[i] for i in g} - {None}
        if members & detached:
            out |= members - detached
    return out


def _leaf_mutated(t, counts_before: dict[int, int]) -> bool:
    if not isinstance(t, FunctionalTensor):
        return False
    m = analysis.input_mutation(t, None, counts_before.get(id(t), 0))
    return m.data or m.metadata or m.storage


def _analyse_inputs(fw, layout, leaves, primals, funs, bases, before, shifts, training, keep_in_graph) -> None:
    grad_on = torch.is_grad_enabled()
    copies, sets, detaches = [], [], []
    for k, (p, f, b) in enumerate(zip(primals, funs, bases)):
        m = analysis.input_mutation(b, *before[k])
        name = _primal_name(layout, k)
        if analysis.was_resized(b):
            raise UnsupportedMutationError(
                f"aotgrad: {name} has its storage resized inside the program "
                "(resize_storage_bytes_); this is not supported yet. Resize it before the call."
            )
        real = layout.primal_sources[k]
        leaf_tensor = leaves[real.leaf] if hasattr(real, "leaf") else None
        if f.requires_grad and not p.requires_grad and f.is_leaf:
            if leaf_tensor is not None and leaf_tensor.is_leaf:
                fw.prologue.append(SetRequiresGrad(k))
            else:
                raise UnsupportedMutationError(
                    f"aotgrad: the program calls requires_grad_() on {name}, which is not a leaf."
                )
        if training and p.requires_grad and p.is_leaf and grad_on:
            if m.seen_by_autograd:
                raise InplaceOnLeafError(
                    f"aotgrad: the program mutates {name} in place, but it is a leaf that requires grad "
                    "(eager raises 'a leaf Variable that requires grad is being used in an in-place "
                    "operation'). Mutate it under torch.no_grad(), or pass a non-leaf (x.clone())."
                )
        if m.storage and m.visible_to_autograd and b.requires_grad:
            raise UnsupportedMutationError(
                f"aotgrad: {name} is set_() to another tensor and also mutated where autograd records "
                "it; aotgrad cannot replay both. Do the data mutation under torch.no_grad()."
            )
        if getattr(b, "_aotgrad_read_caller_storage", False) and (m.data or m.metadata or m.storage):
            raise UnsupportedAliasingError(
                f"aotgrad: the program reads storage outside {name} with as_strided (an absolute storage "
                "offset) and also mutates it; aotgrad traces that input (it requires grad) as a copy, so the "
                "read would miss the mutation. Use views relative to the input, or mutate a .clone()."
            )
        if m.data and analysis.meta_of(b) != analysis.meta_of(analysis.unwrap(b)):
            # The functional value of a mutated non-dense input lost the input's layout; metadata read
            # off its views is not in the caller's storage coordinates.
            fw.relayout.add(k)
            if getattr(b, "_aotgrad_absolute_offset_before_mutation", False):
                raise UnsupportedAliasingError(
                    f"aotgrad: {name} sits at storage offset {b.storage_offset()} and the program takes an "
                    "as_strided view of it with an absolute storage offset, then mutates its data: "
                    "functionalization rebuilds that view on a fresh copy, where the offset addresses other "
                    "elements. Use views relative to the input (slicing, select), or pass a .clone()."
                )
        if m.metadata and not m.storage:
            if k in fw.relayout:
                raise _no_storage_coordinates(name)
            meta = _shifted(name, shifts[k], *analysis.meta_of(b))
            fw.epilogue.append(Restride(k, *meta, no_grad=not m.seen_by_autograd))
        if m.storage:
            other = _storage_owner(b, bases, k)
            if other is not None:
                sets.append(SetToPrimal(k, other))
            else:
                sets.append(SetToOutput(k, _add_fw_value(fw, b, MutatedInputValue(k), False)))
        elif m.data:
            if keep_in_graph and not m.metadata:
                torch.ops.aten.copy_.default(p, analysis.unwrap(b))
                m = InputMutation(data=True, visible_to_autograd=False, kept_in_graph=True)
            else:
                differentiable = training and m.visible_to_autograd and analysis.is_differentiable(b)
                if differentiable and isinstance(layout.primal_sources[k], StorageOfLeaf):
                    raise UnsupportedMutationError(
                        f"aotgrad: the program writes a value that requires grad into {name}, inputs that "
                        "share memory without one autograd base of their dtype (e.g. views of a "
                        ".detach(), or view_as_real views): in eager they then require grad through their "
                        "own bases, which aotgrad cannot reach. Pass separate tensors (clone one of them)."
                    )
                idx = _add_fw_value(fw, b, MutatedInputValue(k), differentiable)
                copies.append(CopyInto(k, idx, grad=differentiable or (m.visible_to_autograd and grad_on)))
        if p.requires_grad and (not b.requires_grad or getattr(b, "_aotgrad_detached", False)):
            detaches.append(Detach(k))  # the program called detach_() on it (maybe re-attached by a copy_)
        fw.mutations.append(m)
    fw.epilogue[:0] = detaches  # detach_() first: a later copy_ into it is then seen as in eager
    fw.epilogue.extend(copies)
    fw.epilogue.extend(sets)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference tensors have no version counter


def _bump_versions(fw, bases, versions) -> None:
    """In-place ops on an input or on views of it bump its version counter in eager; the epilogue's
    copy_ does that for data mutations, the rest (metadata ops on views, no-op writes, and writes
    kept in the graph: a compiled kernel's store does not bump it) need a bump."""
    copied = {a.primal for a in fw.epilogue if isinstance(a, (CopyInto, SetToOutput, SetToPrimal))}
    for k, b in enumerate(bases):
        if _version(b) != versions[k] and k not in copied:
            fw.epilogue.append(BumpVersion(k))


def _analyse_leaf_views(fw, layout, user_leaves, grad_fns_before, shifts) -> None:
    """Arguments the graph saw as views of a synthetic base: their data mutations reach the caller
    through the base; a metadata mutation is replayed on the caller's argument itself."""
    for i, view in layout.leaf_views.items():
        u = user_leaves[i]
        if torch._functionalize_was_storage_changed(u.elem):
            raise UnsupportedMutationError(
                f"aotgrad: input {i} shares memory with another input and is set_(); not supported. "
                "Pass separate tensors."
            )
        if torch._functionalize_has_metadata_mutation(u.elem):
            if view.primal in fw.relayout:
                raise _no_storage_coordinates(f"input {i}")
            meta = _shifted(f"input {i}", shifts[view.primal], *analysis.meta_of(u))
            fw.epilogue.append(RestrideLeaf(i, *meta, no_grad=u.grad_fn is grad_fns_before[i]))
            fw.restrided.add(view.primal)  # views of it are rebuilt with as_strided


def _primal_name(layout: InputLayout, k: int) -> str:
    src = layout.primal_sources[k]
    kind = type(src).__name__
    if kind == "FromLeaf":
        return f"input {src.leaf}"
    return f"the storage shared by inputs around argument {src.leaf}"


def _storage_owner(b, bases, k) -> int | None:
    sid = analysis.storage_id(b)
    for j, other in enumerate(bases):
        if j != k and analysis.storage_id(other) == sid:
            return j
    return None


def _add_fw_value(fw: _Forward, t, kind, differentiable: bool) -> int:
    fw.fw_values.append(analysis.unwrap(t))
    fw.fw_outputs.append(FwOutput(kind, differentiable))
    fw.fw_functional.append(t)
    return len(fw.fw_values) - 1


def _analyse_outputs(fw, layout, flat_out, user_leaves, bases, shifts, training) -> None:
    """Decide, per user output, where it comes from (plan.OutputSource); add graph outputs for the
    ones the graph must return: plain outputs first, then intermediate bases (upstream's order)."""
    leaf_of: dict[int, int] = {}
    for i, x in enumerate(user_leaves):
        if isinstance(x, torch.Tensor):
            leaf_of.setdefault(id(x), i)
    base_storage = {analysis.storage_id(b): k for k, b in enumerate(bases)}
    for k, b in enumerate(bases):
        if getattr(b, "_aotgrad_read_caller_storage", False):
            base_storage.setdefault(analysis.storage_id(b._aotgrad_input_value), k)
    position_of: dict[int, int] = {}
    pending = []  # views of intermediates: resolved once plain outputs have graph indices
    values = list(flat_out) + _detached_bases(flat_out, leaf_of, base_storage, bases)
    sources: list = [None] * len(values)
    for pos in _bases_first(values):
        o = values[pos]
        if isinstance(o, torch.Tensor) and id(o) in position_of:
            sources[pos] = SameAs(position_of[id(o)])  # returned twice: the same object twice
            continue
        if isinstance(o, torch.Tensor):
            position_of[id(o)] = pos
        q = position_of.get(id(getattr(o, "_base", None)))
        kept_history = isinstance(o, torch.Tensor) and o.requires_grad and getattr(o._base, "_aotgrad_detached", False)
        if q is not None and not _is_graph_value(sources[q]) and not kept_history:
            # A view of an output we rebuild ourselves (e.g. of a .detach()): rebuild it from that one.
            chain = analysis.view_chain(o, o._base, torch._functionalize_has_metadata_mutation(o._base.elem))
            if chain is not None:
                chain = _chain_in_caller_coordinates(fw, layout, f"output {pos}", o, chain, base_storage, bases, shifts)
                sources[pos] = AliasOfOutput(q, chain)
                continue
        name = f"output {pos}" if pos < len(flat_out) else "the .detach() of an input that an output views"
        source = _classify_output(fw, layout, name, o, leaf_of, base_storage, bases, shifts, training)
        if source is None:
            pending.append(pos)
        sources[pos] = source
    plain_index: dict[int, int] = {}
    for pos, src in enumerate(sources):
        if isinstance(src, tuple):
            o = src[1]
            plain_index[id(o)] = _add_fw_value(fw, o, UserOutput(pos), training and analysis.is_differentiable(o))
            sources[pos] = GraphOutput(plain_index[id(o)])
    chains = {pos: _intermediate_chain(pos, values[pos]) for pos in sorted(pending)}
    # An intermediate base is differentiable only if some view rebuilt from it keeps an autograd path
    # to it: else the compiled Function would connect every input to it, and eager's None grads would
    # become zeros.
    grad_bases = {id(values[pos]._base) for pos, c in chains.items() if c is not None and _keeps_grad_path(c)}
    for pos, chain in chains.items():
        base_grad = training and id(values[pos]._base) in grad_bases
        sources[pos] = _view_of_intermediate(fw, pos, values[pos], chain, plain_index, training, base_grad)
    fw.out_sources = sources


def _detached_bases(flat_out, leaf_of, base_storage, bases) -> list:
    """`.detach()`ed aliases of inputs that the program did not return but whose views it did.

    In eager such a view's `._base` is the detached tensor, shared by all its views; these become
    hidden entries after the user outputs (plan.Plan.out_sources), rebuilt once at run time."""
    hidden: list = []
    returned = {id(o) for o in flat_out}
    for o in flat_out:
        b = getattr(o, "_base", None)
        if not isinstance(b, FunctionalTensor) or id(b) in returned or any(b is h for h in hidden):
            continue
        k = base_storage.get(analysis.storage_id(b))
        if k is None or b is bases[k] or b._base is not None or id(b) in leaf_of:
            continue
        if not b.requires_grad and (b.dtype == bases[k].dtype or bases[k].dtype.to_real() == b.dtype):
            hidden.append(b)
    return hidden


def _bases_first(values) -> list[int]:
    """Positions in the order to classify them: values that are the `._base` of another value first,
    so a view is rebuilt from its base whichever position the base was returned at."""
    base_ids = {id(getattr(o, "_base", None)) for o in values}
    firsts = [pos for pos, o in enumerate(values) if id(o) in base_ids]
    return firsts + [pos for pos in range(len(values)) if pos not in firsts]


def _is_graph_value(source) -> bool:
    return isinstance(source, (tuple, GraphOutput, InputItself)) or source is None


def _classify_output(fw, layout, name, o, leaf_of, base_storage, bases, shifts, training):
    """The source of one output, ("plain", o) for a graph output, or None for a view of an
    intermediate (decided later)."""
    if not isinstance(o, torch.Tensor):
        # A symbolic number (a size Dynamo returns across a graph break) is a Constant too: the run
        # time computes it from the symbols it reads off the inputs (Plan.symbol_sources).
        return Constant(o)
    if not isinstance(o, FunctionalTensor):
        return ("plain", o)
    if id(o) in leaf_of:
        return InputItself(leaf_of[id(o)])
    if training and o.requires_grad and o.is_leaf and o._base is None:
        raise UnsupportedOutputError(
            f"aotgrad: {name} is a leaf tensor created inside the program with requires_grad=True; "
            "aotgrad can only return tensors computed from the inputs. Pass it in as an input."
        )
    k = base_storage.get(analysis.storage_id(o))
    if k is None:
        return None if o._base is not None else ("plain", o)
    m = fw.mutations[k]
    # A view kept its autograd history through a later detach_() in eager (the trace knows whether it
    # requires grad); rebuilt from the detached tensor it would lose it. So would one rebuilt from
    # another input in the same memory: a version bump makes autograd rebuild that input's history
    # from the detached tensor.
    detached_in_place = any(isinstance(a, Detach) and a.primal == k for a in fw.epilogue) or (
        o.requires_grad and (k in fw.memory_detached or any(
            getattr(t, "_aotgrad_detached", False) for t in (bases[k], o, o._base)))
    )
    if detached_in_place:
        raise UnsupportedAliasingError(
            f"aotgrad: {name} aliases {_primal_name(layout, k)}, which (or a .detach() of it, or an input "
            "sharing its memory) the program detach_()es; "
            "aotgrad cannot tell views taken before the detach from views taken after. Return a .clone()."
        )
    value = getattr(bases[k], "_aotgrad_input_value", None)
    if value is not None and analysis.storage_id(o) == analysis.storage_id(value):
        # an as_strided read of the caller's storage around the input: replay it on the input itself
        chain = analysis.view_chain(o, value, False)
        if chain is None:
            raise UnsupportedAliasingError(f"aotgrad: {name} reads storage around {_primal_name(layout, k)} "
                                           "through as_strided and cannot be rebuilt as a view. Return a .clone().")
        return AliasOfPrimal(k, chain)
    try:
        chain = analysis.view_chain(o, bases[k], m.metadata or m.storage or k in fw.restrided)
    except UnsupportedAliasingError as e:
        raise UnsupportedAliasingError(f"{e} ({name}, a view of {_primal_name(layout, k)})") from None
    if chain is None:
        restrided_view = torch._functionalize_has_metadata_mutation(o.elem) or getattr(o, "_aotgrad_restrided_view", False)
        if m.any or k in fw.restrided or restrided_view:
            raise UnsupportedAliasingError(
                f"aotgrad: {name} aliases {_primal_name(layout, k)}, which the program also mutates (or "
                "restrides the view in place), and it cannot be rebuilt as a view of it. Return a .clone()."
            )
        return ("plain", o)
    if shifts[k] is None and not analysis.replays_on_layout(chain, bases[k], bases[k]._aotgrad_caller_meta):
        raise UnsupportedAliasingError(
            f"aotgrad: {name} is a view of {_primal_name(layout, k)} in the trace, which sees a dense "
            "copy of that input, but not on the input itself (it overlaps itself in memory, e.g. an expand(), "
            "so eager's reshape copies). Pass a .contiguous() input, or return a .clone()."
        )
    if k in fw.relayout and any(step.op is torch.ops.aten.as_strided.default for step in chain.steps):
        raise _no_storage_coordinates(f"{name} (an as_strided view of {_primal_name(layout, k)})")
    if chain.as_strided is not None:
        if k in fw.relayout:
            raise _no_storage_coordinates(f"{name} (a view of {_primal_name(layout, k)})")
        chain = replace(chain, as_strided=_shifted(f"{name}", shifts[k], *chain.as_strided))
    if shifts[k]:
        chain = replace(chain, steps=_steps_in_caller_coordinates(chain.steps, shifts[k], Fraction(1)))
    leaf = getattr(o, "_aotgrad_member_leaf", None)
    if leaf is not None and isinstance(layout.primal_sources[k], StorageOfLeaf) and not m.storage and _starts_absolute(chain):
        return AliasOfLeaf(leaf, chain)
    return AliasOfPrimal(k, chain)


def _starts_absolute(chain) -> bool:
    """The chain's first op places the view in storage coordinates (any tensor on that storage will do)."""
    if chain.as_strided is not None:
        return True
    return bool(chain.steps) and chain.steps[0].op is torch.ops.aten.as_strided.default


def _chain_in_caller_coordinates(fw, layout, name, o, chain, base_storage, bases, shifts):
    """A chain rebuilding `o` from another output that aliases an input's traced copy: its as_strided
    steps hold absolute offsets in the copy's storage, which the caller's tensor has shifted."""
    k = base_storage.get(analysis.storage_id(o))
    as_strided = chain.as_strided is not None or any(step.op is torch.ops.aten.as_strided.default for step in chain.steps)
    if k is None or not as_strided or analysis.storage_id(o) != analysis.storage_id(bases[k]):
        return chain
    if k in fw.relayout:
        raise _no_storage_coordinates(f"{name} (an as_strided view of {_primal_name(layout, k)})")
    if shifts[k] is None:
        raise _overlapping_input(_primal_name(layout, k))
    if chain.as_strided is not None:
        chain = replace(chain, as_strided=_shifted(name, shifts[k], *chain.as_strided))
    ratio = elements_per_root_element(o._base, bases[k])  # the chain starts from another output
    return replace(chain, steps=_steps_in_caller_coordinates(chain.steps, shifts[k], ratio))


def _steps_in_caller_coordinates(steps, shift: int, ratio: Fraction) -> tuple:
    """As_strided steps recorded on an input's clone (`trace_modes.TraceHooks` rewrote their offsets)
    replayed on the caller's tensor: back to the caller's storage offsets. `shift` counts the input's
    elements; `ratio` is how many elements of the chain's first tensor make one of the input's, and
    changes with `view_as_real` / `view_as_complex` on the way."""
    out = []
    for step in steps:
        if step.op is torch.ops.aten.view_as_real.default:
            ratio *= 2
        elif step.op is torch.ops.aten.view_as_complex.default:
            ratio /= 2
        elif step.op is torch.ops.aten.as_strided.default and len(step.args) >= 3 and step.args[2] is not None:
            size, stride, offset = step.args[:3]
            step = replace(step, args=(size, stride, offset + int(shift * ratio), *step.args[3:]))
        out.append(step)
    return tuple(out)


def _intermediate_chain(pos, o):
    """How to rebuild `o`, a view of a tensor the graph computes, from that tensor (None: return `o`)."""
    base = o._base
    if o.requires_grad and not base.requires_grad and o.grad_fn is not None and not getattr(base, "_aotgrad_detached", False):
        # A view an autograd.Function returned (a higher-order op's, e.g. while_loop's): its history is
        # the Function's backward, not its base's. Returned as computed (as upstream does).
        return None
    if o.requires_grad and not base.requires_grad:
        raise UnsupportedAliasingError(
            f"aotgrad: output {pos} is a view of an intermediate that the program detach_()es after taking "
            "the view; the view keeps its autograd history in eager, a view rebuilt from the detached base "
            "cannot. Return a .clone() of the view."
        )
    return analysis.view_chain(o, base, torch._functionalize_has_metadata_mutation(base.elem))


def _keeps_grad_path(chain) -> bool:
    """A view rebuilt with `chain` is connected to its base in autograd (no step under no_grad, no detach)."""
    return chain.no_grad_steps == 0 and not chain.detach


def _view_of_intermediate(fw, pos, o, chain, plain_index, training, base_grad):
    """A view of a tensor the graph computes: return the base from the graph, rebuild the view."""
    base = o._base
    if chain is None:
        if training and o.requires_grad and o.grad_fn is None:
            raise UnsupportedAliasingError(
                f"aotgrad: output {pos} is a view made under no_grad (an autograd leaf that requires grad) of "
                "an intermediate whose layout the program changed in place, with another dtype (e.g. .real); "
                "aotgrad can neither rebuild it as a view nor return it from the graph as such a leaf. "
                "Return a .clone() of it, or take the view outside no_grad."
            )
        return GraphOutput(_add_fw_value(fw, o, UserOutput(pos), training and analysis.is_differentiable(o)))
    idx = plain_index.get(id(base))
    if idx is None:
        differentiable = base_grad and analysis.is_differentiable(base)
        kind = IntermediateBase(leaf_requires_grad=training and not differentiable and analysis.is_differentiable(base))
        idx = _add_fw_value(fw, base, kind, differentiable)
        plain_index[id(base)] = idx
    return AliasOfGraphOutput(idx, chain)


# Autograd errors a backward eager never ran (the caller took no gradient) can hit in the trace.
_BACKWARD_LIMITS = (
    "invalid gradient at index",
    "is a view and its base or another view of its base has been modified inplace",
)


def _without_compiled_autograd():
    """With compiled autograd on (`torch._dynamo.config.compiled_autograd`, or its context manager),
    autograd.grad would hand our traced backward to Dynamo instead of running it under our modes."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca._disable() if ca is not None and ca.compiled_autograd_enabled else contextlib.nullcontext()


def _trace_backward(fw: _Forward, primals, funs, bases, mode):
    """Add tangent placeholders for the differentiable forward values, then trace autograd.grad."""
    diff = [i for i, o in enumerate(fw.fw_outputs) if o.differentiable]
    tangents_fun = []
    for n, i in enumerate(diff):
        tangent = _new_placeholder(f"tangents_{n + 1}", fw.fw_values[i])
        with mode:
            tangents_fun.append(FunctionalTensor.to_functional(tangent))
    wrt = [k for k, (p, f) in enumerate(zip(primals, funs)) if _wants_grad(p, f)]
    counts = [analysis.mutation_count(b) for b in bases]
    metas = [analysis.meta_of(analysis.unwrap(b)) for b in bases]
    grads_wrt: Sequence = ()
    if diff and wrt:
        with mode, _refuse_stale_saved_values(), _without_compiled_autograd():
            try:
                grads_wrt = torch.autograd.grad(
                    [fw.fw_functional[i] for i in diff],
                    [funs[k] for k in wrt],
                    tangents_fun,
                    allow_unused=True,
                )
            except RuntimeError as e:
                if getattr(mode, "aliased_metadata_op", None) or not any(s in str(e) for s in _BACKWARD_LIMITS):
                    raise  # capture names the in-place metadata op on an aliased tensor
                raise UnsupportedMutationError(
                    f"aotgrad: the backward, which aotgrad traces ahead of time (even if the caller never runs "
                    f"it), fails: {str(e).splitlines()[0]} Typical causes: an in-place metadata op (squeeze_, t_) "
                    "under no_grad on a tensor autograd differentiates through; an in-place op on a view from "
                    "a multi-output op (chunk, split) or after detach_(). Use out-of-place ops there."
                ) from e
    _check_backward_mutations(fw, primals, bases, counts, metas, tangents_fun)
    grads: list = [None] * len(funs)
    for k, g in zip(wrt, grads_wrt):
        grads[k] = analysis.unwrap(g) if g is not None else None
    return grads, len(diff)


@contextlib.contextmanager
def _refuse_stale_saved_values():
    """A value autograd saved for the backward was later modified in place or detach_()ed: eager's
    forward runs, but its backward raises (the caller's program often never calls it, e.g. after
    detach_()). aotgrad traces the backward ahead of time, so it refuses the program instead."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, AotgradError) or not any(sign in str(e) for sign in _STALE_SAVED_VALUE):
            raise
        raise UnsupportedMutationError(
            "aotgrad: the program modifies in place (or detach_()es) a value autograd saved for the "
            f"backward ({_saved_value_name(e)}); eager's backward through it fails, and aotgrad traces "
            "the backward ahead of time. Modify (or detach) a .clone() of that value instead."
        ) from e


_STALE_SAVED_VALUE = ("modified by an inplace operation", "saved tensor that has been detached in-place")


def _saved_value_name(e: RuntimeError) -> str:
    """'[torch.FloatTensor [1, 3]], which is output 0 of Tanh' out of autograd's version-check message."""
    first = str(e).splitlines()[0]
    if "inplace operation: " not in first:
        return "a tensor detached in place"
    return first.split("inplace operation: ", 1)[-1].split(", is at version")[0]


def _wants_grad(primal, fun) -> bool:
    """Gradients flow to a primal that required grad, or that the program made a leaf requiring grad."""
    return primal.requires_grad or (fun.requires_grad and fun.is_leaf)


def _new_placeholder(name: str, like: torch.Tensor) -> torch.Tensor:
    """A new graph input created mid-trace (tangents are only known once the forward has run)."""
    mode = _recorder()
    with disable_proxy_modes_tracing():
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if isinstance(mode, LeanTracer):
        mode.placeholder(name, value)
        return value
    tracer = mode.tracer
    proxy = tracer.create_proxy("placeholder", name, (), {}, name=name)
    proxy.node.meta["val"] = value
    track_tensor_tree(value, proxy, constant=None, tracer=tracer)
    return value


def _check_backward_mutations(fw, primals, bases, counts, metas, tangents_fun) -> None:
    for k, b in enumerate(bases):
        if analysis.meta_of(analysis.unwrap(b)) != metas[k]:
            raise BackwardMutationError(
                f"aotgrad: the backward pass changes the metadata (shape/strides/storage) of graph input {k}; "
                "only data mutations of inputs are supported in the backward."
            )
        if analysis.mutation_count(b) == counts[k]:
            continue
        if b.requires_grad or primals[k].requires_grad:
            raise BackwardMutationError(
                f"aotgrad: the backward pass mutates graph input {k}, which requires grad; this cannot be "
                "kept in the backward graph. Mutate a tensor that does not require grad."
            )
        if fw.mutations[k].any:
            raise BackwardMutationError(
                f"aotgrad: graph input {k} is mutated in both the forward and the backward; not supported."
            )
        torch.ops.aten.copy_.default(primals[k], analysis.unwrap(b))
        _last_node().meta[BACKWARD_MUTATION] = True
        fw.mutations[k] = InputMutation(in_backward=True)
    for n, t in enumerate(tangents_fun):
        torch._sync(t)
        if analysis.mutation_count(t) != 0 or torch._functionalize_has_metadata_mutation(t.elem):
            raise BackwardMutationError(
                f"aotgrad: the backward pass mutates the incoming gradient of forward output {n} "
                "(e.g. grad_output.mul_() in a custom autograd.Function); clone it first."
            )


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
    _copy_before_unviewable_views(graph)
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
        if not isinstance(src, torch.Tensor) or src.is_contiguous() or _can_view(src, n.args[1]):
            continue
        with graph.inserting_before(n):
            dense = graph.call_function(
                torch.ops.aten.clone.default, (n.args[0],), {"memory_format": torch.contiguous_format}
            )
        dense.meta["val"] = src.clone(memory_format=torch.contiguous_format)
        n.replace_input_with(n.args[0], dense)


def _can_view(src: torch.Tensor, shape) -> bool:
    return analysis.view_possible(src.shape, src.stride(), shape) is not False  # symbolic: leave it be
