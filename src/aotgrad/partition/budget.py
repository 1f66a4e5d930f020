"""The memory budget: between the cheapest and the smallest cut, a menu of cuts (`_Menu`, knapsack over
the unlockable recomputations) and the choice of the one nearest the requested bytes (`_choose`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch.fx import Node

from .graph import _Candidate, _candidate, _Joint, _recomputed
from .split import land_by_splitting

BUDGET_TOLERANCE = 0.05
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
