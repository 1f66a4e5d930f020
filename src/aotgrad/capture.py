"""Stage 3 — capture: one trace yields the joint graph *and* the plan.

Autograd sits above functionalization in the dispatcher, so we trace the user's forward once, on fake
tensors that require grad, under `FunctionalTensorMode`, inside one `make_fx` session. At the end of
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.effects import _EffectType as EffectType
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
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
    AliasOfPrimal,
    Captured,
    Constant,
    CopyInto,
    FwOutput,
    GraphOutput,
    InputItself,
    InputLayout,
    InputMutation,
    IntermediateBase,
    MutatedInputValue,
    Plan,
    Restride,
    SetRequiresGrad,
    SetToOutput,
    SetToPrimal,
    UserOutput,
)

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
        with fake_mode:
            gm = make_fx(
                traced, decomposition_table=decompositions or {}, _disable_torch_fn_metadata_mode=True
            )(list(fake_primals))
    except RuntimeError as e:
        if "frozen storage" in str(e):
            raise UnsupportedMutationError(
                "aotgrad: the program mutates a view of an input after set_() replaced that input's "
                "storage; functionalization cannot follow the old view. Take the view after set_()."
            ) from e
        raise
    finally:
        torch._C._set_view_replay_enabled(view_replay)
    _finish_graph(gm, state["in_graph_mutated"])
    return Captured(gm, state["plan"], num_tangents=state["num_tangents"])


def _trace_body(fn, layout, leaves, primals, state, *, training, keep_in_graph, storage_groups):
    mode = FunctionalTensorMode()
    with mode:
        initial_token = _seed_effect_token(mode)
        funs = [FunctionalTensor.to_functional(p) for p in primals]
        bases = [_clone_for_grad(f, p) if training and f.requires_grad else f for f, p in zip(funs, primals)]
    _tag_input_clones(bases, funs)
    # Absolute storage offsets recorded on a clone are off by this much on the caller's tensor.
    shifts = [_offset_shift(p, b) for p, b in zip(primals, bases)]
    before = [(b.grad_fn, analysis.mutation_count(b)) for b in bases]
    user_leaves = _user_leaves(layout, bases, shifts, mode)
    args, kwargs = pytree.tree_unflatten(user_leaves, layout.spec)
    with mode:
        out = fn(*args, **kwargs)
    flat_out, out_spec = pytree.tree_flatten(out)

    fw = _Forward(out_spec=out_spec)
    _check_storage_groups(storage_groups, user_leaves, {id(b): n for b, (_, n) in zip(bases, before)})
    _analyse_inputs(fw, layout, leaves, primals, funs, bases, before, shifts, training, keep_in_graph)
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
    requires_grad = tuple(_wants_grad(p, f) for p, f in zip(primals, funs))
    state["plan"] = Plan(
        layout=layout,
        primal_requires_grad=requires_grad if training else (False,) * len(funs),
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
    tracer = get_proxy_mode().tracer
    for b, f in zip(bases, funs):
        if b is not f:
            inner = torch._from_functional_tensor(b.elem)
            get_proxy_slot(inner, tracer).proxy.node.meta[INPUT_CLONE] = True


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
    copies, sets = [], []
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
            if m.visible_to_autograd or m.metadata:
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
            fw.epilogue.append(Restride(k, *_shifted(name, shifts[k], *analysis.meta_of(b))))
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
        fw.mutations.append(m)
    fw.epilogue.extend(copies)
    fw.epilogue.extend(sets)


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
    leaf_of = {}
    for i, x in enumerate(user_leaves):
        if isinstance(x, torch.Tensor):
            leaf_of.setdefault(id(x), i)
    base_storage = {analysis.storage_id(b): k for k, b in enumerate(bases)}
    metadata_mutated = {k for k, m in enumerate(fw.mutations) if m.metadata or m.storage}
    pending = []  # (position, intermediate base) resolved after plain outputs get indices
    plain_index: dict[int, int] = {}
    sources: list = [None] * len(flat_out)
    for pos, o in enumerate(flat_out):
        if not isinstance(o, torch.Tensor):
            if isinstance(o, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise UnsupportedOutputError(f"aotgrad: output {pos} is a symbolic number; return a tensor.")
            sources[pos] = Constant(o)
            continue
        if not isinstance(o, FunctionalTensor):
            sources[pos] = ("plain", o)
            continue
        if id(o) in leaf_of:
            sources[pos] = InputItself(leaf_of[id(o)])
            continue
        if training and o.requires_grad and o.is_leaf and o._base is None:
            raise UnsupportedOutputError(
                f"aotgrad: output {pos} is a leaf tensor created inside the program with requires_grad=True; "
                "aotgrad can only return tensors computed from the inputs. Pass it in as an input."
            )
        sid = analysis.storage_id(o)
        if sid in base_storage:
            k = base_storage[sid]
            chain = analysis.view_chain(o, bases[k], k in metadata_mutated)
            if chain is not None and chain.as_strided is not None:
                if k in fw.relayout:
                    raise _no_storage_coordinates(f"output {pos} (a view of {_primal_name(layout, k)})")
                chain = replace(chain, as_strided=_shifted(f"output {pos}", shifts[k], *chain.as_strided))
            sources[pos] = AliasOfPrimal(k, chain) if chain is not None else ("plain", o)
            continue
        if o._base is not None:
            pending.append((pos, o))
            sources[pos] = None
            continue
        sources[pos] = ("plain", o)
    # Plain outputs first (upstream order: mutated inputs, outputs, intermediate bases).
    for pos, s in enumerate(sources):
        if isinstance(s, tuple):
            o = s[1]
            if id(o) not in plain_index:  # the same tensor returned twice stays one object
                diff = training and analysis.is_differentiable(o)
                plain_index[id(o)] = _add_fw_value(fw, o, UserOutput(pos), diff)
            sources[pos] = GraphOutput(plain_index[id(o)])
    hidden: dict[int, int] = {}
    for pos, o in pending:
        base = o._base
        if id(base) in plain_index:
            idx = plain_index[id(base)]
        elif id(base) in hidden:
            idx = hidden[id(base)]
        else:
            idx = _add_fw_value(fw, base, IntermediateBase(), training and analysis.is_differentiable(base))
            hidden[id(base)] = idx
        chain = analysis.view_chain(o, base, torch._functionalize_has_metadata_mutation(base.elem))
        if chain is None:
            diff = training and analysis.is_differentiable(o)
            sources[pos] = GraphOutput(_add_fw_value(fw, o, UserOutput(pos), diff))
        else:
            sources[pos] = AliasOfGraphOutput(idx, chain)
    fw.out_sources = sources


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
        with mode:
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


def _wants_grad(primal, fun) -> bool:
    """Gradients flow to a primal that required grad, or that the program made a leaf requiring grad."""
    return primal.requires_grad or (fun.requires_grad and fun.is_leaf)


def _new_placeholder(name: str, like: torch.Tensor) -> torch.Tensor:
    """A new graph input created mid-trace (tangents are only known once the forward has run)."""
    tracer = get_proxy_mode().tracer
    with disable_proxy_modes_tracing():
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
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
        node = list(get_proxy_mode().tracer.graph.nodes)[-1]
        node.meta[BACKWARD_MUTATION] = True
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
