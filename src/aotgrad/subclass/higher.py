"""Higher-order gradients through the subclass stage: a differentiable boundary.

The boundary between a subclass and its plain inner tensors is crossed by autograd Functions
(subclass/wrap.py): `_Wrap` (plain -> subclass; backward flattens the subclass gradient) and
`_Unwrap` (subclass -> plain; backward rebuilds it). Their first-order backward reads and builds
inner tensors directly, which autograd does not record: under `create_graph=True` the gradients
would lose their history at the boundary, and a second-order gradient would be silently missing.

Both operations are linear, so under grad mode their backward runs them as autograd Functions
of their own (`_FlattenGrad`, `_RebuildGrad`), each the other's derivative: autograd records the
crossing and differentiates through it, to any order. The plain part's differentiable backward is
the plain pipeline's (higher_order/backward.py). In a trace, the `detach`es of the boundary Functions'
forwards are tagged (`crossing`) so the plain differentiable backward's graphs drop them:
they are the crossing, the identity on inner tensors, not a cut.

The fused run (one autograd.Function per call, subclass_runtime.build_fused_run) reads its
arguments' inner tensors inside its forward, so its plain graph inputs have no history linking them
to the caller's subclasses. Under grad mode its backward (`FusedDoubleBackward`) unwraps the
arguments again, recorded (`unwrap_argument`), hands those as the plain run's primals to the plain
differentiable backward, and flattens/rebuilds gradients with the Functions above. The forward
keeps one reference to its arguments (`ctx.leaves`) where a differentiable backward exists, as the
plain forward keeps `ctx.primals`; a first-order backward that frees the graph drops it.

Refused (`HigherOrderError`): a create_graph backward through a call with a plain argument whose
gradient is a subclass (`mark_spread`), an incoming second-order gradient of another subclass
structure than the gradient it differentiates (it cannot be split into that gradient's inner
tensors), and a create_graph backward through a function compiled without a differentiable backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import HigherOrderError
from ..signature.subclass_layout import SubclassLayout, flatten, layout_of, rebuild, same_structure
from ..trace.backward import _recorded_graph
from ..trace.higher_order_marks import SAVED_UNPACK

log = logging.getLogger("aotgrad.subclass")


def crossing(fn: Callable, *args) -> Any:
    """`fn(*args)`, a boundary Function's forward in a trace: the `detach` nodes it records are tagged
    as higher_order/backward.py tags autograd's saved-value unpacks, so the differentiable backward's graphs
    drop them (the crossing is the identity on inner tensors; its derivative is the Function's
    backward, which the traced gradients already hold)."""
    graph = _recorded_graph()
    if graph is None:
        return fn(*args)
    last = graph._root.prev
    try:
        return fn(*args)
    finally:
        node = last.next
        while node is not graph._root:
            if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
                node.meta[SAVED_UNPACK] = True
            node = node.next


def _detached(ts: Sequence[Any]) -> list:
    return [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in ts]


def _checked_flatten(layout: SubclassLayout, name: str, grad: torch.Tensor) -> list[torch.Tensor]:
    """`grad` (the gradient of a subclass gradient) as the plain tensors of `layout`."""
    got = layout_of(grad)
    if not same_structure(got, layout) or tuple(grad.shape) != tuple(layout.outer_size):
        raise HigherOrderError(
            f"aotgrad: a higher-order gradient (create_graph=True) through {name}: the gradient of its "
            f"{layout.describe()} gradient is {'a plain tensor' if got is None else got.describe()} "
            f"{tuple(grad.shape)}, which cannot be split into that gradient's inner tensors. Build "
            "the second-order loss from subclass operations on the gradient, or call the function eagerly."
        )
    out: list = []
    flatten(grad, layout, out)
    return out


class _FlattenGrad(torch.autograd.Function):
    """A subclass (gradient) -> its plain tensors (`flatten_fn`); the derivative rebuilds them as
    one subclass of `layout` (`_RebuildGrad`)."""

    @staticmethod
    def forward(ctx, layout: SubclassLayout, name: str, flatten_fn: Callable, grad):
        ctx.layout, ctx.name = layout, name
        return tuple(_detached(flatten_fn(grad)))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, rebuild_grad(ctx.layout, ctx.name, grads)


class _RebuildGrad(torch.autograd.Function):
    """Plain gradients -> one subclass gradient of `layout`; the derivative flattens (`_FlattenGrad`)."""

    @staticmethod
    def forward(ctx, layout: SubclassLayout, name: str, *plains):
        ctx.layout, ctx.name = layout, name
        return rebuild(layout, _detached(plains))

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None, None, *(None for _ in range(ctx.layout.num_plain)))
        return (None, None, *flatten_grad(ctx.layout, ctx.name, grad))


def flatten_grad(layout: SubclassLayout, name: str, grad: torch.Tensor,
                 flatten_fn: Callable | None = None) -> tuple:
    """`grad` as plain tensors, recorded by autograd under grad mode (`flatten_fn`: the boundary's
    own check and flatten, else the structure check of `layout`)."""
    if flatten_fn is None:
        def flatten_fn(g):
            return _checked_flatten(layout, name, g)
    if torch.is_grad_enabled():
        return _FlattenGrad.apply(layout, name, flatten_fn, grad)
    return tuple(flatten_fn(grad))


def structural_zero(layout: SubclassLayout, grads: Sequence[Any]) -> torch.Tensor | None:
    """Autograd's structurally zero gradient (an efficient ZeroTensor: `sgn`'s derivative, so the
    second derivative of `abs`) for every inner tensor: eager's formula made it at the subclass
    level, a plain ZeroTensor of the outer size, never a subclass; give the same. Else None."""
    if not grads or not all(isinstance(g, torch.Tensor) and g._is_zerotensor() for g in grads):
        return None
    if layout.symbolic:
        return None
    g = grads[0]
    return torch._efficientzerotensor(layout.outer_size, dtype=g.dtype, device=g.device)


def rebuild_grad(layout: SubclassLayout | None, name: str, grads: Sequence[Any]) -> torch.Tensor | None:
    """The plain gradients as one subclass gradient of `layout`, recorded under grad mode."""
    if layout is None:
        return None
    zero = structural_zero(layout, grads)
    if zero is not None:
        return zero
    if torch.is_grad_enabled() and any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
        return _RebuildGrad.apply(layout, name, *grads)
    return rebuild(layout, grads)


# ---------------------------------------------------------------------------------------------
# Hooks for the boundary Functions of subclass/wrap.py (called only with grad mode on)


def wrap_backward(site, grad: torch.Tensor) -> tuple:
    """`_Wrap.backward` under create_graph: the output's incoming gradient flattened, recorded (its
    derivative is rebuilt in the output's own layout, the one the gradient was checked against)."""
    _refuse_spread(site)
    return flatten_grad(site.layout, site.name, grad, site.flatten_grad)


def unwrap_argument(site, t: torch.Tensor) -> tuple:
    """A subclass argument as its plain inner tensors, recorded: their gradients are rebuilt as the
    subclass the trace saw arrive (`_Unwrap` without its NestedTensor offsets, which the fused run
    does not take)."""
    def flatten_fn(x):
        out: list = []
        flatten(x, site.layout, out)
        return out

    return _FlattenGrad.apply(site.grad_layout, site.name, flatten_fn, t)


def unwrap_backward(site, grads: Sequence[Any]) -> torch.Tensor | None:
    """`_Unwrap.backward` under create_graph: the argument's gradient rebuilt, recorded."""
    _refuse_spread(site)
    return rebuild_grad(site.layout if site.tracing else site.grad_layout, site.name, grads)


def mark_spread(boundary) -> None:
    """A boundary with a plain argument whose gradient is a subclass (`_Spread`): that argument is
    one tensor in the trace (its first plain stand-in), where eager's autograd sees it meet each
    inner tensor apart. Its first-order gradient is eager's, but the history of the differentiable
    backward runs through the first stand-in only, so a second-order gradient would put every
    component's share in the first inner tensor. Every crossing of this boundary refuses to
    create a graph (`_refuse_spread`): a backward with create_graph=True always passes one."""
    if not boundary.spread:
        return
    names = ", ".join(f"{s.name} (a plain tensor whose gradient is a {s.layout.describe()})"
                      for s in boundary.spread.values())
    sites = [o.site for o in boundary.outputs if type(o).__name__ == "SubclassOut"]
    sites += [s for _, s in boundary.rebased_at.values()] + list(boundary.sites.values())
    for site in sites + list(boundary.spread.values()):
        site.spread_refusal = names


def _refuse_spread(site) -> None:
    # A gradient nested less deeply than its argument comes from a custom Function's backward, and
    # create_graph through one is refused before this (higher_order/backward.py): a guard behind it.
    if site.grad_slots is not None and not site.tracing:
        raise HigherOrderError(
            f"aotgrad: backward with create_graph=True through a compiled function where the gradient of "
            f"{site.name} is nested less deeply than the argument ({site.layout.describe()}): aotgrad "
            "carries that gradient through the argument's inner tensors and does not record it for a "
            "second derivative. Call the function eagerly where you need higher-order gradients."
        )
    names = site.__dict__.get("spread_refusal")
    if names is not None:
        raise HigherOrderError(
            f"aotgrad: backward with create_graph=True through a compiled function with {names}: aotgrad "
            "traces that argument as one tensor and cannot split its higher-order gradients into the "
            "subclass's components as eager does. Pass it as a subclass (e.g. TwoTensor(y, y.clone())), "
            "or call the function eagerly where you need higher-order gradients."
        )


def name_mutated_inputs(boundary, compiled) -> None:
    """The plain run's refusals of inputs it mutated (higher_order/backward.py) name the caller's argument,
    not the flattened plain input: `input 1 (inner tensor 0 of a TwoTensor(...))`."""
    higher = getattr(compiled, "higher_order", None)
    if higher is None or not higher.mutated:
        return
    named = {}
    for k, name in higher.mutated.items():
        named[k] = name
        plain = int(name[6:]) if name.startswith("input ") and name[6:].isdigit() else None
        for i, (start, stop) in enumerate(boundary.ranges):
            if plain is not None and start <= plain < stop:
                layout = boundary.layouts[i]
                named[k] = (f"input {i}" if layout is None
                            else f"input {i} (inner tensor {plain - start} of a {layout.describe()})")
                break
    higher.mutated = named


# ---------------------------------------------------------------------------------------------
# The fused run's backward under grad mode


@dataclass
class FusedDoubleBackward:
    """`backward(ctx, *grads)` of the fused run (subclass_runtime.build_fused_run) under grad mode."""

    boundary: Any  # subclass_wrap.Boundary
    plan: Any
    plain_backward: Callable  # the plain run's Function's backward (differentiable under grad mode)
    differentiable: bool  # the plain run has a differentiable backward (compiled.higher_order)

    def __call__(self, ctx, *grads):
        leaves = getattr(ctx, "leaves", None)
        if not self.differentiable:
            raise HigherOrderError(
                "aotgrad: backward with create_graph=True through an aotgrad-compiled function with tensor "
                "subclass arguments or outputs, compiled without a differentiable backward. Compile it "
                "with aot_function/aot_module (or backend='aotgrad'), or call backward without create_graph."
            )
        if leaves is None:
            raise HigherOrderError(
                "aotgrad: backward with create_graph=True through a compiled function whose graph an "
                "earlier backward already released. Pass retain_graph=True to the earlier backward."
            )
        plain = self._plain_leaves(leaves)
        ctx.primals = [plain[s.leaf] for s in self.plan.layout.primal_sources]
        gs = self.plain_backward(ctx, *self._tangents(grads))
        return tuple(self._grads(gs, plain))

    def _plain_leaves(self, leaves: Sequence[Any]) -> list:
        """The plain inner tensors of the arguments, with history to the caller's subclasses."""
        b = self.boundary
        plain: list = []
        for i, layout in enumerate(b.layouts):
            if layout is None:
                plain.append(leaves[i])
            elif b.requires_grad[i]:
                plain.extend(unwrap_argument(b.sites[i], leaves[i]))
            else:
                flatten(leaves[i], layout, plain)
        return plain

    def _tangents(self, grads: Sequence[Any]) -> list:
        """The outputs' gradients as the plain backward takes them, in plain output order."""
        per_output = []
        for k, o in enumerate(self.boundary.outputs):
            if type(o).__name__ == "PlainOut":
                per_output.append((o.position, [grads[k]]))
                continue
            m = o.site.layout.num_plain
            if o.requires_grad and grads[k] is not None:
                per_output.append((o.start, list(wrap_backward(o.site, grads[k]))))
            else:
                per_output.append((o.start, [None] * m))
        return [g for _, gs in sorted(per_output, key=lambda e: e[0]) for g in gs]

    def _grads(self, gs: Sequence[Any], plain: list) -> list:
        """Per argument its gradient: plain, or rebuilt as the subclass the trace saw arrive."""
        b = self.boundary
        primal_of = {s.leaf: k for k, s in enumerate(self.plan.layout.primal_sources)}
        out, pos = [], 0
        for i, layout in enumerate(b.layouts):
            width = 1 if layout is None else layout.num_plain
            ks = [primal_of.get(p) for p in range(pos, pos + width)]
            start, pos = pos, pos + width
            if not b.requires_grad[i] or None in ks:
                out.append(None)
            elif layout is None:
                out.append(gs[ks[0]])
            elif all(gs[k] is None for k in ks):
                out.append(None)
            else:  # inner gradients eager leaves None are zeros, as autograd materialises them
                inner = [gs[k] if gs[k] is not None else torch.zeros_like(plain[start + j])
                         for j, k in enumerate(ks)]
                out.append(unwrap_backward(b.sites[i], inner))
        return out
