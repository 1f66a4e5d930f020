"""The autograd crossings of the subclass boundary (subclass/wrap.py): `_Wrap` (plain -> subclass; its
backward flattens the subclass gradient), `_Unwrap` (subclass -> plain; its backward rebuilds the
subclass gradient), and `_Gather`/`_Spread` for a plain argument whose gradient is a subclass. Each
crossing has a `_Site`: the layout it crosses with, and what the trace saw of its gradient."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UnsupportedInputError, UnsupportedOutputError
from ..signature.subclass_layout import (
    Opaque,
    SubclassLayout,
    flatten,
    layout_of,
    rebuild,
    same_structure,
)
from ..signature.subclass_sizes import integer_positions, sizes_match
from . import higher as subclass_higher


@dataclass(eq=False)
class _Site:
    """One subclass crossing the boundary: an argument (index `leaf`) or an output (`output`)."""

    layout: SubclassLayout
    name: str
    grad_layout: SubclassLayout | None = None  # argument: the gradient's layout the trace saw arrive
    # argument whose gradient is nested less deeply than it (or is plain): where each plain part of
    # the gradient travels among the argument's inner tensors (`gradient_slots`)
    grad_slots: tuple[int, ...] | None = None
    tracing: bool = True
    plain_shapes: list | None = None  # argument: its inner tensors' shapes in the trace

    def flatten_grad(self, grad: torch.Tensor) -> list[torch.Tensor]:
        """`_Wrap.backward`: the incoming subclass gradient as plain tensors."""
        got = layout_of(grad)
        if self.tracing:  # an argument's gradient, as the traced backward computes it
            if got is not None and not same_structure(got, self.layout) and not self._fits(grad, got):
                # in the argument's own metadata where the subclass can coerce it (a DTensor
                # parameter's gradient in the parameter's placements: its local shards then have
                # the shapes of the argument's inner tensors). Where eager's gradient already
                # fits (a Partial(sum) gradient of a Replicate argument), it stays eager's: a
                # coercion would be a collective in the backward the caller did not ask for.
                grad, got = self._coerce(grad, got, refuse=False)
            if got is None or got.num_plain != self.layout.num_plain:
                spread = self._spread_over_slots(grad, got)
                if spread is not None:
                    return spread
                raise UnsupportedInputError(
                    f"aotgrad: the gradient of {self.name} ({self.layout.describe()}) is "
                    f"{'a plain tensor' if got is None else got.describe()}, which cannot be split into the "
                    "argument's inner tensors. Pass the inner tensors as separate inputs."
                )
            self.grad_layout = got
        elif not same_structure(got, self.layout) or not sizes_match(grad.shape, self.layout.outer_size):
            grad, got = self._coerce(grad, got)
        out: list = []
        flatten(grad, got, out)
        return out

    def _spread_over_slots(self, grad: torch.Tensor, got: SubclassLayout | None) -> list | None:
        """An argument's gradient nested less deeply than the argument (eager's, from a custom
        Function's backward): each plain part goes to the first inner tensor of the argument's
        matching part, the others get none; `rebuild_grad` picks them out again. None where the
        gradient does not fit so, or is plain altogether (refused: a plain gradient of a subclass
        argument also comes from a plain tensor written with a subclass value, whose eager gradients
        are the subclass's dispatch artefacts, not something a plain slot carries)."""
        slots = None if got is None else gradient_slots(got, self.layout)
        shapes = self.plain_shapes
        if slots is None or shapes is None:
            return None
        parts: list = []
        flatten(grad, got, parts)
        if any(tuple(p.shape) != shapes[k] for k, p in zip(slots, parts)):
            return None
        self.grad_layout, self.grad_slots = got, tuple(slots)
        out: list = [None] * self.layout.num_plain
        for k, p in zip(slots, parts):
            out[k] = p
        return out

    def _fits(self, grad: torch.Tensor, got: SubclassLayout) -> bool:
        """Whether eager's gradient is kept as it is: a DTensor gradient that is Partial where the
        argument is Replicate (else the same placements), its local tensor of the argument's shape."""
        placements = getattr(grad, "placements", None)
        ctx = self.layout.ctx
        mine = ctx[0] if isinstance(ctx, tuple) and ctx and isinstance(ctx[0], tuple) else None
        if placements is None or mine is None or len(mine) != len(placements) or self.plain_shapes is None:
            return False
        if not all(p == q or (p.is_partial() and q.is_replicate()) for p, q in zip(placements, mine)):
            return False
        out: list = []
        flatten(grad, got, out)
        return got.num_plain == self.layout.num_plain and [tuple(t.shape) for t in out] == self.plain_shapes

    def _coerce(self, grad: torch.Tensor, got: SubclassLayout | None, refuse: bool = True) -> tuple:
        """An incoming gradient of other metadata than the guess: coerced by the subclass itself where
        it knows how (`__coerce_same_metadata_as_tangent__`: DTensor redistributes), else refused."""
        coerce = getattr(grad, "__coerce_same_metadata_as_tangent__", None)
        if got is not None and got.cls is self.layout.cls and coerce is not None:
            coerced = coerce(self.layout.ctx)
            if coerced is not None and tuple(coerced.shape) == self.layout.outer_size:
                new = layout_of(coerced)
                if new.num_plain == self.layout.num_plain:
                    return coerced, new
        if not refuse:
            return grad, got
        raise UnsupportedOutputError(
            f"aotgrad: {self.name} is a {self.layout.describe()}; its incoming gradient is "
            f"{'a plain tensor' if got is None else got.describe()} {tuple(grad.shape)}, not what the "
            "compiled backward was traced for (the output's own type and metadata). Pass a gradient "
            "of the output's type (e.g. torch.ones_like(out)), or call the function eagerly."
        )

    def rebuild_grad(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """`_Unwrap.backward`: the plain gradients as one subclass gradient."""
        layout = self.layout if self.tracing else self.grad_layout
        if self.grad_slots is not None and not self.tracing:  # nested less deeply than the argument
            grads = [grads[k] for k in self.grad_slots]
            if None in grads:
                return None
        if layout is None:
            return None
        if grads and grads[0] is not None and grads[0]._is_zerotensor():  # eager's structural zero (subclass/higher.py)
            zero = subclass_higher.structural_zero(layout, grads)
            if zero is not None:
                return zero
        return rebuild(layout, grads)


def gradient_slots(got: SubclassLayout, layout: SubclassLayout) -> list[int] | None:
    """Positions among `layout`'s plain inner tensors for the plain parts of a gradient of layout
    `got` that is `layout` with some parts less nested (a plain part standing for a whole subclass
    part goes to that part's first inner tensor). None if `got` is not so."""
    if got.cls is not layout.cls or got.attrs != layout.attrs:
        return None
    slots: list[int] = []
    pos = 0
    for mine, theirs in zip(layout.inner, got.inner):
        if isinstance(mine, Opaque) or isinstance(theirs, Opaque):
            if not (isinstance(mine, Opaque) and isinstance(theirs, Opaque)):
                return None
            continue
        if theirs is None:
            slots.append(pos)
        elif mine is None:
            return None  # the gradient nests more deeply here
        else:
            inner = gradient_slots(theirs, mine)
            if inner is None:
                return None
            slots += [pos + k for k in inner]
        pos += 1 if mine is None else mine.num_plain
    return slots


class _Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, site: _Site, *plains):
        ctx.site = site
        if site.tracing:
            site.plain_shapes = [tuple(p.shape) for p in plains]  # its detaches tagged for a differentiable backward (subclass/higher.py)
            return subclass_higher.crossing(_Wrap._forward, site, plains)
        # inner tensors without grad kept as they are: a NestedTensor output then shares its
        # argument's offsets, hence its nested int, as in eager
        return rebuild(site.layout, [p.detach() if p.requires_grad else p for p in plains])

    @staticmethod
    def _forward(site: _Site, plains):
        return rebuild(site.layout, [p.detach() if p.requires_grad else p for p in plains])

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph=True: flattened as autograd records (subclass/higher.py)
            return (None, *subclass_higher.wrap_backward(ctx.site, grad))
        return (None, *ctx.site.flatten_grad(grad))


class _Unwrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, site: _Site, t):
        ctx.site = site
        if site.tracing:  # its detaches tagged for a differentiable backward (subclass/higher.py)
            return subclass_higher.crossing(_Unwrap._forward, ctx, site, t)
        return _Unwrap._forward(ctx, site, t)

    @staticmethod
    def _forward(ctx, site: _Site, t):
        plains: list = []
        flatten(t, site.layout, plains)
        # aliases: the caller's inner tensors keep their autograd state; integer ones (a NestedTensor's
        # offsets) are passed as they are and make the gradient's (its nested int is eager's)
        integer = site.__dict__.get("integer_inner")  # per site: dtypes are in the signature
        if integer is None:
            integer = site.integer_inner = integer_positions(plains)
        if not integer:
            return tuple(p.detach() for p in plains)
        ctx.kept_inner = [p if k in integer else None for k, p in enumerate(plains)]
        return tuple(p if k in integer else p.detach() for k, p in enumerate(plains))

    @staticmethod
    def backward(ctx, *grads):
        kept = getattr(ctx, "kept_inner", None)
        if kept is not None:
            grads = [g if m is None else m for g, m in zip(grads, kept)]
        if torch.is_grad_enabled():  # create_graph=True: rebuilt as autograd records (subclass/higher.py)
            return None, subclass_higher.unwrap_backward(ctx.site, grads)
        return None, ctx.site.rebuild_grad(grads)


class _Gather(_Wrap):
    """Trace side of a plain argument whose gradient is a subclass: the value is the first of its
    plain stand-ins; the subclass gradient is flattened onto all of them."""

    @staticmethod
    def forward(ctx, site: _Site, *plains):
        ctx.site = site
        return subclass_higher.crossing(plains[0].detach) if site.tracing else plains[0].detach()


class _Spread(_Unwrap):
    """Run-time side of `_Gather`: the caller's plain argument passed once per plain gradient; their
    gradients are rebuilt into the subclass gradient eager gives it."""

    @staticmethod
    def forward(ctx, site: _Site, t):
        ctx.site = site
        return tuple(t.detach() for _ in range(site.layout.num_plain))
