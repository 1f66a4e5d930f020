"""`aotgrad.explain`: what compilation did to one program, as text and as a self-contained HTML page.

A layer over the pipeline, not inside it: the program is compiled by `aot_function` / `aot_module`
with the nop compiler (residuals.prepare), and the report is read off what the pipeline already
produced - the `Plan` (what happened to each input and output), the forward/backward graphs, the
residual report (what is saved and recomputed, eager's saved bytes), a measured memory timeline
(explain_memory) and the min-cut partitioner's budget curve. Nothing is recomputed by a second
analysis, so the report cannot disagree with what the compiled code does.

`print(report)` gives the text; `report.save_html(path)` one HTML file (explain_html).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from . import plan as P
from .errors import AotgradError
from .explain_memory import BudgetPoint, Timeline, budget_curve, measure_timeline, recompute_cost
from .explain_peak import peak_note
from .residuals import (
    _FRAME_RE,
    MODULE_KEY,
    ResidualReport,
    _fmt_bytes,
    _op_name,
    _source_line,
    _table,
    prepare,
    report_for,
)

log = logging.getLogger("aotgrad.explain")

__all__ = ["GraphInfo", "InputRow", "NodeRow", "OutputRow", "Report", "explain"]


@dataclass(frozen=True)
class InputRow:
    name: str  # e.g. "param 'h.0.attn.c_attn.weight'", "arg 'x'"
    shape: tuple[int, ...] | None
    dtype: str
    requires_grad: bool
    facts: tuple[str, ...]  # what the program did to it ("read only" when nothing)


@dataclass(frozen=True)
class OutputRow:
    position: int
    what: str


@dataclass(frozen=True)
class NodeRow:
    name: str
    op: str
    shape: str
    source: str  # user file:line, where known
    module: str  # module path, where known
    path: str = ""  # the user file's full path and line ("/abs/file.py:12")


@dataclass
class GraphInfo:
    kind: str  # "forward", "backward", "inference" or "joint"
    num_nodes: int
    num_ops: int
    code: str
    nodes: list[NodeRow] = field(default_factory=list)


@dataclass
class Report:
    title: str
    partitioner: str
    memory_budget: float | None
    inputs: list[InputRow] = field(default_factory=list)
    outputs: list[OutputRow] = field(default_factory=list)
    refusal: str | None = None
    graphs: list[GraphInfo] = field(default_factory=list)
    residuals: ResidualReport | None = None
    timelines: list[Timeline] = field(default_factory=list)
    curve: list[BudgetPoint] = field(default_factory=list)
    chosen: BudgetPoint | None = None

    def __str__(self) -> str:
        return render_text(self)

    def save_html(self, path: str) -> str:
        from .explain_html import render_html

        with open(path, "w", encoding="utf-8") as f:
            f.write(render_html(self))
        return path

    def input_named(self, name: str) -> InputRow:
        return next(r for r in self.inputs if name in r.name)


# ------------------------------------------------------------------------------------------------
# Section 1: the plan, read off `Plan`.
# ------------------------------------------------------------------------------------------------


def _labels(names: list[str], kinds: list[str]) -> list[str]:
    return [f"{k} '{n}'" for n, k in zip(names, kinds)]


def _primal_leaf(plan: P.Plan, k: int) -> int | None:
    return getattr(plan.layout.primal_sources[k], "leaf", None)


def _input_facts(plan: P.Plan, i: int, labels: list[str], requires_grad: bool) -> list[str]:
    layout = plan.layout
    facts = []
    k = layout.leaf_primal[i] if i < len(layout.leaf_primal) else None
    if k is None and i in layout.leaf_views:
        v = layout.leaf_views[i]
        base = _primal_leaf(plan, v.primal)
        facts.append(f"synthetic base: overlaps other mutated inputs; seen as as_strided(graph input {v.primal}"
                     f"{' = base of ' + labels[base] if base is not None else ''}, {list(v.size)}, {list(v.stride)},"
                     f" {v.offset})")
        k = v.primal
    elif k is not None:
        first = layout.leaf_primal.index(k)
        if first != i:
            facts.append(f"duplicate of {labels[first]} (one graph input)")
        src = layout.primal_sources[k]
        if isinstance(src, P.BaseOfLeaf):
            facts.append(f"synthetic base: graph input {k} is its ._base (inputs sharing it are mutated)")
        elif isinstance(src, P.StorageOfLeaf):
            facts.append(f"synthetic base: graph input {k} is a flat view of its whole storage")
    if k is None:
        return facts or ["not a graph input (constant)"]
    own = len(facts)
    facts += _mutation_facts(plan, k, requires_grad)
    if i in layout.leaf_views:  # the facts are the base's: every input that is a view of it shares them
        facts[own:] = [f"its base: {f}" for f in facts[own:]]
    return facts or ["read only"]


def _mutation_facts(plan: P.Plan, k: int, requires_grad: bool) -> list[str]:
    facts = []
    m = plan.mutations[k]
    if m.data:
        where = "" if m.visible_to_autograd or not requires_grad else " under no_grad / through .detach() (autograd does not see it)"
        kept = ", copy_ kept in the graph" if m.kept_in_graph else ", copied back after the graph"
        facts.append(f"data mutated{where}{kept}")
    if m.metadata:
        facts.append("metadata mutated (size/stride/offset changed in place)")
    if m.storage:
        facts.append("set_: storage swapped")
    if m.in_backward:
        facts.append("mutated by the backward")
    if any(isinstance(a, P.SetRequiresGrad) and a.primal == k for a in plan.prologue):
        facts.append("requires_grad_() switched on by the program")
    if any(isinstance(a, P.Detach) and a.primal == k for a in plan.epilogue):
        facts.append("detach_() in place")
    if k in plan.grad_free:
        facts.append("requires grad, but no output depends on it: gets no gradient")
    return facts


def _chain(chain: P.ViewChain) -> str:
    if chain.as_strided is not None:
        size, stride, offset = chain.as_strided
        text = f"as_strided({list(size)}, {list(stride)}, {offset})"
    else:
        ops = [_op_name(s.op).replace("aten.", "") for s in chain.steps]
        text = " -> ".join(ops) if ops else "(no op: same view)"
    if chain.no_grad_steps:
        text += f" (first {chain.no_grad_steps} under no_grad)"
    if chain.detach:
        text += ", detached"
    return text


def _output_what(plan: P.Plan, src: Any, labels: list[str]) -> str:
    if isinstance(src, P.GraphOutput):
        diff = plan.fw_outputs[src.index].differentiable if src.index < len(plan.fw_outputs) else False
        return f"graph output #{src.index}" + ("" if diff or not plan.is_training else " (not differentiable)")
    if isinstance(src, P.Constant):
        return f"constant {src.value!r}"
    if isinstance(src, P.InputItself):
        return f"the input {labels[src.leaf]} itself"
    if isinstance(src, P.AliasOfPrimal):
        leaf = _primal_leaf(plan, src.primal)
        name = labels[leaf] if leaf is not None else f"graph input {src.primal}"
        return f"view of input {src.primal} ({name}) rebuilt by {_chain(src.chain)}"
    if isinstance(src, P.AliasOfLeaf):
        return f"view of {labels[src.leaf]} rebuilt by {_chain(src.chain)}"
    if isinstance(src, P.AliasOfGraphOutput):
        return f"view of an intermediate (graph output #{src.index}) rebuilt by {_chain(src.chain)}"
    if isinstance(src, P.SameAs):
        return f"alias of output {src.position} (the same tensor object)"
    if isinstance(src, P.AliasOfOutput):
        return f"alias of output {src.position}: a view of it rebuilt by {_chain(src.chain)}"
    return type(src).__name__


def _plan_rows(plan: P.Plan, labels: list[str], leaves: list[Any]) -> tuple[list[InputRow], list[OutputRow]]:
    inputs = []
    for i, label in enumerate(labels):
        x = leaves[i] if i < len(leaves) else None
        if not isinstance(x, torch.Tensor):
            continue
        inputs.append(InputRow(label, tuple(int(s) for s in x.shape), str(x.dtype).replace("torch.", ""),
                               x.requires_grad, tuple(_input_facts(plan, i, labels, x.requires_grad))))
    n_out = plan.out_spec.num_leaves
    outputs = [OutputRow(j, _output_what(plan, s, labels)) for j, s in enumerate(plan.out_sources[:n_out])]
    return inputs, outputs


# ------------------------------------------------------------------------------------------------
# Section 2: the graphs.
# ------------------------------------------------------------------------------------------------


def _module_path(node: torch.fx.Node) -> str:
    if node.meta.get(MODULE_KEY):
        return node.meta[MODULE_KEY]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        return f"{path} ({getattr(cls, '__name__', cls)})"
    return ""


def _source_path(node: torch.fx.Node) -> str:
    matches = list(_FRAME_RE.finditer(node.meta.get("stack_trace") or ""))
    return f"{matches[-1].group(1)}:{matches[-1].group(2)}" if matches else ""


def _shape(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return ", ".join(_shape(v) for v in val)
    return "" if val is None else type(val).__name__


def graph_info(kind: str, gm: torch.fx.GraphModule) -> GraphInfo:
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    rows = [NodeRow(n.name, "input" if n.op == "placeholder" else _op_name(n.target), _shape(n.meta.get("val")),
                    _source_line(n), _module_path(n), _source_path(n)) for n in nodes]
    return GraphInfo(kind, len(gm.graph.nodes), sum(n.op == "call_function" for n in gm.graph.nodes),
                     gm.code.strip(), rows)


# ------------------------------------------------------------------------------------------------
# Building the report.
# ------------------------------------------------------------------------------------------------


def _partition_fn(partition_fn: Callable | None, memory_budget: float | None) -> Callable:
    """What `backend="aotgrad"` would partition with: aotgrad's min-cut unless another is named."""
    from .partition_mincut import mincut_partitioner
    from .residuals import with_budget

    if partition_fn is None and memory_budget is None:
        return mincut_partitioner()
    return with_budget(partition_fn, memory_budget)


def _policy_of(partition_fn: Callable | None) -> Any:
    return getattr(partition_fn, "keywords", {}).get("policy") if partition_fn is not None else None


def _title(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"module {type(fn).__name__}"
    return f"function {getattr(fn, '__qualname__', None) or getattr(fn, '__name__', repr(fn))}"


def explain(fn_or_module: Callable, *args: Any, partition_fn: Callable | None = None,
            memory_budget: float | None = None, decompositions: dict | None = None, budget_points: int = 11,
            timeline: bool = True, **kwargs: Any) -> Report:
    """Compile `fn_or_module(*args, **kwargs)` with aotgrad (on copies) and report what it did.

    `partition_fn`/`memory_budget` pick the partitioner as `aotgrad.backend` takes them (by default
    aotgrad's min-cut, what `backend="aotgrad"` runs; `saved_residuals` takes the same keywords);
    `budget_points` budgets in 0..1 for the min-cut curve (0: no curve); `timeline`: measure the
    forward+backward live bytes of aotgrad and eager. A program aotgrad refuses gives a report
    whose `refusal` says why (the error's own message)."""
    from torch.utils import _pytree as pytree

    part = _partition_fn(partition_fn, memory_budget)
    report = Report(_title(fn_or_module), "", memory_budget)
    try:
        program = prepare(fn_or_module, args, kwargs, part, decompositions)
        with torch.random.fork_rng(devices=[]):
            res = report_for(program)
    except AotgradError as e:
        report.refusal = f"{type(e).__name__}: {e}"
        return report
    report.partitioner = res.partitioner
    report.residuals = res
    labels = _labels(program.leaf_names, program.leaf_kinds)
    state = list(program.compiled_state)
    leaves = state + pytree.tree_leaves((args, kwargs))
    report.inputs, report.outputs = _plan_rows(res.plan, labels, leaves)
    kinds = ["inference"] if res.bw_module is None else ["forward", "backward"]
    report.graphs = [graph_info(k, g) for k, g in zip(kinds, (res.fw_module, res.bw_module))]
    if res.bw_module is not None:
        _budget_section(report, res, program, budget_points)
    if timeline:
        report.timelines = _timelines(program)
    return report


def _budget_section(report: Report, res: ResidualReport, program, points: int) -> None:
    from .partition_mincut import INFO_KEY

    info = res.fw_module.meta.get(INFO_KEY)
    flops, n = recompute_cost(res.fw_module, res.bw_module)
    saved = info.saved_bytes if info is not None else res.saved_bytes
    report.chosen = BudgetPoint(getattr(info, "memory_budget", None), saved, flops, n)
    if points and res.joint is not None:
        report.curve = budget_curve(res.joint, program.catcher.num_fwd_outputs, points, _policy_of(program.partition_fn))


def _timelines(program) -> list[Timeline]:
    out = []
    runs = (("aotgrad", program.compiled, program.compiled_state), ("eager", program.eager, program.eager_state))
    for label, call, state in runs:
        a, k = program.fresh_args()
        try:
            with torch.random.fork_rng(devices=[]):
                out.append(measure_timeline(label, lambda call=call, a=a, k=k: call(*a, **k), (a, k, state)))
        except Exception as e:  # the picture is optional; the error is logged
            log.warning("aotgrad.explain: could not measure the %s timeline: %s", label, e)
    return out


# ------------------------------------------------------------------------------------------------
# Text.
# ------------------------------------------------------------------------------------------------


_CODE_IN_TEXT = 40  # graphs with more ops than this are listed by size only in the text


def render_text(r: Report) -> str:
    lines = [f"aotgrad.explain: {r.title}", f"partitioner: {r.partitioner or '-'}"
             + (f", memory_budget={r.memory_budget}" if r.memory_budget is not None
                and "memory_budget" not in r.partitioner else ""), ""]
    if r.refusal:
        return "\n".join(lines + ["REFUSED: " + r.refusal])
    lines.append("1. Plan")
    rows = [["input", "shape", "dtype", "grad", "what the program did to it"]]
    rows += [[i.name, str(list(i.shape)), i.dtype, "yes" if i.requires_grad else "", "; ".join(i.facts)]
             for i in r.inputs]
    lines += _table(rows, "lllll")
    rows = [["output", "what it is"]] + [[str(o.position), o.what] for o in r.outputs]
    lines += [""] + _table(rows, "rl") + ["", "2. Graphs"]
    for g in r.graphs:
        lines.append(f"  {g.kind}: {g.num_ops} ops, {g.num_nodes} nodes")
        if g.num_ops <= _CODE_IN_TEXT:
            lines += ["    " + x for x in g.code.splitlines()]
        else:
            lines.append(f"    (code: report.graphs[{r.graphs.index(g)}].code, or the HTML page)")
    lines += ["", "3. Saved and recomputed"]
    lines += ["  " + x for x in str(r.residuals).splitlines()[1:]]
    if r.timelines:
        lines += ["", "4. Memory timeline (live activation bytes, measured op by op)"]
        for t in r.timelines:
            lines.append(f"  {t.label:8s} peak {_fmt_bytes(t.peak)} at op {t.peak_index} ({t.peak_phase}: "
                         f"{t.ops[t.peak_index] if t.ops else '-'}); alive when the backward starts "
                         f"{_fmt_bytes(t.at_backward_start)}; {t.backward_start} forward + "
                         f"{len(t.live) - t.backward_start} backward ops")
        note = peak_note(r.timelines, _fmt_bytes)
        if note:
            lines.append("  " + note)
    if r.chosen is not None:
        lines += ["", "5. Memory budget (min-cut menu)"]
        rows = [["budget", "saved", "recompute FLOPs", "recomputed ops"]]
        for p in r.curve:
            rows.append([f"{p.budget:.1f}", _fmt_bytes(p.saved_bytes), f"{p.recompute_flops:,}", str(p.recomputed_ops)])
        c = r.chosen
        rows.append([f"chosen ({'-' if c.budget is None else c.budget})", _fmt_bytes(c.saved_bytes),
                     f"{c.recompute_flops:,}", str(c.recomputed_ops)])
        lines += _table(rows, "lrrr")
    return "\n".join(lines)
