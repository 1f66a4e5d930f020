"""Donated saved values: the backward may write into the forward intermediates it was handed.

A saved intermediate (not a forward input, not a value the caller sees) is read by the backward and
then dead. Inductor can reuse such an input's buffer in place ("donated buffer") when told which
inputs are donated: the logits' gradient is then written over the saved logits instead of a new
buffer beside them, which on a language model is the backward's peak (on the demo-sized Llama with
a 32,000-token vocabulary, 1.17x upstream's peak without it). Upstream passes
`bw_donated_idxs` through the tracing context's `fw_metadata`; aotgrad passes the same.

Two rules keep it exact:
- At compile time, only saved values the forward made fresh are offered (`fresh_saved`, recorded
  on the forward graph when it is partitioned, kept with a cached entry), minus any the backward
  returns or views (`donatable`); never under CUDA graphs (not yet checked on a GPU).
- At run time, `DonatingBackward` checks that the backward's argument list holds the only
  reference to each donated tensor and its memory. It does not under `retain_graph=True` (autograd
  keeps the saved values for the next backward), when a saved-tensor hook kept one, or when the
  memory is shared with another tensor: that argument is copied first, so the graph writes into
  the copy. Upstream raises an error for `retain_graph=True` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator

import torch
import torch.fx

from ..trace.analysis import storage_id

log = logging.getLogger("aotgrad.inductor.donation")

# Meta key on a forward graph: the backward placeholders (saved tensors) the forward made fresh.
FRESH_SAVED = "aotgrad_fresh_saved"


def _storage(value) -> int | None:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    try:
        return storage_id(value)
    except (NotImplementedError, RuntimeError):  # a subclass or functional wrapper without storage
        return None


def _changes_metadata(gm: torch.fx.GraphModule) -> bool:
    """An in-place view op (`t_`, `squeeze_`, `as_strided_`...): node values stop describing the
    tensors, so aliasing read off them is not to be trusted."""
    return any(n.op == "call_function" and torch.Tag.inplace_view in getattr(n.target, "tags", ())
               for n in gm.graph.nodes)


def fresh_saved(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> tuple[int, ...]:
    """Positions among the saved tensors (= the backward's first placeholders) of the values the
    forward made: sharing no memory with a forward input, an output the caller gets, or another
    saved tensor."""
    if _changes_metadata(fw):
        return ()
    outputs = list(fw.graph.output_node().args[0])
    saved = [o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in outputs[num_fwd_outputs:]]
    saved = [v for v in saved if isinstance(v, torch.Tensor)]  # saved tensors come first, then symints
    taken: dict = {}
    for node in fw.graph.find_nodes(op="placeholder"):
        taken[_storage(node.meta.get("val"))] = None
    for o in outputs[:num_fwd_outputs]:
        taken[_storage(o.meta.get("val") if isinstance(o, torch.fx.Node) else None)] = None
    counts: dict = {}
    for v in saved:
        s = _storage(v)
        counts[s] = counts.get(s, 0) + 1
    return tuple(j for j, v in enumerate(saved)
                 if (s := _storage(v)) is not None and s not in taken and counts[s] == 1)


def donatable(bw: torch.fx.GraphModule, fresh: tuple[int, ...]) -> tuple[int, ...]:
    """`fresh` minus the placeholders the backward returns, or returns a view of."""
    if not fresh or _changes_metadata(bw):
        return ()
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    returned: set = set()
    for o in bw.graph.output_node().args[0]:
        if isinstance(o, torch.fx.Node):
            returned.add(o)
            returned.add(_storage(o.meta.get("val")))
    return tuple(j for j in fresh if j < len(placeholders) and placeholders[j] not in returned
                 and _storage(placeholders[j].meta.get("val")) not in returned)


@dataclasses.dataclass
class _BackwardMeta:
    """What Inductor reads off `TracingContext.fw_metadata` when it compiles a backward."""

    bw_donated_idxs: list[int]
    static_input_indices: list[int] = dataclasses.field(default_factory=list)
    num_mutated_inp_runtime_indices: int = 0


@contextlib.contextmanager
def donating(ctx, donated: tuple[int, ...]) -> Iterator[None]:
    """Compile under `ctx` with `donated` as the backward's donated inputs; the donation is part of
    Inductor's FX-graph cache key (its cache key tag), so a graph compiled without it is never
    loaded for one compiled with it, nor the other way round."""
    if not donated:
        yield
        return
    log.debug("aotgrad: backward compiled with donated inputs %s", list(donated))
    previous = ctx.fw_metadata
    ctx.fw_metadata = _BackwardMeta(list(donated))
    tag = torch.compiler.config.cache_key_tag
    try:
        with torch.compiler.config.patch(cache_key_tag=f"{tag}|aotgrad donated {','.join(map(str, donated))}"):
            yield
    finally:
        ctx.fw_metadata = previous


def _counts(args: list, i: int) -> tuple[int, int, int]:
    """References to `args[i]`: Python's, the tensor's (autograd keeps its own), its memory's."""
    t = args[i]
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# The counts of a tensor that only a list holds, read the same way.
_ONLY_THE_LIST = _counts([torch.empty(1)], 0)


def _held_elsewhere(args: list, i: int) -> bool:
    refs, uses, storage_uses = _counts(args, i)
    return refs > _ONLY_THE_LIST[0] or uses > _ONLY_THE_LIST[1] or storage_uses > _ONLY_THE_LIST[2]


class DonatingBackward:
    """A compiled backward that writes into its `donated` inputs: copies the ones something else
    still holds before calling it (boxed: takes the argument list and clears it)."""

    _boxed_call = True

    def __init__(self, compiled: Callable, donated: tuple[int, ...]):
        self.aotgrad_compiled = compiled
        self.aotgrad_donated = donated

    def __call__(self, args: list):
        for i in self.aotgrad_donated:
            if isinstance(args[i], torch.Tensor) and _held_elsewhere(args, i):
                log.debug("aotgrad: saved value %d is held elsewhere (retain_graph, a hook, shared memory): "
                          "the backward writes into a copy", i)
                args[i] = args[i].clone()
        return self.aotgrad_compiled(args)


def guard(compiled: Callable, donated: tuple[int, ...]) -> Callable:
    """`compiled`, made safe to call when its donated inputs may be held elsewhere."""
    return DonatingBackward(compiled, donated) if donated else compiled
