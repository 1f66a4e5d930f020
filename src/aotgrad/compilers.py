"""Graph compilers and the boxed calling convention.

A compiler takes an FX `GraphModule` and example inputs and returns a callable. A *boxed* callable
takes one list of inputs (and may clear it, to free inputs early); aotgrad calls every compiled graph
boxed, wrapping unboxed ones once at compile time so the hot path never checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx


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
    running its own re-inplacing pass (reinplace.py) first."""

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

    def compiler(fx_g: torch.fx.GraphModule, _example_inputs):
        print(f"==== {name} ====")
        print(fx_g.code)
        return fx_g

    return compiler
