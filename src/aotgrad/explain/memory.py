"""Memory pictures for `aotgrad.explain`: a measured activation timeline and the memory-budget curve.

The timeline is measured, not modelled: a `TorchDispatchMode` sees every aten op of one forward
then one backward (of eager, and of the aot-compiled function run with the `nop` compiler, whose
FX code runs node by node and drops each value after its last use), notes each new storage an op
creates and, through a weakref on the storage, when it is freed. Storages that existed before the
step (inputs, parameters) are not activations and are not counted.

The budget curve calls the min-cut partitioner (only its public entry point) on the joint graph at
a grid of budgets and reads what each plan saves (`PartitionInfo.saved_bytes`) and what the
backward recomputes (FLOPs by `estimate_flops`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("aotgrad.explain")

__all__ = ["BudgetPoint", "Timeline", "budget_curve", "measure_timeline"]


@dataclass
class Timeline:
    """Live activation bytes after each aten op of one forward then one backward."""

    label: str
    live: list[int] = field(default_factory=list)  # bytes alive after op i
    ops: list[str] = field(default_factory=list)  # op i's name
    backward_start: int = 0  # index of the first backward op
    at_backward_start: int = 0  # bytes alive when the backward is called: what the forward left for it

    @property
    def peak(self) -> int:
        return max(self.live, default=0)

    @property
    def peak_index(self) -> int:
        return self.live.index(self.peak) if self.live else 0

    @property
    def peak_phase(self) -> str:
        return "forward" if self.peak_index < self.backward_start else "backward"


class _LiveBytes(TorchDispatchMode):
    def __init__(self, preexisting: set[int]):
        super().__init__()
        self.preexisting = preexisting
        self.alive: dict[int, int] = {}
        self.total = 0
        self.recording = True
        self.timeline = Timeline("")

    def _freed(self, key: int) -> None:
        self.total -= self.alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in self.alive or key in self.preexisting:
                continue
            self.alive[key] = nbytes
            self.total += nbytes
            weakref.finalize(st, self._freed, key)
        if self.recording:
            self.timeline.live.append(self.total)
            self.timeline.ops.append(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func))
        return out


def _storages(tree: Any) -> set[int]:
    keys = set()
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.layout is torch.strided:
            try:
                keys.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
    return keys


def measure_timeline(label: str, step: Callable[[], Any], held: Any) -> Timeline:
    """Run `step()` (the forward), then a backward of every floating output that requires grad with
    gradients of ones, under the live-bytes mode. `held`: tensors alive before (not counted)."""
    mode = _LiveBytes(_storages(held))
    with mode:
        outs = step()
        mode.timeline.backward_start = len(mode.timeline.live)
        mode.timeline.at_backward_start = mode.total
        heads = [t for t in pytree.tree_leaves(outs) if isinstance(t, torch.Tensor) and t.requires_grad
                 and t.grad_fn is not None]
        if heads:
            mode.recording = False
            grads = [torch.ones_like(t) for t in heads]
            mode.recording = True
            torch.autograd.backward(heads, grads)
        del outs, heads
    mode.timeline.label = label
    return mode.timeline


# ------------------------------------------------------------------------------------------------
# The memory-budget curve.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPoint:
    budget: float | None  # None: the plan the report's partitioner chose, when it has no budget
    saved_bytes: int
    recompute_flops: int
    recomputed_ops: int  # forward ops the backward computes again (views and getitems excluded)


def recompute_cost(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> tuple[int, int]:
    """(FLOPs, op count) of the forward ops that the backward graph computes again."""
    from ..partition.mincut import estimate_flops, op_class
    from ..partition.order import REMADE_FROM

    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    again = [n for n in bw.graph.nodes if n.op == "call_function"
             and (n.name in fw_names or n.meta.get(REMADE_FROM) in fw_names) and op_class(n) not in ("view", "free")]
    return sum(estimate_flops(n) for n in again), len(again)


def budget_curve(joint: torch.fx.GraphModule, num_fwd_outputs: int, points: int = 11,
                 policy: Any = None) -> list[BudgetPoint]:
    """Saved bytes and recomputation cost of the min-cut plan at `points` budgets in 0..1."""
    from ..partition.mincut import INFO_KEY, min_cut_rematerialization_partition

    curve = []
    for i in range(points):
        b = i / max(points - 1, 1)
        try:
            fw, bw = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=num_fwd_outputs,
                                                         memory_budget=b, policy=policy)
        except Exception as e:  # a report must not fail on its optional picture
            log.warning("aotgrad.explain: min-cut at budget %.2f failed: %s", b, e)
            continue
        info = fw.meta.get(INFO_KEY)
        flops, n = recompute_cost(fw, bw)
        curve.append(BudgetPoint(b, info.saved_bytes if info is not None else 0, flops, n))
    return curve
