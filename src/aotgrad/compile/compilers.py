"""Graph compilers and the boxed calling convention.

A compiler takes an FX `GraphModule` and example inputs and returns a callable. A *boxed* callable
takes one list of inputs (and may clear it, to free inputs early); aotgrad calls every compiled graph
boxed, wrapping unboxed ones once at compile time so the hot path never checks.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx


@dataclass(frozen=True)
class AOTConfig:
    """What one compile uses: the compilers, the partitioner, the decomposition table and options
    (here, not in api.py, so that a cache or precompile load builds one without importing the tracer)."""

    fw_compiler: Callable
    bw_compiler: Callable
    inference_compiler: Callable
    partition_fn: Callable
    decompositions: dict
    num_params_buffers: int
    keep_inference_input_mutations: bool
    dynamic: bool
    enable_log: bool = True
    disable_functionalization: bool = False  # compilers get graphs with in-place ops (compile/inplace_graphs.py)


def make_boxed_func(f: Callable) -> Callable:
    """Wrap `f(*args)` as a boxed callable `g(args_list)`."""

    def g(args):
        return f(*args)

    g._boxed_call = True
    return g


def make_boxed_compiler(compiler: Callable) -> Callable:
    """Turn a compiler returning an unboxed callable into one returning a boxed callable."""

    def boxed_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return make_boxed_func(compiler(gm, example_inputs))

    return boxed_compiler


def boxed(compiled: Callable) -> Callable:
    """Return `compiled` if it already takes a list, else its boxed wrapper."""
    return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)


def wants_functional_graphs(compiler: Callable) -> Callable:
    """Mark `compiler` as one that re-inplaces functionalized custom-op calls itself (Inductor does):
    aotgrad then hands it graphs with their `auto_functionalized_v2` nodes as traced, instead of
    running its own re-inplacing pass (compile/reinplace.py) first."""

    def compiler_of_functional_graphs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compiler(gm, example_inputs)

    compiler_of_functional_graphs.aotgrad_functional_graphs = True
    return compiler_of_functional_graphs


def takes_functional_graphs(compiler: Callable) -> bool:
    return getattr(compiler, "aotgrad_functional_graphs", False)


def nop(fx_g: torch.fx.GraphModule, _example_inputs: list[Any]) -> Callable:
    """The identity compiler: run the FX graph's generated Python as is.

    Returns the bound `forward` (a GraphModule has no hooks), skipping `nn.Module.__call__`.
    """
    return fx_g.forward


def print_graph(name: str) -> Callable:
    """A compiler that prints the graph it is given (handy while debugging)."""

    def compiler(fx_g: torch.fx.GraphModule, example_inputs):
        print(f"==== {name} ====")
        return print_compile(fx_g, example_inputs)

    return compiler


def print_compile(fx_g: torch.fx.GraphModule, _example_inputs: list[Any]) -> Callable:
    """A compiler that prints the graph's code and runs it as is (upstream's `print_compile`)."""
    print(fx_g.code)
    return fx_g


def draw_graph(traced: torch.fx.GraphModule, fname: str, figname: str = "fx_graph", clear_meta: bool = True,
               prog: str | list[str] | None = None, parse_stack_trace: bool = False,
               dot_graph_shape: str | None = None) -> None:
    """Write `traced` as an image (format from the file suffix, default .svg); needs `pydot`."""
    import os

    from torch.fx.passes import graph_drawer

    if not graph_drawer.HAS_PYDOT:
        raise ImportError("aotgrad.draw_graph needs pydot (pip install pydot) and graphviz")
    base, ext = os.path.splitext(fname)
    ext = ext or ".svg"
    if clear_meta:
        traced = torch.fx.GraphModule(traced, _without_meta(traced.graph))
    drawer = graph_drawer.FxGraphDrawer(traced, figname, parse_stack_trace=parse_stack_trace, dot_graph_shape=dot_graph_shape)
    graph = drawer.get_main_dot_graph()
    write = getattr(graph, "write_" + ext.lstrip("."))
    write(f"{base}{ext}", prog=prog) if prog else write(f"{base}{ext}")


def _without_meta(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    for node in copy.nodes:
        node.meta = {}
    return copy


def draw_graph_compile(name: str) -> Callable:
    """A compiler that draws each graph it gets to `<name>_<graph name>.svg`, then runs it as is."""

    def compiler(fx_g: torch.fx.GraphModule, _example_inputs: list[Any]) -> Callable:
        draw_graph(fx_g, f"{name}_{get_graph_being_compiled()}")
        return fx_g

    return compiler


# -- the name of the graph being compiled (upstream's naming helpers, for compilers that dump) --

_model_name = "model"
_graphs_compiled = itertools.count(1)
_current: tuple[list[str], int, int] = ([], 0, 0)  # (kind, aot id, nth graph)


def set_model_name(name: str) -> None:
    global _model_name
    _model_name = name


@contextlib.contextmanager
def naming(kind: str, aot_id: int):
    """While a compiler runs: which graph it is ("forward", "backward", "inference") of which signature."""
    global _current
    saved = _current
    _current = ([kind], aot_id, next(_graphs_compiled))
    try:
        yield
    finally:
        _current = saved


def get_aot_compilation_context() -> tuple[list[str], str, int]:
    kinds, _, nth = _current
    return list(kinds), _model_name, nth


def get_aot_graph_name() -> str:
    kinds, aot_id, nth = _current
    return f"{_model_name}__{aot_id}_{'_'.join(kinds)}_{nth}"


get_graph_being_compiled = get_aot_graph_name
