"""A cache hit's differentiable backward: what higher_order/backward.py and partition/zero_tangents.py need, kept in
the entry and unpickled only when a backward actually needs it.

A cold training compile keeps pristine copies of the partitioned forward and backward graphs
(`compile.compile_training`, `HigherOrder`): a backward under `create_graph=True` traces its
differentiable backward from them, and a backward where some outputs get no gradient specialises
the backward graph for those zeros (`CompiledForward.backward_with_none_tangents`). The entry
stores both graphs (`HigherOrderRecord`, pickled like the others); a hit gets a `LoadedHigherOrder`
whose graphs are unpickled on first use, so a first-order warm start unpickles nothing more and
its generated run time is the cold compile's. An entry without them (the pristine graphs did not
pickle) is still a hit: there `create_graph=True` is refused as before, and a backward with None
gradients runs the plain backward graph (same values).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx

from ..higher_order.backward import HigherOrder

log = logging.getLogger("aotgrad.cache")


@dataclass(frozen=True)
class HigherOrderRecord:
    """The pristine forward/backward graphs (cache_serialize.dump_graph) and the facts
    `HigherOrder` holds beside them."""

    fw_graph: bytes
    bw_graph: bytes
    mutated: tuple  # (primal, name) of the primals the program mutated in place
    grad_mode_recorded: bool


def record(compiled: Any, dump: Callable[[torch.fx.GraphModule], bytes]) -> HigherOrderRecord | None:
    """`compiled.higher_order`'s graphs as bytes; None (logged) when there is none or they do not
    pickle: the entry is still stored, its hits refuse `create_graph=True`."""
    h = compiled.higher_order
    if h is None:
        return None
    try:
        fw, bw = dump(h.fw_graph), dump(h.bw_graph)
    except Exception as e:  # noqa: BLE001 - any pickling failure: cache the first-order part only
        log.info("aotgrad cache: the pristine graphs cannot be serialized (%s: %s); a hit of this entry "
                 "refuses create_graph=True", type(e).__name__, e)
        return None
    return HigherOrderRecord(fw, bw, tuple(sorted(h.mutated.items())), h.grad_mode_recorded)


class LoadedHigherOrder(HigherOrder):
    """A `HigherOrder` whose pristine graphs are unpickled on first use (`load("fw" | "bw")`)."""

    def __init__(self, load: Callable[[str], torch.fx.GraphModule], **fields):
        self._load = load
        self._graphs: dict[str, torch.fx.GraphModule] = {}
        super().__init__(fw_graph=None, bw_graph=None, **fields)

    def _graph(self, which: str) -> torch.fx.GraphModule:
        gm = self._graphs.get(which)
        if gm is None:
            gm = self._graphs[which] = self._load(which)
            log.debug("aotgrad cache: loaded the pristine %s graph (differentiable or None-gradient backward)", which)
        return gm

    def _set(self, which: str, gm: torch.fx.GraphModule | None) -> None:
        if gm is not None:
            self._graphs[which] = gm

    def __repr__(self) -> str:  # the dataclass's would unpickle both graphs
        return f"LoadedHigherOrder(loaded={sorted(self._graphs)}, mutated={self.mutated})"

    fw_graph = property(lambda self: self._graph("fw"), lambda self, gm: self._set("fw", gm))
    bw_graph = property(lambda self: self._graph("bw"), lambda self, gm: self._set("bw", gm))


def attach(compiled: Any, rec: HigherOrderRecord | None, load: Callable[[bytes], torch.fx.GraphModule],
           make_compiled: Callable) -> None:
    """Give a hit's `CompiledForward` the cold compile's `higher_order` (before its run time is
    generated: the run time reads it); nothing is unpickled here."""
    if rec is None:
        return
    compiled.higher_order = LoadedHigherOrder(
        lambda which: load(rec.fw_graph if which == "fw" else rec.bw_graph),
        num_fw_outputs=compiled.num_fw_outputs,
        num_saved_tensors=compiled.num_saved_tensors,
        mutated=dict(rec.mutated),
        make_compiled=make_compiled,
        grad_mode_recorded=rec.grad_mode_recorded,
    )
