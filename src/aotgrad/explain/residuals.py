"""The residual report: what a compiled forward hands to its backward, and what the backward redoes.

`saved_residuals(fn, *args, partition_fn=None, **kwargs)` (and `saved_residuals_module(mod, *args)`)
compiles the program with aotgrad and the given partitioner (None: `aot_function`'s default), runs
it once, and lists:

- every value the forward graph saves for the backward: shape, dtype, bytes, the op that produced it
  (or the input it is), and the user source line that created it;
- every op the backward recomputes (an op that appears in both graphs), grouped by op and line;
- totals: bytes by shape x itemsize, the unique storages actually handed to `save_for_backward` at
  run time, and what eager PyTorch saves for the same program (unique storages packed by
  `torch.autograd.graph.saved_tensors_hooks`).

Source lines: while the program is traced, a `TorchFunctionMode` notes, for every torch call made
from user code, the innermost user frame (outside torch, aotgrad and the standard library) and the
enclosing `nn.Module`, on the graph nodes that call created (`node.meta["stack_trace"]` and
`node.meta["aotgrad_module"]`). Values created by torch internals alone have no line.

The report is a `ResidualReport`; `str(report)` is the plain-text table.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import os
import re
import sys
import sysconfig
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..partition.ops import op_class, tensor_nbytes
from ..partition.order import REMADE_FROM

MODULE_KEY = "aotgrad_module"

__all__ = ["Recomputed", "Residual", "ResidualReport", "saved_residuals", "saved_residuals_module"]


@dataclass(frozen=True)
class Residual:
    """One value the forward saves for the backward."""

    name: str  # node name in the forward graph
    shape: tuple[int, ...] | None  # None for a non-tensor value (a symbolic int)
    dtype: torch.dtype | None
    nbytes: int
    op: str  # "input" or the aten op that produced it
    source: str  # the input's name, or the user line that created the value
    module: str = ""  # the enclosing nn.Module, when known


@dataclass(frozen=True)
class Recomputed:
    """One forward op that the backward computes again."""

    name: str
    op: str
    source: str
    module: str = ""
    free: bool = False  # a view, alias or getitem: no work


@dataclass
class ResidualReport:
    partitioner: str
    residuals: list[Residual]
    recomputed: list[Recomputed]
    saved_bytes: int  # sum of shape x itemsize over the saved tensors
    runtime_bytes: int  # unique storages handed to save_for_backward, measured at run time
    runtime_count: int
    eager_bytes: int  # unique storages eager autograd saves for the same program
    eager_count: int
    fw_module: torch.fx.GraphModule | None = field(default=None, repr=False)
    bw_module: torch.fx.GraphModule | None = field(default=None, repr=False)
    inference: bool = False  # nothing required grad: one inference graph, nothing saved
    # For aotgrad.explain: the compiled signature's plan, a name per flat caller argument, and the
    # joint graph the partitioner split (None for an inference graph).
    plan: Any = field(default=None, repr=False)
    leaf_names: list[str] = field(default_factory=list, repr=False)
    joint: torch.fx.GraphModule | None = field(default=None, repr=False)

    @property
    def saved_tensors(self) -> list[Residual]:
        return [r for r in self.residuals if r.shape is not None]

    @property
    def recomputed_ops(self) -> Counter:
        return Counter(r.op for r in self.recomputed)

    def __str__(self) -> str:
        lines = [
            f"aotgrad saved residuals (partitioner: {self.partitioner})",
            f"the forward saves {len(self.saved_tensors)} tensors, {_fmt_bytes(self.saved_bytes)}"
            + (f" and {len(self.residuals) - len(self.saved_tensors)} other values" if len(self.residuals) > len(self.saved_tensors) else "")
            + f"; eager saves {self.eager_count} storages, {_fmt_bytes(self.eager_bytes)}",
            "",
        ]
        if self.inference:
            lines.insert(1, "(no input requires grad: aotgrad compiled an inference graph, there is no backward)")
        rows = [["#", "shape", "dtype", "bytes", "produced by", "source"]]
        for i, r in enumerate(self.residuals):
            shape = "-" if r.shape is None else str(tuple(r.shape))
            dtype = "-" if r.dtype is None else str(r.dtype).replace("torch.", "")
            src = (r.source or "-") + (f"  [{r.module}]" if r.module else "")
            rows.append([str(i), shape, dtype, _fmt_bytes(r.nbytes), r.op, src])
        if len(rows) > 1:  # a header above no rows says nothing
            lines += _table(rows, "rllrll")
            lines.append("")
        # Counted from the same rows the table shows: views and getitems are free and listed apart.
        again = [r for r in self.recomputed if not r.free]
        views = len(self.recomputed) - len(again)
        if again:
            heavy = sum(_is_matmul_name(r.op) for r in again)
            lines.append(
                f"recomputed in the backward: {len(again)} ops ({heavy} matmul/conv/attention)"
                + (f", plus {views} views/getitems (free)" if views else "")
            )
            groups = Counter((r.op, r.source, r.module) for r in again)
            rows = [["count", "op", "source"]]
            for (op, src, mod), n in groups.items():  # in program order
                rows.append([str(n), op, (src or "-") + (f"  [{mod}]" if mod else "")])
            lines += _table(rows, "rll")
        else:
            lines.append("recomputed in the backward: nothing" + (f" but {views} views/getitems (free)" if views else ""))
        lines.append("")
        lines.append(
            f"totals: graph {_fmt_bytes(self.saved_bytes)} in {len(self.saved_tensors)} tensors | "
            f"run time {_fmt_bytes(self.runtime_bytes)} in {self.runtime_count} storages | "
            f"eager {_fmt_bytes(self.eager_bytes)} in {self.eager_count} storages"
        )
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"


def _table(rows: list[list[str]], align: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _is_matmul_name(op: str) -> bool:
    base = op.split(".")[1] if op.startswith("aten.") else op
    return base in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "dot", "linear") or (
        "conv" in base or "attention" in base
    )


# ------------------------------------------------------------------------------------------------
# Source lines while tracing.
# ------------------------------------------------------------------------------------------------

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the aotgrad package
_SKIP_DIRS = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))
) + tuple(
    d + os.sep for d in {sysconfig.get_paths().get("stdlib", ""), sysconfig.get_paths().get("platstdlib", "")} if d
)


def _is_user_file(filename: str) -> bool:
    if filename.startswith(("<frozen", "<eval_with_key")):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_SKIP_DIRS) and f"{os.sep}functorch{os.sep}" not in path


class _SourceRecorder(TorchFunctionMode):
    """Notes the user line (and nn.Module) behind every graph node a torch call creates."""

    def __init__(self, boundary, module_names: dict[int, str] | None = None):
        super().__init__()
        self.boundary = boundary
        self.module_names = module_names or {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        kwargs = kwargs or {}
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        before = len(graph.nodes) if graph is not None else 0
        out = func(*args, **kwargs)
        if graph is not None and len(graph.nodes) > before:
            where = self._where()
            if where is not None:
                trace, module = where
                for node in itertools.islice(reversed(graph.nodes), len(graph.nodes) - before):
                    if trace:
                        node.meta.setdefault("stack_trace", trace)
                    if module:
                        node.meta.setdefault(MODULE_KEY, module)
        return out

    def _where(self) -> tuple[str, str] | None:
        frame = sys._getframe(2)
        user = None
        module = ""
        while frame is not None and frame is not self.boundary:
            code = frame.f_code
            if user is None and _is_user_file(code.co_filename):
                user = frame
            elif user is None and code.co_filename.startswith("<eval_with_key"):
                found = _graph_module_source(frame)  # a Dynamo graph: its node knows the user's line
                if found is not None:
                    return found
            if not module and code.co_name == "forward" and code.co_argcount and not code.co_filename.startswith(_OWN_DIR):
                owner = frame.f_locals.get(code.co_varnames[0])
                if isinstance(owner, nn.Module):
                    name = self.module_names.get(id(owner))
                    module = f"{name} ({type(owner).__name__})" if name else type(owner).__name__
            if user is not None and module:
                break
            frame = frame.f_back
        if frame is None:
            return None  # not called from the program below the report's own call
        if user is None:
            return ("", module) if module else None
        summary = traceback.FrameSummary(user.f_code.co_filename, user.f_lineno, user.f_code.co_name)
        return "".join(traceback.format_list([summary])).rstrip(), module


def _graph_module_source(frame) -> tuple[str, str] | None:
    """The stack trace and module path that a GraphModule's node (Dynamo's graphs carry them) holds
    for the line of its generated code this frame is at."""
    gm = frame.f_locals.get("self")
    lines = getattr(gm, "_lineno_map", None)
    if not isinstance(gm, torch.fx.GraphModule) or not lines:
        return None
    index = lines.get(frame.f_lineno - getattr(gm, "_prologue_start", 0))
    nodes = list(gm.graph.nodes)
    if index is None or index >= len(nodes):
        return None
    meta = nodes[index].meta
    stack = meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        path, cls = list(stack.values())[-1]
        module = f"{_fqn(path)} ({getattr(cls, '__name__', str(cls).rsplit('.', 1)[-1])})"
    trace = meta.get("stack_trace") or ""
    return (trace, module) if trace or module else None


def _fqn(dynamo_path: str, drop_root: bool = True) -> str:
    """`L['self']._modules['h']._modules['0']` -> `h.0`: Dynamo's source names as module paths
    (`drop_root`: the first name is the module itself, `self`)."""
    # Layer indices stay: `L['self'].h.0.ln_1` and `L['self'].h[0].ln_1` are `h.0.ln_1`.
    keys = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", dynamo_path)
    parts = [a or b or c for a, b, c in keys]
    if drop_root and len(parts) > 1:
        parts = parts[1:]
    parts = [p for p in parts if p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts) or dynamo_path


def _dynamo_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, str]] | None:
    """(name, kind) of a Dynamo graph's inputs from their sources (`l1.weight`, "param"; `x`, "arg");
    None if the graph is not Dynamo's."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        arg = n.meta.get("grapharg")
        source = getattr(getattr(arg, "source", None), "name", None)
        if source is None:
            return None
        source = source() if callable(source) else source
        kind = "param" if "_parameters" in source else "buffer" if "_buffers" in source else "arg"
        out.append((_fqn(source, drop_root=any(k in source for k in ("_modules", "_parameters", "_buffers"))), kind))
    return out


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)(?:\n\s*(.*))?')


def _source_line(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace")
    if not trace:
        return ""
    matches = list(_FRAME_RE.finditer(trace))
    if not matches:
        return trace.strip().splitlines()[-1]
    m = matches[-1]
    filename, line, func, code = m.group(1), m.group(2), m.group(3).strip(), (m.group(4) or "").strip()
    text = f"{os.path.basename(filename)}:{line} in {func}"
    return f"{text}: {code}" if code else text


# ------------------------------------------------------------------------------------------------
# Counting saved tensors at run time.
# ------------------------------------------------------------------------------------------------


class _SavedCounter:
    def __init__(self):
        self.storages: dict[tuple[int, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            if st.nbytes():
                self.storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)


def _clone_tree(tree: Any) -> Any:
    """Copies of the tensors in `tree` that alias and track gradients as the originals do: one copy
    per distinct tensor, a view is the same view of its base's copy (so inputs sharing a storage
    still share one, and aotgrad's plan for them - a synthetic base - is the one reported), and a
    non-leaf that requires grad stays a non-leaf."""
    memo: dict[int, torch.Tensor] = {}

    def clone(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in memo:
            return memo[id(x)]
        base = x._base
        if base is not None and x.layout is torch.strided and not base.is_sparse:
            b = clone(base)
            grad = contextlib.nullcontext() if x.requires_grad or not b.requires_grad else torch.no_grad()
            with grad:
                out = b.as_strided(x.size(), x.stride(), x.storage_offset())
        else:
            out = x.detach().clone()
            if x.requires_grad:
                out = out.requires_grad_() if x.is_leaf else out.requires_grad_().clone()
        memo[id(x)] = out
        return out

    return pytree.tree_map(clone, tree)


# ------------------------------------------------------------------------------------------------
# The report.
# ------------------------------------------------------------------------------------------------


def _leaf_names_for_function(fn: Callable, args: tuple, kwargs: dict) -> list[str]:
    """A name per flat argument: the parameter name (plus the pytree path inside it) where known."""
    try:
        positional = [
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        first, rest = path[1], path[2:]
        if path[0].idx == 0:
            head = positional[first.idx] if first.idx < len(positional) else f"args[{first.idx}]"
        else:
            head = str(first.key)
        names.append(head + pytree.keystr(rest))
    return names


def _input_name(plan, k: int, leaf_names: list[str]) -> str:
    src = plan.layout.primal_sources[k]
    leaf = getattr(src, "leaf", None)
    name = leaf_names[leaf] if leaf is not None and leaf < len(leaf_names) else f"graph input {k}"
    kind = type(src).__name__
    if kind == "BaseOfLeaf":
        return f"base of {name}"
    if kind == "StorageOfLeaf":
        return f"storage of {name}"
    return name


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.overloadpacket.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _build_report(run, leaf_names, partitioner, runtime: _SavedCounter, eager: _SavedCounter) -> ResidualReport:
    compiled = run.compiled
    plan = run.plan
    fw = compiled.fw_module
    bw = compiled.bw_module
    if bw is None:  # inference graph: nothing is saved
        return ResidualReport(partitioner, [], [], 0, runtime.nbytes, runtime.count, eager.nbytes, eager.count, fw, None,
                              inference=True, plan=plan, leaf_names=list(leaf_names))
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    saved = list(fw.graph.output_node().args[0])[compiled.num_fw_outputs :]
    residuals = []
    total = 0
    for node in saved:
        val = node.meta.get("val")
        if node.op == "placeholder":
            op, source = "input", _input_name(plan, placeholders.index(node), leaf_names)
        elif node.target is torch.ops.aten.clone.default and node.args and node.args[0] in placeholders:
            k = placeholders.index(node.args[0])
            op, source = "input (copy)", f"{_input_name(plan, k, leaf_names)}, copied: mutated after the forward"
        else:
            op, source = _op_name(node.target), _source_line(node)
        if isinstance(val, torch.Tensor):
            nbytes = tensor_nbytes(val)
            total += nbytes
            residuals.append(Residual(node.name, tuple(int(s) for s in val.shape), val.dtype, nbytes, op, source,
                                      node.meta.get(MODULE_KEY, "")))
        else:
            residuals.append(Residual(node.name, None, None, 0, op, source or repr(val)))
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    recomputed = [
        Recomputed(n.name, _op_name(n.target), _source_line(n), n.meta.get(MODULE_KEY, ""),
                   op_class(n) in ("view", "free"))
        for n in bw.graph.nodes
        if n.op == "call_function" and (n.name in fw_ops or n.meta.get(REMADE_FROM) in fw_ops)
    ]
    return ResidualReport(partitioner, residuals, recomputed, total, runtime.nbytes, runtime.count,
                          eager.nbytes, eager.count, fw, bw, plan=plan, leaf_names=list(leaf_names))


def _partitioner_name(partition_fn) -> str:
    if partition_fn is None:
        return "default_partition"
    if getattr(partition_fn, "__name__", None):
        return partition_fn.__name__
    if hasattr(partition_fn, "func"):  # functools.partial
        kw = ", ".join(f"{k}={getattr(v, '__name__', None) or repr(v)}" for k, v in partition_fn.keywords.items())
        return f"{getattr(partition_fn.func, '__name__', 'partition')}({kw})"
    return repr(partition_fn)


class _CatchJoint:
    """Wraps a partitioner to keep the joint graph it was handed (for explain's budget curve)."""

    def __init__(self, partition_fn: Callable):
        self.partition_fn = partition_fn
        self.joint: torch.fx.GraphModule | None = None
        self.num_fwd_outputs = 0

    def __call__(self, joint, joint_inputs, **kwargs):
        self.joint, self.num_fwd_outputs = joint, kwargs.get("num_fwd_outputs", 0)
        return self.partition_fn(joint, joint_inputs, **kwargs)


@dataclass
class Program:
    """A program made ready for reporting: an aot-compiled copy (nop compilers), an eager copy, and
    the caller's arguments (cloned afresh for each run, so neither copy sees the other's mutations)."""

    compiled: Callable
    eager: Callable
    args: tuple
    kwargs: dict
    leaf_names: list[str]
    leaf_kinds: list[str]  # per flat argument: "param", "buffer" or "arg"
    partition_fn: Callable | None
    catcher: _CatchJoint
    module_names: dict[int, str] | None = None
    eager_state: list = field(default_factory=list)  # the eager module's parameters and buffers
    compiled_state: list = field(default_factory=list)

    def fresh_args(self) -> tuple[tuple, dict]:
        return _clone_tree((self.args, self.kwargs))


def prepare(fn: Callable, args: tuple, kwargs: dict, partition_fn: Callable | None = None,
            decompositions: dict | None = None) -> Program:
    """Compile `fn` (a function, or an nn.Module lifted as `aot_module` lifts it: parameters and
    buffers become graph inputs that keep `requires_grad`) with the nop compiler, on copies."""
    from ..api import _named_state, aot_function, aot_module
    from ..compile.compilers import nop
    from ..partition.default import default_partition
    from .freeing import freeing_nop

    catcher = _CatchJoint(partition_fn or default_partition)
    if not isinstance(fn, nn.Module):
        cf = aot_function(fn, nop, freeing_nop, decompositions=decompositions, partition_fn=catcher)
        names = _leaf_names_for_function(fn, args, kwargs)
        kinds = ["param" if isinstance(x, nn.Parameter) else "arg" for x in pytree.tree_leaves((args, kwargs))]
        return Program(cf, fn, args, kwargs, names, kinds, partition_fn, catcher)
    eager_mod = copy.deepcopy(fn)
    test_mod = copy.deepcopy(fn)
    compiled = aot_module(test_mod, nop, freeing_nop, decompositions=decompositions, partition_fn=catcher)
    state_names, state = _named_state(test_mod)
    num_params = len(list(test_mod.named_parameters(remove_duplicate=False)))
    arg_names = _leaf_names_for_function(fn.forward, args, kwargs)
    kinds = ["param"] * num_params + ["buffer"] * (len(state) - num_params)
    arg_kinds = ["param" if isinstance(x, nn.Parameter) else "arg" for x in pytree.tree_leaves((args, kwargs))]
    dynamo = _dynamo_inputs(fn) if isinstance(fn, torch.fx.GraphModule) and not kwargs else None
    if dynamo is not None and len(dynamo) == len(arg_kinds):
        arg_names, arg_kinds = [n for n, _ in dynamo], [k for _, k in dynamo]
    kinds += arg_kinds
    module_names = {id(m): n for n, m in test_mod.named_modules() if n}
    return Program(compiled, eager_mod, args, kwargs, list(state_names) + arg_names, kinds, partition_fn, catcher,
                   module_names, _named_state(eager_mod)[1], state)


def report_for(program: Program) -> ResidualReport:
    """Run the program (eager, compile, measure) and build its residual report."""
    eager_args, eager_kwargs = program.fresh_args()
    call_args, call_kwargs = program.fresh_args()
    rep = _report(program.compiled, call_args, call_kwargs, lambda: program.eager(*eager_args, **eager_kwargs),
                  program.leaf_names, program.partition_fn, program.module_names)
    rep.joint = program.catcher.joint
    return rep


def _report(compiled_fn, call_args: tuple, call_kwargs: dict, eager_call: Callable, leaf_names, partition_fn,
            module_names=None) -> ResidualReport:
    eager = _SavedCounter()
    runtime = _SavedCounter()
    with torch.random.fork_rng(devices=[]):
        with eager.hooks():
            eager_call()
        boundary = sys._getframe()
        with _SourceRecorder(boundary, module_names):
            compiled_fn(*call_args, **call_kwargs)  # compiles (traces) and runs once
        with runtime.hooks():
            compiled_fn(*call_args, **call_kwargs)
    inner = getattr(compiled_fn, "_compiled", compiled_fn)
    if not inner.cache:
        raise RuntimeError("aotgrad.saved_residuals: the program was not compiled")
    run = next(iter(inner.cache.values()))
    return _build_report(run, leaf_names, _partitioner_name(partition_fn), runtime, eager)


def with_budget(partition_fn: Callable | None, memory_budget: float | None) -> Callable | None:
    """The partitioner that `partition_fn=` / `memory_budget=` name (as `aotgrad.backend` takes
    them): a budget alone means aotgrad's min-cut at that budget."""
    if memory_budget is None:
        return partition_fn
    from ..partition.mincut import mincut_partitioner

    if partition_fn is None:
        return mincut_partitioner(memory_budget)
    part = functools.partial(partition_fn, memory_budget=memory_budget)
    part.__name__ = f"{getattr(partition_fn, '__name__', 'partition')}(memory_budget={memory_budget})"  # type: ignore[attr-defined]
    return part


def saved_residuals(fn: Callable, *args: Any, partition_fn: Callable | None = None, memory_budget: float | None = None,
                    decompositions: dict | None = None, **kwargs: Any) -> ResidualReport:
    """Compile `fn(*args, **kwargs)` with aotgrad and report what its forward saves for the backward.

    The program runs on copies of the arguments (three times: eager, compile, measure); the caller's
    tensors and random state are left untouched. `partition_fn` defaults to aot_function's default;
    `memory_budget` (as `aotgrad.explain` takes it) picks the min-cut at that budget. Neither keyword
    reaches `fn`. An nn.Module is lifted as `aot_module` lifts it (its parameters are inputs that
    require grad).
    """
    return report_for(prepare(fn, args, kwargs, with_budget(partition_fn, memory_budget), decompositions))


def saved_residuals_module(mod: nn.Module, *args: Any, partition_fn: Callable | None = None,
                           memory_budget: float | None = None, decompositions: dict | None = None,
                           **kwargs: Any) -> ResidualReport:
    """`saved_residuals` for a module: parameters and buffers are graph inputs, named as in the module.

    Runs on deep copies of the module (buffers such as BatchNorm statistics are not updated)."""
    return report_for(prepare(mod, args, kwargs, with_budget(partition_fn, memory_budget), decompositions))
