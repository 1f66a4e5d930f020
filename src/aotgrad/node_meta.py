"""Node metadata upstream's graphs carry, for compilers and tools that read it.

* `meta["stack_trace"]`: where in the user's source the op was called (frames of the traced
  program, innermost last, as `traceback` formats them; aotgrad's and torch's internal frames left
  out, torch.nn's kept). Backward nodes take the stack trace of the forward op they differentiate.
* `meta["seq_nr"]`: autograd's sequence number of that forward op (upstream's key for the same
  pairing); `meta["autograd_backward"] = True` on every node traced by the backward.
* `meta["tensor_meta"]` (and `meta["val"]`) on every node, filled in just before a compiler gets
  the graph (`complete`), so the trace itself does not pay for it.

The lean recorder (trace/tracer.py) calls `annotate` per node; the backward is traced inside
`backward_phase()`.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading

import torch
import torch.fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

_AOTGRAD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep
_SKIPPED_FILES = {os.path.join(_TORCH_NN_DIR, "modules", "module.py")}

_state = threading.local()
_frame_text: dict[tuple[str, int, str], str] = {}


@contextlib.contextmanager
def backward_phase(graph: torch.fx.Graph | None = None):
    """Nodes recorded inside are the backward's. With `graph` (the one being recorded, whichever
    recorder records it), every node appended to it inside is marked too: the make_fx fallback
    does not call `annotate`."""
    old = getattr(_state, "backward", False)
    _state.backward = True
    last = graph._root.prev if graph is not None else None
    try:
        yield
    finally:
        _state.backward = old
        if last is not None:
            node = last.next
            while node is not graph._root:
                if node.op == "call_function":
                    node.meta["autograd_backward"] = True
                node = node.next


# Meta key on the nodes of a program's own `as_strided_scatter` call (higher_order/scatters.py).
EXPLICIT_SCATTER = "aotgrad_explicit_as_strided_scatter"


@contextlib.contextmanager
def explicit_scatter():
    """Nodes recorded inside come from the program calling `as_strided_scatter` itself, not from
    functionalization writing back through an `as_strided` view."""
    old = getattr(_state, "explicit_scatter", False)
    _state.explicit_scatter = True
    try:
        yield
    finally:
        _state.explicit_scatter = old


def annotate(node: torch.fx.Node) -> None:
    """Record where `node`'s op comes from (called by the recorder right after it makes the node)."""
    if getattr(_state, "explicit_scatter", False):
        node.meta[EXPLICIT_SCATTER] = True
    if getattr(_state, "backward", False):
        node.meta["autograd_backward"] = True
        current = torch._C._current_autograd_node()
        if current is not None:
            node.meta["seq_nr"] = current._sequence_nr()
        return
    node.meta["seq_nr"] = torch.autograd._get_sequence_nr() - 1
    trace = user_stack_trace()
    if trace:
        node.meta["stack_trace"] = trace


def _is_user_file(filename: str) -> bool:
    if filename.startswith(_TORCH_NN_DIR):
        return filename not in _SKIPPED_FILES
    return not filename.startswith(_TORCH_DIR) and not filename.startswith("<")


def user_stack_trace() -> str | None:
    """The traced program's frames on the current stack: those between the op and the aotgrad frame
    that called the program."""
    frame = sys._getframe(2)
    frames = []
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<eval_with_key"):  # an FX graph's code (Dynamo's): its node's trace
            from_graph = _graph_node_trace(frame)
            if from_graph is not None:
                return from_graph
        elif filename.startswith(_AOTGRAD_DIR):
            if frames:
                break
        elif _is_user_file(filename):
            frames.append((filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    if not frames:
        return None
    return "".join(_format(f) for f in reversed(frames))


def _graph_node_trace(frame) -> str | None:
    gm = frame.f_locals.get("self")
    lineno_map = getattr(gm, "_lineno_map", None)
    if not isinstance(gm, torch.fx.GraphModule) or not lineno_map:
        return None
    index = lineno_map.get(frame.f_lineno - frame.f_code.co_firstlineno)
    if index is None:
        return None
    nodes = getattr(gm, "_aotgrad_node_list", None)
    if nodes is None or len(nodes) != len(gm.graph.nodes):
        nodes = list(gm.graph.nodes)
        gm._aotgrad_node_list = nodes
    return nodes[index].meta.get("stack_trace") if index < len(nodes) else None


def _format(key: tuple[str, int, str]) -> str:
    text = _frame_text.get(key)
    if text is None:
        filename, lineno, name = key
        line = linecache.getline(filename, lineno).strip()
        text = f'  File "{filename}", line {lineno}, in {name}\n' + (f"    {line}\n" if line else "")
        _frame_text[key] = text
    return text


def copy_forward_traces(graph: torch.fx.Graph) -> None:
    """Backward nodes take the stack trace of the first forward node with their sequence number."""
    forward: dict[int, str] = {}
    for node in graph.nodes:
        seq = node.meta.get("seq_nr")
        if seq is None:
            continue
        if not node.meta.get("autograd_backward"):
            if "stack_trace" in node.meta:
                forward.setdefault(seq, node.meta["stack_trace"])
        elif seq in forward and "stack_trace" not in node.meta:
            node.meta["stack_trace"] = forward[seq]


def complete(gm: torch.fx.GraphModule) -> None:
    """Give every node of a graph about to be compiled `meta["tensor_meta"]` (from its `val`)."""
    for node in gm.graph.nodes:
        if "tensor_meta" in node.meta or node.op == "output":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        elif isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val) and val:
            node.meta["tensor_meta"] = type(val)(_extract_tensor_metadata(v) for v in val)
