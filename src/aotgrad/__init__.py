"""aotgrad: ahead-of-time autograd for PyTorch.

Trace a function's forward and backward together into one functional aten graph, record what it
does to its inputs and outputs, split the graph, compile each half, and run them with results and
gradients identical to eager. See ARCHITECTURE.md for the pipeline.
"""

from .api import (
    AOTModule,
    CompiledFunction,
    aot_function,
    aot_module,
    aot_module_simplified,
    compiled_function,
    compiled_module,
)
from .compile.compilers import (
    draw_graph,
    draw_graph_compile,
    get_aot_compilation_context,
    get_aot_graph_name,
    get_graph_being_compiled,
    make_boxed_compiler,
    make_boxed_func,
    nop,
    print_compile,
    print_graph,
    set_model_name,
)
from .errors import (
    AotgradError,
    BackwardMutationError,
    HigherOrderError,
    InplaceOnLeafError,
    UnsupportedAliasingError,
    UnsupportedInputError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)
from .export.export import BackwardSignature, GraphSignature, aot_export_joint_simple, aot_export_module
from .observe import compile_times
from .partition.default import default_partition
from .trace.decompositions import default_decompositions

__all__ = [
    "AOTModule",
    "AotgradError",
    "BackwardMutationError",
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
from . import config  # noqa: E402
from .backend.dynamo import BackendCompileError, aotgrad_backend, aotgrad_eager, backend  # noqa: E402
from .cache.store import cache_stats, clear_cache  # noqa: E402

__all__ += ["BackendCompileError", "aotgrad_backend", "aotgrad_eager", "backend", "cache_stats", "clear_cache", "config"]

# Size-aware min-cut partitioner, memory budget and policies (partition/mincut.py); residual report
# (explain/residuals.py); what compilation did, as text and HTML (explain/report.py; CLI: python -m aotgrad.explain).
from .explain.report import Report as ExplainReport  # noqa: E402
from .explain.report import explain  # noqa: E402
from .explain.residuals import ResidualReport, saved_residuals, saved_residuals_module  # noqa: E402
from .partition.mincut import (  # noqa: E402
    POLICIES,
    PartitionInfo,
    checkpoint_name,
    min_cut_rematerialization_partition,
    mincut_partitioner,
    recompute_names,
    save_everything,
    save_matmuls,
    save_names,
    save_nothing,
    save_only_these_names,
)

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
