"""The joint graph as a min-cut problem: `_Joint` (forward region, required values, the flow network)
and cut candidates. Shared by partition/mincut.py, partition/budget.py and partition/split.py.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

if TYPE_CHECKING:
    import networkx as nx

from ..trace.state import BACKWARD_MUTATION
from .default import _ancestors, _descendants, _flat_outputs, reads_of_mutated_in_graph, side_effects
from .ops import (
    _EXPENSIVE,
    _NEVER,
    _val,
    checkpoint_names,
    estimate_flops,
    is_matmul_like,
    op_class,
    tensor_nbytes,
)
from .policies import Policy, _decision

_SCALE = 1 << 22  # bytes are worth more than any sum of tie-breaks
# A cheap forward value at most this fraction of the graph's largest value is saved, not recomputed:
# see `_Joint._negligible`.
NEGLIGIBLE_FRACTION = 1 / 1024
_SOURCE, _SINK = "source", "sink"


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
        kept_for_library = self._library_operands()
        negligible = self._negligible()
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
            elif d is None and n in negligible:
                pinned.add(n)
            elif d is None and n in kept_for_library:
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

    def _negligible(self) -> set[Node]:
        """Cheap values the forward computes anyway whose bytes are negligible beside the graph's
        largest value (a shifted label row, a row of log-sum-exps, a mask): recomputing one in the
        backward frees next to nothing, but it adds operations to the backward's fused kernels. A
        fused kernel past Inductor's size limit (`realize_opcount_threshold`) writes its
        intermediate to memory: on a language model's loss that is a float32 copy of the logits'
        gradient, which also keeps Inductor from writing the gradient over the donated logits
        (Llama-shaped, vocabulary 32,000, torch 2.11: activation peak 1.15x upstream's). Upstream's
        min-cut saves these values too."""
        largest = max(self.bytes.values(), default=0)
        return {
            n for n in self.region
            if self.cls[n] in ("pointwise", "cheap") and n in self.fw_needed
            and self.bytes[n] <= NEGLIGIBLE_FRACTION * largest
        }

    def _library_operands(self) -> set[Node]:
        """Cheap values a backward library op (matmul, convolution, attention) reads, directly or
        through views, that are computed from a large reduction's output: a normalised activation
        feeding a linear layer, softmax
        probabilities feeding attention's second matmul. Recomputing one saves its bytes but costs
        the backward a kernel of its own: Inductor fuses the recomputation neither into the matmul
        nor into the normalisation's backward reduction, and the forward wrote the value anyway.
        Measured: one C++ kernel fewer per layer type, cold compile -8% on mlp and -6% on GPT-2.
        A pointwise function of a matmul output (GELU) stays recomputable: saving it measured
        slower, and its recomputation fuses with the activation's backward.
        Values made from factories alone count too: a causal attention mask, made from `arange`
        and read by every layer's attention. Unsaved, the forward has no output of it, so Inductor
        writes it out for each attention kernel (GPT-2 on the pretend H100: 12 forward kernels of a
        4 MiB mask, where upstream saves it and writes it once), and the backward makes it again.
        A convolution's backward is such a reader too (ops._CONV): ResNet-50's ReLU outputs."""
        through = ("pointwise", "cheap", "view", "free")
        from_reduction: set[Node] = set()  # computed, through cheap ops only, from a large reduction
        from_nothing: set[Node] = set()  # computed from factories alone (a causal mask from arange)
        for n in self.region:
            if self.cls[n] not in through:
                continue
            if any(a in self.cls and (self.cls[a] == "reduction" or a in from_reduction) for a in n.all_input_nodes):
                from_reduction.add(n)
            elif all(a in from_nothing for a in n.all_input_nodes):
                from_nothing.add(n)
        return {
            n for n in from_reduction | from_nothing
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

    def _held_inputs(self) -> set[Node]:
        """Graph inputs that get no gradient (the batch, masks, buffers, frozen weights): data the
        caller holds through the step anyway, so saving one adds no bytes, where saving a value
        made from it (a LayerNorm's normalised input) adds its own. Inputs that get a gradient are
        charged: the budget's byte scale counts what the forward hands over, and a weight handed
        over only to recompute its matmul (budget 0) must not look free there."""
        if len(self.primals) != len(self.bw_outs):
            return set()
        return {p for p, g in zip(self.primals, self.bw_outs) if g is None}

    def _costs(self) -> None:
        self.fw_out_set = {o for o in self.fw_outs if isinstance(o, Node)}
        total = sum(self.bytes.values()) + 1
        big = (total + 1) * _SCALE * 4  # a MUST_RECOMPUTE value is saved only if nothing else works
        cost: dict[Node, int | None] = {}
        held = self._held_inputs()
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
            c = (0 if n in held else self.bytes[n] * _SCALE) + tie
            cost[n] = big + c if n in self.soft_unsaveable else c
        self.cost = cost
        import networkx as nx  # here: a warm start (cache hit) never partitions, so never pays its import

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
        import networkx as nx

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


def _recomputed(j: _Joint, saved: list[Node]) -> list[Node]:
    fw = _ancestors(list(j.fw_outs) + saved + j.fw_effects, stop=set(j.primals))
    boundary = set(saved) | set(j.tangents)
    bw = _ancestors(list(j.bw_outs) + j.bw_effects, stop=boundary) - boundary
    return [n for n in j.graph.nodes if n.op == "call_function" and n in fw and n in bw]


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
