"""`freeing_nop`: the identity compiler whose graph lets go of each input at its last use.

`nop` runs the FX graph's Python as is; its caller's argument list keeps every input alive until the
graph returns. For a backward graph the inputs are the saved activations, so a backward run with
`nop` holds all of them to its end, where Inductor's compiled code (boxed: it clears the list) and
eager autograd free each as soon as it is used. `aotgrad.explain` measures its memory timeline with
this compiler for the backward, so the timeline shows what a compiled backward holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

from .torch_compat import boxed_codegen

__all__ = ["freeing_nop"]


def freeing_nop(fx_g: torch.fx.GraphModule, _example_inputs: list[Any]) -> Callable:
    """A boxed callable running a copy of `fx_g` that clears its argument list on entry (so the
    graph's own `x = None` after each last use frees the value). `fx_g` itself is not changed."""
    codegen = boxed_codegen()
    if codegen is None:  # no boxed code generation in this torch: the plain nop, boxed
        from .compilers import make_boxed_func, nop

        return make_boxed_func(nop(fx_g, _example_inputs))
    graph = torch.fx.Graph()
    out = graph.graph_copy(fx_g.graph, {})
    graph.output(out)
    graph.set_codegen(codegen)
    gm = torch.fx.GraphModule(fx_g, graph)

    def run(args: list) -> Any:
        return gm.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
