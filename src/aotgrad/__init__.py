"""aotgrad: ahead-of-time autograd for PyTorch.

Trace a function's forward and backward together into one functional aten graph, record what it
does to its inputs and outputs, split the graph, compile each half, and run them with results and
gradients identical to eager. See ARCHITECTURE.md for the pipeline.

`import aotgrad` loads the torch.compile backend, its switches and its cache (what Dynamo's backend
lookup and a precompile or cache load need); the tracing API, the partitioners, export and explain
are imported on first use of their names (`__getattr__` below), so a process that only loads
compiled graphs never imports the tracer.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from . import config
from .backend.dynamo import BackendCompileError, aotgrad_backend, aotgrad_eager, backend
from .cache.store import cache_stats, clear_cache
from .errors import (
    AotgradError,
    BackwardMutationError,
    CompilerError,
    DataDependentError,
    HigherOrderError,
    InplaceOnLeafError,
    UnsupportedAliasingError,
    UnsupportedInputError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)

# name -> (module, its name there), imported when first read
_LAZY: dict[str, tuple[str, str]] = {}
for _module, _names in {
    ".api": ("AOTModule", "CompiledFunction", "aot_function", "aot_module", "aot_module_simplified",
             "compiled_function", "compiled_module"),
    ".compile.compilers": ("draw_graph", "draw_graph_compile", "get_aot_compilation_context", "get_aot_graph_name",
                           "get_graph_being_compiled", "make_boxed_compiler", "make_boxed_func", "nop",
                           "print_compile", "print_graph", "set_model_name"),
    # an Adam/AdamW step as a plain function, so precompile can save it (backend/optimizer_step.py)
    ".backend.optimizer_step": ("OptimizerStep", "UnsupportedOptimizerError"),
    ".export.export": ("BackwardSignature", "GraphSignature", "aot_export_joint_simple", "aot_export_module"),
    ".observe": ("compile_times",),
    ".partition.default": ("default_partition",),
    ".trace.decompositions": ("default_decompositions",),
    # Size-aware min-cut partitioner, memory budget and policies (partition/mincut.py)
    ".partition.mincut": ("POLICIES", "PartitionInfo", "checkpoint_name", "min_cut_rematerialization_partition",
                          "mincut_partitioner", "recompute_names", "save_everything", "save_matmuls", "save_names",
                          "save_nothing", "save_only_these_names"),
    # residual report (explain/residuals.py); what compilation did, as text and HTML (explain/report.py;
    # CLI: python -m aotgrad.explain). `aotgrad.explain` is callable as the function or as its package.
    ".explain.residuals": ("ResidualReport", "saved_residuals", "saved_residuals_module"),
    ".explain.report": ("explain",),
}.items():
    _LAZY.update((n, (_module, n)) for n in _names)
_LAZY["ExplainReport"] = (".explain.report", "Report")
del _module, _names


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'aotgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0], __name__), where[1])
    globals()[name] = value
    # Importing `aotgrad.explain.report` set the attribute `explain` to its package: the function, as before
    report = sys.modules.get(__name__ + ".explain.report")
    if report is not None and isinstance(globals().get("explain"), types.ModuleType):
        globals()["explain"] = report.explain
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AOTModule",
    "AotgradError",
    "BackwardMutationError",
    "CompilerError",
    "DataDependentError",
    "HigherOrderError",
    "BackwardSignature",
    "GraphSignature",
    "CompiledFunction",
    "InplaceOnLeafError",
    "UnsupportedAliasingError",
    "UnsupportedInputError",
    "UnsupportedMutationError",
    "UnsupportedOutputError",
    "aot_export_joint_simple",
    "compile_times",
    "aot_export_module",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "compiled_function",
    "compiled_module",
    "default_decompositions",
    "default_partition",
    "draw_graph",
    "draw_graph_compile",
    "get_aot_compilation_context",
    "get_aot_graph_name",
    "get_graph_being_compiled",
    "make_boxed_compiler",
    "make_boxed_func",
    "nop",
    "print_compile",
    "print_graph",
    "set_model_name",
]

# torch.compile backend (backend/dynamo.py) and its switches (config.py). Note: `aotgrad.backend` is the
# backend factory function; the module is importable as `aotgrad.backend` via `from aotgrad.backend
# import ...` (sys.modules), which is how the `torch_dynamo_backends` entry points load it.
__all__ += ["BackendCompileError", "aotgrad_backend", "aotgrad_eager", "backend", "cache_stats", "clear_cache", "config"]

__all__ += [
    "POLICIES",
    "PartitionInfo",
    "ExplainReport",
    "ResidualReport",
    "checkpoint_name",
    "explain",
    "min_cut_rematerialization_partition",
    "mincut_partitioner",
    "recompute_names",
    "save_everything",
    "save_matmuls",
    "save_names",
    "save_nothing",
    "save_only_these_names",
    "saved_residuals",
    "saved_residuals_module",
]

__all__ += ["OptimizerStep", "UnsupportedOptimizerError"]
