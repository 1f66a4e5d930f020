"""Reports under `torch.compile`: with `aotgrad.config.explain_dir` (or `AOTGRAD_EXPLAIN_DIR`) set, the
backend hands every Dynamo graph to `explain_graph` before compiling it, which writes one report per
graph (`graph_000.html`, ...) and rewrites `index.html` listing them in graph order.

The report compiles a copy of the Dynamo graph with aotgrad's pipeline (nop compilers, the backend's
partitioner and decompositions) on the real example inputs; what Inductor then does to the graphs
is not shown. A report that fails is logged and skipped: it never stops the compile.
"""

from __future__ import annotations

import html
import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger("aotgrad.explain")

__all__ = ["explain_graph"]

_lock = threading.Lock()
_written: dict[str, list[tuple[str, str, str]]] = {}  # directory -> [(file, title, summary)]


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        return "" if cid is None else str(cid)
    except Exception:  # an older or newer torch without it: the number alone names the graph
        return ""


def _decompositions(backend: Any) -> dict | None:
    if backend.decompositions is not None or not backend.use_inductor:
        return backend.decompositions
    from .backend_inductor import _inductor_decompositions

    return _inductor_decompositions()


def explain_graph(gm: torch.fx.GraphModule, example_inputs: list, backend: Any, directory: str) -> str | None:
    """Write the report for one Dynamo graph into `directory`; return its path (None on failure)."""
    from .backend_shapes import _concrete
    from .explain_report import explain
    from .residuals import _fmt_bytes

    try:
        os.makedirs(directory, exist_ok=True)
        args = _concrete(list(example_inputs))
        gm, floats = _specialise_items(gm, args)
        report = torch._dynamo.disable(explain)(
            gm, *args, partition_fn=backend._partition_fn(), decompositions=_decompositions(backend))
    except Exception as e:
        log.warning("aotgrad.explain: no report for this graph (%s: %s)", type(e).__name__, e)
        return None
    with _lock:
        entries = _written.setdefault(os.path.abspath(directory), [])
        name = f"graph_{len(entries):03d}.html"
        cid = _compile_id()
        report.title = f"Dynamo graph {len(entries)}" + (f" (compile id {cid})" if cid else "") + (
            f"; floats Dynamo made dynamic taken as their values here: {', '.join(floats)}" if floats else "")
        path = report.save_html(os.path.join(directory, name))
        entries.append((name, report.title, _summary(report, _fmt_bytes)))
        _write_index(directory, entries)
    log.info("aotgrad.explain: wrote %s", path)
    return path


def _specialise_items(gm: torch.fx.GraphModule, args: list) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of `gm` where `.item()` of a 0-d tensor input (a float Dynamo made dynamic: a module's
    `eps`, BatchNorm's `momentum`) is that input's example value: traced on real tensors, the call
    has no symbol to answer with. The backend compiles the graph itself, unchanged."""
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    items = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item" and n.args[0] in placeholders]
    if not items:
        return gm, []
    graph = torch.fx.Graph()
    env: dict = {}
    graph.output(graph.graph_copy(gm.graph, env))
    names = []
    for node in items:
        value = args[placeholders[node.args[0]]].item()
        copied = env[node]
        for user in list(copied.users):
            user.replace_input_with(copied, value)
        graph.erase_node(copied)
        names.append(f"{node.args[0].name}={value:g}")
    out = torch.fx.GraphModule(gm, graph)
    out.meta = dict(gm.meta)
    return out, names


def _summary(report, fmt) -> str:
    if report.refusal:
        return "refused: " + report.refusal
    parts = [f"{g.kind} {g.num_ops} ops" for g in report.graphs]
    if report.residuals is not None and not report.residuals.inference:
        parts.append(f"saves {fmt(report.residuals.saved_bytes)} (eager {fmt(report.residuals.eager_bytes)})")
    parts += [f"{t.label} peak {fmt(t.peak)}" for t in report.timelines]
    from .explain_peak import peak_note

    note = peak_note(report.timelines, fmt)
    return "; ".join(parts) + (f". {note[0].upper()}{note[1:]}" if note else "")


def _write_index(directory: str, entries: list[tuple[str, str, str]]) -> None:
    rows = "".join(f"<li><a href='{html.escape(f)}'>{html.escape(t)}</a> <span>{html.escape(s)}</span></li>"
                   for f, t, s in entries)
    page = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>aotgrad.explain index</title>"
            "<style>body{font:14px system-ui,sans-serif;margin:24px}li{margin:6px 0}span{color:#5b6677}</style>"
            f"</head><body><h1>aotgrad.explain: {len(entries)} compiled graphs, in graph order</h1><ol start='0'>"
            f"{rows}</ol></body></html>\n")
    with open(os.path.join(directory, "index.html"), "w", encoding="utf-8") as f:
        f.write(page)
