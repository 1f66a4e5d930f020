"""aotgrad: ahead-of-time autograd for PyTorch.

Trace a function's forward and backward together into one functional aten graph, record what it
does to its inputs and outputs, split the graph, compile each half, and run them with results and
gradients identical to eager. See ARCHITECTURE.md for the pipeline.
"""

from .api import (
    AOTModule,
    CompiledFunction,
    aot_export_joint_simple,
    aot_function,
    aot_module,
    aot_module_simplified,
    compiled_function,
    compiled_module,
)
from .compilers import make_boxed_compiler, make_boxed_func, nop, print_graph
from .decompositions import default_decompositions
from .errors import (
    AotgradError,
    BackwardMutationError,
    InplaceOnLeafError,
    UnsupportedAliasingError,
    UnsupportedInputError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)
from .partition import default_partition

__all__ = [
    "AOTModule",
    "AotgradError",
    "BackwardMutationError",
    "CompiledFunction",
    "InplaceOnLeafError",
    "UnsupportedAliasingError",
    "UnsupportedInputError",
    "UnsupportedMutationError",
    "UnsupportedOutputError",
    "aot_export_joint_simple",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "compiled_function",
    "compiled_module",
    "default_decompositions",
    "default_partition",
    "make_boxed_compiler",
    "make_boxed_func",
    "nop",
    "print_graph",
]
