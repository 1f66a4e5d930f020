"""Stage 5 — compile: hand each graph to its compiler, boxed.

The forward (or inference) graph is compiled now; the backward graph on the first `.backward()`,
because many compiled functions never run one and backward compilation can be as slow as forward.
A backward with symbolic sizes is compiled now too: its compiler may specialise a size, and that
guard must exist before the caller caches the compiled function.
Before a graph goes to its compiler, functionalized custom-op calls are put back in place where
that is safe (compile/reinplace.py), unless the compiler does that itself.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .. import observe
from ..higher_order.backward import HigherOrder, pristine_copy
from ..partition import zero_tangents
from ..partition.default import clone_saved_inputs, flows_from
from ..plan import Captured, CopyInto, MutatedInputValue, Plan
from ..signature import ambient, subclass_layout
from ..signature.subclass_layout import is_subclass
from ..trace import backward_mutations
from ..trace.inputs import _primal_name
from ..trace.interpreter_stack import on_roomy_stack
from ..trace.tracer import GRAD_MODE_RECORDED
from .compilers import boxed, naming, takes_functional_graphs
from .inplace_graphs import keep_inplace_ops
from .reinplace import reinplace

# Meta key on a backward graph made from the compiled one (specialised for zero tangents, re-traced
# under autocast): that graph, whose inputs (the saved values) it takes as they are. A compiler that
# lays out the saved values (Inductor: their strides) lays this one out the same way.
SAME_INPUTS_AS = "aotgrad_same_inputs_as"

@dataclass
class CompiledForward:
    """A compiled forward (training) or inference graph and what the run time needs around it."""

    forward: Callable
    fw_module: torch.fx.GraphModule
    num_fw_outputs: int
    num_saved_tensors: int = 0
    num_saved_other: int = 0
    written_in_place: frozenset[int] = frozenset()  # primals whose new value the graph already wrote
    # Which gradients eager would leave None, read off the graphs before any compiler could
    # simplify a dependency away: per forward output, a bitmask of the primals the program computed
    # it from; per primal, a bitmask of the tangents the backward computes its gradient from (None:
    # no gradient).
    computed_from: tuple[int, ...] = ()
    gradient_from: tuple[int | None, ...] = ()
    bw_module: torch.fx.GraphModule | None = None
    bw_compiler: Callable | None = None
    aot_id: int = 0  # names the graphs for compilers that ask (compilers.get_aot_graph_name)
    higher_order: HigherOrder | None = None  # the differentiable backward (higher_order/backward.py)
    keep_inplace: bool = False  # disable_functionalization=True: compilers get in-place ops back
    facts: Any = None  # a cache hit's GraphFacts: what the run time would read off graphs not loaded
    # False inside the subclass stage: its graph holds flattened subclass values, which a subclass
    # gradient run op by op would mix with (subclass/wrap.py)
    dispatch_backward: bool = True
    decompositions: dict | None = None  # the capture's table, for a backward re-traced under autocast
    _backward: Callable | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _autocast_backwards: dict = field(default_factory=dict, repr=False)
    _zero_backwards: dict = field(default_factory=dict, repr=False)

    def backward(self, example_inputs: Sequence[Any]) -> Callable:
        """The compiled backward, compiling it on first use."""
        if self._backward is None:
            with self._lock:
                if self._backward is None:
                    self._backward = on_roomy_stack(self._compile_backward, list(example_inputs))
        return self._backward

    def traceable_backward(self, args: list) -> Any:
        """The backward graph run as is, for Dynamo to trace into its graph (compiled autograd
        traces the backward; the CA graph's own compiler compiles it, as upstream's does)."""
        return self.bw_module(*args)

    def backward_by_dispatch(self, args: list, output: int) -> Any:
        """A subclass gradient reached this backward, traced for a plain one (forward output
        `output` is plain, its gradient a subclass, as when a plain and a subclass loss are summed):
        the graph runs op by op, so the subclass's own dispatch computes what eager's backward would."""
        gm = self.bw_module
        if gm is None or not self.dispatch_backward:
            subclass_layout.refuse_subclass_tangent(next(a for a in args if is_subclass(a)), output,
                                                    inside_subclass_stage=gm is not None)
        return list(gm(*args))

    def _compile_backward(self, example_inputs: list) -> Callable:
        if not takes_functional_graphs(self.bw_compiler):
            reinplace(self.bw_module)
        if self.keep_inplace:
            keep_inplace_ops(self.bw_module)
        with naming("backward", self.aot_id):
            return boxed(observe.call_compiler("backward", self.bw_compiler, self.bw_module, example_inputs,
                                               log=False))

    def backward_with_none_tangents(self, nones: tuple[bool, ...], args: list) -> list:
        """Run the backward when the tangents flagged in `nones` came as None (zeros in `args`):
        a backward specialised for those zeros (partition/zero_tangents.py), compiled once per set; the
        plain backward where that simplifies nothing or no unchanged copy of the graph is kept."""
        compiled = self._zero_backwards.get(nones)
        if compiled is None:
            compiled = self._zero_backwards[nones] = self._compile_zero_backward(nones, args)
        return compiled(args)

    def _compile_zero_backward(self, nones: tuple[bool, ...], args: list) -> Callable:
        source = self.higher_order.bw_graph if self.higher_order is not None else None
        offset = len(args) - len(nones)
        gm = source and zero_tangents.specialise(source, {offset + j for j, none in enumerate(nones) if none})
        if gm is None:
            return self.backward(args)
        gm.meta[SAME_INPUTS_AS] = self.bw_module
        if not takes_functional_graphs(self.bw_compiler):
            reinplace(gm)
        if self.keep_inplace:
            keep_inplace_ops(gm)
        with naming("backward", self.aot_id):
            return boxed(on_roomy_stack(observe.call_compiler, "backward", self.bw_compiler, gm, list(args), log=False))

    def backward_under_autocast(self, args: list) -> list:
        """Run the backward as eager's runs when `.backward()` is called under autocast: the
        backward graph re-traced under that state (signature/ambient.py), compiled once per state and shapes."""
        key = (ambient.autocast_key(), tuple(_arg_key(a) for a in args))
        compiled = self._autocast_backwards.get(key)
        if compiled is None:
            gm = ambient.retrace_under_autocast(self.bw_module, key[0], args, self.decompositions)
            gm.meta[SAME_INPUTS_AS] = self.bw_module
            if not takes_functional_graphs(self.bw_compiler):
                reinplace(gm)
            if self.keep_inplace:
                keep_inplace_ops(gm)
            with naming("backward", self.aot_id):
                compiled = boxed(on_roomy_stack(observe.call_compiler, "backward", self.bw_compiler, gm, list(args),
                                                log=False))
            self._autocast_backwards[key] = compiled
        with ambient.no_autocast():
            return compiled(args)


def _arg_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device)
    return (type(x), x)


_aot_ids = itertools.count()


def compile_inference(
    captured: Captured, compiler: Callable, example_primals: Sequence[Any], *, keep_inplace: bool = False
) -> CompiledForward:
    gm = captured.graph
    if isinstance(gm, _LazyGraphModule):  # compilers get a module whose forward is the real code
        gm = torch.fx.GraphModule(gm, gm.graph)
    in_place = _reinplace_for(compiler, gm, captured.plan)
    if keep_inplace:
        keep_inplace_ops(gm)
    aot_id = next(_aot_ids)
    with naming("inference", aot_id):
        compiled = boxed(observe.call_compiler("inference", compiler, gm, list(example_primals)))
    return CompiledForward(compiled, gm, captured.plan.num_fw_outputs, written_in_place=in_place, aot_id=aot_id,
                           keep_inplace=keep_inplace)


def compile_training(
    captured: Captured,
    partition_fn: Callable,
    fw_compiler: Callable,
    bw_compiler: Callable,
    example_primals: Sequence[Any],
    *,
    keep_input_mutations: bool = False,
    make_compiled: Callable | None = None,
    keep_inplace: bool = False,
    decompositions: dict | None = None,
) -> CompiledForward:
    """`make_compiled(fn)`: an aotgrad compiled function of `fn` with this signature's configuration,
    for the differentiable backward of higher-order gradients (none without it). `decompositions`:
    the capture's table, applied again where the backward is re-traced under autocast."""
    plan = captured.plan
    computed_from = _computed_from(captured.graph, plan.num_fw_outputs)
    joint_inputs = (list(example_primals), [None] * captured.num_tangents)
    with observe.stage("partition", getattr(partition_fn, "__name__", "")):
        fw_module, bw_module = partition_fn(captured.graph, joint_inputs, num_fwd_outputs=plan.num_fw_outputs)
    observe.log_graph("backward", bw_module)
    # Copied before anything below or a compiler changes them in place.
    pristine = (pristine_copy(fw_module), pristine_copy(bw_module)) if make_compiled is not None else None
    gradient_from = _gradient_from(bw_module, captured.num_tangents)
    # Any epilogue action on an input would invalidate a saved view of it.
    both = backward_mutations.mutated_in_both(plan)
    changed = _with_storage_sharers(plan.primals_changed_after_forward - both, example_primals)
    clone_saved_inputs(fw_module, plan.num_fw_outputs, changed)
    saved = list(fw_module.graph.output_node().args[0])[plan.num_fw_outputs :]
    num_tensors = sum(isinstance(n.meta.get("val"), torch.Tensor) for n in saved if hasattr(n, "meta"))
    in_place = _reinplace_for(fw_compiler, fw_module, plan)
    if keep_inplace:
        keep_inplace_ops(fw_module)
    if keep_input_mutations or both:
        in_place |= _write_back_in_graph(fw_module, plan, example_primals, in_place,
                                         only=None if keep_input_mutations else both)
    backward_mutations.check_written_in_forward(both, in_place)
    backward_mutations.check_backward_reads(fw_module, bw_module, plan.num_fw_outputs, both)
    aot_id = next(_aot_ids)
    with naming("forward", aot_id):
        forward = boxed(observe.call_compiler("forward", fw_compiler, fw_module, list(example_primals)))
    compiled = CompiledForward(
        forward,
        fw_module,
        plan.num_fw_outputs,
        num_saved_tensors=num_tensors,
        num_saved_other=len(saved) - num_tensors,
        written_in_place=in_place,
        computed_from=computed_from,
        gradient_from=gradient_from,
        bw_module=bw_module,
        bw_compiler=bw_compiler,
        aot_id=aot_id,
        keep_inplace=keep_inplace,
        decompositions=decompositions,
    )
    if pristine is not None:
        mutated = sorted(plan.primals_changed_after_forward | in_place)
        compiled.higher_order = HigherOrder(
            *pristine, plan.num_fw_outputs, num_tensors,
            mutated={k: _primal_name(plan.layout, k) for k in mutated}, make_compiled=make_compiled,
            grad_mode_recorded=bool(captured.graph.meta.get(GRAD_MODE_RECORDED)),
        )
    example_cotangents = _symbolic_placeholder_values(bw_module)
    if example_cotangents is not None:
        # A compiler may specialise a symbolic size (add a guard on it). Guards are only checked if
        # they exist when the caller's cache entry is made (Dynamo's, or ours), so compile it now.
        compiled.backward(example_cotangents)
    return compiled


def _computed_from(joint: torch.fx.GraphModule, num_fw_outputs: int) -> tuple[int, ...]:
    """For each forward output of the joint graph, the graph inputs its value flows from, as a
    bitmask by placeholder position (the primals come first)."""
    flows = flows_from(joint, joint.graph.find_nodes(op="placeholder"))
    outs = list(joint.graph.output_node().args[0])[:num_fw_outputs]
    return tuple(flows.get(o, 0) if isinstance(o, torch.fx.Node) else 0 for o in outs)


def _gradient_from(bw: torch.fx.GraphModule, num_tangents: int) -> tuple[int | None, ...]:
    """For each gradient the backward graph returns, the tangents (its last `num_tangents` inputs)
    it flows from, as a bitmask; None where it returns no gradient."""
    tangents = bw.graph.find_nodes(op="placeholder")[len(bw.graph.find_nodes(op="placeholder")) - num_tangents:]
    flows = flows_from(bw, tangents)
    grads = bw.graph.output_node().args[0]
    return tuple(flows.get(g, 0) if isinstance(g, torch.fx.Node) else None for g in grads)


def placeholder_values(gm: torch.fx.GraphModule) -> list:
    """The (fake) value each graph input was traced with: what graph compilers get as examples."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _symbolic_placeholder_values(gm: torch.fx.GraphModule) -> list | None:
    """The placeholders' (fake) values when any size, stride or input is symbolic, else None."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    values = placeholder_values(gm)
    if any(free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat))):
        return values
    return None


def _writable_inputs(plan: Plan, gm: torch.fx.GraphModule) -> list[int]:
    """Graph inputs a compiled graph may mutate in place: those whose only epilogue action is a copy
    of their new value that autograd does not record (a plain data mutation of a tensor that does
    not require grad). The run time then skips that copy (`CompiledForward.written_in_place`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    actions: dict[int, list] = {}
    for a in plan.epilogue:
        actions.setdefault(getattr(a, "primal", None), []).append(a)
    out = []
    for k, acts in actions.items():
        if k is None or k >= len(placeholders) or len(acts) != 1:
            continue
        (a,) = acts
        val = placeholders[k].meta.get("val")
        if isinstance(a, CopyInto) and not a.grad and isinstance(val, torch.Tensor) and not val.requires_grad:
            out.append(k)
    return out


def _reinplace_for(compiler: Callable, gm: torch.fx.GraphModule, plan: Plan) -> frozenset[int]:
    """Re-inplace the graph for `compiler` (unless it does so itself); return the primals whose new
    value the graph now leaves in the primal itself, so the epilogue's copy would be a no-op."""
    if takes_functional_graphs(compiler):
        return frozenset()
    writable = _writable_inputs(plan, gm)
    if not reinplace(gm, writable):
        return frozenset()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = list(gm.graph.output_node().args[0])
    return frozenset(
        o.kind.primal
        for o, node in zip(plan.fw_outputs, outs)
        if isinstance(o.kind, MutatedInputValue) and o.kind.primal in writable and node is placeholders[o.kind.primal]
    )


def _write_back_in_graph(
    gm: torch.fx.GraphModule, plan: Plan, primals: Sequence[Any], done: frozenset[int],
    only: set[int] | None = None,
) -> frozenset[int]:
    """End the forward graph with `copy_(input, new value)` for each input the epilogue would only
    copy into outside autograd (BatchNorm's running stats): a fusing compiler then writes the new
    value straight into the input, as upstream's graphs do. Inputs sharing memory with another input
    are left to the epilogue (the compiler cannot see that a write to one changes the other)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = gm.graph.output_node()
    outs = list(output.args[0])
    value_of = {o.kind.primal: node for o, node in zip(plan.fw_outputs, outs) if isinstance(o.kind, MutatedInputValue)}
    written = set()
    for k in _writable_inputs(plan, gm):
        node = value_of.get(k)
        if k in done or node is None or node is placeholders[k] or _with_storage_sharers({k}, primals) != {k}:
            continue
        if only is not None and k not in only:
            continue
        with gm.graph.inserting_before(output):
            gm.graph.call_function(torch.ops.aten.copy_.default, (placeholders[k], node))
        written.add(k)
    if written:
        gm.recompile()
    return frozenset(written)


def _with_storage_sharers(indices: set[int], primals: Sequence[Any]) -> set[int]:
    """`indices` plus the primals that share a storage (and so a version counter) with one of them:
    an epilogue action on one invalidates the others' saved values too."""
    def storage(t):
        return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None

    touched = {storage(primals[i]) for i in indices}
    return indices | {i for i, p in enumerate(primals) if storage(p) is not None and storage(p) in touched}
