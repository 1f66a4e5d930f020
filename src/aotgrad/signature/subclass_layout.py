"""What a traceable wrapper subclass argument is made of: the plain data the subclass stage keys on.

A traceable wrapper subclass (`__tensor_flatten__` / `__tensor_unflatten__`: TwoTensor, DTensor,
float8 tensors) is flattened at the pipeline's boundary into its plain inner tensors; every graph is
plain. `SubclassLayout` records, per subclass tensor, what is needed to rebuild it from those plain
tensors: its type, flatten context (constant metadata), inner attribute names (nested recursively),
outer size and stride. The layout is part of the signature: another type, nesting or context
recompiles (subclass/wrap.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import AotgradError, UnsupportedOutputError
from .subclass_sizes import tie_ragged, traced_outer


@dataclass(frozen=True)
class Opaque:
    """An inner attribute that is not a tensor (DTensor's device mesh): kept as is, not flattened."""

    value: Any


@dataclass(frozen=True)
class SubclassLayout:
    """One subclass tensor: `cls.__tensor_unflatten__({attr: inner...}, ctx, outer_size, outer_stride)`.

    `inner[i]` is None for a plain inner tensor, else the inner subclass's layout. `ctx` is compared
    through `ctx_key` (a hashable stand-in where the context itself is not hashable)."""

    cls: type
    ctx: Any = field(compare=False, hash=False)
    ctx_key: Any
    attrs: tuple[str, ...]
    inner: tuple[SubclassLayout | Opaque | None, ...]
    outer_size: tuple
    outer_stride: tuple
    num_plain: int
    symbolic: bool = False  # SymInts in the outer size or stride (dynamic/subclasses.py)

    def describe(self) -> str:
        kids = ", ".join(f"{a}={_describe(k)}" for a, k in zip(self.attrs, self.inner))
        return f"{self.cls.__name__}({kids})"


def _describe(k) -> str:
    return "Tensor" if k is None else type(k.value).__name__ if isinstance(k, Opaque) else k.describe()


def _inner_layout(x: Any):
    return layout_of(x) if isinstance(x, torch.Tensor) else Opaque(x)


def _num_plain(k) -> int:
    return 1 if k is None else 0 if isinstance(k, Opaque) else k.num_plain


def is_subclass(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def is_traced(t: Any) -> bool:
    """A subclass over a trace's stand-ins (functional or fake inner tensors), not a caller's tensor."""
    if not is_subclass(t):
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    attrs, _ = t.__tensor_flatten__()
    inner = getattr(t, attrs[0]) if attrs else None
    return isinstance(inner, (FakeTensor, FunctionalTensor)) or (isinstance(inner, torch.Tensor) and is_traced(inner))


class NeedsSubclassBoundary(AotgradError):
    """Internal: a program over plain arguments returned a subclass; compile it through the
    subclass stage, which flattens outputs too (subclass/wrap.py)."""


def refuse_subclass_outputs(flat_out: Sequence[Any]) -> None:
    """Called on a plain trace's outputs: a subclass among them needs the subclass stage."""
    if any(is_subclass(o) and type(o).__name__ != "FunctionalTensor" for o in flat_out):
        raise NeedsSubclassBoundary


def is_untraced_subclass(g: torch.Tensor) -> bool:
    """A subclass gradient a caller passed (not one of a trace's own functional or fake tensors)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return is_subclass(g) and not isinstance(g, FunctionalTensor) and not is_traced(g)


def refuse_subclass_tangent(g: torch.Tensor, i: int, inside_subclass_stage: bool) -> None:
    """A compiled plain backward received a subclass gradient for forward output `i`, and cannot
    run its graph over it op by op."""
    why = ("the program has subclass arguments, whose flattened values the subclass gradient would "
           "be mixed with (as a plain output summed into a subclass loss gives). Return that output as "
           "a subclass, or make its gradient plain" if inside_subclass_stage else
           "its graph was not kept. Call backward with a plain gradient there")
    raise UnsupportedOutputError(
        f"aotgrad: forward output {i} is a plain tensor but its incoming gradient is a "
        f"{layout_of(g).describe()}; the compiled backward was traced for a plain gradient and "
        f"{why}, or call the function eagerly."
    )


def _ctx_key(ctx: Any) -> Any:
    if isinstance(ctx, dict) and "requires_grad" in ctx:  # autograd state (a NestedTensor's), not structure
        ctx = {k: v for k, v in ctx.items() if k != "requires_grad"}
    try:
        hash(ctx)
    except TypeError:
        return ("repr", repr(ctx))
    return ctx


def layout_of(t: torch.Tensor) -> SubclassLayout | None:
    """The layout of `t`, or None for a plain tensor."""
    if not is_traceable_wrapper_subclass(t):
        return None
    attrs, ctx = t.__tensor_flatten__()
    inner = tuple(_inner_layout(getattr(t, a)) for a in attrs)
    n = sum(_num_plain(k) for k in inner)
    size, stride = tuple(t.shape), tuple(t.stride())
    symbolic = any(isinstance(v, torch.SymInt) for v in (*size, *stride))
    return SubclassLayout(type(t), ctx, _ctx_key(ctx), tuple(attrs), inner, size, stride, n, symbolic)


def flatten(t: torch.Tensor, layout: SubclassLayout, out: list) -> None:
    """Append `t`'s plain inner tensors, depth first in attribute order, to `out`."""
    for a, k in zip(layout.attrs, layout.inner):
        if k is None:
            out.append(getattr(t, a))
        elif not isinstance(k, Opaque):
            flatten(getattr(t, a), k, out)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    out: list = []
    flatten(t, layout_of(t), out)
    return out


def rebuild(layout: SubclassLayout, plains: Sequence[torch.Tensor], pos: int = 0) -> torch.Tensor:
    """The subclass tensor of `layout` over `plains[pos:pos + layout.num_plain]`."""
    inner = {}
    for a, k in zip(layout.attrs, layout.inner):
        if k is None:
            inner[a] = plains[pos]
            pos += 1
        elif isinstance(k, Opaque):
            inner[a] = k.value
        else:
            inner[a] = rebuild(k, plains, pos)
            pos += k.num_plain
    size, stride = layout.outer_size, layout.outer_stride
    if layout.symbolic:  # in a trace: in terms of the inner tensors' tracked SymInts
        size, stride = traced_outer(size, stride, plains[pos - layout.num_plain:pos])
        tie_ragged(layout.cls, inner, layout.ctx, size)
    return layout.cls.__tensor_unflatten__(inner, layout.ctx, size, stride)


def same_structure(a: SubclassLayout | None, b: SubclassLayout | None) -> bool:
    """Same types, contexts and nesting (sizes and strides aside)."""
    if a is None or b is None:
        return a is b
    return (
        a.cls is b.cls and a.ctx_key == b.ctx_key and a.attrs == b.attrs
        and all(x == y if isinstance(x, Opaque) else same_structure(x, y) for x, y in zip(a.inner, b.inner))
    )


def guard_conditions(x: torch.Tensor, v: str, scope: dict, tensor_conds: Callable) -> list[str]:
    """Conditions that argument expression `v` is a subclass of `x`'s layout over plain inner tensors
    like `x`'s (`tensor_conds(t, expr)` gives a plain tensor's conditions)."""
    return _layout_conds(x, layout_of(x), v, scope, tensor_conds)


def _layout_conds(x, layout: SubclassLayout, v: str, scope: dict, tensor_conds: Callable) -> list[str]:
    n = len(scope)
    scope[f"_SC{n}"], scope[f"_SA{n}"] = layout.cls, layout.attrs
    conds = [f"type({v}) is _SC{n}"]
    if layout.ctx is None:
        conds.append(f"{v}.__tensor_flatten__() == (list(_SA{n}), None)")
    else:
        scope[f"_SX{n}"] = layout.ctx_key
        scope["_flatten_key"] = _flatten_key
        conds.append(f"_flatten_key({v}) == (list(_SA{n}), _SX{n})")
    for attr, inner in zip(layout.attrs, layout.inner):
        expr = f"{v}.{attr}"
        if inner is None:
            conds += tensor_conds(getattr(x, attr), expr, scope)
        elif isinstance(inner, Opaque):
            scope[f"_SO{len(scope)}"] = inner.value
            conds.append(f"{expr} is _SO{len(scope) - 1}")
        else:
            conds += _layout_conds(getattr(x, attr), inner, expr, scope, tensor_conds)
    return conds


def _flatten_key(t: torch.Tensor) -> tuple:
    attrs, ctx = t.__tensor_flatten__()
    return list(attrs), _ctx_key(ctx)


def signature_part(t: torch.Tensor, tensor_key) -> tuple:
    """What the signature adds for a subclass argument: its layout and each plain inner tensor's key."""
    layout = layout_of(t)
    plains: list = []
    flatten(t, layout, plains)
    return (layout, tuple(tensor_key(p) for p in plains))


def with_inner_tensors(leaves: Sequence[Any]) -> list:
    """`leaves` with each subclass replaced by its plain inner tensors (for the aliasing key)."""
    out: list = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x):
            flatten(x, layout_of(x), out)
        else:
            out.append(x)
    return out
