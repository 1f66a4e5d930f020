"""Average-pool backwards whose ceil-mode windows Inductor would divide wrongly run as aten kernels.

With `count_include_pad=True`, eager divides each window by its size clipped to the padded input:
a `ceil_mode` window that runs past the padding counts only the part inside it. Inductor's lowering
of `avg_pool2d_backward` and `avg_pool3d_backward` (torch 2.13, checked) divides by the whole
kernel instead, while its forward is right. So the gradient is too small, and nothing fails:
HuggingFace EfficientNet pools globally with `AvgPool2d(hidden_dim, ceil_mode=True)`, a 1280
kernel over a 7x7 map at 224 px, and under plain `torch.compile` every gradient below the pool is
3e-5 of eager's (tests/inductor/test_avg_pool_backward.py; the sweep's efficientnet `top_bn.bias`).

So before Inductor sees a graph, each such backward is replaced by a custom op that calls the same
aten kernel. Whether a window overhangs depends on the sizes, which may be symbolic, so every
ceil-mode backward that counts padding is routed; the rest keep Inductor's kernel.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx

from .reroute import replace_call

log = logging.getLogger("aotgrad.inductor")

aten = torch.ops.aten


def _define(aten_op: torch._ops.OpOverload, name: str):
    """`aotgrad::NAME`: ATEN_OP itself, which Inductor cannot lower (it falls back to the kernel)."""

    def run(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: list[int], stride: list[int],
            padding: list[int], ceil_mode: bool, count_include_pad: bool,
            divisor_override: Optional[int]) -> torch.Tensor:  # noqa: UP045
        return _like(self, aten_op(grad_output, self, kernel_size, stride, padding, ceil_mode,
                                   count_include_pad, divisor_override))

    op = torch.library.custom_op(f"aotgrad::{name}", run, mutates_args=())
    op.register_fake(lambda grad_output, self, *args: torch.empty_like(self))
    return getattr(torch.ops.aotgrad, name).default


def _like(self: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient in the layout the fake promises (`empty_like(self)`): Inductor plans around it."""
    if grad.stride() == torch.empty_like(self).stride():
        return grad
    return torch.empty_like(self).copy_(grad)


_ROUTES = {op: _define(op, op.name().split("::")[1].split(".")[0])
           for op in (aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)}
_ARGUMENTS = ("grad_output", "self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
              "divisor_override")


def route_to_aten(gm: torch.fx.GraphModule) -> int:
    """Replace each ceil-mode average-pool backward that counts padding by its custom op; the
    number replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ROUTES:
            continue
        args = _arguments(node)
        if not (args["ceil_mode"] and args["count_include_pad"] and args["divisor_override"] is None):
            continue
        new = replace_call(gm, node, _ROUTES[node.target], tuple(args.values()))
        replaced += 1
        log.debug("aotgrad: %s (ceil_mode, count_include_pad) runs as an aten kernel (Inductor divides "
                  "its overhanging windows by the whole kernel)", new.name)
    if replaced:
        gm.recompile()
    return replaced


def _arguments(node: torch.fx.Node) -> dict:
    """The backward's eight arguments by name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for k, (name, arg) in enumerate(zip(_ARGUMENTS, schema.arguments)):
        if k < len(node.args):
            out[name] = node.args[k]
        elif arg.name in node.kwargs:
            out[name] = node.kwargs[arg.name]
        else:
            out[name] = arg.default_value
    return out
