"""A size-aware min-cut partitioner, a memory budget, and save/recompute policies.

`min_cut_rematerialization_partition(joint_module, joint_inputs, *, num_fwd_outputs, memory_budget=None,
policy=None)` has upstream's partitioner signature. It decides which forward values the
forward hands to the backward ("saved"), and which ones the backward computes again ("recomputed").

The model
---------
Every node of the joint graph that does not depend on a tangent (or on a backward mutation) is a
*forward-region* node; the rest are backward nodes. A forward-region node the backward reads is
*required*: the backward must have it, either saved by the forward or recomputed from values it has.
For each forward-region node `v` three facts matter:

- it is available in the backward (saved, or recomputed there);
- it is recomputed in the backward (then its inputs must be available there too);
- it may not be recomputed (a graph input, a random op, an op with a data-dependent shape, an
  expensive op the current budget does not allow to recompute, or a policy says so).

This is a minimum s-t cut. Each node becomes an edge `v_in -> v_out` whose capacity is the cost of
saving `v`; data edges `u_out -> v_in` and the edges `v_out -> sink` (required nodes) and
`source -> v_in` (nodes that may not be recomputed) are uncuttable. A cut edge `v_in -> v_out` is a
saved value; a node whose `v_in` lies on the sink side is recomputed in the backward.

Costs are lexicographic: real bytes first (shape x dtype itemsize, symbolic sizes through their
hints; none for a graph input that gets no gradient - the batch, a mask, a buffer: its caller holds
it anyway), then a small tie-break. Among cuts of equal bytes we prefer (1) saving values a fusing
compiler materialises anyway (graph inputs, forward outputs, outputs of matmuls, convolutions,
reductions, random ops, values feeding a matmul) over intermediates of a pointwise chain, (2) fewer
tensors, and (3) the cut closest to the backward: the least recomputation. Views, `detach` and
aliases are never saved (their base is saved and the view is rebuilt for free), so no storage is
handed over twice, and a graph input or forward output appears at most once in the saved list.

Op classes
----------
- free: views and aliases, `getitem`, factories without tensor inputs, constants, symbolic ints;
- cheap (recomputed at any budget): pointwise ops, broadcasts, copies, concatenation, normalisations,
  softmax, pooling and other ops that write about as much as they read;
- expensive (not recomputed at budget 1): matmul (mm, bmm, addmm, baddbmm, matmul, linear, ...),
  convolutions, attention kernels, and *large reductions* - any other op that reads more than
  `LARGE_REDUCTION_RATIO` (8) times the elements it writes;
- kept like expensive ops (saved at budget 1, a lower budget may recompute them): cheap values a
  backward matmul reads that are computed from a large reduction's output - LayerNorm's output
  feeding a linear layer, softmax probabilities feeding attention's second matmul. The forward
  writes them anyway; recomputing one costs the backward a kernel Inductor can fuse with neither
  the matmul nor the normalisation's backward (upstream never recomputes any value a backward
  matmul reads; for a GELU output that measured slower here, so the rule stays this narrow);
- saved, never recomputed: cheap values the forward computes anyway whose bytes are at most
  `NEGLIGIBLE_FRACTION` (1/1024) of the graph's largest value (a shifted label row, a log-sum-exp
  row). Recomputing one frees nothing measurable, but it grows the backward's fused kernels; past
  Inductor's `realize_opcount_threshold` a loss kernel writes its float32 intermediate to memory;
- never recomputed: graph inputs, random ops (`nondeterministic_seeded`: bernoulli, native_dropout,
  rand*, randn*, ...), ops with data-dependent output shapes, unknown callables.

The memory budget
-----------------
`memory_budget` (0..1) picks a point between two solutions: 1 is the min-cut above (B1 saved
bytes); 0 is the min-cut where every legal op may be recomputed, expensive ones included (B0 bytes:
in practice the graph inputs the backward needs plus random-op outputs; a smaller set of values if
one determines the backward). The *requested point* for a budget b is

    target(b) = B0 + b * (B1 - B0) bytes        (saved bytes as the forward's graph outputs count them)

and a plan is *on target* when its saved bytes are within 5% of (B1 - B0) of it. Budget 1 and 0 are
the two ends exactly. In between we choose from a menu of exact min-cuts, each one a set of
expensive nodes "unlocked" for recomputation plus, optionally, cheap values "forced" to be saved:

- knapsack plans: for each point of a fixed grid (5%, 10%, ... 95% of the range), a min-FLOPs set of
  expensive nodes whose estimated freed bytes reach it (dynamic programming; every value saved at
  budget 1 is credited to the expensive nodes it is recomputable from through cheap ops);
- fix-ups, where no plan is within 2% of a grid point: from the nearest plan above it, unlock one
  more expensive node; from the nearest plan below it, lock one again, or save one more cheap value
  of about the missing size that the plan recomputes (an intermediate of a chain instead of its
  matmul output: finer steps than whole matmuls); two rounds.

Of plans within 0.5% of the range of each other only the cheapest (FLOPs) is offered. The menu does
not depend on the budget asked for. A request takes the offered plan with the fewest recompute FLOPs
among those within 2% of the range of `target(b)`; if there is none, the nearest plan (fewest FLOPs
on a tie). That rank, (distance beyond 2%, FLOPs, bytes), is convex in (bytes - target), so as the
budget falls the saved bytes never grow. Since every request is within 2.5% of a grid point, a
request is missed by more than 5% only where the menu has nothing closer - in practice where the
range is made of a few indivisible tensors (an MLP whose hidden activations all have one size moves
in steps of 1/3; a CNN whose activations are multiples of 1/7 of the range cannot reach 1/2). Then
*activation splitting* (`partition_split.land_by_splitting`) lands between the two nearest plans:
one value X that the plan below recomputes and the backward reads, provably row-separable along
dim 0, is computed as `cat([op(A[:m]), op(A[m:])])` in a copy of the joint graph; the head is forced
saved (its own m-row tensor, not a view of X) and the tail recomputed in the backward, so the plan
saves the plan below plus m rows of X, with m chosen to land on the request. X depends only on the
two plans around the request, m grows with it, and the split plan is solved exactly and taken only
if it saves what was predicted, so the saved bytes stay monotone (`PartitionInfo.split` says what
was split). If nothing can be split, the nearest whole plan is taken, and
`PartitionInfo.nearest_plans` gives the explored plans around the request. Matmuls, convolutions
and attention are recomputed only when the budget asks for fewer bytes than cheap recomputation
reaches (B1 is taken for any request within 2% of it); landing near
the request may take a plan that recomputes more for more bytes than another one
(`PartitionInfo.dominated`).

FLOPs estimates: `2*M*N*K` for matmuls (batch included), `2 * out_elems * in_channels/groups *
kernel_elems` for convolutions, `2*B*H*L*S*(E+Ev)` for attention, and the number of elements read
or written (the larger) for everything else.

Policies
--------
`policy` is a callable `policy(node) -> CheckpointPolicy | None` or one of the names in `POLICIES`.
A node's decision is the policy's answer, else the `torch.utils.checkpoint` selective-checkpoint tag
on the node (`node.meta["recompute"]`), else the op-class default above:

- MUST_SAVE: never recomputed (any budget); PREFER_SAVE: treated as expensive (budget may lift it);
- MUST_RECOMPUTE: never saved unless nothing else is possible; PREFER_RECOMPUTE: recomputable at
  budget 1, expensive ops included (vanilla activation checkpointing).

Random ops are never recomputed, whatever the policy says: their randomness would not be replayed.
`checkpoint_name(x, name)` names a value in user code; `save_only_these_names`, `save_names` and
`recompute_names` act on those names. A decision on a view applies to its base.

`torch.utils.checkpoint.checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy_fn))`,
traced by make_fx, leaves the policy function's answer in `node.meta["recompute"]` on every node the
checkpointed region creates (forward ops; the backward reuses them through `detach` nodes).

Side effects (effect-token sinks, backward mutations of inputs) run where `partition.side_effects`
puts them; the partition info is attached to both modules as `meta["aotgrad_partition"]`.

Modules: this one holds the entry points and `PartitionInfo`; op costs and classes are in
partition/ops.py, the policies in partition/policies.py, the joint graph as a cut problem in
partition/graph.py, the memory budget in partition/budget.py, activation splitting in partition/split.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule

from .budget import BUDGET_TOLERANCE, _choose
from .default import _order_saved, extract_graph, symbol_bindings
from .graph import _Joint, _recomputed
from .ops import checkpoint_name, checkpoint_names, estimate_flops, is_matmul_like, op_class, tensor_nbytes
from .order import sink_recomputation
from .policies import (
    POLICIES,
    Policy,
    _resolve_policy,
    recompute_names,
    save_everything,
    save_matmuls,
    save_names,
    save_nothing,
    save_only_these_names,
)
from .scatters import nest_zero_scatters

__all__ = [
    "POLICIES",
    "PartitionInfo",
    "checkpoint_name",
    "checkpoint_names",
    "estimate_flops",
    "is_matmul_like",
    "min_cut_rematerialization_partition",
    "mincut_partitioner",
    "op_class",
    "recompute_names",
    "save_everything",
    "save_matmuls",
    "save_names",
    "save_nothing",
    "save_only_these_names",
    "tensor_nbytes",
]

INFO_KEY = "aotgrad_partition"


@dataclass
class PartitionInfo:
    """What the partitioner decided, attached to the forward module as `fw_module.meta['aotgrad_partition']`."""

    saved: list[str]
    saved_bytes: int
    recomputed: list[tuple[str, str]]  # (node name, op class) of forward nodes the backward recomputes
    memory_budget: float | None = None
    policy: str | None = None
    bytes_at_budget_1: int | None = None
    bytes_at_budget_0: int | None = None
    requested_bytes: int | None = None
    unlocked: list[str] = field(default_factory=list)  # expensive nodes the budget lets us recompute
    forced: list[str] = field(default_factory=list)  # cheap values saved to land nearer the request
    cuts_solved: int = 0
    # The saved bytes of the explored plans nearest the request, at or below it and above it: where
    # the chosen plan misses the request by more than 5%, no plan was found in between.
    nearest_plans: tuple[int | None, int | None] = (None, None)
    dominated: bool = False  # another explored plan saves fewer bytes for no more FLOPs
    # Activation splitting (partition_split): {"value": name, "rows_saved": m, "rows": n} where the
    # first m of n rows of one value are saved and the rest recomputed; None for a whole-tensor plan.
    split: dict | None = None

    @property
    def achieved_fraction(self) -> float | None:
        """Where the saved bytes landed between budget 0 (0.0) and budget 1 (1.0)."""
        if self.bytes_at_budget_1 is None or self.bytes_at_budget_0 is None:
            return None
        span = self.bytes_at_budget_1 - self.bytes_at_budget_0
        return 1.0 if span <= 0 else (self.saved_bytes - self.bytes_at_budget_0) / span

    @property
    def on_target(self) -> bool | None:
        """Saved bytes within 5% of the budget-0..1 range from the requested point (None: no budget)."""
        if self.requested_bytes is None or self.bytes_at_budget_1 is None or self.bytes_at_budget_0 is None:
            return None
        span = self.bytes_at_budget_1 - self.bytes_at_budget_0
        return abs(self.saved_bytes - self.requested_bytes) <= BUDGET_TOLERANCE * span + 1

    @property
    def recomputed_matmuls(self) -> int:
        return sum(cls in ("matmul", "conv", "attention") for _, cls in self.recomputed)


# ------------------------------------------------------------------------------------------------
# The partitioner.
# ------------------------------------------------------------------------------------------------


def min_cut_rematerialization_partition(
    joint_module: GraphModule,
    joint_inputs: Any = None,
    *,
    num_fwd_outputs: int,
    memory_budget: float | None = None,
    policy: str | Policy | None = None,
    **_ignored: Any,
) -> tuple[GraphModule, GraphModule]:
    """Split the joint graph, saving the fewest bytes the backward needs (see the module docstring).

    `memory_budget` in [0, 1] trades recomputation for memory (None or 1: recompute only cheap ops;
    0: recompute everything legal). `policy` is a callable `node -> CheckpointPolicy | None` or a name
    from `POLICIES` ('save_everything', 'save_nothing', 'save_matmuls', ...).
    """
    if memory_budget is not None and not (0.0 <= float(memory_budget) <= 1.0):
        raise ValueError(f"memory_budget must be in [0, 1], got {memory_budget}")
    resolved = _resolve_policy(policy)
    j = _Joint(joint_module, num_fwd_outputs, resolved)
    j, saved, extra = _choose(j, None if memory_budget is None else float(memory_budget))
    saved = _order_saved(j.graph, list(saved) + symbol_bindings(j.graph, saved, j.tangents))
    fw_module = extract_graph(j.graph, j.primals, list(j.fw_outs) + saved, j.fw_effects)
    bw_module = extract_graph(j.graph, saved + j.tangents, list(j.bw_outs), j.bw_effects)
    bw_module = sink_recomputation(nest_zero_scatters(bw_module))
    info = PartitionInfo(
        saved=[n.name for n in saved],
        saved_bytes=j.saved_bytes(saved),
        recomputed=[(n.name, op_class(n)) for n in _recomputed(j, saved)],
        memory_budget=memory_budget,
        policy=None if policy is None else (policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))),
        **extra,
    )
    fw_module.meta[INFO_KEY] = info
    bw_module.meta[INFO_KEY] = info
    return fw_module, bw_module


def mincut_partitioner(memory_budget: float | None = None, policy: str | Policy | None = None) -> Callable:
    """`min_cut_rematerialization_partition` with a budget and/or policy bound, for `partition_fn=`."""
    if memory_budget is not None and not (0.0 <= float(memory_budget) <= 1.0):
        raise ValueError(f"memory_budget must be in [0, 1], got {memory_budget}")
    _resolve_policy(policy)
    fn = functools.partial(min_cut_rematerialization_partition, memory_budget=memory_budget, policy=policy)
    shown = policy if policy is None or isinstance(policy, str) else getattr(policy, "__name__", repr(policy))
    fn.__name__ = f"mincut_partitioner(memory_budget={memory_budget}, policy={shown!r})"  # type: ignore[attr-defined]
    return fn
