"""Stage 6 — run time: generated straight-line Python around the compiled graphs.

From a `Plan` we write, once per compiled signature, the source of one function `run(leaves)`:
unpack the caller's flat arguments, pick the graph inputs, call the compiled forward (inside an
`autograd.Function` when training), apply input mutations to the caller's tensors, rebuild outputs
that alias inputs or intermediates, and rebuild the output pytree. For example, for
`def f(a): a.mul_(2); return a.view(-1)` with `a` requiring grad:

    def run(leaves):
        l0, = leaves
        p0 = l0
        r0, = _apply(p0)
        p0.copy_(r0)
        o0 = _op0(p0, *_a0)          # aten.view.default(p0, [-1])
        return o0

No loop over metadata runs per call: every decision was taken when the source was written.
The generated code is logged to `aotgrad.runtime.source` at DEBUG; `AOTGRAD_PRINT_RUNTIME=1` turns
that logger on, writing to stderr.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.utils import _pytree as pytree
from torch.utils._sympy.printers import PythonPrinter

from ..compile.compile import CompiledForward, placeholder_values
from ..errors import AotgradError
from ..plan import (
    AliasOfGraphOutput,
    AliasOfLeaf,
    AliasOfOutput,
    AliasOfPrimal,
    BaseOfLeaf,
    BumpVersion,
    Constant,
    CopyInto,
    Detach,
    FromLeaf,
    GraphOutput,
    InputItself,
    IntermediateBase,
    Plan,
    Restride,
    RestrideLeaf,
    SameAs,
    SetToOutput,
    SetToPrimal,
    UserOutput,
    ViewChain,
    symbols_in,
)
from ..signature import ambient, subclass_layout
from ..signature.inputs import storage_base, storage_id

_SOURCE_LOG = logging.getLogger("aotgrad.runtime.source")
if os.environ.get("AOTGRAD_PRINT_RUNTIME"):
    _SOURCE_LOG.setLevel(logging.DEBUG)
    _SOURCE_LOG.addHandler(logging.StreamHandler())

_PRINTER = PythonPrinter()


class _Source:
    """A tiny code writer: lines plus the globals they refer to."""

    def __init__(self, symbols: dict[str, str] | None = None):
        self.lines: list[str] = []
        self.globals: dict[str, Any] = {"_no_grad": torch.no_grad, "torch": torch}
        self.symbols = symbols or {}  # symbol name -> source expression reading it off the leaves
        self.symbols_used: set[str] = set()

    def bind(self, prefix: str, value: Any) -> str:
        name = f"_{prefix}{len(self.globals)}"
        self.globals[name] = value
        return name

    def literal(self, value: Any) -> str:
        """Source for a view argument or size: numbers inline, a symbolic size as its expression
        over symbols read per call (see `symbol_lines`), a list holding one as a list literal, anything
        else (a list of plain ints included) a global bound once."""
        if isinstance(value, (bool, int, type(None))) or (isinstance(value, float) and math.isfinite(value)):
            return repr(value)
        if isinstance(value, (list, tuple)):
            if not symbols_in(value):  # bound once, not rebuilt per call
                return self.bind("a", _plain_numbers(value))
            items = [self.literal(v) for v in value]
            if isinstance(value, tuple):
                return "(" + "".join(f"{v}, " for v in items) + ")"
            return "[" + ", ".join(items) + "]"
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            names = {str(s) for s in value.node.expr.free_symbols}
            if names <= self.symbols.keys():
                self.symbols_used |= names
                return f"({_PRINTER.doprint(value.node.expr)})"
        return self.bind("a", value)

    def symbol_lines(self) -> list[str]:
        return [f"{name} = {self.symbols[name]}" for name in sorted(self.symbols_used)]

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    def build(self, name: str, header: str) -> Callable:
        src = "\n".join([header] + (self.lines or ["    pass"])) + "\n"
        if _SOURCE_LOG.isEnabledFor(logging.DEBUG):
            _SOURCE_LOG.debug("%s", src)
        code = compile(src, f"<aotgrad {name}>", "exec")
        scope: dict[str, Any] = {}
        exec(code, self.globals, scope)
        fn = scope[name]
        fn.__aotgrad_source__ = src
        return fn


def _plain_numbers(value: list | tuple) -> list | tuple:
    """A size or stride list whose symbolic entries the trace specialised (a SymInt whose expression
    is a constant) as plain numbers: bound as they are, `as_strided_` or a view would leave the
    caller's tensor with symbolic sizes, which every later numel() on it refuses."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return _plain_numbers(v)
        return _PLAIN_OF[type(v)](v.node.expr) if type(v) in _PLAIN_OF else v

    return type(value)(plain(v) for v in value)


_PLAIN_OF = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _tuple_src(names: list[str]) -> str:
    return "(" + "".join(f"{n}, " for n in names) + ")"


def make_autograd_function(plan: Plan, compiled: CompiledForward) -> type:
    """An `autograd.Function` whose forward/backward call the compiled graphs."""
    n_out = compiled.num_fw_outputs
    n_t, n_o = compiled.num_saved_tensors, compiled.num_saved_other
    diff = [i for i, o in enumerate(plan.fw_outputs) if o.differentiable]
    nondiff = [i for i, o in enumerate(plan.fw_outputs) if not o.differentiable]

    fw = _Source()
    fw_call = fw.bind("fw", compiled.forward)
    facts = compiled.facts  # what a cache hit knows without its graphs (cache_serialize.GraphFacts)
    scattered = facts.scattered if facts is not None else _scattered_into(compiled.fw_module)
    if scattered:
        # aten's as_strided_scatter refuses a non-contiguous input that requires grad, even under
        # no_grad; the graph needs only its values (the Function records the autograd side).
        args = [f"primals[{k}].detach()" if k in scattered else f"primals[{k}]" for k in range(plan.layout.num_primals)]
        _emit_graph_call(fw, plan, f"outs = {fw_call}([{', '.join(args)}])")
    else:
        _emit_graph_call(fw, plan, f"outs = {fw_call}(list(primals))")
    if compiled.written_in_place:
        # The graph wrote these inputs itself; a compiled kernel's write does not bump the version
        # counter as eager's copy_ does. Bump them here, before anything sharing a counter is saved.
        bumped = _tuple_src([f"primals[{k}]" for k in sorted(compiled.written_in_place)])
        fw.emit(f"{fw.bind('bump', increment_version)}({bumped})")
    if n_t:
        fw.emit(f"ctx.save_for_backward(*outs[{n_out}:{n_out + n_t}])")
    if n_o:
        fw.emit(f"ctx.saved_other = outs[{n_out + n_t}:{n_out + n_t + n_o}]")
    higher = compiled.higher_order
    if higher is not None:  # for a differentiable backward (higher_order/backward.py); one reference, no copy
        fw.emit("ctx.primals = primals")
    outs = [f"o{i}" for i in range(n_out)]
    fw.emit(f"{_tuple_src(outs)} = outs[:{n_out}]")
    names = [f"primals[{k}]" for k in range(plan.layout.num_primals)]
    _emit_as_caller_sees(fw, plan, compiled, outs, names, "primals", in_function=True)
    fw.emit(f"outs = {_tuple_src(outs)}")
    unreached = _unreached_when_none(plan, compiled, diff)
    # Outputs that get no gradient are seen as None, for the inputs eager leaves None (below) and
    # for a backward specialised for their zeros (partition/zero_tangents.py; where no unchanged copy of the
    # backward graph was kept, the plain backward runs: the same code either way).
    # A non-differentiable output (a buffer's new value, an integer tensor) also turns it on: with
    # grads materialised, autograd would hand the backward a tensor of zeros for it, of its size,
    # alive through the whole backward for a gradient the graph never reads.
    none_aware = bool(unreached) or len(diff) >= 2 or bool(diff and nondiff)
    static_shapes = _static_tangent_shapes(compiled, len(diff)) if none_aware else None
    if none_aware:
        # Outputs that get no gradient arrive as None (not zeros), so that inputs only they reach
        # get None, as in eager; the backward graph gets zeros in their place, of the traced
        # tangents' dtype, device and shape. Static shapes are constants on the Function's backward
        # class (ctx's type: `ctx.tangent_shapes` reads them); symbolic ones are stored per call.
        fw.emit("ctx.set_materialize_grads(False)")
        if static_shapes is None:
            fw.emit(f"ctx.tangent_shapes = {_tuple_src([f'outs[{i}].shape' for i in diff])}")
    if nondiff:
        fw.emit("ctx.mark_non_differentiable(" + ", ".join(f"outs[{i}]" for i in nondiff) + ")")
    fw.emit("return outs")
    forward = fw.build("forward", "def forward(ctx, *primals):")

    bw = _Source()
    cfw = bw.bind("compiled", compiled)
    bw.emit("if type(grads[0]) is list:")  # boxed (`_BoxedGrads`): one list of gradients
    bw.emit("grads = grads[0]", indent=2)
    parts = ["*ctx.saved_tensors"] if n_t else []
    if n_o:
        parts.append("*ctx.saved_other")
    bw.globals["_contig"] = _contiguous
    if none_aware:
        bw.globals["_zeros"] = torch.zeros
        traced = _traced_tangents(compiled, len(diff))
        for j, i in enumerate(diff):
            bw.emit(f"t{j} = grads[{i}]")
            bw.globals[f"_dtype{j}"], bw.globals[f"_device{j}"] = traced[j].dtype, traced[j].device
        tangents = [
            f"_contig(t{j}, {i}) if t{j} is not None else _zeros(ctx.tangent_shapes[{j}], dtype=_dtype{j}, device=_device{j})"
            for j, i in enumerate(diff)
        ]
    else:
        tangents = [f"_contig(grads[{i}], {i})" for i in diff]
    # A subclass gradient where the trace saw a plain one (a plain output summed into a subclass
    # loss): the backward graph then runs op by op over it, as eager's backward would.
    bw.globals["_SubclassGradient"] = SubclassGradient
    bw.globals["_keep"] = _contiguous_any
    bw.emit("try:")
    bw.emit(f"args = [{', '.join(parts + tangents)}]", 2)
    bw.emit("by_dispatch = None", 2)
    bw.emit("except _SubclassGradient as subclass_gradient:")
    bw.emit(f"args = [{', '.join(parts + [t.replace('_contig(', '_keep(') for t in tangents])}]", 2)
    bw.emit("by_dispatch = subclass_gradient.args[0]", 2)
    # Eager's backward is cast by the autocast state in force when it runs (signature/ambient.py).
    bw.globals["_any_autocast"] = ambient.any_autocast
    run_bw = f"({cfw}.backward(args)(args) if not _any_autocast() else {cfw}.backward_under_autocast(args))"
    # Under compiled autograd Dynamo traces this backward: it gets the backward graph itself to
    # inline (compile.CompiledForward.traceable_backward), without the lock or the compiler call.
    bw.globals["_is_compiling"] = torch.compiler.is_compiling
    run_bw = f"({cfw}.traceable_backward(args) if _is_compiling() else {run_bw})"
    if none_aware:
        bw.emit(f"nones = {_tuple_src([f't{j} is None' for j in range(len(diff))])}")
        bw.emit("del " + ", ".join(f"t{j}" for j in range(len(diff))))
        run_bw = (f"({cfw}.backward_with_none_tangents(nones, args) if True in nones and not _is_compiling() "
                  f"and not _any_autocast() else {run_bw})")
    # outermost: a subclass gradient beside missing ones still runs op by op (zeros in their place)
    run_bw = f"({cfw}.backward_by_dispatch(args, by_dispatch) if by_dispatch is not None else {run_bw})"
    # The node lets go of its saved tensors (unless retain_graph keeps them for another backward),
    # so the boxed graph, which clears `args`, frees each activation after its last use: the
    # backward's peak memory is then what the graph needs, not that plus every saved activation.
    if n_t:
        bw.emit("if not _is_compiling():")
        bw.emit("ctx.maybe_clear_saved_tensors()", indent=2)
    # Boxed (`_BoxedGrads`): the engine's list was the gradients' other holder; emptied, `args`
    # holds them alone and the graph frees each after its last use (a language model's logits
    # gradient, a whole logits buffer, no longer lives through the backward).
    bw.emit("if type(grads) is list:")
    bw.emit("grads.clear()", indent=2)
    if higher is not None:  # a first-order backward that frees the graph frees the inputs too
        # (not while Dynamo traces this backward for compiled autograd: the call would break its graph)
        bw.emit(f"if not _is_compiling() and not {bw.bind('keep_graph', torch._C._autograd._get_current_graph_task_keep_graph)}():")
        bw.emit("ctx.primals = None", 2)
    if unreached:
        bw.emit(f"grads_in = list({run_bw})")
        for tangents, primals in unreached.items():
            cond = " and ".join(f"nones[{j}]" for j in tangents) or "True"
            bw.emit(f"if {cond}:")
            for k in primals:
                bw.emit(f"grads_in[{k}] = None", indent=2)
        bw.emit("return tuple(grads_in)")
    else:
        bw.emit(f"return tuple({run_bw})")
    backward = bw.build("backward", "def backward(ctx, *grads):")
    differentiable = None
    if higher is not None:
        tangent_meta = [(v.dtype, v.device) for v in _traced_tangents(compiled, len(diff))]
        differentiable = higher.bind(diff, unreached, tangent_meta)

    function = _BoxedGrads(
        "CompiledFunction",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(_guarded_backward(backward, differentiable))},
    )
    if static_shapes is not None:
        function._backward_cls.tangent_shapes = static_shapes
    return function


class _BoxedGrads(type(torch.autograd.Function)):
    """The autograd.Function metaclass, with `boxed_grads_call` on where torch has it (2.13+): the
    engine hands the backward its gradients as one list it keeps no other reference to, so the
    backward can let go of them (upstream's compiled functions do the same). Off while compiled
    autograd is on: it calls backwards with the gradients unboxed and refuses boxed ones."""

    @property
    def boxed_grads_call(cls) -> bool:
        if not _ENGINE_BOXES:
            return False
        compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
        return not (compiled_autograd is not None and compiled_autograd.compiled_autograd_enabled)


_ENGINE_BOXES = hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")


def _traced_tangents(compiled: CompiledForward, n: int) -> list:
    """The backward graph's tangent placeholders' traced values (a cache hit's GraphFacts)."""
    if compiled.facts is not None:
        return list(compiled.facts.tangents)
    return placeholder_values(compiled.bw_module)[-n:] if n else []


def _static_tangent_shapes(compiled: CompiledForward, n: int) -> tuple[torch.Size, ...] | None:
    """The traced tangents' shapes when every one is static (then the shape of each output at run
    time), else None. A cache hit reads them off its GraphFacts, so it generates the same code."""
    shapes = [getattr(v, "shape", None) for v in _traced_tangents(compiled, n)]
    if any(s is None or not all(type(d) is int for d in s) for s in shapes):
        return None
    return tuple(torch.Size(s) for s in shapes)


def _unreached_when_none(plan: Plan, compiled: CompiledForward, diff: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Inputs whose gradient eager leaves None when some outputs get no gradient, by those outputs.

    One backward node computes the gradients of all the graph's outputs, so autograd calls it when
    any of them gets a gradient; eager reaches an input only through the outputs connected to it.
    Connected here means: the traced program computed the output from the input, or the backward
    graph computes the input's gradient from the output's. That misses only a gradient that is
    zero whatever the output's gradient, of an output whose value does not depend on the input;
    inputs mutated in place (whose value flow the functional graph cuts where eager's autograd
    keeps the tensor) count as connected to every output. An input connected to outputs D only
    gets None when all of D's gradients are None. Returns {D: inputs} for the D that are not all
    outputs (those need nothing: the node runs only if some gradient is given)."""
    if not diff or not compiled.computed_from or not compiled.gradient_from:
        return {}
    mutated = compiled.written_in_place | plan.primals_changed_after_forward
    every = tuple(range(len(diff)))
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, from_tangents in enumerate(compiled.gradient_from):
        if from_tangents is None or k in mutated:
            continue
        outputs = tuple(j for j, i in enumerate(diff) if compiled.computed_from[i] >> k & 1 or from_tangents >> j & 1)
        if outputs != every:
            groups.setdefault(outputs, []).append(k)
    return groups


def _scattered_into(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the graph inputs that an `as_strided_scatter` writes into."""
    placeholders = {n: k for k, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    return {placeholders[n.args[0]] for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.as_strided_scatter.default)
            if n.args and n.args[0] in placeholders}


def _guarded_backward(backward: Callable, differentiable: Callable | None) -> Callable:
    """The backward as autograd calls it, refusing what it cannot do and explaining what it refuses.

    - The compiled backward graph is not differentiable. Under `create_graph=True` (grad mode on)
      eager records its gradients' history: run `differentiable` instead (higher_order/backward.py), or,
      without one, refuse rather than return gradients with none (a gradient penalty built on them
      would silently lose its second-order term).
    - A saved tensor modified in place since the forward (an output, a view of one, an input):
      autograd's version check fails. Eager checks a saved tensor only when the gradient reaches
      the node that saved it; this one node computes the gradients of all of the graph's outputs,
      so it fails whenever any of them gets a gradient. Say so, and what to do."""

    def wrapper(ctx, *grads):
        run = backward
        if torch.is_grad_enabled():
            if len(grads) == 1 and type(grads[0]) is list:  # boxed: the differentiable backward takes them unboxed
                grads = tuple(grads[0])
            if differentiable is None:
                raise AotgradError(
                    "aotgrad: backward with create_graph=True (double backward) through an aotgrad-compiled "
                    "function: its compiled backward graph is not differentiable. Run this function eagerly "
                    "where you need higher-order gradients, or call backward without create_graph."
                )
            run = differentiable
        try:
            return run(ctx, *grads)
        except RuntimeError as e:
            if isinstance(e, AotgradError) or "modified by an inplace operation" not in str(e):
                raise
            raise AotgradError(
                f"{e}\naotgrad: a tensor the compiled forward saved for the backward (an output of the "
                "compiled function, a view of one, or an input) was modified in place after the forward. "
                "aotgrad's backward computes the gradients of all of the compiled graph's outputs at once, "
                "so it needs the saved value whenever any of them gets a gradient (eager: only when that "
                "tensor's own gradient path does). Modify a .clone() of the output instead."
            ) from e

    return wrapper


def _non_view(t, primals):
    """A view of a graph intermediate returned from a custom Function may not be mutated in place
    later; the user's tensor is no view in eager, so hand autograd a non-view alias. (A mutated
    input's new value may be the input itself, or a view of it.)"""
    if isinstance(t, torch.Tensor) and t._is_view():
        base = t._base
        if not any(base is p or base is p._base for p in primals):
            return t.detach()
    return t


def _unaliased(t, written: set):
    """`t`, a user output, or its copy if it shares memory with an input the graph wrote in place.
    In eager it aliases no input; a graph compiler can make it one. Inductor drops the `clone` in
    `a[2:3].fill_(0).clone()` (the clone's source is a fresh value then), and its re-inplacing pass
    then turns that source into `a` itself."""
    if isinstance(t, torch.Tensor) and storage_id(t) in written:
        return t.clone()
    return t


def _emit_as_caller_sees(
    src: _Source,
    plan: Plan,
    compiled: CompiledForward,
    outs: list[str],
    primals: list[str],
    primals_tuple: str,
    *,
    in_function: bool,
) -> None:
    """Graph outputs as the caller may see them (`in_function`: as an autograd.Function returns them).

    A hidden base of returned views gets a tensor object of its own: a graph compiler may return
    one tensor for two outputs that alias (Inductor drops the `detach` in `y = x.neg(); return
    y.detach(), y.view(-1)`), and the views must not come back as views of another output. No output
    is a view of a hidden intermediate (`_non_view`), and no user output shares memory with an input
    the graph wrote (`_unaliased`)."""
    src.globals.update(_non_view=_non_view, _unaliased=_unaliased)
    written = _written_by_graph(plan, compiled)
    user = [i for i, o in enumerate(plan.fw_outputs[: len(outs)]) if isinstance(o.kind, UserOutput)]
    if written and user:
        sid = src.bind("storage_id", storage_id)
        src.emit(f"_written = {{{', '.join(f'{sid}({primals[k]})' for k in sorted(written))}}}")
    if compiled.facts is not None:
        are_tensors = compiled.facts.outputs_are_tensors
    else:
        are_tensors = [isinstance(v, torch.Tensor) for v in _output_values(compiled.fw_module)]
    for i, name in enumerate(outs):
        kind = plan.fw_outputs[i].kind
        if isinstance(kind, IntermediateBase):
            src.emit(f"{name} = {name}.detach()")
        elif (isinstance(kind, UserOutput) or in_function) and are_tensors[i]:
            # the view test inline: the common output is no view, and pays no call (nor the tuple)
            src.emit(f"if {name}._is_view():")
            src.emit(f"{name} = _non_view({name}, {primals_tuple})", 2)
        elif isinstance(kind, UserOutput) or in_function:  # not known to be a tensor
            src.emit(f"{name} = _non_view({name}, {primals_tuple})")
        if written and i in user:
            src.emit(f"{name} = _unaliased({name}, _written)")
    tensors = [name for name, is_tensor in zip(outs, are_tensors) if is_tensor]
    if len(tensors) > 1:
        _emit_distinct(src, tensors)


def _written_by_graph(plan: Plan, compiled: CompiledForward) -> frozenset[int]:
    """Primals the compiled forward writes into (re-inplaced, or a mutation kept in the graph)."""
    return compiled.written_in_place | {k for k, m in enumerate(plan.mutations) if m.kept_in_graph}


def _emit_distinct(src: _Source, names: list[str]) -> None:
    """Give each output its own tensor object. A graph compiler may return one tensor for two
    outputs that are equal aliases (Inductor removes `detach` and `alias`); eager returns two
    objects, and an autograd.Function would mark both non-differentiable if either were."""
    outs, n = _tuple_src(names), len(names)
    if n <= 4:  # a few `is` tests cost less than building a set
        src.emit(f"if {' or '.join(f'{a} is {b}' for k, a in enumerate(names) for b in names[k + 1:])}:")
    else:
        src.emit(f"if len({{id(o) for o in {outs}}}) < {n}:")
    src.emit(f"{outs} = {src.bind('distinct', _distinct_objects)}({outs})", 2)


def _distinct_objects(outs: tuple) -> tuple:
    seen: set[int] = set()
    fresh = []
    for o in outs:
        if id(o) in seen:
            o = o.detach()
        seen.add(id(o))
        fresh.append(o)
    return tuple(fresh)


def _output_values(gm: torch.fx.GraphModule) -> list:
    """The traced value of each graph output (None where it is no node)."""
    return [getattr(v, "meta", {}).get("val") for v in gm.graph.output_node().args[0]]


class SubclassGradient(Exception):
    """Internal: a compiled plain backward received a subclass gradient (make_autograd_function)."""


def _contiguous(g: torch.Tensor, i: int = -1) -> torch.Tensor:
    if type(g) is not torch.Tensor and g is not None and subclass_layout.is_untraced_subclass(g):
        raise SubclassGradient(i)
    return g.contiguous() if g is not None else g


def _contiguous_any(g: torch.Tensor, i: int = -1) -> torch.Tensor:
    return g.contiguous() if g is not None else g


def build_runner(plan: Plan, compiled: CompiledForward) -> Callable[[list], Any]:
    """Write and compile `run(leaves)` for one plan (see module docstring)."""
    src = _Source({s.name: f"l{s.leaf}{s.accessor}" for s in plan.symbol_sources})
    layout = plan.layout
    src.emit(f"{_tuple_src([f'l{i}' for i in range(layout.num_leaves)])} = leaves")
    for k, s in enumerate(layout.primal_sources):
        if isinstance(s, FromLeaf):
            src.emit(f"p{k} = l{s.leaf}")
        elif isinstance(s, BaseOfLeaf):
            src.emit(f"p{k} = l{s.leaf}._base")
        else:
            src.emit(f"p{k} = {src.bind('storage_base', storage_base)}(l{s.leaf})")
    for action in plan.prologue:
        src.emit(f"p{action.primal}.requires_grad_(True)")
    primals = [f"p{k}" for k in range(layout.num_primals)]
    results = [f"r{i}" for i in range(compiled.num_fw_outputs)]
    if plan.is_training and results:
        apply = src.bind("apply", make_autograd_function(plan, compiled).apply)
        args = [f"{p}.detach()" if k in plan.grad_free else p for k, p in enumerate(primals)]
        call = f"{_tuple_src(results)} = {apply}({', '.join(args)})"
        if plan.grad_mode_at_call:
            src.emit(call)
        else:  # the program's enable_grad() region: its outputs get a grad_fn, as in eager
            src.globals["_enable_grad"] = torch.enable_grad
            src.emit("with _enable_grad():")
            src.emit(call, indent=2)
    else:
        # Version bumps without a write of ours (the graph writes, or eager bumped without writing)
        # go first: the counters are still in cache from Dynamo's guards, after a kernel that
        # streamed an optimizer's tensors they are not (AdamW over GPT-2: 45-50 us after, 15-17 before).
        bumped = _bumps_only(plan, compiled.written_in_place)
        if bumped:
            src.emit(f"{src.bind('bump', increment_version)}({_tuple_src([f'p{k}' for k in bumped])})")
        call = src.bind("fw", compiled.forward)
        n = compiled.num_fw_outputs
        target = _tuple_src(results) if n else "_"
        _emit_graph_call(src, plan, f"{target} = {call}([{', '.join(primals)}])[:{n}]" if plan.is_training else f"{target} = {call}([{', '.join(primals)}])")
        _emit_as_caller_sees(src, plan, compiled, results, primals, _tuple_src(primals), in_function=False)
    for i, o in enumerate(plan.fw_outputs):
        if isinstance(o.kind, IntermediateBase) and o.kind.leaf_requires_grad:
            src.emit(f"r{i}.requires_grad_(True)")
    _emit_epilogue(src, plan, compiled.written_in_place, bumped_before=bool(not plan.is_training or not results))
    names = _emit_outputs(src, plan)
    src.emit(f"return {_structure(src, plan.out_spec, names[: plan.out_spec.num_leaves])}")
    src.lines[1:1] = ["    " + line for line in src.symbol_lines()]
    return src.build("run", "def run(leaves):")


def _bumps_only(plan: Plan, written_in_place: frozenset[int]) -> list[int]:
    """Primals whose only change the epilogue makes is a version bump, in epilogue order."""
    return [
        a.primal for a in plan.epilogue
        if isinstance(a, BumpVersion) or (isinstance(a, CopyInto) and a.primal in written_in_place)
    ]


def _emit_epilogue(src: _Source, plan: Plan, written_in_place: frozenset[int], *, bumped_before: bool) -> None:
    """The epilogue's actions on the caller's tensors (`bumped_before`: without the version bumps
    the run time made before calling the graph)."""
    bumps: list[str] = []  # consecutive version bumps go out as one call (an optimizer has hundreds)

    def flush_bumps():
        if bumps:
            src.emit(f"{src.bind('bump', increment_version)}({_tuple_src(bumps)})")
            bumps.clear()

    for a in plan.epilogue:
        if isinstance(a, CopyInto) and a.primal in written_in_place:
            # The compiled graph wrote the input itself (compile/reinplace.py, compile._write_back_in_graph);
            # a compiled kernel's write does not bump the version counter as eager's copy_ does (the
            # training path bumps it inside the autograd.Function).
            continue
        if isinstance(a, BumpVersion):
            if not bumped_before:
                bumps.append(f"p{a.primal}")
            continue
        flush_bumps()
        if isinstance(a, (Restride, RestrideLeaf)):
            target = f"p{a.primal}" if isinstance(a, Restride) else f"l{a.leaf}"
            if not a.no_grad:  # refresh a view's grad_fn after the copy_ into its base, as eager's reads did
                src.emit(f"{target}.grad_fn")
            size, stride, offset = (src.literal(v) for v in (a.size, a.stride, a.offset))
            _emit(src, f"{target}.as_strided_({size}, {stride}, {offset})", a.no_grad)
        elif isinstance(a, CopyInto):
            _emit(src, f"p{a.primal}.copy_(r{a.value})", not a.grad)
        elif isinstance(a, SetToOutput):
            _emit(src, f"p{a.primal}.set_(r{a.value})", True)
        elif isinstance(a, SetToPrimal):
            _emit(src, f"p{a.primal}.set_(p{a.other})", True)
        elif isinstance(a, Detach):
            src.emit(f"p{a.primal}.detach_()")
    flush_bumps()


def _emit_graph_call(src: _Source, plan: Plan, line: str) -> None:
    """A call of a compiled graph. Traced under autocast, its casts are in it: autocast is off.
    An inference graph whose program marked an input with requires_grad_() (the prologue did that
    already) runs under no_grad: no output it computes needs a grad_fn (else it would be training)."""
    contexts = []
    if plan.autocast:
        src.globals["_no_autocast"] = ambient.no_autocast
        contexts.append("_no_autocast()")
    if (plan.prologue and not plan.is_training) or plan.inference_under_grad:
        contexts.append("_no_grad()")
    if contexts:
        src.emit(f"with {', '.join(contexts)}:")
        src.emit(line, indent=2)
    else:
        src.emit(line)


def _emit(src: _Source, line: str, no_grad: bool) -> None:
    if no_grad:
        src.emit("with _no_grad():")
        src.emit(line, 2)
    else:
        src.emit(line)


def _emit_outputs(src: _Source, plan: Plan) -> list[str]:
    """Emit every output (and hidden base), each after the one it is rebuilt from or the same as:
    a view may be returned before its base."""
    names: dict[int, str] = {}

    def emit(i: int) -> None:
        if i in names:
            return
        s = plan.out_sources[i]
        if isinstance(s, (SameAs, AliasOfOutput)):
            emit(s.position)
        names[i] = _emit_output(src, i, s, names)

    for i in range(len(plan.out_sources)):
        emit(i)
    return [names[i] for i in range(len(plan.out_sources))]


def _emit_output(src: _Source, i: int, s, names: dict[int, str]) -> str:
    """Emit what output `i` needs and return the expression naming it."""
    if isinstance(s, GraphOutput):
        return f"r{s.index}"
    if isinstance(s, Constant):
        return src.literal(s.value)
    if isinstance(s, InputItself):
        return f"l{s.leaf}"
    if isinstance(s, SameAs):
        return names[s.position]
    if isinstance(s, AliasOfPrimal):
        base = f"p{s.primal}"
    elif isinstance(s, AliasOfLeaf):
        base = f"l{s.leaf}"
    elif isinstance(s, AliasOfGraphOutput):
        base = f"r{s.index}"
    else:
        base = names[s.position]
    _emit_chain(src, f"o{i}", base, s.chain)
    return f"o{i}"


def _emit_chain(src: _Source, target: str, base: str, chain: ViewChain) -> None:
    exprs = []
    if chain.as_strided is not None:
        size, stride, offset = (src.literal(v) for v in chain.as_strided)
        exprs.append(lambda x: f"{x}.as_strided({size}, {stride}, {offset})")
    for step in chain.steps:
        exprs.append(_step_expr(src, step))
    if chain.detach:
        exprs.append(lambda x: f"{x}.detach()")
    value = base
    if chain.no_grad_steps:
        for make in exprs[: chain.no_grad_steps]:
            value = make(value)
        src.emit("with _no_grad():")
        src.emit(f"{target} = {value}", 2)
        value = target
    for make in exprs[chain.no_grad_steps :]:
        value = make(value)
    if value != target:
        src.emit(f"{target} = {value}")
    if chain.multi_output:
        set_meta = src.bind("set_creation_meta", torch._C._autograd._set_creation_meta)
        meta = src.bind("multi_output", torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE)
        src.emit(f"{set_meta}({target}, {meta})")
    if chain.requires_grad:
        src.emit(f"{target}.requires_grad_(True)")


def _step_expr(src: _Source, step) -> Callable[[str], str]:
    op = src.bind("op", step.op)
    args = "".join(f", {src.literal(a)}" for a in step.args)
    kwargs = "".join(f", {k}={src.literal(v)}" for k, v in step.kwargs)
    item = f"[{step.item}]" if step.item is not None else ""
    return lambda x: f"{op}({x}{args}{kwargs}){item}"


def _structure(src: _Source, spec: pytree.TreeSpec, names: list[str]) -> str:
    """Source rebuilding the output pytree from flat names (tuple/list/dict inline, else unflatten)."""
    it = iter(names)

    def walk(s: pytree.TreeSpec) -> str:
        if s.is_leaf():
            return next(it)
        kids = [walk(c) for c in s.children()]
        if s.type is tuple:
            return _tuple_src(kids)
        if s.type is list:
            return "[" + ", ".join(kids) + "]"
        if s.type is dict and all(isinstance(k, (str, int)) for k in s.context):
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(s.context, kids)) + "}"
        raise _Fallback

    try:
        return walk(spec)
    except _Fallback:
        unflatten = src.bind("unflatten", pytree.tree_unflatten)
        return f"{unflatten}([{', '.join(names)}], {src.bind('spec', spec)})"


class _Fallback(Exception):
    pass
