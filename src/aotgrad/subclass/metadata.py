"""Metadata mutations of subclass arguments (`x.t_()`, `transpose_`, `unsqueeze_`, `as_strided_`...)
and `x.detach_()` on one (`detached`, replayed after the call as eager's leaves it).

In eager, an in-place view op on a traceable wrapper subclass reaches its `__torch_dispatch__`,
which applies the op to the inner tensors (below autograd: their version counters do not move) and
then, through `return_and_correct_aliasing`, to the wrapper itself (below the subclass's dispatch).
The wrapper's own version counter is bumped once per op, as for a plain tensor.

The subclass stage traces the program over a subclass rebuilt from the inner tensors, so after the
trace every level of the argument (the wrapper, nested wrappers, the plain inner tensors) carries
its final size, stride and offset. We record them (`record`) and the generated run time sets them
on the caller's objects after the plain run (`emit_prologue` / `emit_epilogue`), each level as eager
changed it: `as_strided_` below ADInplaceOrView (no autograd, no version bump), wrappers also below
Python dispatch. The plain run may already have restrided the caller's inner tensors (its own
epilogue for the plain primals); their version counters are then put back to eager's.

In grad mode a non-leaf requiring grad gets new history from the op (eager's `TBackward`): it is
rebased as for a data write (`subclass_runtime._Rebase`, after the metadata is set), with the same
limits (not a view, not viewed by an output...: subclass_wrap.Boundary.refuse_grad_mutations); a
leaf requiring grad is refused as eager refuses it. Refused by name here: symbolic sizes, and
subclasses whose in-place ops replace their inner tensors instead of changing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._mode_utils import no_dispatch

from ..errors import UnsupportedMutationError, UnsupportedOutputError
from ..signature.subclass_layout import Opaque, SubclassLayout

log = logging.getLogger("aotgrad.subclass.metadata")


@dataclass(frozen=True)
class Relayout:
    """One level of an argument: `path` of attributes from it (() is the argument itself), its final
    size/stride/offset, and whether it is a wrapper subclass."""

    path: tuple[str, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    wrapper: bool


@dataclass(frozen=True)
class ArgumentRelayout:
    """What the run time sets on subclass argument `leaf` after the call, innermost levels first."""

    leaf: int
    levels: tuple[Relayout, ...]
    inner_paths: tuple[tuple[str, ...], ...]  # the plain inner tensors: version counters put back
    before: tuple | None = None  # (size, stride, offset) before the program: the argument's, then its plain inner tensors'


def _levels(t: torch.Tensor, layout: SubclassLayout, path: tuple[str, ...], out: list) -> None:
    for attr, inner in zip(layout.attrs, layout.inner):
        if isinstance(inner, Opaque):
            continue
        child = getattr(t, attr)
        if inner is None:
            out.append(_relayout(child, (*path, attr), False))
        else:
            _levels(child, inner, (*path, attr), out)
    out.append(_relayout(t, path, True))


def _relayout(t: torch.Tensor, path: tuple[str, ...], wrapper: bool) -> Relayout:
    return Relayout(path, tuple(t.shape), tuple(t.stride()), t.storage_offset(), wrapper)


def plain_tensors(t: torch.Tensor, layout: SubclassLayout) -> list:
    out = []
    for attr, inner in zip(layout.attrs, layout.inner):
        if inner is None:
            out.append(getattr(t, attr))
        elif not isinstance(inner, Opaque):
            out += plain_tensors(getattr(t, attr), inner)
    return out


def inner_paths(layout: SubclassLayout, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The attribute paths of a subclass's plain inner tensors, in flatten order."""
    out: list = []
    for attr, inner in zip(layout.attrs, layout.inner):
        if inner is None:
            out.append((*path, attr))
        elif not isinstance(inner, Opaque):
            out += inner_paths(inner, (*path, attr))
    return out


def record(i: int, layout: SubclassLayout, t: torch.Tensor, inner: Sequence[torch.Tensor],
           before: tuple) -> ArgumentRelayout:
    """After the trace: subclass argument `i` (traced as `t` over `inner`, its inner tensors before the
    program) changed metadata in place. Refuse what the run time cannot set on the caller's subclass
    as eager does; else its final metadata. (New autograd history from the op, in grad mode, is
    rebased as for a data write: subclass_wrap.Boundary._rebased_values, subclass_runtime._Rebase.)"""
    name = f"subclass input {i} ({layout.describe()})"
    now = plain_tensors(t, layout)
    if len(now) != len(inner) or any(a is not b for a, b in zip(now, inner)):
        raise UnsupportedMutationError(
            f"aotgrad: the program changes the metadata of {name} in place and the subclass replaced its "
            "inner tensors instead of changing them; aotgrad cannot replay that on the caller's subclass. "
            "Use the out-of-place op and return the result."
        )
    levels: list = []
    _levels(t, layout, (), levels)
    if any(not isinstance(v, int) for lv in levels for v in (*lv.size, *lv.stride, lv.offset)):
        raise UnsupportedMutationError(
            f"aotgrad: the program changes the metadata of {name} in place and its sizes are symbolic; "
            "aotgrad replays a subclass's metadata mutation only with static sizes. Use the out-of-place "
            "op and return the result, or mark the sizes static."
        )
    log.debug("aotgrad: metadata of %s replayed after each call: %s", name, levels[-1])
    return ArgumentRelayout(i, tuple(levels), tuple(inner_paths(layout)), before)


def chain_before(relayout: ArgumentRelayout | None, chain: Callable) -> tuple | None:
    """A view output of an argument taken before the program changed the argument's metadata: its
    view chain on the argument as it was (`chain(meta)`: subclass_wrap._chain, which checks that the
    replay gives the view's own size/stride/offset), or None. The run time replays it before it sets
    the new metadata (`emit_epilogue`), as the view was taken in eager."""
    if relayout is None or relayout.before is None:
        return None
    try:
        return chain(relayout.before[0])
    except UnsupportedOutputError:
        return None


def versions_only(i: int, layout: SubclassLayout) -> ArgumentRelayout:
    """An argument whose inner tensors the plain run restrides back to where they were (`t_().t_()`):
    only their version counters to put back."""
    return ArgumentRelayout(i, (), tuple(inner_paths(layout)))


def set_metadata(t: torch.Tensor, size, stride, offset: int, wrapper: bool) -> None:
    """`t.as_strided_(size, stride, offset)` as a subclass's `__torch_dispatch__` does it: below
    ADInplaceOrView (no autograd, no version bump); a wrapper also below Python dispatch, on its Meta
    kernel (as `return_and_correct_aliasing` sets a wrapper's metadata)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        if not wrapper:
            torch.ops.aten.as_strided_.default(t, size, stride, offset)
            return
        with no_dispatch():
            include = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                torch.ops.aten.as_strided_.default(t, size, stride, offset)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(include)


def _expr(leaf: int, path: tuple[str, ...]) -> str:
    return "".join([f"l{leaf}", *(f".{a}" for a in path)])


def emit_prologue(src, relayouts: dict[int, ArgumentRelayout]) -> None:
    """Before the plain run: the version counters of the inner tensors it may restride."""
    for i, r in sorted(relayouts.items()):
        src.emit(f"v{i} = ({''.join(f'{_expr(i, p)}._version, ' for p in r.inner_paths)})")


def emit_early_views(src, boundary, emit_view: Callable) -> None:
    """The views of `chain_before`, on the argument as it was: the plain run may have restrided its
    plain inner tensors already (its own epilogue), so they are set back first."""
    set_meta = src.bind("set_metadata", set_metadata)
    leaves = sorted({boundary.outputs[k].leaf for k in boundary.early_views})
    for i in leaves:
        r = boundary.relayouts[i]
        for path, (size, stride, offset) in zip(r.inner_paths, r.before[1:]):
            src.emit(f"{set_meta}({_expr(i, path)}, {src.bind('a', size)}, {src.bind('a', stride)}, {offset}, False)")
    for k in sorted(boundary.early_views):
        emit_view(k)


def detached(i: int, before: tuple, after: tuple, requires_grad: bool) -> bool:
    """The program called `detach_()` on argument `i` (subclass_wrap._state before/after in the trace;
    `requires_grad`: the caller's, also in a no_grad call where the trace's does not): whether that
    is to replay (it required grad and is now a leaf without it; without grad it is a no-op);
    refused where its autograd state changed again after it (`requires_grad_()`: a new leaf)."""
    if not (before[1] or requires_grad):
        return False
    if after[1] or after[2] is not None:
        raise UnsupportedMutationError(
            f"aotgrad: the program calls detach_() on subclass input {i} and then gives it autograd state "
            "again (requires_grad_(), or a write of a value requiring grad); aotgrad replays detach_() "
            "on a subclass argument only where it ends without grad. Use detach() (out of place)."
        )
    return True


def refuse_detached(boundary, leaves: Sequence) -> None:
    """`detach_()` on an argument is replayed on the caller's subclass after the call (its outputs
    computed before it keep their history in the trace, as in eager). Refused by name: an argument
    that is a view (eager refuses that), or one an output views (eager's view keeps its history)."""
    viewed = {getattr(o, "leaf", None) for o in boundary.outputs if type(o).__name__ == "ViewOfLeafOut"}
    for i in sorted(boundary.detached):
        if leaves[i]._is_view() or i in viewed or i in boundary.rebased:
            raise UnsupportedMutationError(
                f"aotgrad: the program calls detach_() on subclass input {i} ({type(leaves[i]).__name__}), "
                "which is a view, is viewed by an output, or is also written with gradients; aotgrad "
                "replays detach_() on a subclass argument only without those. Use detach() (out of place)."
            )


def emit_epilogue(src, relayouts: dict[int, ArgumentRelayout], detach: set = frozenset()) -> None:
    """After the plain run, before outputs are rebuilt (views of the argument are taken on its new
    metadata, as in eager; those taken before are rebuilt before this: `chain_before`): every
    level's final metadata, inner versions as eager leaves them; `detach_()` of the arguments in
    `detach`."""
    for i in sorted(detach):
        src.emit(f"l{i}.detach_()")
    if not relayouts:
        return
    set_meta = src.bind("set_metadata", set_metadata)
    set_versions = src.bind("set_versions", torch._C._autograd._unsafe_set_version_counter)
    for i, r in sorted(relayouts.items()):
        for lv in r.levels:
            size, stride = src.bind("a", lv.size), src.bind("a", lv.stride)
            src.emit(f"{set_meta}({_expr(i, lv.path)}, {size}, {stride}, {lv.offset}, {lv.wrapper})")
        inner = "".join(f"{_expr(i, p)}, " for p in r.inner_paths)
        src.emit(f"{set_versions}(({inner}), v{i})")
