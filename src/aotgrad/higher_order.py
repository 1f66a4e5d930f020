"""Higher-order gradients: a differentiable backward for compiled functions.

The compiled backward graph runs inside an `autograd.Function`, whose backward autograd does not
differentiate. When that backward runs with grad mode on (`create_graph=True`, or
`autograd.grad(..., create_graph=True)` inside a model), the run time calls `HigherOrder.backward`
instead, which computes the same gradients through two functions aotgrad compiles itself:

    recompute(primals, non-float saved)  -> the forward's floating saved values   (R)
    backward(saved, tangents)            -> the gradient of each primal            (B)

`R` is the forward graph cut down to the values it saves; `B` is the backward graph. Both are
traced from pristine copies of the partitioned graphs (compile.py keeps them before any compiler
touches them), through `CompiledFunction`, so each is cached per input signature and its own
backward is differentiable the same way: third and higher orders come by recursion.

The saved values autograd gives back are used for their values; `_Rebind` ties each one to its
recomputation, so the gradient flows from `B` through `R` into the primals' autograd history
(values stay bit-identical to the first-order backward). Non-floating saved values (masks,
indices, maybe drawn at random) have no derivative: `R` takes them as inputs instead of recomputing
them, so a dropout mask is not drawn again.

First-order cost: the compiled forward keeps a reference to its inputs on the autograd context
(`ctx.primals`, dropped by a first-order backward that frees the graph), and compile.py copies the
two partitioned graphs once per compiled signature. Nothing else runs unless a backward runs with
grad mode on.

Refused (an `AotgradError` naming the input), never a wrong gradient: a saved value that depends
on an input the program mutated in place (the second backward would need its old value); random
operators left in `R`; recomputed saved values that no longer match the saved ones (an input
modified in place after the forward); an earlier first-order backward that already released the
graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from .errors import AotgradError

log = logging.getLogger("aotgrad.higher_order")


class HigherOrderError(AotgradError):
    """A higher-order gradient aotgrad cannot give exactly."""


def pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm`'s graph (nodes and their meta dicts), so that compilers and the in-place
    rewrites of compile.py may change the original."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


@dataclass
class HigherOrder:
    """What one compiled signature needs for a differentiable backward, built at compile time
    (cheap: references only); the two compiled functions are made on the first use."""

    fw_graph: torch.fx.GraphModule  # pristine forward: primals -> forward outputs + saved values
    bw_graph: torch.fx.GraphModule  # pristine backward: saved values + tangents -> gradients
    num_fw_outputs: int
    num_saved_tensors: int
    mutated: dict[int, str]  # primal -> its name, for primals the program mutated in place
    make_compiled: Callable[[Callable], Callable]  # fn -> aotgrad CompiledFunction with the same config
    _recompute: _Recompute | None = field(default=None, repr=False)
    _backward: Callable | None = field(default=None, repr=False)

    def recompute(self) -> _Recompute:
        if self._recompute is None:
            self._recompute = _build_recompute(self)
        return self._recompute

    def compiled_backward(self) -> Callable:
        if self._backward is None:
            self._backward = self.make_compiled(_positional(self.bw_graph))
        return self._backward

    def bind(self, diff: list[int], unreached: dict[tuple[int, ...], list[int]], tangent_meta: list) -> Callable:
        """The differentiable `backward(ctx, *grads)` for the autograd.Function the run time builds
        (`diff`: the differentiable forward outputs; `unreached`, `tangent_meta`: as the generated
        first-order backward uses them, for gradients autograd passes as None)."""

        def backward(ctx, *grads):
            tangents = []
            for j, i in enumerate(diff):
                t = grads[i]
                if t is None:
                    dtype, device = tangent_meta[j]
                    t = torch.zeros(ctx.tangent_shapes[j], dtype=dtype, device=device)
                tangents.append(t.contiguous())
            primals = getattr(ctx, "primals", None)
            if primals is None:
                raise HigherOrderError(
                    "aotgrad: backward with create_graph=True through a compiled function whose graph an "
                    "earlier backward already released. Pass retain_graph=True to the earlier backward."
                )
            saved = list(ctx.saved_tensors)
            other = list(getattr(ctx, "saved_other", ()))
            ctx.maybe_clear_saved_tensors()
            grads_in = list(self.differentiable_backward(primals, saved, other, tangents))
            for group, ks in unreached.items():
                if all(grads[diff[j]] is None for j in group):
                    for k in ks:
                        grads_in[k] = None
            return tuple(grads_in)

        return backward

    def differentiable_backward(self, primals, saved: list, other: list, tangents: list) -> list:
        """The gradients of the primals, with autograd history on the primals and tangents."""
        rec = self.recompute()
        rec.check_mutated(primals, self.mutated)
        bound = list(saved)
        if rec.float_positions and any(p.requires_grad for p in primals if isinstance(p, torch.Tensor)):
            fixed = [saved[i] for i in rec.fixed_positions]
            recomputed = rec.compiled(*primals, *fixed)
            recomputed = recomputed if isinstance(recomputed, (list, tuple)) else (recomputed,)
            for i, r in zip(rec.float_positions, recomputed):
                if isinstance(r, torch.Tensor) and r.requires_grad:
                    _check_same(saved[i], r, i)
                    bound[i] = _Rebind.apply(saved[i], r)
        out = self.compiled_backward()(*bound, *other, *tangents)
        return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclass
class _Recompute:
    compiled: Callable  # (*primals, *fixed saved values) -> floating saved values
    float_positions: list[int]  # saved tensors recomputed (differentiable)
    fixed_positions: list[int]  # saved tensors taken as inputs (no derivative)
    needs: dict[int, int]  # primal -> bitmask of float_positions (by order) whose value flows from it

    def check_mutated(self, primals, mutated: dict[int, str]) -> None:
        """Refuse where a saved value that carries a derivative depends on an input the program
        mutated in place: the primal now holds its new value, and its autograd history is that of
        the mutation."""
        for k, name in mutated.items():
            if self.needs.get(k):
                raise HigherOrderError(
                    f"aotgrad: higher-order gradient (create_graph=True) through a compiled function that "
                    f"mutates {name} in place: the second backward would need that input's value from before "
                    "the mutation, which is gone. Mutate a .clone() of it inside the function instead, or "
                    "run this function eagerly."
                )


def _positional(gm: torch.fx.GraphModule) -> Callable:
    """`gm` called with positional arguments (one per placeholder)."""

    def call(*args):
        return gm(*args)

    return call


def _build_recompute(h: HigherOrder) -> _Recompute:
    """The forward graph cut down to the floating saved values, non-floating ones as inputs."""
    gm = pristine_copy(h.fw_graph)
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    outs = list(graph.output_node().args[0])
    saved = outs[h.num_fw_outputs : h.num_fw_outputs + h.num_saved_tensors]
    float_positions, fixed_positions = [], []
    for i, node in enumerate(saved):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex()):
            float_positions.append(i)
        else:
            fixed_positions.append(i)
    last = placeholders[-1] if placeholders else None
    for i in fixed_positions:
        node = saved[i]
        ctx = graph.inserting_after(last) if last is not None else graph.inserting_before(None)
        with ctx:
            p = graph.placeholder(f"saved_{i}")
        p.meta = dict(node.meta) if isinstance(node, torch.fx.Node) else {}
        last = p
        if isinstance(node, torch.fx.Node) and node.op != "placeholder":
            node.replace_all_uses_with(p, propagate_meta=False)
    out_node = graph.output_node()
    out_node.args = ([saved[i] for i in float_positions],)
    graph.eliminate_dead_code()
    random = [n for n in graph.nodes if n.op == "call_function" and _is_random(n.target)]
    if random:
        raise HigherOrderError(
            f"aotgrad: higher-order gradient (create_graph=True) through a compiled function whose saved "
            f"values depend on a random operator ({random[0].target}): recomputing them would draw new random "
            "numbers. Run this function eagerly where you need higher-order gradients."
        )
    gm.recompile()
    needs = _needs(gm, len(placeholders))
    log.debug("higher-order recompute: %d saved values recomputed, %d taken as inputs",
              len(float_positions), len(fixed_positions))
    return _Recompute(h.make_compiled(_positional(gm)), float_positions, fixed_positions, needs)


def _needs(gm: torch.fx.GraphModule, num_primals: int) -> dict[int, int]:
    """Per primal, a bitmask of the graph's outputs its value flows into."""
    placeholders = gm.graph.find_nodes(op="placeholder")[:num_primals]
    flows = {n: 1 << k for k, n in enumerate(placeholders)}
    for node in gm.graph.nodes:
        if node not in flows:
            mask = 0
            for a in node.all_input_nodes:
                mask |= flows.get(a, 0)
            flows[node] = mask
    needs: dict[int, int] = {}
    for j, o in enumerate(gm.graph.output_node().args[0]):
        mask = flows.get(o, 0) if isinstance(o, torch.fx.Node) else 0
        for k in range(num_primals):
            if mask >> k & 1:
                needs[k] = needs.get(k, 0) | 1 << j
    return needs


def _is_random(target) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _check_same(saved: torch.Tensor, recomputed: torch.Tensor, i: int) -> None:
    """The recomputed saved value must be the saved one (up to a compiler's rounding): otherwise an
    input changed since the forward and the derivative would be taken at the wrong point."""
    a, b = saved.detach(), recomputed.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise HigherOrderError(f"aotgrad internal error: recomputed saved value {i} has shape/dtype "
                               f"{tuple(b.shape)}/{b.dtype}, saved {tuple(a.shape)}/{a.dtype}")
    rtol = 1e-3 if a.element_size() >= 4 else 2e-2
    if not torch.allclose(a, b, rtol=rtol, atol=rtol, equal_nan=True):
        raise HigherOrderError(
            "aotgrad: higher-order gradient (create_graph=True) through a compiled function: a value its "
            "forward saved no longer matches its recomputation from the function's inputs, so an input was "
            "modified in place after the forward. Eager would need that input's old value too; pass a "
            ".clone() of it, or modify it after the backward."
        )


class _Rebind(torch.autograd.Function):
    """`saved`'s value with `recomputed`'s autograd history (the gradient passes to `recomputed`)."""

    @staticmethod
    def forward(ctx, saved, recomputed):
        return saved.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, grad
