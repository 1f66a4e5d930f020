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
hints), then a small tie-break. Among cuts of equal bytes we prefer (1) saving values a fusing
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
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .capture_state import BACKWARD_MUTATION
from .partition import (
    _ancestors,
    _descendants,
    _flat_outputs,
    _order_saved,
    extract_graph,
    reads_of_mutated_in_graph,
    side_effects,
    symbol_bindings,
)

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

NAME_KEY = "aotgrad_checkpoint_names"
INFO_KEY = "aotgrad_partition"
LARGE_REDUCTION_RATIO = 8
BUDGET_TOLERANCE = 0.05
_SCALE = 1 << 22  # bytes are worth more than any sum of tie-breaks
_SOURCE, _SINK = "source", "sink"

# ------------------------------------------------------------------------------------------------
# checkpoint_name: a name on a value, recorded on the node that produces it while tracing.
# ------------------------------------------------------------------------------------------------


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Name the value `x` for name-based policies; returns `x` itself (an identity in eager).

    While aotgrad (or any `make_fx`-based tracer) traces the program, the name is recorded on the
    graph node that computes `x` (`node.meta["aotgrad_checkpoint_names"]`); nothing is added to the
    graph, so gradients are those of eager by construction.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"checkpoint_name expects a tensor, got {type(x).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name expects a str name, got {type(name).__name__}")
    node = _traced_node(x)
    if node is not None:
        names = node.meta.get(NAME_KEY, ())
        if name not in names:
            node.meta[NAME_KEY] = (*names, name)
    return x


def _traced_node(x: torch.Tensor) -> Node | None:
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return None
    inner = x
    if isinstance(inner, FunctionalTensor):
        torch._sync(inner)
        inner = torch._from_functional_tensor(inner.elem)
    slot = get_proxy_slot(inner, mode.tracer, default=None)
    proxy = getattr(slot, "proxy", None)
    return getattr(proxy, "node", None)


def checkpoint_names(node: Node) -> tuple[str, ...]:
    """The names `checkpoint_name` gave the value of `node` (empty if none)."""
    return tuple(node.meta.get(NAME_KEY, ()))


# ------------------------------------------------------------------------------------------------
# Sizes, op classes and FLOPs.
# ------------------------------------------------------------------------------------------------


def _hint(n: Any, fallback: int = 4096) -> int:
    if isinstance(n, int):
        return n
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        try:
            return int(optimization_hint(n, fallback=fallback))
        except Exception:
            return fallback
    return int(n)


def _numel(t: torch.Tensor) -> int:
    return math.prod(_hint(s) for s in t.shape)


def tensor_nbytes(val: Any) -> int:
    """Bytes of a node value: shape x itemsize for tensors (summed over tuples), 8 for a symbolic int."""
    if isinstance(val, torch.Tensor):
        return _numel(val) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_nbytes(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return 8
    return 0


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _tensor_args(node: Node) -> list[torch.Tensor]:
    return [v for v in (_val(a) for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]


def _out_tensors(node: Node) -> list[torch.Tensor]:
    v = _val(node)
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_MATMUL = {
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear",
    "_int_mm", "_scaled_mm", "einsum", "tensordot", "_weight_int8pack_mm", "_weight_int4pack_mm",
}
_CONV = {
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "cudnn_convolution", "cudnn_convolution_transpose", "mkldnn_convolution",
    "miopen_convolution", "_slow_conv2d_forward", "slow_conv3d_forward", "thnn_conv2d",
    "convolution_overrideable", "_nnpack_spatial_convolution",
}
_EXPENSIVE = frozenset({"matmul", "conv", "attention", "reduction"})
_NEVER = frozenset({"input", "random", "fixed"})


def _packet_name(target: Any) -> str:
    return getattr(getattr(target, "overloadpacket", None), "__name__", getattr(target, "__name__", ""))


def _is_view_op(target: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


@functools.cache
def _target_class(target: torch._ops.OpOverload) -> str:
    tags = set(target.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return "fixed"
    if target._schema.is_mutable:
        return "fixed"
    if _is_view_op(target):
        return "view"
    name = _packet_name(target)
    if name in _MATMUL:
        return "matmul"
    if name in _CONV:
        return "conv"
    if "attention" in name:
        return "attention"
    if torch.Tag.pointwise in tags:
        return "pointwise"
    return "other"


def op_class(node: Node) -> str:
    """'input', 'view', 'free', 'pointwise', 'cheap', 'matmul', 'conv', 'attention', 'reduction',
    'random' or 'fixed' (see the module docstring)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "free"
    if node.op != "call_function":
        return "fixed"
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return "view" if isinstance(parent, Node) and op_class(parent) == "view" else "free"
    val = _val(node)
    number = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))
    if not isinstance(target, torch._ops.OpOverload):
        return "free" if number else "fixed"  # symbolic arithmetic, or an unknown callable
    cls = _target_class(target)
    if cls in ("random", "fixed", "view"):
        return cls
    if number:
        return "free"  # sym_size, sym_numel...
    if val is None:
        return "fixed"  # no output: an op run for its effect
    if cls != "other":
        return cls
    ins, outs = _tensor_args(node), _out_tensors(node)
    if not ins:
        return "free"  # a factory: zeros, full, arange, scalar_tensor...
    read = sum(_numel(t) for t in ins)
    written = sum(_numel(t) for t in outs)
    if read > LARGE_REDUCTION_RATIO * max(written, 1):
        return "reduction"
    return "cheap"


def is_matmul_like(node: Node) -> bool:
    """A matmul, convolution or attention op (what `save_matmuls` saves)."""
    return node.op == "call_function" and op_class(node) in ("matmul", "conv", "attention")


def estimate_flops(node: Node) -> int:
    """A rough FLOP count for computing `node` once (see the module docstring)."""
    cls = op_class(node)
    if cls in ("input", "view", "free"):
        return 0
    ins, outs = _tensor_args(node), _out_tensors(node)
    out_numel = sum(_numel(t) for t in outs)
    name = _packet_name(node.target)
    try:
        if cls == "matmul":
            args = [_val(a) for a in node.args if isinstance(a, Node)]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name in ("addmm", "baddbmm", "addbmm", "addmv"):
                tensors = tensors[1:]
            if name in ("dot", "vdot"):
                return 2 * _numel(tensors[0])
            k = _hint(tensors[0].shape[-1]) if tensors and tensors[0].dim() else 1
            return 2 * out_numel * k
        if cls == "conv":
            x, w = _val(node.args[0]), _val(node.args[1])
            per_out = _numel(w) // max(_hint(w.shape[0]), 1)
            transposed = name.startswith("conv_transpose") or (
                name in ("convolution", "_convolution") and len(node.args) > 6 and bool(node.args[6])
            )
            return 2 * (_numel(x) if transposed else out_numel) * per_out
        if cls == "attention":
            q, k, v = (_val(a) for a in node.args[:3])
            lq, s = _hint(q.shape[-2]), _hint(k.shape[-2])
            batch = _numel(q) // max(lq * _hint(q.shape[-1]), 1)
            return 2 * batch * lq * s * (_hint(q.shape[-1]) + _hint(v.shape[-1]))
    except (AttributeError, IndexError, TypeError):
        pass
    return max(sum(_numel(t) for t in ins), out_numel)


# ------------------------------------------------------------------------------------------------
# Policies.
# ------------------------------------------------------------------------------------------------

Policy = Callable[[Node], "CheckpointPolicy | None"]


def save_everything(node: Node) -> CheckpointPolicy | None:
    """Recompute nothing: every forward value the backward reads is saved (views aside)."""
    return CheckpointPolicy.MUST_SAVE


def save_nothing(node: Node) -> CheckpointPolicy | None:
    """Save only graph inputs (and random-op outputs); recompute everything else."""
    return CheckpointPolicy.MUST_RECOMPUTE


def save_matmuls(node: Node) -> CheckpointPolicy | None:
    """Save only matmul / convolution / attention outputs (JAX's `dots_saveable`)."""
    return CheckpointPolicy.MUST_SAVE if is_matmul_like(node) else CheckpointPolicy.MUST_RECOMPUTE


def save_only_these_names(*names: str) -> Policy:
    """Save only values named with `checkpoint_name` in `names`; recompute everything else."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        if wanted.intersection(checkpoint_names(node)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    policy.__name__ = f"save_only_these_names{tuple(names)}"
    return policy


def save_names(*names: str) -> Policy:
    """Never recompute the values named in `names`; the rest is the default min-cut."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        return CheckpointPolicy.MUST_SAVE if wanted.intersection(checkpoint_names(node)) else None

    policy.__name__ = f"save_names{tuple(names)}"
    return policy


def recompute_names(*names: str) -> Policy:
    """Always recompute the values named in `names` (even matmuls); the rest is the default min-cut."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        return CheckpointPolicy.MUST_RECOMPUTE if wanted.intersection(checkpoint_names(node)) else None

    policy.__name__ = f"recompute_names{tuple(names)}"
    return policy


POLICIES: dict[str, Policy | None] = {
    "default": None,
    "save_everything": save_everything,
    "save_all": save_everything,
    "everything_saveable": save_everything,
    "save_nothing": save_nothing,
    "recompute_all": save_nothing,
    "nothing_saveable": save_nothing,
    "save_matmuls": save_matmuls,
    "dots_saveable": save_matmuls,
}


def _resolve_policy(policy: str | Policy | None) -> Policy | None:
    if policy is None or callable(policy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown partition policy {policy!r}; known: {sorted(POLICIES)}") from None


_SAVE_LIKE = {
    CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
}


def _decision(node: Node, policy: Policy | None) -> CheckpointPolicy | None:
    d = policy(node) if policy is not None else None
    if d is None:
        d = node.meta.get("recompute")
    if isinstance(d, bool):  # torch's old boolean form: True = save
        d = CheckpointPolicy.MUST_SAVE if d else CheckpointPolicy.PREFER_RECOMPUTE
    if not isinstance(d, CheckpointPolicy):
        return None
    return _SAVE_LIKE.get(d, d)


# ------------------------------------------------------------------------------------------------
# The joint graph, analysed once.
# ------------------------------------------------------------------------------------------------


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


class _Joint:
    def __init__(self, joint: GraphModule, num_fwd_outputs: int, policy: Policy | None):
        graph = joint.graph
        self.joint = joint
        self.graph = graph
        self.num_fwd_outputs, self.policy = num_fwd_outputs, policy
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.primals = [n for n in placeholders if not n.name.startswith("tangents")]
        self.tangents = [n for n in placeholders if n.name.startswith("tangents")]
        outs = _flat_outputs(graph)
        self.fw_outs, self.bw_outs = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
        # Impure nodes nothing reads (effect-token sinks, backward mutations) run in the graph
        # whose values they depend on; backward mutations always in the backward.
        fw_effects, bw_effects = side_effects(graph, _descendants(self.tangents))
        tagged = [n for n in graph.nodes if n.meta.get(BACKWARD_MUTATION)]
        self.bw_effects = bw_effects + [n for n in tagged if n not in bw_effects]
        self.fw_effects = [n for n in fw_effects if n not in self.bw_effects]
        backward = _descendants(self.tangents + self.bw_effects)
        self.backward = backward
        self.fw_needed = _ancestors(list(self.fw_outs) + self.fw_effects)
        if self.fw_needed & backward:
            bad = sorted(n.name for n in self.fw_needed & backward)[:5]
            raise RuntimeError(f"aotgrad min-cut: forward outputs depend on tangents ({bad})")
        required: set[Node] = set()
        for n in graph.nodes:
            if n in backward and n.op not in ("placeholder", "output"):
                required.update(a for a in n.all_input_nodes if a not in backward)
        required.update(o for o in self.bw_outs if isinstance(o, Node) and o not in backward)
        self.required = required
        region = _ancestors(required)
        self.region = [n for n in graph.nodes if n in region]
        self.index = {n: i for i, n in enumerate(self.region)}
        self.cls = {n: op_class(n) for n in self.region}
        for n in reads_of_mutated_in_graph(graph):
            if n in self.cls and self.cls[n] not in ("input", "view"):
                self.cls[n] = "fixed"  # its value depends on when it runs: save it
        self.bytes = {n: tensor_nbytes(_val(n)) for n in self.region}
        self._decide(policy)
        self._costs()

    # -- decisions -----------------------------------------------------------------------------

    def _decide(self, policy: Policy | None) -> None:
        decisions: dict[Node, CheckpointPolicy] = {}
        for n in self.region:
            if self.cls[n] == "input":
                continue
            d = _decision(n, policy)
            if d is not None:
                decisions[n] = d
        # A decision on a view applies to its base; a save decision on a getitem to the op.
        for n in self.region:
            d = decisions.get(n)
            if d is None:
                continue
            if self.cls[n] == "view":
                base = n
                while isinstance(base, Node) and self.cls.get(base) == "view" and base.args:
                    base = base.args[0]
                if isinstance(base, Node) and base in self.cls and self.cls[base] != "input":
                    decisions.setdefault(base, d)
                    if checkpoint_names(n):  # an explicit name on the view wins
                        decisions[base] = d
            elif n.target is operator.getitem and isinstance(n.args[0], Node) and n.args[0] in self.cls:
                parent = n.args[0]
                if d in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                    decisions.setdefault(parent, d)
                else:
                    decisions.setdefault(parent, CheckpointPolicy.PREFER_RECOMPUTE)
        self.decisions = decisions

        pinned, items, unsaveable = set(), [], set()
        kept_for_matmul = self._normalised_matmul_operands()
        for n in self.region:
            cls, d = self.cls[n], decisions.get(n)
            if cls == "view" or n.op == "get_attr":
                continue  # always rebuilt for free, never saved
            if cls in _NEVER:
                pinned.add(n)
            elif d == CheckpointPolicy.MUST_SAVE:
                # Computing a value the forward does not need in the backward is no recomputation.
                if n in self.fw_needed or cls in _EXPENSIVE:
                    pinned.add(n)
            elif d == CheckpointPolicy.PREFER_SAVE or (
                cls in _EXPENSIVE and d not in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
            ):
                items.append(n)
            elif d is None and n in kept_for_matmul:
                items.append(n)
            if d == CheckpointPolicy.MUST_RECOMPUTE and cls != "input":
                unsaveable.add(n)
        self.pinned = pinned
        self.soft_unsaveable = unsaveable
        # The knapsack order: FLOPs of recomputing per byte it frees, cheapest first.
        self.flops = {n: estimate_flops(n) for n in items}

        def ratio(n: Node) -> tuple[float, int]:
            extra = self.flops[n] if n in self.fw_needed else 0
            return (extra / max(self.bytes[n], 1), -self.index[n])

        self.items = sorted(items, key=ratio)
        self.item_set = set(items)

    def _normalised_matmul_operands(self) -> set[Node]:
        """Cheap values a backward matmul reads (directly or through views) that are computed from
        a large reduction's output: a normalised activation feeding a linear layer, softmax
        probabilities feeding attention's second matmul. Recomputing one saves its bytes but costs
        the backward a kernel of its own: Inductor fuses the recomputation neither into the matmul
        nor into the normalisation's backward reduction, and the forward wrote the value anyway.
        Measured: one C++ kernel fewer per layer type, cold compile -8% on mlp and -6% on GPT-2.
        A pointwise function of a matmul output (GELU) stays recomputable: saving it measured
        slower, and its recomputation fuses with the activation's backward."""
        through = ("pointwise", "cheap", "view", "free")
        from_reduction: set[Node] = set()  # computed, through cheap ops only, from a large reduction
        for n in self.region:
            if self.cls[n] in through and any(
                a in self.cls and (self.cls[a] == "reduction" or a in from_reduction) for a in n.all_input_nodes
            ):
                from_reduction.add(n)
        return {
            n for n in from_reduction
            if self.cls[n] in ("pointwise", "cheap") and self._read_by_backward_matmul(n)
        }

    def _read_by_backward_matmul(self, n: Node) -> bool:
        todo = [n]
        while todo:
            for u in todo.pop().users:
                if u.op != "call_function":
                    continue
                if op_class(u) == "view":
                    todo.append(u)
                elif u in self.backward and is_matmul_like(u):
                    return True
        return False

    # -- the cut network -----------------------------------------------------------------------

    def _materialized(self, n: Node) -> bool:
        if n.op == "placeholder" or n in self.fw_out_set:
            return True
        cls = self.cls[n]
        if cls in _EXPENSIVE or cls in _NEVER or n.target is operator.getitem:
            return True
        return any(u.op == "call_function" and op_class(u) in _EXPENSIVE for u in n.users)

    def _costs(self) -> None:
        self.fw_out_set = {o for o in self.fw_outs if isinstance(o, Node)}
        total = sum(self.bytes.values()) + 1
        big = (total + 1) * _SCALE * 4  # a MUST_RECOMPUTE value is saved only if nothing else works
        cost: dict[Node, int | None] = {}
        for n in self.region:
            val = _val(n)
            saveable = (
                self.cls[n] != "view"
                and n.op != "get_attr"
                and ("val" not in n.meta or isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)))
            )
            if not saveable:
                cost[n] = None
                continue
            tie = 1 + (0 if self._materialized(n) else 2)
            c = self.bytes[n] * _SCALE + tie
            cost[n] = big + c if n in self.soft_unsaveable else c
        self.cost = cost
        g = nx.DiGraph()
        for n in self.region:
            i = self.index[n]
            if cost[n] is None:
                g.add_edge(2 * i, 2 * i + 1)
            else:
                g.add_edge(2 * i, 2 * i + 1, capacity=cost[n])
            for u in n.users:
                j = self.index.get(u)
                if j is not None:
                    g.add_edge(2 * i + 1, 2 * j)
            if n in self.required:
                g.add_edge(2 * i + 1, _SINK)
        self.network = g

    def solve(self, unlocked: Iterable[Node] = (), tie: str = "sink", forced: Iterable[Node] = ()) -> list[Node]:
        """Saved nodes of the min cut where the knapsack items in `unlocked` may be recomputed and
        the nodes in `forced` may not (they are saved if the backward needs them)."""
        if not self.required:
            return []
        g = self.network.copy()
        free, kept = set(unlocked), set(forced)
        for n in self.region:
            if n in self.pinned or n in kept or (n in self.item_set and n not in free):
                g.add_edge(_SOURCE, 2 * self.index[n])
        if _SOURCE not in g:
            g.add_node(_SOURCE)
        try:
            residual = nx.algorithms.flow.boykov_kolmogorov(g, _SOURCE, _SINK, capacity="capacity")
        except nx.NetworkXUnbounded as e:
            raise RuntimeError(
                "aotgrad min-cut: no valid partition - the backward needs a value that may neither be "
                "saved nor recomputed (a policy conflict)"
            ) from e
        source_side = _source_side(residual, tie)
        saved = []
        for n in self.region:
            i = self.index[n]
            if (2 * i in source_side) and (2 * i + 1 not in source_side):
                saved.append(n)
        return saved

    def saved_bytes(self, saved: Sequence[Node]) -> int:
        # Symbol bindings (partition.symbol_bindings) join after the cut, outside the region.
        return sum(self.bytes[n] if n in self.bytes else tensor_nbytes(_val(n)) for n in saved)

    def forceable(self, n: Node) -> bool:
        """May `n` be kept from recomputation (saved instead) by a fix-up move? Any value the cut
        may save at its plain byte cost: not a view, not MUST_RECOMPUTE, not already pinned."""
        return (
            n not in self.pinned
            and n not in self.item_set
            and n not in self.soft_unsaveable
            and self.cost.get(n) is not None
            and self.bytes[n] > 0
        )


def _source_side(residual: nx.DiGraph, tie: str) -> set:
    """Source side of a minimum cut: the smallest one (tie='source': recompute the most) or the
    largest one (tie='sink': recompute the least)."""
    def open_edge(u, v) -> bool:
        e = residual[u][v]
        return e["capacity"] - e["flow"] > 0

    if tie == "source":
        seen = {_SOURCE}
        stack = [_SOURCE]
        while stack:
            u = stack.pop()
            for v in residual.successors(u):
                if v not in seen and open_edge(u, v):
                    seen.add(v)
                    stack.append(v)
        return seen
    sink_side = {_SINK}
    stack = [_SINK]
    while stack:
        v = stack.pop()
        for u in residual.predecessors(v):
            if u not in sink_side and open_edge(u, v):
                sink_side.add(u)
                stack.append(u)
    return set(residual.nodes) - sink_side


# ------------------------------------------------------------------------------------------------
# Building the two modules.
# ------------------------------------------------------------------------------------------------


def _recomputed(j: _Joint, saved: list[Node]) -> list[Node]:
    fw = _ancestors(list(j.fw_outs) + saved + j.fw_effects, stop=set(j.primals))
    boundary = set(saved) | set(j.tangents)
    bw = _ancestors(list(j.bw_outs) + j.bw_effects, stop=boundary) - boundary
    return [n for n in j.graph.nodes if n.op == "call_function" and n in fw and n in bw]


# ------------------------------------------------------------------------------------------------
# The partitioner.
# ------------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    unlocked: tuple[Node, ...]  # knapsack items the backward may recompute
    saved: list[Node]
    bytes: int
    flops: int  # estimated FLOPs of everything the backward recomputes
    forced: tuple[Node, ...] = ()  # cheap values saved although the cut would recompute them

    @property
    def key(self) -> tuple:
        return (frozenset(self.unlocked), frozenset(self.forced))


def _candidate(j: _Joint, unlocked: Iterable[Node], tie: str = "sink", forced: Iterable[Node] = ()) -> _Candidate:
    unlocked, forced = tuple(unlocked), tuple(forced)
    saved = j.solve(unlocked, tie, forced)
    flops = sum(estimate_flops(n) for n in _recomputed(j, saved))
    return _Candidate(unlocked, saved, j.saved_bytes(saved), flops, forced)


_GRID = tuple(i / 20 for i in range(1, 20))  # the menu aims at these fractions of the range
_BUCKETS = 400
_MOVES = 4  # fix-up moves tried per kind and round, the most promising first
_ROUNDS = 2
_SNAP = 0.02  # plans this close to the request (fraction of the range) count as on it
_CLUSTER = 0.005  # of plans this close to each other (fraction of the range) only the cheapest is offered


def _knapsack(values: list[int], costs: list[int], needs: Iterable[int], unit: float) -> dict[int, tuple[int, ...]]:
    """For each need: the indices of a min-cost subset whose values sum to at least `need`.
    Values are counted in buckets of `unit` bytes (rounded down, so the estimate stays conservative)."""
    units = [int(v // unit) for v in values]
    top = _BUCKETS + 1
    best = [0] + [math.inf] * top  # best[u]: min cost to cover at least u units
    take: list[list[bool]] = []
    for u_i, c_i in zip(units, costs):
        row = [False] * (top + 1)
        if u_i > 0:
            for u in range(top, 0, -1):
                c = best[max(0, u - u_i)] + c_i
                if c < best[u]:
                    best[u] = c
                    row[u] = True
        take.append(row)
    out: dict[int, tuple[int, ...]] = {}
    for need in needs:
        u = min(top, math.ceil(need / unit)) if need > 0 else 0
        while u <= top and best[u] == math.inf:
            u += 1
        if u > top:
            out[need] = tuple(range(len(values)))
            continue
        chosen = []
        for i in range(len(values) - 1, -1, -1):
            if take[i][u]:
                chosen.append(i)
                u = max(0, u - units[i])
        out[need] = tuple(sorted(chosen))
    return out


def _item_values(j: _Joint, saved: list[Node]) -> dict[Node, float]:
    """Estimated bytes that unlocking each knapsack item frees: every value saved at budget 1 is
    credited to the expensive nodes it is recomputable from through cheap ops (shared evenly)."""
    credit: dict[Node, float] = {}
    for s in saved:
        if s.op == "placeholder" or s in j.pinned:
            continue
        anchors, seen, stack = set(), set(), [s]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in j.item_set:
                anchors.add(n)
            elif n.op != "placeholder" and n not in j.pinned:
                stack.extend(a for a in n.all_input_nodes if a in j.index)
        for a in anchors:
            credit[a] = credit.get(a, 0.0) + j.bytes[s] / len(anchors)
    return credit


class _Menu:
    """The plans a budget can pick from: exact min-cuts, keyed by (unlocked items, forced saves).

    Built from the two ends and the grid alone - never from the budget asked for - so that picking
    from it (`pick`) is monotone in the budget."""

    def __init__(self, j: _Joint, top: _Candidate, bottom: _Candidate):
        self.j, self.top, self.bottom = j, top, bottom
        self.span = max(top.bytes - bottom.bytes, 0)
        self.plans: dict[tuple, _Candidate] = {top.key: top, bottom.key: bottom}
        self.credit = _item_values(j, top.saved)
        self._offered: list[_Candidate] | None = None

    def add(self, unlocked: Iterable[Node], forced: Iterable[Node] = ()) -> None:
        unlocked, forced = tuple(unlocked), tuple(forced)
        key = (frozenset(unlocked), frozenset(forced))
        if key not in self.plans:
            self.plans[key] = _candidate(self.j, unlocked, forced=forced)
            self._offered = None

    def offered(self) -> list[_Candidate]:
        """The plans a budget may pick: all but those with a cheaper plan (fewer FLOPs, or as many
        and fewer bytes) within `_CLUSTER` of the range of them - a few bytes nearer the request are
        not worth more recomputation. The ends are always offered."""
        if self._offered is None:
            near = _CLUSTER * self.span
            plans = sorted(self.plans.values(), key=lambda c: (c.flops, c.bytes, len(c.forced)))
            kept: list[_Candidate] = []
            for c in plans:
                if c in (self.top, self.bottom) or all(abs(c.bytes - d.bytes) > near for d in kept):
                    kept.append(c)
            self._offered = kept
        return self._offered

    def bytes_at(self, fraction: float) -> float:
        return self.bottom.bytes + fraction * self.span

    def nearest(self, goal: float) -> tuple[_Candidate | None, _Candidate | None]:
        """The plans with the most bytes at or below `goal` and the fewest above it (fewest FLOPs
        among equal bytes)."""
        below = [c for c in self.offered() if c.bytes <= goal]
        above = [c for c in self.offered() if c.bytes > goal]
        lo = max(below, key=lambda c: (c.bytes, -c.flops), default=None)
        hi = min(above, key=lambda c: (c.bytes, c.flops), default=None)
        return lo, hi

    # -- building ------------------------------------------------------------------------------

    def fill(self) -> None:
        """Knapsack plans for every grid point, then fix-up moves where a grid point is missed."""
        items = list(self.j.items)
        values = [int(self.credit.get(n, 0)) for n in items]
        costs = [self.j.flops[n] if n in self.j.fw_needed else 0 for n in items]
        needs = {g: int((1.0 - g) * self.span) for g in _GRID}
        picks = _knapsack(values, costs, set(needs.values()), unit=max(self.span / _BUCKETS, 1.0))
        for g in _GRID:
            self.add(items[i] for i in picks[needs[g]])
        slack = _SNAP * self.span  # a plan this close to every grid point meets any request within 5%
        for g in _GRID:
            goal = self.bytes_at(g)
            for _ in range(_ROUNDS):
                lo, hi = self.nearest(goal)
                if min(goal - lo.bytes if lo else math.inf, hi.bytes - goal if hi else math.inf) <= slack:
                    break
                self._fix_up(goal, lo, hi)

    def _fix_up(self, goal: float, lo: _Candidate | None, hi: _Candidate | None) -> None:
        """Plans between `lo` and `hi` (the nearest plans around `goal`), one step from either:
        unlock one more item in `hi`, lock one item of `lo` again, or save one more cheap value in
        `lo` (an intermediate the backward would otherwise recompute: finer than whole items)."""
        j = self.j
        if hi is not None:
            gap = hi.bytes - goal
            extra = [n for n in j.items if n not in hi.unlocked]
            for n in sorted(extra, key=lambda n: abs(self.credit.get(n, 0) - gap))[:_MOVES]:
                self.add((*hi.unlocked, n), hi.forced)
        if lo is not None:
            gap = goal - lo.bytes
            for n in sorted(lo.unlocked, key=lambda n: abs(self.credit.get(n, 0) - gap))[:_MOVES]:
                self.add((u for u in lo.unlocked if u is not n), lo.forced)
            held = set(lo.saved) | set(lo.forced)
            # Values of about the gap's size only: saving small ones creeps by a few bytes per cut.
            cheap = [n for n in _recomputed(j, lo.saved) if n not in held and j.forceable(n) and 2 * j.bytes[n] >= gap]
            for n in sorted(cheap, key=lambda n: (abs(j.bytes[n] - gap), j.index[n]))[:_MOVES]:
                self.add(lo.unlocked, (*lo.forced, n))

    # -- choosing ------------------------------------------------------------------------------

    def pick(self, target: float) -> _Candidate:
        """The plan for a request of `target` bytes: the fewest FLOPs among plans within half the
        tolerance of it (2.5% of the range: any of them is as good as on the point); if there are
        none, the nearest plan (fewest FLOPs on a tie).

        That is the minimum of (distance beyond the band, FLOPs, bytes). The distance beyond the
        band is a convex function of (bytes - target), so as the target falls a plan with more
        bytes can never overtake one with fewer: the saved bytes are monotone in the budget."""
        band = _SNAP * self.span

        def rank(c: _Candidate) -> tuple:
            return (max(0.0, abs(c.bytes - target) - band), c.flops, c.bytes, len(c.forced))

        return min(self.offered(), key=rank)


def _choose(j: _Joint, budget: float | None) -> tuple[_Joint, list[Node], dict]:
    """The joint graph to cut (the given one, or a copy with one value split in row blocks), the
    values to save, and what to report."""
    top = _candidate(j, ())
    extra: dict[str, Any] = {"cuts_solved": 1}
    if budget is None:
        return j, top.saved, extra
    bottom = _candidate(j, j.items, tie="source") if j.items else top
    menu = _Menu(j, top, bottom)
    target = menu.bytes_at(budget)
    extra.update(bytes_at_budget_1=top.bytes, bytes_at_budget_0=bottom.bytes, requested_bytes=int(round(target)))
    if budget >= 1.0 or budget <= 0.0 or menu.span == 0:
        chosen = bottom if budget <= 0.0 else top
        extra.update(unlocked=[n.name for n in chosen.unlocked], cuts_solved=2 if j.items else 1)
        return j, chosen.saved, extra
    menu.fill()
    chosen = menu.pick(target)
    lo, hi = menu.nearest(target)
    if abs(chosen.bytes - target) > BUDGET_TOLERANCE * menu.span and lo is not None and hi is not None:
        from .partition_split import land_by_splitting

        landed = land_by_splitting(j, lo, hi, target, chosen)
        if landed is not None:
            j, chosen, extra["split"] = landed
    extra.update(
        unlocked=[n.name for n in chosen.unlocked],
        forced=[n.name for n in chosen.forced],
        cuts_solved=len(menu.plans),
        nearest_plans=(None if lo is None else lo.bytes, None if hi is None else hi.bytes),
        dominated=any(c.bytes < chosen.bytes and c.flops <= chosen.flops for c in menu.offered()),
    )
    return j, chosen.saved, extra


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
