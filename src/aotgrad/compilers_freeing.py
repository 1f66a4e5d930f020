"""`freeing_nop`: the identity compiler whose graph lets go of each input at its last use.

`nop` runs the FX graph's Python as is; its caller's argument list keeps every input alive until the
graph returns. For a backward graph the inputs are the saved activations, so a backward run with
`nop` holds all of them to its end, where Inductor's compiled code (boxed: it clears the list) and
eager autograd free each as soon as it is used. `aotgrad.explain` measures its memory timeline with
this compiler for the backward, so the timeline shows what a compiled backward holds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch.fx

from .torch_compat import boxed_codegen

__all__ = ["freeing_nop"]


def _items_right_after_their_tuple(graph: torch.fx.Graph) -> None:
    """Move each `getitem` of a multi-output op (batch norm, attention...) right after the op: the
    generated code holds the op's tuple until its last `getitem`, and with it every item, even one
    whose own last use is long past. Compiled code frees each item on its own; so does this then."""
    for node in list(graph.nodes):
        items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        cursor = node
        for item in sorted(items, key=lambda u: u.args[1] if isinstance(u.args[1], int) else 0):
            cursor.append(item)
            cursor = item


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
    _items_right_after_their_tuple(graph)
    graph.set_codegen(codegen)
    gm = torch.fx.GraphModule(fx_g, graph)

    def run(args: list) -> Any:
        return gm.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
