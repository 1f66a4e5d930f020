"""Capture, inputs: what the traced program did to each input.

Clones for grad, user leaves, storage groups, version bumps and views of leaves, read off the
functional wrappers at the end of the forward (capture.py drives the trace).
"""

from __future__ import annotations

import torch
import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.functional_tensor import FunctionalTensor

from . import analysis
from .capture_state import NeedsSyntheticBase, _add_fw_value
from .errors import AotgradError, InplaceOnLeafError, UnsupportedAliasingError, UnsupportedMutationError
from .plan import (
    BumpVersion,
    CopyInto,
    Detach,
    InputLayout,
    InputMutation,
    MutatedInputValue,
    Restride,
    RestrideLeaf,
    SetRequiresGrad,
    SetToOutput,
    SetToPrimal,
    StorageOfLeaf,
)


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
            if (m.metadata or m.storage) and f.shape != p.shape:  # a gradient of the new shape, an input of the old
                raise UnsupportedMutationError(
                    f"aotgrad: the program changes the metadata of {name} in place (t_(), squeeze_(), set_()...) "
                    "and calls requires_grad_() on it; the compiled function cannot give it a gradient of its "
                    "new shape. Call requires_grad_() before the call, or apply the op out of place."
                )
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
        if p.requires_grad and getattr(b, "_aotgrad_detached", False) and b.requires_grad and b.grad_fn is None:
            raise UnsupportedMutationError(  # fuzz seed 1 program 17216
                f"aotgrad: the program calls detach_() and then requires_grad_() on {name}: in eager it is then "
                "a new autograd leaf in the same tensor object, which aotgrad does not rebuild. Do that outside "
                "the compiled function."
            )
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
    copy_ (as_strided_) does that for data (metadata) mutations, the rest (metadata ops on views, no-op writes, and writes
    kept in the graph: a compiled kernel's store does not bump it) need a bump."""
    copied = {a.primal for a in fw.epilogue if isinstance(a, (CopyInto, SetToOutput, SetToPrimal, Restride))}
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
