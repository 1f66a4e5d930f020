"""What aotgrad did, for the tools torch users reach for.

- `TORCH_LOGS="aot_graphs"` / `"aot_joint_graph"` (torch's artifact loggers of those names) print
  aotgrad's joint, forward, backward and inference graphs, under `aot_function` and the
  `torch.compile` backend alike; `aot_function(enable_log=False)` silences them for that function.
- `logging.getLogger("aotgrad")` at DEBUG reports each stage (capture, partition, compile) with its
  time, and each recompile with its reason.
- `compile_times()` returns the per-stage totals since the process started (or the last reset).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._logging

from . import node_meta
from .errors import CompilerError

log = logging.getLogger("aotgrad.stages")
# torch's artifact loggers of upstream's names; under the `torch` logger, where TORCH_LOGS installs
# its handler (a logger outside it would need registering as a torch log, which makes torch reset
# its propagation on every `set_logs`).
graphs_log = torch._logging.getArtifactLogger(f"torch.{__name__}", "aot_graphs")
joint_log = torch._logging.getArtifactLogger(f"torch.{__name__}", "aot_joint_graph")

_totals: dict[str, float] = {}
_counts: dict[str, int] = {}
_local = threading.local()


def compile_times(reset: bool = False) -> dict[str, dict[str, float]]:
    """Per stage ("capture", "partition", "compile_forward", "compile_backward", "compile_inference"):
    `{"seconds": total, "count": how many times it ran}`. `reset=True` clears the totals after reading."""
    out = {k: {"seconds": _totals[k], "count": _counts[k]} for k in _totals}
    if reset:
        _totals.clear()
        _counts.clear()
    return out


@contextlib.contextmanager
def stage(name: str, what: str = "") -> Iterator[None]:
    """Time one stage: added to `compile_times()` and logged at DEBUG."""
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        _totals[name] = _totals.get(name, 0.0) + took
        _counts[name] = _counts.get(name, 0) + 1
        log.debug("aotgrad: %s%s took %.4f s", name, f" ({what})" if what else "", took)


@contextlib.contextmanager
def graph_logging(enabled: bool) -> Iterator[None]:
    """Whether this thread's compiles log their graphs (`aot_function(enable_log=...)`)."""
    old = getattr(_local, "enabled", True)
    _local.enabled = enabled
    try:
        yield
    finally:
        _local.enabled = old


def _graph_text(title: str, gm: torch.fx.GraphModule) -> Any:
    return torch._logging.LazyString(
        lambda: f"TRACED GRAPH\n ===== {title} (aotgrad) =====\n{gm.print_readable(print_output=False)}"
    )


def log_graph(kind: str, gm: torch.fx.GraphModule) -> None:
    """kind: "joint" goes to aot_joint_graph; "forward", "backward", "inference" to aot_graphs."""
    if not getattr(_local, "enabled", True):
        return
    target = joint_log if kind == "joint" else graphs_log
    if target.isEnabledFor(logging.INFO):
        target.info("%s", _graph_text(f"{kind.capitalize()} graph", gm))


def call_compiler(
    kind: str, compiler: Callable, gm: torch.fx.GraphModule, example_inputs: list, log: bool = True
) -> Callable:
    """Hand `gm` to `compiler`, timed; a compiler that returns None is named in an AotgradError.

    The compiler runs with autocast off, as the graph it gets will: the graph already holds the
    casts of the autocast state it was traced under, and a compiler that runs or re-propagates its
    ops under the caller's autocast would see other dtypes than the graph computes (Inductor 2.11's
    post-grad passes then drop a cast they think is a no-op, and its code mixes float32 and bf16)."""
    node_meta.complete(gm)
    if log:
        log_graph(kind, gm)
    with stage(f"compile_{kind}", getattr(compiler, "__name__", type(compiler).__name__)), \
            torch._C._DisableAutocast():
        compiled = compiler(gm, example_inputs)
    if compiled is None:
        name = getattr(compiler, "__qualname__", None) or getattr(compiler, "__name__", repr(compiler))
        raise CompilerError(
            f"aotgrad: the {kind} compiler {name} returned None; a compiler must return a callable that "
            "runs the graph (return the GraphModule itself, or `gm.forward`, to run it as is)."
        )
    return compiled


def log_recompile(fn: Callable, reason: str) -> None:
    log.debug("aotgrad: recompiling %s: %s", getattr(fn, "__qualname__", fn), reason)
