"""Stage 2 — analysis: read what the program did off its functional tensors.

These functions run inside the single trace (trace/capture.py), right after the user's forward returns
and before the backward is traced, because the answers decide which values need tangents. Each one
looks at `FunctionalTensor`s (the functionalization wrappers the program ran on) and returns plain
data from plan.py.

Example: for `def f(a): a.mul_(2); return a.view(-1)`, `input_mutation` reports
`InputMutation(data=True, visible_to_autograd=True)` for `a`, and `view_chain` turns the output into
`ViewChain(steps=(ViewStep(aten.view.default, ([-1],)),))`, replayed on the caller's `a` after the
epilogue has copied the new value in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, disable_functional_mode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UnsupportedAliasingError
from ..plan import InputMutation, ViewChain, ViewStep


def input_mutation(base: FunctionalTensor, grad_fn_before: Any = None, count_before: int = 0) -> InputMutation:
    """What the forward did to one graph input, from its functional wrapper's flags.

    Data mutations are counted from `count_before`. Autograd saw one iff the wrapper's `grad_fn`
    changed: mutations under `no_grad` or through a `.detach()`ed alias leave it alone, exactly as they
    leave eager's alone.
    """
    elem = base.elem
    torch._sync(base)
    data = mutation_count(base) > count_before
    return InputMutation(
        data=data,
        visible_to_autograd=data and base.grad_fn is not grad_fn_before,
        seen_by_autograd=base.grad_fn is not grad_fn_before and base.grad_fn is not None,  # not detach_()
        metadata=torch._functionalize_has_metadata_mutation(elem),
        storage=torch._functionalize_was_storage_changed(elem),
    )


def was_resized(base: FunctionalTensor) -> bool:
    return torch._functionalize_was_inductor_storage_resized(base.elem)


def mutation_count(t: FunctionalTensor) -> int:
    return torch._functionalize_mutation_counter(t.elem)


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def unwrap(t: Any) -> Any:
    """The traced (fake, proxied) tensor behind a functional tensor, after pending updates."""
    if isinstance(t, FunctionalTensor):
        torch._sync(t)
        return torch._from_functional_tensor(t.elem)
    return t


def is_differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def meta_of(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


# ----------------------------------------------------------------------------------------------
# View chains for outputs that alias an input or an intermediate.
# ----------------------------------------------------------------------------------------------


class _ViewRecorder(TorchDispatchMode):
    """Records the aten view ops a view function replays, as `ViewStep`s.

    A multi-output view op (unbind, split, chunk) hands back a list; the next op (or the end of the
    replay) says which item the chain continues from, and that index is stored on the op's step, so
    the run time replays the real multi-output op and autograd marks the result as eager does."""

    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.current = start
        self.steps: list[ViewStep] = []
        self.ok = True
        self.pending_multi: list | tuple | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, list, tuple)):  # metadata queries (device, sizes)
            return out
        if args and self.pending_multi is not None:
            self.continue_from(args[0])
        if not args or args[0] is not self.current or not is_view_op(func):
            self.ok = False
            return out
        rest = args[1:]
        if any(isinstance(a, torch.Tensor) for a in rest) or any(
            isinstance(v, torch.Tensor) for v in kwargs.values()
        ):
            self.ok = False
        self.steps.append(ViewStep(func, tuple(rest), tuple(sorted(kwargs.items()))))
        if isinstance(out, (list, tuple)):
            self.pending_multi = out
            self.current = None
        else:
            self.current = out
        return out

    def continue_from(self, item: torch.Tensor) -> None:
        """The chain goes on from `item` of the last multi-output op: remember which one."""
        k = next((k for k, x in enumerate(self.pending_multi) if x is item), None)
        self.pending_multi = None
        if k is None:
            self.ok = False
            return
        last = self.steps[-1]
        self.steps[-1] = ViewStep(last.op, last.args, last.kwargs, item=k)
        self.current = item


def is_view_op(func) -> bool:
    schema = func._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None and not schema.is_mutable


def replays_on_layout(chain: ViewChain, like: torch.Tensor, meta) -> bool:
    """Whether `chain`'s view ops run on a tensor laid out as `meta` (size, stride, offset). The trace
    sees a dense copy of an input that overlaps itself (an expand()), where `reshape` is a view; on the
    caller's layout eager's `reshape` copied, and the output is no alias."""
    probe = _probe_like(like, requires_grad=False, meta=meta)
    try:
        with disable_functional_mode(), disable_proxy_modes_tracing():
            for step in chain.steps:
                probe = step.op(probe, *step.args, **dict(step.kwargs))
                probe = probe[step.item] if step.item is not None else probe
    except (RuntimeError, ValueError):  # fake tensors raise ValueError for an impossible view
        return False
    return True


def _probe_like(t: torch.Tensor, requires_grad: bool, meta=None) -> torch.Tensor:
    """A fresh fake tensor with `t`'s size/stride/offset (or `meta`), standing in for the run-time base."""
    size, stride, offset = meta or meta_of(t)
    with disable_functional_mode(), disable_proxy_modes_tracing():
        storage_numel = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else offset
        flat = torch.empty(max(storage_numel, 1), dtype=t.dtype, device=t.device)
        probe = flat.as_strided(size, stride, offset)
        if requires_grad:
            probe = probe.detach().requires_grad_(True)
            probe = probe.as_strided(size, stride, offset) if offset else probe
        return probe


def _record_chain(out: torch.Tensor, base_probe: torch.Tensor) -> tuple[tuple[ViewStep, ...], torch.Tensor] | None:
    """Replay `out`'s autograd view function on `base_probe`, returning the ops and the result (None
    where it does not apply, or where replaying it is not safe: `may_replay`)."""
    if not may_replay(out, base_probe):
        return None
    recorder = _ViewRecorder(base_probe)
    try:
        with disable_functional_mode(), disable_proxy_modes_tracing(), recorder:
            result = out._view_func_unsafe(base_probe)
    except Exception:
        return None
    if recorder.pending_multi is not None:
        recorder.continue_from(result)
    if not recorder.ok:
        return None
    return tuple(recorder.steps), result


def may_replay(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view`'s recorded view function may be replayed on a tensor of `base`'s rank. Three kinds
    have crashed libtorch (segfault): view ops recorded for a base of another rank, a multi-output
    view op (unbind, split...) taken from a view restrided in place, whose replay picks an output the
    replayed layout may not have; or one whose base was restrided in place after it (fuzz seed 29,
    subclass program 708: `unbind(0)[2]` of a (3, 2) base, then `transpose_`, replayed on the (2, 3)
    base). `trace_modes` marks them on the views it sees made."""
    if getattr(view, "_aotgrad_base_dim", base.dim()) != base.dim():
        return False
    root_shape = getattr(view, "_aotgrad_multi_output_root_shape", None)
    if root_shape is not None and root_shape != tuple(base.shape):
        return False
    return not getattr(view, "_aotgrad_split_after_restride", False)


def _autograd_path(t: torch.Tensor, base: torch.Tensor) -> tuple[list[str], bool]:
    """Names of the autograd nodes from `t` back towards `base`, and whether the walk reached it
    (else it stopped at a leaf: a view made under no_grad, which autograd treats as a new leaf)."""
    names, fn = [], t.grad_fn
    while fn is not None and len(names) < 64:
        if fn is base.grad_fn or getattr(fn, "variable", None) is base:
            return names, True
        names.append(type(fn).__name__)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        fn = nxt[0] if len(nxt) == 1 else None
    return names, False


def view_chain(
    out: FunctionalTensor, base: FunctionalTensor, base_metadata_mutated: bool
) -> ViewChain | None:
    """How to rebuild `out` (an alias of `base`) from the run-time base, or None if it must instead
    be returned by the graph (its autograd history is more than views, e.g. a custom Function)."""
    if out._base is not base:
        # Shares storage without an autograd view relation: .detach(), alias under no_grad...
        if out.requires_grad:
            return None
        if out.dtype == base.dtype:
            return ViewChain(as_strided=meta_of(out), detach=True)
        if base.is_complex() and base.dtype.to_real() == out.dtype:  # e.g. a .detach() of .real
            return ViewChain(steps=_as_real_steps(out), detach=True)
        return None
    grad_steps = None  # how many trailing view ops autograd recorded (None: all of them)
    if base.requires_grad:
        names, reached = _autograd_path(out, base)
        if out.grad_fn is None:
            grad_steps = 0
        elif not reached:  # ... then views made in grad mode on a view made under no_grad
            views = names[:-1] if names and names[-1] == "AccumulateGrad" else names
            if not all(_is_view_backward(n) for n in views):
                return None
            grad_steps = len(views)
        elif not all(_is_view_backward(n) for n in names):
            return None  # e.g. a custom autograd.Function returning its input: keep its backward
    restrided_on_the_way = getattr(out, "_aotgrad_restrided_view", False)  # set by trace_modes.Functionalize
    if base_metadata_mutated or torch._functionalize_has_metadata_mutation(out.elem) or restrided_on_the_way:
        # The recorded view function predates an in-place view op on the base, on `out` itself or on a
        # view `out` was taken from: as_strided from out's own geometry, unless it cannot change dtype
        # (view_as_real, .real): then the recorded ops, where they still give `out` exactly.
        chain = _as_strided_chain(out, base, grad_steps)
        if chain is not None or out.dtype == base.dtype:
            return _keep_multi_output(out, chain)
        return _keep_multi_output(out, _exact_recorded_chain(out, base, grad_steps))
    probe = _probe_like(base, requires_grad=base.requires_grad)
    recorded = _record_chain(out, probe)
    # Only sizes are compared: after a data mutation functionalization may give views of a
    # non-contiguous tensor other strides than eager; replaying the view ops on the real base is right.
    if recorded is None or recorded[1].shape != out.shape:
        return _keep_multi_output(out, _as_strided_chain(out, base, grad_steps))
    steps = recorded[0]
    if grad_steps is None:
        return ViewChain(steps=steps)
    if grad_steps > len(steps):
        return _keep_multi_output(out, _as_strided_chain(out, base, grad_steps))
    return ViewChain(steps=steps, no_grad_steps=len(steps) - grad_steps)


def _exact_recorded_chain(out: FunctionalTensor, base: FunctionalTensor, grad_steps: int | None) -> ViewChain | None:
    """`out`'s recorded view ops replayed on the base's current layout, or, if an in-place op restrided
    it, the base reinterpreted as real numbers and an as_strided to `out`'s own geometry (replaying a
    view function after in-place metadata ops is only tried for dtype views, which as_strided alone
    cannot express: torch has crashed replaying some)."""
    recorded = _record_chain(out, _probe_like(base, requires_grad=base.requires_grad))
    if recorded is not None and recorded[1].dtype == out.dtype and meta_of(recorded[1]) == meta_of(out):
        steps = recorded[0]
    elif out.requires_grad and getattr(out, "_aotgrad_dtype_view_at", 0) < getattr(base, "_aotgrad_layout", 0):
        raise UnsupportedAliasingError(
            f"aotgrad: a {out.dtype} view (view_as_real, .real, .imag) of a tensor that requires grad, taken "
            "before an in-place metadata op (t_, transpose_, unsqueeze_...) restrided that tensor, is "
            "returned: eager's autograd rebuilds its history by replaying the view on the new layout, so its "
            "gradients follow elements the view does not hold, which aotgrad does not reproduce. Return a "
            ".clone(), or take the view after the in-place op."
        )
    elif base.is_complex() and base.dtype.to_real() == out.dtype and grad_steps in (None, 0):
        # The replay does not give `out` (its base, or a view on the way, was restrided in place; the
        # view function of a view restrided in place replays the in-place op). An as_strided after the
        # replay would give the right values but lose gradients for elements outside the replayed
        # view: reinterpret the whole base, then as_strided in the real dtype's coordinates.
        steps = _as_real_steps(out)
    else:
        return None
    if grad_steps is None:
        return ViewChain(steps=steps)
    if grad_steps > len(steps):
        return None
    return ViewChain(steps=steps, no_grad_steps=len(steps) - grad_steps)


def _as_real_steps(out: torch.Tensor) -> tuple[ViewStep, ...]:
    """A complex base reinterpreted as real numbers, then an as_strided to `out`'s own geometry (in
    the real dtype's coordinates)."""
    return (
        ViewStep(torch.ops.aten.view_as_real.default, (), ()),
        ViewStep(torch.ops.aten.as_strided.default, meta_of(out), ()),
    )


def _keep_multi_output(out: torch.Tensor, chain: ViewChain | None) -> ViewChain | None:
    """An as_strided chain loses what autograd knows when `out` comes from unbind/split/chunk (in-place
    ops on it are errors): mark the chain so the run time sets the same creation meta."""
    if chain is None or not out._is_view():
        return chain
    meta = torch._C._autograd._get_creation_meta(out)
    if meta != torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE:
        return chain
    return replace(chain, multi_output=True)


def _as_strided_chain(out: torch.Tensor, base: torch.Tensor, grad_steps: int | None) -> ViewChain | None:
    if out.dtype != base.dtype:  # as_strided cannot reinterpret (view_as_real, view(dtype))
        return None
    if grad_steps is None:
        return ViewChain(as_strided=meta_of(out))
    if grad_steps == 0:
        return ViewChain(as_strided=meta_of(out), no_grad_steps=1)
    raise UnsupportedAliasingError(
        "aotgrad: an output is a view taken in grad mode of a view taken under no_grad, and aotgrad "
        "cannot replay the chain op by op. Return a .clone() of it."
    )


_VIEW_BACKWARDS = (
    "View", "Alias", "AsStrided", "T", "Transpose", "Permute", "Select", "Slice", "Unsqueeze", "Squeeze",
    "Expand", "Diagonal", "Unbind", "Split", "SplitWithSizes", "Narrow", "Unfold", "Real", "Imag",
    "ViewAsReal", "ViewAsComplex", "Reshape", "Indices", "Values", "Chunk", "Movedim", "Swapaxes",
)


def _is_view_backward(name: str) -> bool:
    stem = name.rstrip("0123456789")
    return stem.endswith("Backward") and stem[: -len("Backward")] in _VIEW_BACKWARDS




def view_fails(value: torch.Tensor, shape) -> bool:
    """Whether `value.view(shape)` fails: by ATen's rule, or where a size is symbolic (the rule
    cannot decide) by trying the view on the fake value. A permuted value with a symbolic size
    (funnel's batch-3 recompile under autocast) fails where the rule leaves it undecided. Trying it
    may add the guards the view's own meta function adds, as the graph's replay on fake values does."""
    known = view_possible(value.shape, value.stride(), shape)
    if known is not None:
        return not known
    try:
        value.view(list(shape))
    except (RuntimeError, ValueError):
        return True
    return False


def view_possible(size, stride, shape) -> bool | None:
    """Whether `view(shape)` works on a tensor laid out as (size, stride), by ATen's rule (None when a
    size is symbolic). Fake tensors answer wrongly for some layouts with stride-0 dimensions (an
    expand()), so the answer is computed here: view merges a run of dimensions only where they are
    contiguous with one another."""
    shape = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape)
    if not all(isinstance(x, int) for x in (*size, *stride, *shape)):
        return None
    numel = 1
    for n in size:
        numel *= n
    if -1 in shape:
        known = 1
        for n in shape:
            known *= n if n != -1 else 1
        shape[shape.index(-1)] = numel // known if known else 0
    if numel == 0 or not size:
        return True
    view_d, view_numel, tensor_numel = len(shape) - 1, 1, 1
    chunk_stride = stride[-1]
    for d in range(len(size) - 1, -1, -1):
        tensor_numel *= size[d]
        if d == 0 or (size[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_stride):
            while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                view_numel *= shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if d > 0:
                chunk_stride, tensor_numel, view_numel = stride[d - 1], 1, 1
    return view_d == -1
