"""Higher-order gradients: a differentiable backward for compiled functions.

The compiled backward graph runs inside an `autograd.Function`, whose backward autograd does not
differentiate. When that backward runs with grad mode on (`create_graph=True`, or
`autograd.grad(..., create_graph=True)` inside a model), the run time calls `HigherOrder.bind`'s
backward instead, which computes the same gradients through functions aotgrad compiles itself:

    R(primals, other saved values)  -> the saved values that lack autograd history
    B(saved values, tangents)       -> the gradient of each primal

`R` is the forward graph cut down to those saved values; `B` is the backward graph. Both are
traced from pristine copies of the partitioned graphs (compile/compile.py keeps them before any compiler
touches them) through `CompiledFunction`, so each is cached per input signature and its own
backward is differentiable the same way: third and higher orders come by recursion.

Saved inputs and outputs of the forward come back from autograd with their history and are used as
they are (as eager uses its saved tensors). Every other floating saved value keeps its saved value
and gets the history of its recomputation (`_Rebind`), so the first-order values are bit-identical
to the plain backward's. Non-floating saved values (masks, indices, maybe drawn at random) have no
derivative: `R` takes them as inputs, so a dropout mask is not drawn again.

First-order cost: the compiled forward keeps a reference to its inputs on the autograd context
(`ctx.primals`, dropped by a first-order backward that frees the graph), and compile/compile.py copies the
two partitioned graphs once per compiled signature. Nothing else runs unless a backward runs with
grad mode on.

Refused (a `HigherOrderError`), never a wrong gradient: an input requiring grad that the program
mutated in place, and a recomputed value that depends on any input it mutated (named: the second
backward would need its old value and history); a derivative
through a value the forward computed with grad mode off (`no_grad`, a custom Function's forward:
`_refuse_no_grad_values`), and graphs make_fx recorded, which do not mark those; random operators
left in `R`; recomputed values that no longer match the saved ones (an input modified in place
after the forward); a backward operator with neither derivative nor decomposition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import AotgradError, HigherOrderError
from ..partition.default import flows_from
from ..trace.higher_order_marks import _NO_DERIVATIVE, SAVED_UNPACK
from ..trace.tracer import NO_GRAD
from .scatters import differentiable_scatters

log = logging.getLogger("aotgrad.higher_order")


def _undetach(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with the tagged `detach` nodes replaced by their input (in place)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.meta.get(SAVED_UNPACK) and node.op == "call_function":
            node.replace_all_uses_with(node.args[0], propagate_meta=False)
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()
    return gm


def pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm`'s graph (nodes and their meta dicts), so that compilers and the in-place
    rewrites of compile/compile.py may change the original."""
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
    grad_mode_recorded: bool = True  # the trace marked nodes recorded under no_grad (tracer.NO_GRAD)
    _recompute: dict[tuple[int, ...], _Recompute] = field(default_factory=dict, repr=False)
    _backward: Callable | None = field(default=None, repr=False)
    _drawn: frozenset[int] | None = field(default=None, repr=False)

    def recompute(self, positions: tuple[int, ...]) -> _Recompute:
        """`R` for recomputing the saved tensors at `positions` (the others are its inputs)."""
        rec = self._recompute.get(positions)
        if rec is None:
            rec = self._recompute[positions] = _build_recompute(self, positions)
        return rec

    def drawn_at_random(self) -> frozenset[int]:
        """Saved tensors computed from random draws alone (a dropout mask): no derivative, and
        recomputing them would draw again, so `R` takes them as inputs."""
        if self._drawn is None:
            self._drawn = _drawn_at_random(self.fw_graph, self.num_fw_outputs, self.num_saved_tensors)
        return self._drawn

    def compiled_backward(self) -> Callable:
        if self._backward is None:
            gm = differentiable_scatters(_undetach(pristine_copy(self.bw_graph)))
            _refuse_no_grad_values(gm, gm.graph.find_nodes(op="placeholder"))
            self._backward = _compile_graph(self, gm)
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
            grads_in = list(self.differentiable_backward(ctx, primals, saved, other, tangents))
            for group, ks in unreached.items():
                if all(grads[diff[j]] is None for j in group):
                    for k in ks:
                        grads_in[k] = None
            return tuple(grads_in)

        # Autograd may call it from a frame Dynamo is compiling (`autograd.grad` inside a
        # torch.compile'd model runs after a graph break): Dynamo must not trace aotgrad itself.
        return torch._disable_dynamo(backward, recursive=True)

    def differentiable_backward(self, node, primals, saved: list, other: list, tangents: list) -> list:
        """The gradients of the primals, with autograd history on the primals and tangents.

        A saved tensor that is an input or an output of the compiled forward (`node`) comes back
        from autograd with its history and is used as it is, as eager uses its saved tensors; the
        other floating ones are recomputed by `R` and rebound to their saved values. (A view of an
        input made in the forward comes back requiring grad but without the view's history.)"""
        inputs = {id(p) for p in primals}
        drawn = self.drawn_at_random()
        positions = tuple(
            i for i, s in enumerate(saved)
            if isinstance(s, torch.Tensor) and (s.is_floating_point() or s.is_complex())
            and id(s) not in inputs and s.grad_fn is not node and i not in drawn
        )
        bound = list(saved)
        if not self.grad_mode_recorded:
            raise HigherOrderError(
                "aotgrad: higher-order gradient (create_graph=True) through a function traced with make_fx "
                "(symbolic shapes, or higher-order operators other than with_effects): that trace does not "
                "record which values were computed under torch.no_grad(), which the second derivative must "
                "treat as constants. Use static shapes, or run this function eagerly."
            )
        for k, name in self.mutated.items():
            # Its autograd history is now the mutation's (the epilogue's copy_), which the saved
            # values the gradient goes through do not account for (fuzzer program 2686).
            if isinstance(primals[k], torch.Tensor) and primals[k].requires_grad:
                raise _mutated_input(name)
        if positions and any(isinstance(p, torch.Tensor) and p.requires_grad for p in primals):
            rec = self.recompute(positions)
            rec.check_mutated(self.mutated)
            out = _call_differentiably(rec.compiled, *primals, *(saved[i] for i in rec.fixed_positions),
                                       *(saved[i].detach() for i in rec.checked_positions))
            recomputed = out[:len(positions)]
            # R computed how far its values are from the saved ones (fused into its kernels); only
            # a value past the tolerance (or a NaN) sends them through the full check.
            unchecked = set(positions)
            if rec.checked_positions and bool(out[-1] <= 0):
                unchecked -= set(rec.checked_positions)
            for i, r in zip(positions, recomputed):
                if isinstance(r, torch.Tensor) and r.requires_grad:
                    if i in unchecked:
                        _check_same(saved[i], r, i)
                    bound[i] = _Rebind.apply(saved[i], r)
        out = _call_differentiably(self.compiled_backward(), *bound, *other, *tangents)
        return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclass
class _Recompute:
    compiled: Callable  # (*primals, *fixed saved values) -> the recomputed saved values
    fixed_positions: list[int]  # saved tensors taken as inputs
    checked_positions: list[int]  # saved tensors R compares its recomputation with (last output)
    needs: dict[int, int]  # primal -> bitmask of the recomputed values whose value flows from it

    def check_mutated(self, mutated: dict[int, str]) -> None:
        """Refuse where a saved value that carries a derivative depends on an input the program
        mutated in place: the primal now holds its new value, and its autograd history is that of
        the mutation."""
        for k, name in mutated.items():
            if self.needs.get(k):
                raise _mutated_input(name)


def _mutated_input(name: str) -> HigherOrderError:
    return HigherOrderError(
        f"aotgrad: higher-order gradient (create_graph=True) through a compiled function that mutates {name} "
        "in place: the second backward would need that input's value (and autograd history) from before the "
        "mutation, which is gone. Mutate a .clone() of it inside the function instead, or run this function "
        "eagerly."
    )


def _positional(gm: torch.fx.GraphModule) -> Callable:
    """`gm` as a function of its placeholders, run op by op so that operators autograd cannot
    differentiate are replaced by their decompositions (`_call_differentiably`)."""

    def call(*args):
        return _Decomposing(gm).run(*args)

    return call


def _compile_graph(h: HigherOrder, gm: torch.fx.GraphModule) -> Callable:
    """`gm` compiled by aotgrad, with its 0-d inputs read only by `.item()` passed as Python numbers."""
    scalars = _scalar_inputs(gm)
    compiled = h.make_compiled(_positional(gm))
    if not scalars:
        return compiled

    def call(*args):
        return compiled(*(a.item() if k in scalars else a for k, a in enumerate(args)))

    return call


def _scalar_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Placeholders read only by `_local_scalar_dense` (a float Dynamo passes as a 0-d tensor under
    `dynamic=True`), rewritten to take the number itself. Tracing `.item()` of a fake tensor fails;
    a number is part of aotgrad's cache key, so each value gets its own compiled graph."""
    item = torch.ops.aten._local_scalar_dense.default
    out = set()
    for k, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        if p.users and all(u.op == "call_function" and u.target is item for u in p.users):
            for u in list(p.users):
                u.replace_all_uses_with(p, propagate_meta=False)
                gm.graph.erase_node(u)
            out.add(k)
    if out:
        gm.recompile()
    return frozenset(out)


# Operators (by schema name) autograd has no derivative for and that we decompose instead. Capture
# traced the backward with grad mode off, and autograd then picks formulas it cannot differentiate
# (`silu_backward`, where eager's double backward picks `infinitely_differentiable_silu_backward`).
# Only those: a backward operator that has a double-backward formula keeps it (decomposing
# `native_layer_norm_backward` would cut the dependence of the saved mean and rstd on the input).
_DECOMPOSED: set[str] = set()
class _Decomposing(torch.fx.Interpreter):
    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.zero.default:  # no derivative for complex outputs; the same value
            return torch.zeros_like(args[0])
        if target is torch.ops.aten.copy.default:  # no derivative; `src` in a tensor laid out as `self`
            self_, src = args[:2]
            out = torch.empty_strided(self_.size(), self_.stride(), dtype=self_.dtype, device=self_.device)
            return out.copy_(src)
        if isinstance(target, torch._ops.OpOverload) and target._schema.name in _DECOMPOSED:
            from torch._decomp import decomposition_table

            decomposed = decomposition_table.get(target)
            if decomposed is not None:
                out = decomposed(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        return super().call_function(target, args, kwargs)


def _call_differentiably(fn: Callable, *args):
    """`fn(*args)` (which compiles on a new signature), retried with each operator autograd reports
    it cannot differentiate decomposed; refused if torch has no decomposition for it."""
    from torch._decomp import decomposition_table

    while True:
        try:
            return fn(*args)
        except RuntimeError as e:
            m = _NO_DERIVATIVE.search(str(e))
            if "does not support automatic differentiation" in str(e) and not isinstance(e, AotgradError):
                raise HigherOrderError(
                    f"aotgrad: higher-order gradient (create_graph=True): {str(e).splitlines()[0]} (an operator "
                    "of the compiled backward). Run this function eagerly where you need higher-order gradients."
                ) from e
            if m is None or isinstance(e, AotgradError) or m.group(1) in _DECOMPOSED:
                raise
            name = m.group(1)
            if not any(isinstance(op, torch._ops.OpOverload) and op._schema.name == name for op in decomposition_table):
                raise HigherOrderError(
                    f"aotgrad: higher-order gradient (create_graph=True): the compiled backward calls {name}, "
                    "which autograd cannot differentiate and torch has no decomposition for. Run this function "
                    "eagerly where you need higher-order gradients."
                ) from e
            log.debug("higher-order: decomposing %s (no derivative)", name)
            _DECOMPOSED.add(name)


def _build_recompute(h: HigherOrder, positions: tuple[int, ...]) -> _Recompute:
    """The forward graph cut down to the saved tensors at `positions`; the other saved tensors
    become inputs (their values are known; those with history carry it in)."""
    gm = differentiable_scatters(_undetach(pristine_copy(h.fw_graph)))
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    saved = list(graph.output_node().args[0])[h.num_fw_outputs : h.num_fw_outputs + h.num_saved_tensors]
    fixed_positions = [i for i in range(len(saved)) if i not in positions]
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
    graph.output_node().args = ([saved[i] for i in positions],)
    _eliminate_dead_code(graph)
    random = [n for n in graph.nodes if n.op == "call_function" and _is_random(n.target)]
    if random:
        raise HigherOrderError(
            f"aotgrad: higher-order gradient (create_graph=True) through a compiled function whose saved "
            f"values depend on a random operator ({random[0].target}): recomputing them would draw new random "
            "numbers. Run this function eagerly where you need higher-order gradients."
        )
    _refuse_no_grad_values(gm, placeholders)
    checked = _add_saved_value_check(graph, positions)
    gm.recompile()
    needs = _needs(gm, len(placeholders))
    log.debug("higher-order recompute: %d saved values recomputed (%d checked in R), %d taken as inputs",
              len(positions), len(checked), len(fixed_positions))
    return _Recompute(_compile_graph(h, gm), fixed_positions, checked, needs)


def _add_saved_value_check(graph: torch.fx.Graph, positions: tuple[int, ...]) -> list[int]:
    """Append to R one more output: max over its recomputed values r (with their saved values s as
    new inputs) of `amax|r - s| - tol * (1 + amax|s|)`, detached. A compiler fuses it into the
    kernels computing r, where a separate check read each value five more times (a tenth of a
    force-field step); `_check_same`'s full check runs only when it is positive or NaN. Values of
    unknown or zero size are left to `_check_same`. Returns the positions checked here."""
    aten = torch.ops.aten
    outputs = list(graph.output_node().args[0])
    last = graph.find_nodes(op="placeholder")[-1]
    checked: list[int] = []
    violation = None
    for i, node in zip(positions, outputs):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
            continue
        if any(not isinstance(d, int) for d in val.shape) or val.numel() == 0:
            continue
        with graph.inserting_after(last):
            saved = last = graph.placeholder(f"check_{i}")
        saved.meta = dict(node.meta)
        tol = 1e-3 if val.element_size() >= 4 else 2e-2
        with graph.inserting_before(graph.output_node()):
            diff = graph.call_function(aten.amax.default, (graph.call_function(aten.abs.default, (
                graph.call_function(aten.sub.Tensor, (node, saved)),)), []))
            scale = graph.call_function(aten.amax.default, (graph.call_function(aten.abs.default, (saved,)), []))
            bound = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.add.Tensor, (scale, 1.0)), tol))
            v = graph.call_function(aten._to_copy.default, (graph.call_function(aten.sub.Tensor, (diff, bound)),),
                                    {"dtype": torch.float32})
            violation = v if violation is None else graph.call_function(aten.maximum.default, (violation, v))
        checked.append(i)
    if violation is not None:
        with graph.inserting_before(graph.output_node()):
            violation = graph.call_function(aten.detach.default, (violation,))
        graph.output_node().args = (outputs + [violation],)
    return checked


# Factories that read only their argument's metadata (a random mask is drawn into `empty_like(x)`).
_METADATA_ONLY = {torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
                  torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default,
                  torch.ops.aten.empty.memory_format, torch.ops.aten.full.default,
                  torch.ops.aten.empty_strided.default}


def _drawn_at_random(gm: torch.fx.GraphModule, num_fw_outputs: int, num_saved: int) -> frozenset[int]:
    """Positions of the saved tensors whose value comes from random operators, metadata-only
    factories and constants alone."""
    random: set[torch.fx.Node] = set()
    constant: set[torch.fx.Node] = set()  # no value flows from a graph input
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _METADATA_ONLY:
            constant.add(node)
        elif _is_random(node.target):
            random.add(node)
        elif node.all_input_nodes and all(a in random or a in constant for a in node.all_input_nodes):
            (random if any(a in random for a in node.all_input_nodes) else constant).add(node)
    saved = list(gm.graph.output_node().args[0])[num_fw_outputs : num_fw_outputs + num_saved]
    return frozenset(i for i, n in enumerate(saved) if n in random)


def _refuse_no_grad_values(gm: torch.fx.GraphModule, inputs: list[torch.fx.Node]) -> None:
    """Refuse a graph that differentiates through a floating value the forward computed with grad
    mode off from a floating input. Under `torch.no_grad()` eager made it a constant; inside a
    custom autograd.Function's forward its derivative is the Function's backward: the graph cannot
    tell the two apart, and either way differentiating its ops would be wrong."""
    floating = {n for n in inputs if _is_floating(n)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _METADATA_ONLY:
            continue
        if any(a in floating for a in node.all_input_nodes):
            if node.meta.get(NO_GRAD) and _is_floating(node):
                raise HigherOrderError(
                    f"aotgrad: higher-order gradient (create_graph=True): a value the second derivative goes "
                    f"through ({node.target}) was computed from the inputs with grad mode off, under "
                    "torch.no_grad() or inside a custom autograd.Function. aotgrad cannot tell which, so "
                    "it cannot differentiate it as eager would. Run this function eagerly, or compute that "
                    "value outside the compiled function."
                )
            floating.add(node)


def _is_floating(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """Dead-code elimination that also drops unused random draws (fx keeps them as impure): `R`
    must not advance the random generator for a value nothing reads."""
    while True:
        graph.eliminate_dead_code()
        unused = [n for n in graph.nodes if n.op == "call_function" and not n.users and _is_random(n.target)]
        if not unused:
            return
        for n in unused:
            graph.erase_node(n)


def _needs(gm: torch.fx.GraphModule, num_primals: int) -> dict[int, int]:
    """Per primal, a bitmask of the graph's outputs its value flows into."""
    flows = flows_from(gm, gm.graph.find_nodes(op="placeholder")[:num_primals])
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
    tol = 1e-3 if a.element_size() >= 4 else 2e-2
    # Three passes (allclose makes a dozen: 27% of a force-field step); the full check only when
    # this one fails (a NaN or an infinity also lands there).
    if a.numel() and bool(torch.sub(a, b).abs().amax() <= tol * (1 + a.abs().amax())):
        return
    if not torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True):
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
