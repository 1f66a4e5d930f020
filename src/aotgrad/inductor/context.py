"""The torch.compile backend's compile context: Dynamo's tracing context and fake mode for a compile,
and `BackendCompileError` with the failure description (the op, the input names, the graph line).
"""

from __future__ import annotations

import itertools
import linecache
import traceback

import torch
import torch.fx

from .. import config
from ..dynamic import shapes as dynamic_shapes
from ..errors import AotgradError

_graph_ids = itertools.count()


class BackendCompileError(AotgradError):
    """aotgrad could not compile a graph Dynamo handed it (see the message for the op and line)."""


# Shared with aot_function(dynamic=True), aot_module_simplified and export (dynamic/shapes.py).
_context_fake_mode = dynamic_shapes.context_fake_mode
_compile_context = dynamic_shapes.compile_context


def _must_propagate(e: BaseException) -> bool:
    """Dynamo control flow (restart analysis, skip frame) must reach Dynamo unchanged."""
    try:
        from torch._dynamo import exc as dexc
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (dexc.RestartAnalysis, dexc.SkipFrame))


def _describe_failure(e: BaseException, gm: torch.fx.GraphModule | None) -> BackendCompileError:
    """A `BackendCompileError` naming the failing op, the input involved and the Dynamo graph line."""
    op = _failing_op(e)
    line = _graph_line(e, gm) if gm is not None else None
    first = (str(e).strip().splitlines() or [""])[0][:400].rstrip(". ")
    parts = [f"aotgrad could not compile a graph Dynamo handed it: {type(e).__name__}: {first}"]
    if op is not None and op not in first:
        parts.append(f"op: {op}")
    named = _input_names(first, gm) if gm is not None else None
    if named:
        parts.append(named)
    if line is not None:
        parts.append(f"while tracing: `{line}`")
    if not config.fallback_to_eager:
        parts.append("set aotgrad.config.fallback_to_eager = True to run such graphs eagerly")
    return BackendCompileError(". ".join(parts) + ".")


def _input_names(message: str, gm: torch.fx.GraphModule) -> str | None:
    """'input 3' in an aotgrad message, as the Dynamo graph's placeholder (and its source) name."""
    import re

    m = re.search(r"\binputs? \[?(\d+)", message)
    if not m:
        return None
    from ..api import _named_state  # here: a load, which imports this module, needs no tracer

    names, _ = _named_state(gm)
    i = int(m.group(1)) - len(names)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not 0 <= i < len(placeholders):
        return None
    node = placeholders[i]
    source = getattr(node.meta.get("grapharg"), "source", None)
    where = f" ({source.name})" if source is not None and hasattr(source, "name") else ""
    return f"input {m.group(1)} is the graph input `{node.name}`{where}"


def _failing_op(e: BaseException) -> str | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        func = getattr(e, "func", None) or getattr(e, "target", None)
        if func is not None:
            return str(func)
        e = e.__cause__ or e.__context__ or getattr(e, "inner_exception", None)
    return None


def _graph_line(e: BaseException, gm: torch.fx.GraphModule) -> str | None:
    code = getattr(gm.forward, "__code__", None)
    filename = code.co_filename if code is not None else None
    seen = set()
    found = None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            if filename is not None and frame.filename == filename:
                found = (linecache.getline(frame.filename, frame.lineno) or frame.line or "").strip()
        e = e.__cause__ or e.__context__
    if found:
        return found.split(";")[0].strip()
    return None
