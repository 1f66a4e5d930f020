"""The modes a trace runs under, and what they refuse.

`Functionalize` is torch's `FunctionalTensorMode` plus the checks for programs functionalization would
silently get wrong: writes through self-overlapping views, uses of views made stale by an in-place
metadata op, custom ops whose schema cannot be functionalized. `TraceHooks` is a torch-function mode
above autograd for what the dispatcher never sees (`detach_()`, absolute `as_strided` offsets on
inputs traced as clones, `contiguous()`/`reshape()` decided on the caller's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
)
from torch.utils import _pytree as pytree

from .. import node_meta
from ..errors import UnsupportedAliasingError, UnsupportedMutationError
from . import analysis, rnn, storage_ops


class Functionalize(FunctionalTensorMode):
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
        _share_higher_order_rules()
        self.aliased_metadata_op = None
        self.metadata_ops = 0  # in-place metadata ops so far: views older than the last may be stale
        self.last_metadata_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if storage_ops.kept_in_graph(func, args, kwargs):  # FSDP2's set_ of a parameter under no_grad
            func = storage_ops.IN_GRAPH_SET
        if (decomposed := storage_ops.decomposition(func)) is not None:
            with self:
                return decomposed(*args, **(kwargs or {}))
        is_metadata_op = torch.Tag.inplace_view in getattr(func, "tags", ())
        is_view_op = bool(args) and isinstance(args[0], torch.Tensor) and analysis.is_view_op(func)
        if self.metadata_ops:
            # A view of a stale view is as stale (it inherits the epoch below): checked where it is used.
            written = _written_args(func, args)
            grad_in = any(isinstance(t, torch.Tensor) and _requires_grad(t) for t in pytree.tree_leaves(args))
            for a in pytree.tree_leaves(args[1:] if is_view_op else args):  # cat/stack take lists
                if isinstance(a, FunctionalTensor):
                    w = any(a is w for w in written)
                    self._check_not_stale(func, a, written=w, gets_grad=w and grad_in)
        if is_metadata_op:
            self._note_metadata_op(func, args[0])
        for a in [args[0]] if is_metadata_op else _written_args(func, args):
            if getattr(a, "_aotgrad_caller_storage_read", False):
                raise UnsupportedAliasingError(
                    f"aotgrad: {func} on an as_strided view that reads the caller's storage outside an input "
                    "that requires grad (traced as a copy of its own elements); aotgrad does not follow "
                    "in-place ops on it. Use out-of-place ops, or take the view from a .clone()."
                )
        schema = getattr(func, "_schema", None)
        if schema is not None and not torch._library.utils.is_builtin(func):
            _check_custom_op(func, schema)
        if not is_metadata_op:
            for a in _written_args(func, args):
                _check_writable(func, a)
                self._check_not_restrided(func, a, args)
                _check_not_absolute_with_grad(func, a, args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if is_metadata_op:
            _remember_layout(args[0], self.metadata_ops)
            if args[0]._is_view():
                # autograd's view function of this view (and of views taken from it) no longer describes it
                args[0]._aotgrad_restrided_view = (func, _describe_tensor(args[0]))  # truthy: which op
                args[0]._aotgrad_restrided_at = args[0]._version  # autograd bumps it once after this op
        if is_view_op:
            _note_views(func, args[0], out, self.metadata_ops)
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
        if a._is_view():  # incl. inputs traced as views of a synthetic base
            _alias_root(a)._aotgrad_view_restrided = (func, _describe_tensor(a))
        if getattr(a, "_aotgrad_shares_input_memory", False) and getattr(a, "_aotgrad_caller_not_view", False):
            raise UnsupportedMutationError(
                f"aotgrad: {func} on {_describe_tensor(a)}, which shares memory with another input: eager's "
                "autograd then rebuilds the other input's views on the new metadata, which a functional graph "
                "cannot reproduce. Pass a .clone(), or use the out-of-place op (e.g. t() instead of t_())."
            )
        caller_leaf_or_view = getattr(a, "_aotgrad_caller_leaf", False) or getattr(a, "_aotgrad_caller_view", False)
        if not torch.is_grad_enabled() and a.requires_grad and (a._is_view() or caller_leaf_or_view):
            raise UnsupportedMutationError(
                f"aotgrad: {func} under no_grad on a leaf or a view that requires grad: eager's "
                "gradients then follow the old metadata, which a functional graph cannot reproduce. "
                "Do it outside no_grad, or on a .clone()."
            )
        if hasattr(a, "_aotgrad_primal") and func.overloadpacket not in _STORAGE_OPS and a.requires_grad:
            # The epilogue restrides the caller's tensor once, either inside autograd or outside it.
            a._aotgrad_metadata_grad_modes = getattr(a, "_aotgrad_metadata_grad_modes", set()) | {
                torch.is_grad_enabled()
            }
            if len(a._aotgrad_metadata_grad_modes) == 2:
                raise UnsupportedMutationError(
                    f"aotgrad: {func} on {_describe_tensor(a)}, which requires grad and gets in-place metadata "
                    "ops both under no_grad and with grad on: eager's gradients then follow the layout the "
                    "grad-mode ops saw, which the graph cannot reproduce. Do them all in one mode, or on a .clone()."
                )

    def _check_not_restrided(self, func, written: FunctionalTensor, args) -> None:
        """Functionalization's autograd gets a write through a view whose own layout was changed in
        place (`v.unsqueeze_(1); v.mul_(w)`) wrong whenever a gradient flows through it (measured: the
        base's gradient misses the write's factor, a broadcast operand's is summed once per element)."""
        own = getattr(written, "_aotgrad_restrided_view", False)
        view_restrided = None if own else getattr(_alias_root(written), "_aotgrad_view_restrided", None)
        restrided = own or view_restrided is not None
        if not (restrided and torch.is_grad_enabled()):
            return
        if not any(isinstance(t, torch.Tensor) and _requires_grad(t) for t in pytree.tree_leaves(args)):
            return
        op, on = view_restrided or own
        if view_restrided is not None:
            raise UnsupportedMutationError(
                f"aotgrad: {func} writes into {_describe_tensor(written)}, which shares memory with {on}, restrided "
                f"in place by {op} before, with gradients flowing: eager rebuilds the restrided view's autograd "
                "history differently from the functional graph. Use the out-of-place view op (e.g. unsqueeze() "
                "instead of unsqueeze_()), or pass inputs that do not share memory."
            )
        raise UnsupportedMutationError(
            f"aotgrad: {func} writes through {_describe_tensor(written)}, whose layout an in-place {op} changed "
            "(it is a view, or a view of one), with gradients flowing: functionalization's autograd gets that "
            "wrong. Use the out-of-place view op (e.g. unsqueeze() instead of unsqueeze_()), or write "
            "through a fresh view."
        )

    def _check_not_stale(self, func, a: FunctionalTensor, *, written: bool, gets_grad: bool) -> None:
        """Refuse a use of a view that requires grad (or a write that makes it require grad), taken
        before an in-place metadata op on a tensor sharing its memory, if autograd (which replays view
        functions during the trace) would now rebuild it on its base with another size/stride/offset:
        eager uses the view's own geometry. A write through a view whose own layout was changed in
        place (or a view of one) is checked too: autograd's view function of it predates that change.
        So is any use of one after a write to its memory: autograd then rebuilds its history with that
        view function."""
        if getattr(a, "_aotgrad_caller_storage_read", False):
            return  # a view of the graph input itself, which no in-place op touches (refused above)
        remembered = getattr(a, "_aotgrad_layout", None)
        restrided = getattr(a, "_aotgrad_restrided_view", False) and (written or _written_since_restrided(a))
        if remembered is None or (remembered == self.metadata_ops and not restrided) or not a._is_view():
            return
        if restrided and not _requires_grad(a):
            return  # a write bringing gradients through a restrided view: _check_not_restrided refuses it
        if not (torch.is_grad_enabled() and (_requires_grad(a) or gets_grad)):
            return  # autograd does not rebuild it now
        # Not even for an empty view: replayed on the restrided base it may cover elements (seed 231).
        replayed = _replayed_on_current_base(a)
        if replayed is not None and _same_elements(replayed, analysis.meta_of(a)):
            a._aotgrad_layout = self.metadata_ops
            return
        own = getattr(a, "_aotgrad_restrided_view", False)
        op, on = own or self.last_metadata_op
        rebuilt = f"as {replayed}" if replayed is not None else "with view ops that no longer apply to it"
        when = "changed in place by, or taken from a view changed by," if own else "taken before"
        raise UnsupportedMutationError(
            f"aotgrad: {func} uses {_describe_tensor(a)} (size/stride/offset {analysis.meta_of(a)}) {when} "
            f"the in-place {op} on {on}; the traced autograd graph would rebuild that view from its base "
            f"{rebuilt}, where eager keeps its elements. Use the out-of-place op (e.g. t() instead of t_()), "
            "or take the view afterwards from a tensor that is not a view."
        )


_STORAGE_OPS = (torch.ops.aten.set_, torch.ops.aten.resize_, torch.ops.aten.resize_as_)


def _written_since_restrided(view: FunctionalTensor) -> bool:
    """Whether the memory of a view restrided in place was written since (its version counter moved
    past the one bump of the in-place metadata op), so that autograd rebuilds its history."""
    return view._version > view._aotgrad_restrided_at + 1


def _requires_grad(view: torch.Tensor) -> bool:
    """`view.requires_grad`, without the error autograd raises for a view taken under no_grad whose
    base was then written with grad on: eager raises that only where the program itself asks."""
    try:
        return view.requires_grad
    except RuntimeError:
        return False


def _same_elements(meta, other) -> bool:
    """Whether two (size, stride, offset) address the same elements in the same order and shape (the
    strides of size-1 dimensions mean nothing)."""
    def key(m):
        size, stride, offset = m
        return tuple(size), [(n, st) for n, st in zip(size, stride) if n != 1], offset
    return key(meta) == key(other)


def _replayed_on_current_base(view: FunctionalTensor):
    """The (size, stride, offset) `view`'s recorded view function gives on its base's current layout
    (None if it does not apply any more)."""
    if not analysis.may_replay(view, view._base):
        return None
    replayed = _replayed_on(view, view._base, None)
    return None if replayed is None else analysis.meta_of(replayed)


def _remember_layout(t: FunctionalTensor, epoch: int) -> None:
    """How many in-place metadata ops the program had made when it last saw view `t` whole (checked by
    `Functionalize._check_not_stale`)."""
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
    if overlaps_itself(a.shape, a.stride()):
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


# What a view of a view inherits from it (each set by the checks that read it).
_INHERITED_MARKS = (
    "_aotgrad_restrided_view",
    "_aotgrad_restrided_at",
    "_aotgrad_caller_storage_read",
    "_aotgrad_member_leaf",
    "_aotgrad_absolute_view_of",
    "_aotgrad_split_after_restride",
    "_aotgrad_multi_output_root_shape",
    "_aotgrad_dtype_view_at",
)
_DTYPE_VIEWS = (torch.ops.aten.view_as_real.default, torch.ops.aten.view_as_complex.default, torch.ops.aten.view.dtype)


def _note_views(func, src: torch.Tensor, out, epoch: int) -> None:
    """Mark `src` as having views, and the views a write through which functionalization cannot scatter
    back: those of a self-overlapping `as_strided` result (its inverse, as_strided_scatter, refuses to
    write overlapping elements) or of a self-overlapping input (the epilogue's copy_ into it would).
    A view that reinterprets the dtype on the way remembers how many in-place metadata ops came before
    (`analysis._exact_recorded_chain`: autograd rebuilds it by replaying the views after later ones)."""
    src._aotgrad_has_views = True
    outs = [t for t in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(t, torch.Tensor)]
    caller_meta = getattr(src, "_aotgrad_caller_meta", None)
    overlapping_input = caller_meta is not None and overlaps_itself(*caller_meta[:2])
    for t in outs:
        # The rank of the root base when the first of the view ops autograd records for `t` was taken
        # (its view function replays them all from the root).
        inherited = getattr(src, "_aotgrad_base_dim", None) if src._base is not None else None
        t._aotgrad_base_dim = inherited if inherited is not None else (t._base if t._base is not None else src).dim()
        made_overlapping = func is torch.ops.aten.as_strided.default and overlaps_itself(t.shape, t.stride())
        if overlapping_input or made_overlapping or getattr(src, "_aotgrad_in_overlapping", False):
            t._aotgrad_in_overlapping = True
        for mark in _INHERITED_MARKS:
            if hasattr(src, mark):
                setattr(t, mark, getattr(src, mark))
        if isinstance(out, (list, tuple)) and hasattr(src, "_aotgrad_restrided_view"):
            t._aotgrad_split_after_restride = True
        if isinstance(out, (list, tuple)) and not hasattr(t, "_aotgrad_multi_output_root_shape"):
            root = t._base if t._base is not None else src
            t._aotgrad_multi_output_root_shape = tuple(root.shape)
        if func in _DTYPE_VIEWS and not hasattr(src, "_aotgrad_dtype_view_at"):
            t._aotgrad_dtype_view_at = epoch


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


def overlaps_itself(size, stride) -> bool:
    extent = 0
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride) if sz > 1):
        if st <= extent:
            return True
        extent += st * (sz - 1)
    return False


def _share_higher_order_rules() -> None:
    """Higher-order ops (`torch.cond`, `while_loop`, `scan`...) register how to functionalize them
    for `FunctionalTensorMode` itself, looked up by exact type; `Functionalize` is a subclass, so it
    takes the same rules (for the ops defined so far: modules define them as they are imported)."""
    for hop in list(torch._ops._higher_order_ops.values()):
        rule = hop.python_key_table.get(FunctionalTensorMode)
        if rule is not None and Functionalize not in hop.python_key_table:
            hop.py_impl(Functionalize)(rule)


class TraceHooks(torch.overrides.TorchFunctionMode):
    """What the program calls above autograd, where the dispatcher (functionalization) cannot see it.

    `detach_()`: autograd handles it, and a later `copy_` from a tensor that requires grad makes the
    input require grad again; the mark tells `_analyse_inputs` to detach it in the epilogue.

    `as_strided` family: the storage offset is absolute, but an input that requires grad is traced as
    a clone at another offset (`shift`). The offset is rewritten into the clone's coordinates before
    autograd records it (so forward and backward see the elements eager sees), and the clone stays in
    the graph (`clone_coordinates`): the run-time input is not at the clone's offset."""

    def __init__(self, dense_copies: Sequence[str] = ()):
        super().__init__()
        self.clone_coordinates: set[int] = set()
        self.dense_copies = list(dense_copies)  # inputs overlapping themselves, traced as dense clones
        self.requires_grad_called = False  # the program called requires_grad_() (capture checks inputs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _AS_STRIDED_SCATTER:  # the program's own call: its derivative is torch's formula
            with node_meta.explicit_scatter():
                return self._torch_function(func, args, kwargs)
        return self._torch_function(func, args, kwargs)

    def _torch_function(self, func, args, kwargs):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.requires_grad_:
            self.requires_grad_called = True
        if func is torch.Tensor.detach_ and args:
            _check_detach_in_place(args[0])
            args[0]._aotgrad_detached = True
        if args and getattr(args[0], "_aotgrad_caller_not_view", False):
            # Traced as a view of a synthetic base, where the caller's tensor is not a view: refresh the
            # view's autograd history after a write to its base, which eager never needs for a non-view
            # (without it autograd takes the view for a leaf and refuses in-place ops on it).
            args[0].grad_fn  # noqa: B018
        if func in _AS_STRIDED and args and isinstance(args[0], FunctionalTensor):
            at_offset = func not in _AS_STRIDED_SCATTER and _at_caller_offset(args[0])
            args, kwargs = self._in_clone_coordinates(func, args, kwargs)
            if getattr(args[0], "_aotgrad_graph_input_value", False):  # redirected to the graph input
                out = func(*args, **kwargs)
                out._aotgrad_caller_storage_read = True  # no in-place op on it (Functionalize refuses)
                return out
            if at_offset:
                out = func(*args, **kwargs)
                out._aotgrad_absolute_view_of = (_describe_tensor(args[0]), at_offset)
                return out
        if func is torch.Tensor.contiguous and args and isinstance(args[0], FunctionalTensor):
            return _contiguous_as_on_caller_layout(args[0], **kwargs)
        if func in (torch.Tensor.reshape, torch.reshape) and args and isinstance(args[0], FunctionalTensor):
            return _reshape_as_on_caller_layout(func, *args, **kwargs)
        if func is torch.Tensor.view and args and isinstance(args[0], FunctionalTensor):
            return _view_or_refuse(func, args, kwargs, self.dense_copies)
        if func in (torch.Tensor.detach, torch.detach) and args and isinstance(args[0], FunctionalTensor):
            out = func(*args, **kwargs)
            out._aotgrad_alias_of = _alias_root(args[0])  # detach() has no ._base, yet shares storage
            return out
        if rnn.is_lstm(func):
            return rnn.lstm(args, kwargs)
        return func(*args, **kwargs)

    def _in_clone_coordinates(self, func, args, kwargs):
        bind = _scatter_params if func in _AS_STRIDED_SCATTER else _as_strided_params
        *lead, size, stride, offset = bind(*args, **kwargs)
        root = _alias_root(args[0])
        k, shift = getattr(root, "_aotgrad_primal", (None, 0))
        if k is None and self.dense_copies:
            raise UnsupportedAliasingError(
                f"aotgrad: as_strided on an intermediate while {self.dense_copies[0]} overlaps itself (e.g. an "
                "expand()) and requires grad: aotgrad traces that input as a dense copy, so intermediates "
                "computed from it may be laid out in memory unlike eager's, and as_strided addresses memory. "
                "Pass a .contiguous() input, or use views that do not depend on strides."
            )
        if k is not None and shift == 0 and offset is not None:
            return self._in_value_coordinates(args, kwargs, lead, size, stride, offset, root)
        if k is None or shift == 0 or offset is None:
            return args, kwargs
        ratio = elements_per_root_element(args[0], root)
        new_offset = None if shift is None or (shift * ratio).denominator != 1 else offset - int(shift * ratio)
        if new_offset is None or not _inside(root, size, stride, new_offset, ratio):
            value = getattr(root, "_aotgrad_input_value", None)
            unmutated = value is not None and analysis.mutation_count(root) == root._aotgrad_clone_mutations
            if unmutated and args[0] is root and func in (torch.as_strided, torch.Tensor.as_strided):
                # Read the caller's storage through the graph input itself (the copy equals it so far;
                # capture refuses a later mutation of the input).
                root._aotgrad_read_caller_storage = True
                value._aotgrad_graph_input_value = True  # __torch_function__ marks the view it makes
                return (value, size, stride, offset), {}
            raise UnsupportedAliasingError(
                f"aotgrad: as_strided with storage offset {offset} on {_describe_tensor(args[0])} addresses "
                "the caller's storage directly, but aotgrad traces that input (it requires grad) as a copy "
                "holding only its own elements. Use views relative to the input (slicing, view, select), "
                "or pass the tensor the view was taken from."
            )
        self.clone_coordinates.add(k)
        return (*lead, size, stride, new_offset), {}

    @staticmethod
    def _in_value_coordinates(args, kwargs, lead, size, stride, offset, root):
        """An input traced as itself keeps the caller's storage offset until a data mutation replaces
        its functional value by a fresh tensor (offset 0): functionalization then applies the absolute
        offset to that tensor. Shift it by the same amount; refuse when the value's layout differs."""
        value = analysis.unwrap(root)
        drift = root.storage_offset() - value.storage_offset()
        if drift == 0:
            if root.storage_offset() != 0:
                # A later data mutation would make functionalization rebuild this view on a fresh
                # value at offset 0, where the offset addresses other elements (capture refuses then).
                root._aotgrad_absolute_offset_before_mutation = True
            return args, kwargs
        if tuple(value.stride()) != tuple(root.stride()):
            raise UnsupportedAliasingError(
                f"aotgrad: as_strided with storage offset {offset} on {_describe_tensor(args[0])} after a data "
                "mutation of that input, whose functional copy has another layout; the absolute offset has no "
                "meaning there. Use views relative to the input (slicing, view, select)."
            )
        ratio = elements_per_root_element(args[0], root)
        return (*lead, size, stride, offset - int(drift * ratio)), {}


def _at_caller_offset(t: FunctionalTensor) -> int:
    """The storage offset of the input `t` views, when that input is traced as itself (its functional
    value still at the caller's offset) and the offset is not 0; else 0.

    An as_strided view of it takes an absolute offset. Autograd's record of a write through that view
    (CopySlices) replays the view on a fresh copy of the input at offset 0 in the backward, where the
    offset addresses other elements: `Functionalize` refuses such writes with gradients."""
    root = _alias_root(t)
    k, shift = getattr(root, "_aotgrad_primal", (None, 0))
    if k is None or shift != 0 or root.storage_offset() == 0:
        return 0
    return root.storage_offset() if analysis.unwrap(root).storage_offset() == root.storage_offset() else 0


def _view_or_refuse(func, args, kwargs, dense_copies: Sequence[str]):
    """`view()` of a tensor traced as the dense copy of a self-overlapping input (an expand()ed input
    that requires grad), or of an intermediate computed from one, can fail where the caller's layout
    allows it (ops lay out their results after their inputs' strides): refuse that clearly."""
    try:
        return func(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        if getattr(_alias_root(args[0]), "_aotgrad_in_overlapping", False):
            what = f"{_describe_tensor(args[0])}: the input overlaps itself"
        elif dense_copies:
            what = f"{_describe_tensor(args[0])}, computed while {dense_copies[0]} overlaps itself"
        else:
            raise
        raise UnsupportedAliasingError(
            f"aotgrad: view() of {what} (e.g. an expand()) and requires grad, so aotgrad traces that "
            "input as a dense copy, and this view is impossible on what is computed from it "
            f"({str(e).splitlines()[0]}). Use reshape(), or pass a .contiguous() input."
        ) from e


def _check_not_absolute_with_grad(func, written: FunctionalTensor, args) -> None:
    """See `_at_caller_offset`."""
    view_of = getattr(written, "_aotgrad_absolute_view_of", None)
    if view_of is None or not torch.is_grad_enabled():
        return
    if not any(isinstance(t, torch.Tensor) and _requires_grad(t) for t in pytree.tree_leaves(args)):
        return
    name, offset = view_of
    raise UnsupportedAliasingError(
        f"aotgrad: {func} writes, with gradients flowing, through an as_strided view of {name} (which sits "
        f"at storage offset {offset}) taken with an absolute storage offset: autograd replays that view in "
        "the backward on a copy at offset 0, where the offset addresses other elements. Use views relative "
        "to the input (slicing, select), write under torch.no_grad(), or pass a .clone()."
    )


def _check_detach_in_place(t: torch.Tensor) -> None:
    """An input sharing memory with another input is traced as a view of a synthetic base, which it is
    not in eager: autograd would not let go of the other input's history the way eager's detach_() does."""
    if getattr(t, "_aotgrad_shares_input_memory", False):
        raise UnsupportedMutationError(
            f"aotgrad: detach_() of {_describe_tensor(t)}, which shares memory with another input. Use "
            "detach() (out of place), or pass inputs that do not share memory."
        )


def _alias_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views: its `._base`, seen through `.detach()` aliases too."""
    root = t if t._base is None else t._base
    return getattr(root, "_aotgrad_alias_of", root)


def _contiguous_as_on_caller_layout(t: FunctionalTensor, memory_format=torch.contiguous_format):
    """`t.contiguous()` as eager decides it. An input that overlaps itself (an expand()) and requires
    grad is traced as a dense clone, so a view of it may be contiguous in the trace and not on the
    caller's tensor (eager copies), or the other way round (eager returns `t` itself). So is a view
    taken after a data mutation of a non-dense input (see `_layout_as_on_caller`)."""
    root = t if t._base is None else t._base
    eager_view = _layout_as_on_caller(t, root, "contiguous()")
    if eager_view is None:
        return t.contiguous(memory_format=memory_format)  # traced with the caller's layout
    if eager_view.is_contiguous(memory_format=memory_format):
        return t
    return t.clone(memory_format=memory_format)


def _reshape_as_on_caller_layout(func, t: FunctionalTensor, *shape, **kwargs):
    """`t.reshape(shape)` as eager decides it (a view, or a copy), for the same reason as
    `_contiguous_as_on_caller_layout`."""
    root = t if t._base is None else t._base
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else (shape or kwargs.get("shape"))
    eager_view = _layout_as_on_caller(t, root, "reshape()")
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


def _layout_as_on_caller(t: FunctionalTensor, root: FunctionalTensor, what: str):
    """A stand-in for `t` laid out as eager lays it out, where the trace lays it out otherwise (None
    where they agree). An input overlapping itself that requires grad is traced as a dense copy; and a
    data mutation of a non-dense input gives its functional value a fresh dense layout, which views
    taken afterwards inherit while the input's own metadata (and eager's views) keep the caller's."""
    caller_meta = getattr(root, "_aotgrad_caller_meta", None)
    if caller_meta is None:
        return None  # an intermediate: laid out as in eager
    if getattr(root, "_aotgrad_primal", (None, 0))[1] is None:
        return _replayed_on(t, root, caller_meta)
    if t is root or analysis.meta_of(root)[1] == analysis.meta_of(analysis.unwrap(root))[1]:
        return None
    eager_view = _replayed_on(t, root, analysis.meta_of(root))
    if eager_view is None:
        raise UnsupportedAliasingError(
            f"aotgrad: {what} of a view of {_describe_tensor(root)} after a data mutation of it: that input is "
            "not contiguous, its mutated functional value is laid out afresh, and aotgrad cannot tell how "
            "eager lays the view out. Pass a .contiguous() input, or take the view from a .clone()."
        )
    return eager_view


def _can_view(t: torch.Tensor, shape) -> bool:
    possible = analysis.view_possible(t.shape, t.stride(), shape)
    if possible is not None:
        return possible
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
    if not analysis.may_replay(t, probe):
        return None
    try:
        with analysis.disable_functional_mode(), disable_proxy_modes_tracing():
            replayed = t._view_func_unsafe(probe)
    except (RuntimeError, ValueError, IndexError):
        return None
    return replayed if _replays_on_meta(t, root, analysis.meta_of(probe)) else None


def _replays_on_meta(t: FunctionalTensor, root: FunctionalTensor, meta) -> bool:
    """Whether `t`'s view function also applies to a real (meta-device) tensor laid out as `meta`: fake
    tensors accept some views real ones refuse (`view(12)` of a (3, 1, 4) tensor with strides (1, 12, 3)
    gives stride (1,), where eager raises), and such a replay says nothing about eager's view."""
    size, stride, offset = meta
    if not all(isinstance(x, int) for x in (*size, *stride, offset)):
        return True  # symbolic: only fake tensors can say
    numel = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1 if all(size) else offset + 1
    with unset_fake_temporarily(), analysis.disable_functional_mode(), disable_proxy_modes_tracing():
        probe = torch.empty(numel, dtype=root.dtype, device="meta").as_strided(size, stride, offset)
        try:
            t._view_func_unsafe(probe)
        except RuntimeError:
            return False
    return True


def _as_strided_params(self, size, stride, storage_offset=None):
    return self, size, stride, storage_offset


def _scatter_params(self, src, size, stride, storage_offset=None):
    return self, src, size, stride, storage_offset


_AS_STRIDED_SCATTER = (torch.as_strided_scatter, torch.Tensor.as_strided_scatter)
_AS_STRIDED = (torch.as_strided, torch.Tensor.as_strided, torch.Tensor.as_strided_, *_AS_STRIDED_SCATTER)


def _inside(clone: torch.Tensor, size, stride, offset: int, ratio: Fraction = Fraction(1)) -> bool:
    """Whether an as_strided view of (size, stride, offset) reads only elements of the dense `clone`
    (offsets and strides counted in elements `ratio` times smaller than the clone's)."""
    if not is_non_overlapping_and_dense_or_false(clone):
        return False
    if not all(size):
        return 0 <= offset
    first = clone.storage_offset() * ratio
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    return first <= offset and last < first + clone.numel() * ratio and all(st >= 0 for st in stride)


def elements_per_root_element(t: torch.Tensor, root: torch.Tensor) -> Fraction:
    """How many of `t`'s elements one element of `root` holds (2 for `.real` of a complex root)."""
    return Fraction(root.element_size(), t.element_size())
