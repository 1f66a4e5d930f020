"""Accumulating scatters on CPU that Inductor's C++ code would address wrongly run as aten kernels.

Inductor's C++ backend (torch 2.13, checked) tiles a kernel in two dimensions when it reads one
tensor transposed, and fuses a reduction's consumers into the reduction's loops. In such a kernel an
accumulating scatter (`index_put(..., accumulate=True)`, the backward of indexing and of embedding)
adds the inner tile offset to its address twice when the kernel runs on more than one thread: the
gradient of one column lands in the next one, and the last column's past the end of the buffer (a
heap corruption that aborts later). Plain `torch.compile` hits it too (tests/test_inductor_cpu_scatter.py);
aotgrad's min-cut makes the shape in swinv2's backward, where it recomputes the sigmoid of the
gathered position bias from the gathered values (read transposed) instead of saving it.

So before Inductor sees a CPU graph, each accumulating scatter whose values are computed from a
transposed read is replaced by a custom op that calls the same aten kernel: Inductor computes the
values in a kernel of their own and calls aten for the scatter. Scatters of values read in order
(the embedding backward of most models) keep Inductor's fused kernel.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx

from ..torch_compat import optimization_hint
from ..trace.analysis import is_view_op
from .reroute import replace_call

log = logging.getLogger("aotgrad.inductor")

aten = torch.ops.aten


@torch.library.custom_op("aotgrad::index_put_accumulate", mutates_args=())
def index_put_accumulate(self: torch.Tensor, indices: list[Optional[torch.Tensor]],  # noqa: UP045
                         values: torch.Tensor) -> torch.Tensor:
    """`aten.index_put(self, indices, values, accumulate=True)`, which Inductor cannot fuse."""
    return aten.index_put.default(self, indices, values, True)


@index_put_accumulate.register_fake
def _(self, indices, values):
    return torch.empty_like(self)


@torch.library.custom_op("aotgrad::masked_index_put_accumulate", mutates_args=())
def masked_index_put_accumulate(self: torch.Tensor, mask: torch.Tensor,
                                indices: list[Optional[torch.Tensor]],  # noqa: UP045
                                values: torch.Tensor) -> torch.Tensor:
    """`aten._unsafe_masked_index_put_accumulate`, which Inductor cannot fuse."""
    return aten._unsafe_masked_index_put_accumulate.default(self, mask, indices, values)


@masked_index_put_accumulate.register_fake
def _(self, mask, indices, values):
    return torch.empty_like(self)


# Accumulating scatter -> (position of `values`, the custom op taking the same arguments).
_SCATTERS = {
    aten.index_put.default: (2, torch.ops.aotgrad.index_put_accumulate.default),
    aten._unsafe_index_put.default: (2, torch.ops.aotgrad.index_put_accumulate.default),
    aten._unsafe_masked_index_put_accumulate.default: (3, torch.ops.aotgrad.masked_index_put_accumulate.default),
}
_TRANSPOSING = {aten.permute.default, aten.transpose.int, aten.t.default, aten.as_strided.default}
# Ops whose loops Inductor may fuse with a scatter reading them: the walk goes through these.
_FUSIBLE_NAMES = {"sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std", "clone", "where",
                  "_softmax_backward_data", "_log_softmax_backward_data", "squeeze", "unsqueeze"}


def route_to_aten(gm: torch.fx.GraphModule) -> int:
    """Replace each CPU accumulating scatter of transposed-read values by its custom op; the number
    replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SCATTERS or not _accumulates(node):
            continue
        values_at, op = _SCATTERS[node.target]
        values = node.args[values_at] if len(node.args) > values_at else node.kwargs.get("values")
        if not _on_cpu(node) or not isinstance(values, torch.fx.Node) or not _reads_transposed(values):
            continue
        args = [node.args[0], *node.args[1:values_at], values]
        new = replace_call(gm, node, op, tuple(args))
        replaced += 1
        log.debug("aotgrad: %s of transposed-read values runs as an aten kernel (Inductor's C++ tiling "
                  "misaddresses an accumulating scatter)", new.name)
    if replaced:
        gm.recompile()
    return replaced


def _accumulates(node: torch.fx.Node) -> bool:
    if node.target is aten._unsafe_masked_index_put_accumulate.default:
        return True
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return accumulate is True


def _on_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _reads_transposed(values: torch.fx.Node) -> bool:
    """Whether the scatter's kernel could read a tensor across its layout: a transposing view, or
    an input laid out out of order, among the ops Inductor may fuse into it."""
    seen, stack = set(), [values]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if _out_of_order(node.meta.get("val")):
                return True
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in _TRANSPOSING:
            if node.target is not aten.permute.default or list(node.args[1]) != sorted(node.args[1]):
                return True
            continue
        if not _fusible(node.target):
            continue
        stack.extend(n for n in node.all_input_nodes)
    return False


def _fusible(target: torch._ops.OpOverload) -> bool:
    if torch.Tag.pointwise in target.tags or is_view_op(target):
        return True
    return target.overloadpacket.__name__ in _FUSIBLE_NAMES


def _out_of_order(t) -> bool:
    """A tensor whose strides do not fall from the first dimension to the last (size-1 and
    broadcast dimensions aside): reading it in index order walks across its layout."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return False
    hints = [(optimization_hint(n, fallback=2), optimization_hint(s, fallback=1)) for n, s in zip(t.shape, t.stride())]
    strides = [s for n, s in hints if n > 1 and s != 0]
    return strides != sorted(strides, reverse=True)
