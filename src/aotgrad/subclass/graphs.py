"""The subclass stage's pass over the plain graphs before they reach the caller's compiler.

The boundary's autograd Functions (`_Wrap`, `_Unwrap`: subclass/crossings.py) detach the inner tensors they
hand across, so every subclass argument and output leaves an `aten.detach` per inner tensor in the
forward graph. A detach changes no value; it matters only where the graph returns it (the run time
gets a tensor object of its own, not the input or another output). So a detach's other uses read
its input directly, and a returned detach is folded too where its input is an op result returned
nowhere else. Under the `nop` compiler that is four of six aten calls in `TwoTensor.sin()`; every
compiler sees the graph upstream's would (ops on the inner tensors only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx

log = logging.getLogger("aotgrad.subclass")

_DETACH = torch.ops.aten.detach.default


def drop_detaches(gm: torch.fx.GraphModule, num_user: int | None = None) -> int:
    """Fold the `detach` nodes of `gm` as above, in place; returns how many went. Graph outputs past
    `num_user` are values saved for the backward: no one sees their identity, so a detach of an
    input is folded there too."""
    graph = gm.graph
    out = graph.output_node()
    returned = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else []
    dropped = 0
    for node in list(graph.find_nodes(op="call_function", target=_DETACH)):
        (src,) = node.args[:1] or (None,)
        if not isinstance(src, torch.fx.Node) or node.kwargs:
            continue
        node.replace_all_uses_with(src, delete_user_cb=lambda user: user is not out)
        user = returned if num_user is None else returned[:num_user]
        others = [r for r in user if r is not node]
        fold_user = src.op != "placeholder" and src not in others and user.count(node) == 1
        returned = [src if r is node and (k >= len(user) or fold_user) else r for k, r in enumerate(returned)]
        if returned != list(out.args[0]):
            out.args = (type(out.args[0])(returned),)
        if not node.users:
            graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _folding(compiler: Callable) -> Callable:
    def compiler_without_boundary_detaches(gm: torch.fx.GraphModule, example_inputs):
        n = drop_detaches(gm)
        log.debug("aotgrad: %d boundary detaches folded out of the graph", n)
        return compiler(gm, example_inputs)

    # what the pipeline reads off a compiler (compilers.takes_functional_graphs, ...)
    compiler_without_boundary_detaches.__dict__.update(getattr(compiler, "__dict__", {}))
    return compiler_without_boundary_detaches


def _folding_partition(partition_fn: Callable) -> Callable:
    def partition_without_boundary_detaches(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        n = drop_detaches(fw, num_fwd_outputs)
        log.debug("aotgrad: %d boundary detaches folded out of the forward graph", n)
        return fw, bw

    partition_without_boundary_detaches.__dict__.update(getattr(partition_fn, "__dict__", {}))
    partition_without_boundary_detaches.__name__ = getattr(partition_fn, "__name__", "partition")
    return partition_without_boundary_detaches


def with_folded_detaches(config):
    """`config` with its partitioner (forward graphs) and inference compiler behind `drop_detaches`
    (not where compilers get graphs with in-place ops: an in-place op through a detach stays)."""
    if getattr(config, "disable_functionalization", False):
        return config
    return replace(config, partition_fn=_folding_partition(config.partition_fn),
                   inference_compiler=_folding(config.inference_compiler))
