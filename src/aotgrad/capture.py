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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
from torch._higher_order_ops.effects import _EffectType as EffectType
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_slot,
    make_fx,
    track_tensor_tree,
)
from torch.utils import _pytree as pytree

from . import analysis
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
    UserOutput,
)
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
    try:
        # Dispatch modes the caller has active (a FLOP counter, a logging mode) would see, and
        # interleave with, the trace's own modes; they see the compiled code's ops at run time.
        with torch.utils._python_dispatch._disable_current_modes():
            gm = _record(traced, fake_primals, decompositions or {}, fake_mode)
    except (RuntimeError, ValueError, IndexError) as e:
        if isinstance(e, AotgradError):
            raise
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
    _finish_graph(gm, state["in_graph_mutated"])
    return Captured(gm, state["plan"], num_tangents=state["num_tangents"])


class _Functionalize(FunctionalTensorMode):
    """Functionalization that refuses in-place writes through self-overlapping views (`expand`,
    `as_strided` with repeated elements) or through views of them: eager's result depends on write
    order, or the functional graph's scatter back into the overlapping view cannot run.

    In-place metadata ops (`t_`, `unsqueeze_`...): with view replay on, autograd rebuilds a view taken
    before such an op by replaying its view ops on the base's *new* layout, where eager's view keeps its
    elements. Each use of a view after such an op checks that the replay still addresses the view's
    elements (`_check_not_stale`), and the first op on a tensor that has views or is one is remembered
    (`aliased_metadata_op`) so that capture turns a trace that then fails into a clear refusal."""

    def __init__(self):
        super().__init__()
        self.aliased_metadata_op = None
        self.metadata_ops = 0  # in-place metadata ops so far: views older than the last may be stale
        self.last_metadata_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        is_metadata_op = torch.Tag.inplace_view in getattr(func, "tags", ())
        is_view_op = bool(args) and isinstance(args[0], torch.Tensor) and analysis.is_view_op(func)
        if self.metadata_ops:
            # A view of a stale view is as stale (it inherits the epoch below): checked where it is used.
            written = _written_args(func, args)
            for a in args[1:] if is_view_op else args:
                if isinstance(a, FunctionalTensor):
                    self._check_not_stale(func, a, written=any(a is w for w in written))
        if is_metadata_op:
            self._note_metadata_op(func, args[0])
        schema = getattr(func, "_schema", None)
        if schema is not None and not torch._library.utils.is_builtin(func):
            _check_custom_op(func, schema)
        if not is_metadata_op:
            for a in _written_args(func, args):
                _check_writable(func, a)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if is_metadata_op:
            _remember_layout(args[0], self.metadata_ops)
            if args[0]._is_view():
                # autograd's view function of this view (and of views taken from it) no longer describes it
                args[0]._aotgrad_restrided_view = True
        if is_view_op:
            _note_views(func, args[0], out)
            epoch = getattr(args[0], "_aotgrad_layout", self.metadata_ops)
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, FunctionalTensor):
                    _remember_layout(t, epoch)
        return out

    def _note_metadata_op(self, func, a) -> None:
        if self.aliased_metadata_op is None and (a._is_view() or getattr(a, "_aotgrad_has_views", False)):
            self.aliased_metadata_op = (func, _describe_tensor(a))
        self.metadata_ops += 1
        self.last_metadata_op = (func, _describe_tensor(a))
        caller_leaf_or_view = getattr(a, "_aotgrad_caller_leaf", False) or getattr(a, "_aotgrad_caller_view", False)
        if not torch.is_grad_enabled() and a.requires_grad and (a._is_view() or caller_leaf_or_view):
            raise UnsupportedMutationError(
                f"aotgrad: {func} under no_grad on a leaf or a view that requires grad: eager's "
                "gradients then follow the old metadata, which a functional graph cannot reproduce. "
                "Do it outside no_grad, or on a .clone()."
            )

    def _check_not_stale(self, func, a: FunctionalTensor, *, written: bool) -> None:
        """Refuse a use of a view that requires grad, taken before an in-place metadata op on a tensor
        sharing its memory, if autograd (which replays view functions during the trace) would now
        rebuild it on its base with another size/stride/offset: eager uses the view's own geometry.
        A write through a view whose own layout was changed in place (or a view of one) is checked
        too: autograd's view function of it predates that change."""
        remembered = getattr(a, "_aotgrad_layout", None)
        restrided = written and getattr(a, "_aotgrad_restrided_view", False)
        if remembered is None or (remembered == self.metadata_ops and not restrided) or not a._is_view():
            return
        if not (a.requires_grad and torch.is_grad_enabled()) or a.numel() == 0:
            return  # autograd does not rebuild it now, or there is nothing to get wrong
        replayed = _replayed_on_current_base(a)
        if replayed is not None and _same_elements(replayed, analysis.meta_of(a)):
            a._aotgrad_layout = self.metadata_ops
            return
        op, on = self.last_metadata_op
        when = "changed in place by, or taken from a view changed by," if restrided else "taken before"
        raise UnsupportedMutationError(
            f"aotgrad: {func} uses {_describe_tensor(a)} (size/stride/offset {analysis.meta_of(a)}) {when} "
            f"the in-place {op} on {on}; the traced autograd graph would rebuild that view from its base as "
            f"{replayed}, where eager keeps its elements. Use the out-of-place op (e.g. t() instead of t_()), "
            "or take the view afterwards from a tensor that is not a view."
        )


def _same_elements(meta, other) -> bool:
    """Whether two (size, stride, offset) address the same elements in the same order (size-1
    dimensions, whose strides mean nothing, left out)."""
    def key(m):
        size, stride, offset = m
        return [(n, st) for n, st in zip(size, stride) if n != 1], offset
    return key(meta) == key(other)


def _replayed_on_current_base(view: FunctionalTensor):
    """The (size, stride, offset) `view`'s recorded view function gives on its base's current layout
    (None if it does not apply any more)."""
    replayed = _replayed_on(view, view._base, None)
    return None if replayed is None else analysis.meta_of(replayed)


def _remember_layout(t: FunctionalTensor, epoch: int) -> None:
    """How many in-place metadata ops the program had made when it last saw view `t` whole (checked by
    `_Functionalize._check_not_stale`)."""
    t._aotgrad_layout = epoch


def _written_args(func, args) -> list:
    """The tensor arguments an op writes into (its schema's `Tensor(a!)` arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    return [
        a for a, spec in zip(args, schema.arguments)
        if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.Tensor)
    ]


def _check_writable(func, a: torch.Tensor) -> None:
    """Refuse an in-place write into a tensor whose elements overlap in memory, or a view of one."""
    if _overlaps_itself(a.shape, a.stride()):
        raise UnsupportedMutationError(
            f"aotgrad: {func} writes through a view whose elements overlap in memory "
            f"(size {tuple(a.shape)}, stride {tuple(a.stride())}, e.g. from expand()); "
            "the result would depend on write order. Write into a .clone() instead."
        )
    if getattr(a, "_aotgrad_in_overlapping", False):
        raise UnsupportedMutationError(
            f"aotgrad: {func} writes into {_describe_tensor(a)}, whose elements overlap in "
            "memory (an input made by expand(), or a view of as_strided with a zero stride); "
            "the functional graph cannot scatter the write back into it. Write into a .clone() instead."
        )


def _describe_tensor(t: torch.Tensor) -> str:
    """'input 0', 'a view of input 0' or 'an intermediate', for error messages."""
    name = getattr(t, "_aotgrad_name", None) or getattr(t._base, "_aotgrad_name", None)
    if name is None:
        return "an intermediate"
    return name if getattr(t, "_aotgrad_name", None) else f"a view of {name}"


def _note_views(func, src: torch.Tensor, out) -> None:
    """Mark `src` as having views, and the views a write through which functionalization cannot scatter
    back: those of a self-overlapping `as_strided` result (its inverse, as_strided_scatter, refuses to
    write overlapping elements) or of a self-overlapping input (the epilogue's copy_ into it would)."""
    src._aotgrad_has_views = True
    outs = [t for t in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(t, torch.Tensor)]
    caller_meta = getattr(src, "_aotgrad_caller_meta", None)
    overlapping_input = caller_meta is not None and _overlaps_itself(*caller_meta[:2])
    for t in outs:
        made_overlapping = func is torch.ops.aten.as_strided.default and _overlaps_itself(t.shape, t.stride())
        if overlapping_input or made_overlapping or getattr(src, "_aotgrad_in_overlapping", False):
            t._aotgrad_in_overlapping = True
        if getattr(src, "_aotgrad_restrided_view", False):
            t._aotgrad_restrided_view = True


def _check_custom_op(func, schema) -> None:
    """A custom op is functionalized by torch's auto-functionalization (a functional call that returns
    new values for the mutated arguments) unless it brings its own functionalization kernel. Refuse,
    naming the op, the schemas that neither covers, before torch fails with a less direct message."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.Functionalize):
        return
    if schema.is_mutable and can_auto_functionalize(func):
        return
    aliased = [r for r in schema.returns if r.alias_info is not None]
    if aliased:
        raise UnsupportedMutationError(
            f"aotgrad: custom operator {func} returns an alias of an argument ({schema}); functionalization "
            "cannot follow it. Return a new tensor (no alias annotation on the return), or nothing."
        )
    if schema.is_mutable:
        raise UnsupportedMutationError(
            f"aotgrad: custom operator {func} mutates an argument of a type auto-functionalization does not "
            f"handle ({schema}). Declare mutated arguments as Tensor(a!), Tensor(a!)? or Tensor(a!)[]."
        )


def _overlaps_itself(size, stride) -> bool:
    extent = 0
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride) if sz > 1):
        if st <= extent:
            return True
        extent += st * (sz - 1)
    return False


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
        return make_fx(traced, decomposition_table=decompositions, _disable_torch_fn_metadata_mode=True)(
            list(fake_primals)
        )



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
    mode = state["functionalize"] = _Functionalize()
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
        b._aotgrad_in_overlapping = _overlaps_itself(*b._aotgrad_caller_meta[:2])
    # Absolute storage offsets recorded on a clone are off by this much on the caller's tensor.
    shifts = [_offset_shift(p, b) for p, b in zip(primals, bases)]
    for k, b in enumerate(bases):
        b._aotgrad_primal = (k, shifts[k])
    before = [(b.grad_fn, analysis.mutation_count(b)) for b in bases]
    versions = [_version(b) for b in bases]
    user_leaves = _user_leaves(layout, bases, shifts, mode)
    leaf_grad_fns = {i: user_leaves[i].grad_fn for i in layout.leaf_views}
    args, kwargs = pytree.tree_unflatten(user_leaves, layout.spec)
    hooks = _TraceHooks()
    with mode, hooks:
        out = fn(*args, **kwargs)
    flat_out, out_spec = pytree.tree_flatten(out)

    fw = _Forward(out_spec=out_spec)
    _check_storage_groups(storage_groups, user_leaves, {id(b): n for b, (_, n) in zip(bases, before)})
    _analyse_inputs(fw, layout, leaves, primals, funs, bases, before, shifts, training, keep_in_graph)
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
    state["plan"] = Plan(
        layout=layout,
        mutations=tuple(fw.mutations),
        fw_outputs=tuple(fw.fw_outputs),
        out_spec=out_spec,
        out_sources=tuple(fw.out_sources),
        prologue=tuple(fw.prologue),
        epilogue=tuple(fw.epilogue),
        is_training=training,
    )
    state["num_tangents"] = num_tangents
    state["in_graph_mutated"] = {i for i, m in enumerate(fw.mutations) if m.kept_in_graph or m.in_backward}
    state["in_graph_mutated"] |= hooks.clone_coordinates  # as_strided offsets are relative to the clone
    return list(fw.fw_values) + list(grads)


class _TraceHooks(torch.overrides.TorchFunctionMode):
    """What the program calls above autograd, where the dispatcher (functionalization) cannot see it.

    `detach_()`: autograd handles it, and a later `copy_` from a tensor that requires grad makes the
    input require grad again; the mark tells `_analyse_inputs` to detach it in the epilogue.

    `as_strided` family: the storage offset is absolute, but an input that requires grad is traced as
    a clone at another offset (`shift`). The offset is rewritten into the clone's coordinates before
    autograd records it (so forward and backward see the elements eager sees), and the clone stays in
    the graph (`clone_coordinates`): the run-time input is not at the clone's offset."""

    def __init__(self):
        super().__init__()
        self.clone_coordinates: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.detach_ and args:
            args[0]._aotgrad_detached = True
        if func in _AS_STRIDED and args and isinstance(args[0], FunctionalTensor):
            args, kwargs = self._in_clone_coordinates(func, args, kwargs)
        if func is torch.Tensor.contiguous and args and isinstance(args[0], FunctionalTensor):
            return _contiguous_as_on_caller_layout(args[0], **kwargs)
        if func in (torch.Tensor.reshape, torch.reshape) and args and isinstance(args[0], FunctionalTensor):
            return _reshape_as_on_caller_layout(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _in_clone_coordinates(self, func, args, kwargs):
        bind = _scatter_params if func in _AS_STRIDED_SCATTER else _as_strided_params
        *lead, size, stride, offset = bind(*args, **kwargs)
        root = args[0] if args[0]._base is None else args[0]._base
        k, shift = getattr(root, "_aotgrad_primal", (None, 0))
        if k is None or shift == 0 or offset is None:
            return args, kwargs
        new_offset = None if shift is None else offset - shift
        if new_offset is None or not _inside(root, size, stride, new_offset):
            raise UnsupportedAliasingError(
                f"aotgrad: as_strided with storage offset {offset} on {_describe_tensor(args[0])} addresses "
                "the caller's storage directly, but aotgrad traces that input (it requires grad) as a copy "
                "holding only its own elements. Use views relative to the input (slicing, view, select), "
                "or pass the tensor the view was taken from."
            )
        self.clone_coordinates.add(k)
        return (*lead, size, stride, new_offset), {}


def _contiguous_as_on_caller_layout(t: FunctionalTensor, memory_format=torch.contiguous_format):
    """`t.contiguous()` as eager decides it. An input that overlaps itself (an expand()) and requires
    grad is traced as a dense clone, so a view of it may be contiguous in the trace and not on the
    caller's tensor (eager copies), or the other way round (eager returns `t` itself)."""
    root = t if t._base is None else t._base
    caller_meta = getattr(root, "_aotgrad_caller_meta", None)
    if caller_meta is None or getattr(root, "_aotgrad_primal", (None, 0))[1] is not None:
        return t.contiguous(memory_format=memory_format)  # traced with the caller's layout
    eager_view = _replayed_on(t, root, caller_meta)
    if eager_view is None:
        return t.contiguous(memory_format=memory_format)
    if eager_view.is_contiguous(memory_format=memory_format):
        return t
    return t.clone(memory_format=memory_format)


def _reshape_as_on_caller_layout(func, t: FunctionalTensor, *shape, **kwargs):
    """`t.reshape(shape)` as eager decides it (a view, or a copy), for the same reason as
    `_contiguous_as_on_caller_layout`."""
    root = t if t._base is None else t._base
    caller_meta = getattr(root, "_aotgrad_caller_meta", None)
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else (shape or kwargs.get("shape"))
    eager_view = None
    if caller_meta is not None and getattr(root, "_aotgrad_primal", (None, 0))[1] is None:
        eager_view = _replayed_on(t, root, caller_meta)
    if eager_view is None:
        return t.reshape(shape)
    if _can_view(eager_view, shape):
        if not _can_view(t, shape):
            raise UnsupportedAliasingError(
                f"aotgrad: reshape of {_describe_tensor(t)} is a view on the caller's layout (the input overlaps "
                "itself, e.g. an expand()) but not on the dense copy aotgrad traces. Reshape a .clone()."
            )
        return t.view(shape)
    return torch.ops.aten._unsafe_view(t.clone(memory_format=torch.contiguous_format), shape)


def _can_view(t: torch.Tensor, shape) -> bool:
    try:
        with analysis.disable_functional_mode(), disable_proxy_modes_tracing():
            probe = analysis._probe_like(t, requires_grad=False)
            probe.view(shape)
    except (RuntimeError, ValueError):  # fake tensors raise ValueError for an impossible view
        return False
    return True


def _replayed_on(t: FunctionalTensor, root: FunctionalTensor, meta):
    """A fake stand-in for `t` as a view of `root` laid out as `meta` (default: as now), by replaying
    `t`'s recorded view function (None if it does not apply)."""
    probe = analysis._probe_like(root, requires_grad=False, meta=meta)
    if t is root:
        return probe
    try:
        with analysis.disable_functional_mode(), disable_proxy_modes_tracing():
            return t._view_func_unsafe(probe)
    except (RuntimeError, ValueError, IndexError):
        return None


def _as_strided_params(self, size, stride, storage_offset=None):
    return self, size, stride, storage_offset


def _scatter_params(self, src, size, stride, storage_offset=None):
    return self, src, size, stride, storage_offset


_AS_STRIDED_SCATTER = (torch.as_strided_scatter, torch.Tensor.as_strided_scatter)
_AS_STRIDED = (torch.as_strided, torch.Tensor.as_strided, torch.Tensor.as_strided_, *_AS_STRIDED_SCATTER)


def _inside(clone: torch.Tensor, size, stride, offset: int) -> bool:
    """Whether an as_strided view of (size, stride, offset) reads only elements of the dense `clone`."""
    if not is_non_overlapping_and_dense_or_false(clone):
        return False
    if not all(size):
        return 0 <= offset
    first = clone.storage_offset()
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    return first <= offset and last < first + clone.numel() and all(st >= 0 for st in stride)


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
        raise UnsupportedAliasingError(
            f"aotgrad: {name} has overlapping memory (e.g. an expand()) and requires grad; aotgrad cannot "
            "replay a metadata mutation or an as_strided alias of it. Pass a .contiguous() copy."
        )
    return size, stride, offset + shift


def _no_storage_coordinates(what: str) -> AotgradError:
    return UnsupportedAliasingError(
        f"aotgrad: {what} would need as_strided in the caller's storage after a data mutation of a "
        "non-contiguous input, whose layout functionalization does not keep. Pass a .contiguous() input "
        "or return a .clone()."
    )


def _user_leaves(layout: InputLayout, bases, shifts, mode) -> list:
    """The flat arguments the program sees: graph inputs, constants and views of synthetic bases."""
    out = []
    for i in range(layout.num_leaves):
        if i in layout.constants:
            out.append(layout.constants[i])
        elif i in layout.leaf_views:
            v = layout.leaf_views[i]
            shift = shifts[v.primal] or 0
            with mode:
                out.append(bases[v.primal].as_strided(v.size, v.stride, v.offset - shift))
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
        if m.data and analysis.meta_of(b) != analysis.meta_of(analysis.unwrap(b)):
            # The functional value of a mutated non-dense input lost the input's layout; metadata read
            # off its views is not in the caller's storage coordinates.
            fw.relayout.add(k)
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
    copy_ does that for data mutations, the rest (metadata ops on views, no-op writes) need a bump."""
    copied = {a.primal for a in fw.epilogue if isinstance(a, (CopyInto, SetToOutput, SetToPrimal))}
    for k, b in enumerate(bases):
        if _version(b) != versions[k] and k not in copied and not fw.mutations[k].kept_in_graph:
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
        if q is not None and not _is_graph_value(sources[q]):
            # A view of an output we rebuild ourselves (e.g. of a .detach()): rebuild it from that one.
            chain = analysis.view_chain(o, o._base, torch._functionalize_has_metadata_mutation(o._base.elem))
            if chain is not None:
                sources[pos] = AliasOfOutput(q, chain)
                continue
        source = _classify_output(fw, layout, pos, o, leaf_of, base_storage, bases, shifts, training)
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
        if not b.requires_grad and b.dtype == bases[k].dtype:
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


def _classify_output(fw, layout, pos, o, leaf_of, base_storage, bases, shifts, training):
    """The source of one output, ("plain", o) for a graph output, or None for a view of an
    intermediate (decided later)."""
    if not isinstance(o, torch.Tensor):
        if isinstance(o, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnsupportedOutputError(f"aotgrad: output {pos} is a symbolic number; return a tensor.")
        return Constant(o)
    if not isinstance(o, FunctionalTensor):
        return ("plain", o)
    if id(o) in leaf_of:
        return InputItself(leaf_of[id(o)])
    if training and o.requires_grad and o.is_leaf and o._base is None:
        raise UnsupportedOutputError(
            f"aotgrad: output {pos} is a leaf tensor created inside the program with requires_grad=True; "
            "aotgrad can only return tensors computed from the inputs. Pass it in as an input."
        )
    k = base_storage.get(analysis.storage_id(o))
    if k is None:
        return None if o._base is not None else ("plain", o)
    m = fw.mutations[k]
    if any(isinstance(a, Detach) and a.primal == k for a in fw.epilogue):
        raise UnsupportedAliasingError(
            f"aotgrad: output {pos} aliases {_primal_name(layout, k)}, which the program detach_()es; "
            "aotgrad cannot tell views taken before the detach from views taken after. Return a .clone()."
        )
    chain = analysis.view_chain(o, bases[k], m.metadata or m.storage or k in fw.restrided)
    if chain is None:
        if m.any:
            raise UnsupportedAliasingError(
                f"aotgrad: output {pos} aliases {_primal_name(layout, k)}, which the program also mutates, "
                "and it cannot be rebuilt as a view of it. Return a .clone()."
            )
        return ("plain", o)
    if shifts[k] is None and not analysis.replays_on_layout(chain, bases[k], bases[k]._aotgrad_caller_meta):
        raise UnsupportedAliasingError(
            f"aotgrad: output {pos} is a view of {_primal_name(layout, k)} in the trace, which sees a dense "
            "copy of that input, but not on the input itself (it overlaps itself in memory, e.g. an expand(), "
            "so eager's reshape copies). Pass a .contiguous() input, or return a .clone()."
        )
    if chain.as_strided is not None:
        if k in fw.relayout:
            raise _no_storage_coordinates(f"output {pos} (a view of {_primal_name(layout, k)})")
        chain = replace(chain, as_strided=_shifted(f"output {pos}", shifts[k], *chain.as_strided))
    if shifts[k]:
        chain = replace(chain, steps=tuple(_in_caller_coordinates(step, shifts[k]) for step in chain.steps))
    return AliasOfPrimal(k, chain)


def _in_caller_coordinates(step, shift: int):
    """An as_strided step recorded on an input's clone (`_TraceHooks` rewrote its offset) replayed on
    the caller's tensor: back to the caller's storage offsets."""
    if step.op is not torch.ops.aten.as_strided.default or len(step.args) < 3 or step.args[2] is None:
        return step
    size, stride, offset = step.args[:3]
    return replace(step, args=(size, stride, offset + shift, *step.args[3:]))


def _intermediate_chain(pos, o):
    """How to rebuild `o`, a view of a tensor the graph computes, from that tensor (None: return `o`)."""
    base = o._base
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
        with mode, _refuse_stale_saved_values():
            grads_wrt = torch.autograd.grad(
                [fw.fw_functional[i] for i in diff],
                [funs[k] for k in wrt],
                tangents_fun,
                allow_unused=True,
            )
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
    """Flat signature, placeholders first, input clones dropped, dead code removed."""
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
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
