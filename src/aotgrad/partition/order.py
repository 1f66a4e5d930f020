"""The order of the backward graph: each recomputed value made where the backward first needs it.

`extract_graph` copies nodes in joint order, and in the joint graph every forward op comes before
every backward op, so a backward graph that recomputes forward values (min-cut partitions) would
compute all of them at its start and hold them until their last use: its live peak would then be
above eager's, whose autograd engine recomputes nothing and frees each node's saved values as it
goes. `sink_recomputation` keeps the backward's own ops (those reading a tangent) and every op with
a side effect in their order and moves each other op to just before its first user, as the autograd
engine would run them (upstream calls the same idea `reordering_to_mimic_autograd_engine`).
Then a recomputed pointwise value read again late (a chain's link, read at once to make the next
link and late by its own derivative) is made again just before that late read, where its inputs are
alive there anyway, instead of being held in between (`_remake_for_late_users`); where its inputs
are not, a short chain of pointwise ops and views back to values that are (or to small ones held
for it: a normalisation's statistics) is remade with it, kept only where that lowers the backward's
simulated live peak (`_remake_chains_for_late_users`; each forward value remade by one chain at
most). A factory (a zero buffer) read by several stretches of the backward gets a copy per stretch
(`_remake_factories_for_late_users`). Last, recomputation that runs just before its user among the
backward's own values moves above a few backward ops where that lowers the simulated peak
(`_recompute_before_backward_allocations`).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from ..trace.state import BACKWARD_MUTATION
from .ops import op_class, tensor_nbytes

__all__ = ["REMADE_FROM", "sink_recomputation"]

# meta key of a value made again for its late users (either remake pass below): the name of the
# node it copies (the recomputed forward op: a count of the backward's recomputation counts copies).
REMADE_FROM = "aotgrad_remade_from"


def _anchored(node: Node, tangent_dependent: set[Node]) -> bool:
    """Ops that keep their place: the backward proper, side effects, random ops (their order is the
    random stream's order)."""
    if node.op != "call_function" or node in tangent_dependent:
        return node.op != "get_attr"
    if node.meta.get(BACKWARD_MUTATION) or node.is_impure():
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def sink_recomputation(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Reorder `gm` (a backward graph) in place so that ops not reading a tangent run just before
    their first user; everything else keeps its relative order; then remake cheap recomputed values
    for their late users (`_remake_for_late_users`). Returns `gm`."""
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    tangents = [n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if not tangents:
        return gm
    dependent: set[Node] = set()
    for n in nodes:  # graph order is topological: one pass marks every descendant
        if n in tangents or any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    emitted: set[Node] = set()
    order: list[Node] = []

    def emit_with_inputs(root: Node) -> None:
        todo, stack = [], [root]
        while stack:
            n = stack.pop()
            if n in emitted or n in todo:
                continue
            todo.append(n)
            stack.extend(a for a in n.all_input_nodes if a not in emitted)
        for n in sorted(todo, key=index.__getitem__):  # the original order is a topological one
            emitted.add(n)
            order.append(n)

    for n in nodes:
        if n.op == "placeholder" or n.op == "output" or _anchored(n, dependent):
            emit_with_inputs(n)
    assert len(order) == len(nodes), "aotgrad internal error: backward reordering lost nodes"
    moved = order != nodes
    if moved:
        cursor = order[0]
        for n in order[1:]:
            cursor.append(n)
            cursor = n
    remade = _remake_factories_for_late_users(graph, dependent)
    remade |= _remake_for_late_users(graph, dependent)
    remade |= _remake_chains_for_late_users(graph, dependent)
    if _recompute_before_backward_allocations(graph, dependent):
        # The peak moved: a chain not worth remaking at the old peak may lower the new one.
        remade = True
        if _remake_chains_for_late_users(graph, dependent):
            _recompute_before_backward_allocations(graph, dependent)
    if remade or moved:
        graph.lint()
        gm.recompile()
    return gm


def _remakeable(node: Node, dependent: set[Node]) -> bool:
    """A recomputed pointwise op with one tensor output: cheap to run again, its own storage."""
    return (node.op == "call_function" and node not in dependent and len(node.users) > 1
            and isinstance(node.meta.get("val"), torch.Tensor) and op_class(node) == "pointwise"
            and not _anchored(node, dependent))


def _remake_for_late_users(graph: torch.fx.Graph, dependent: set[Node]) -> bool:
    """Give the late users of a recomputed pointwise value their own copy of it, made just before
    them, where every input of the op is alive there anyway (read at or after that point).

    A recomputed chain (x -> sin -> cos -> ... in the forward) reads each link twice: at once, to
    make the next link, and late, where the backward reaches the link's own derivative. Held from
    the first read to the last, every link of the chain is alive when the backward starts on it:
    twice the bytes where the op's input would serve, since that input is kept for the backward's
    own late read. Made again from it, the value lives only around its late read. Only where
    backward work (an op reading a tangent) runs between two reads: the copy costs one pointwise op."""
    nodes = list(graph.nodes)
    pos: dict[Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    work_before = [0]
    for n in nodes:
        work_before.append(work_before[-1] + (n in dependent))

    def backward_work_between(a: Node, b: Node) -> bool:
        return work_before[int(pos[b])] - work_before[int(pos[a]) + 1] > 0

    def alive_at(value: Node, user: Node, skip: set[Node]) -> bool:
        if value.op == "get_attr":
            return True
        return any(w not in skip and pos[w] >= pos[user] for w in value.users)

    changed = False
    for n in nodes:
        if not _remakeable(n, dependent):
            continue
        users = sorted(n.users, key=pos.__getitem__)
        holder, copies = n, {n}
        for prev, u in zip(users, users[1:]):
            if not backward_work_between(prev, u):
                continue
            if not all(alive_at(a, u, copies) for a in n.all_input_nodes):
                continue
            with graph.inserting_before(u):
                copy = graph.node_copy(n)
            copy.meta = {**n.meta, REMADE_FROM: n.meta.get(REMADE_FROM, n.name)}
            pos[copy] = pos[u] - 0.5
            for w in users[users.index(u):]:
                w.replace_input_with(holder, copy)
            holder = copy
            copies.add(copy)
            changed = True
    return changed


def _remake_factories_for_late_users(graph: torch.fx.Graph, dependent: set[Node]) -> bool:
    """Give each late reader of a factory (`full`, `zeros`: no tensor input) its own copy, with the
    views between, made just before it. Common-subexpression elimination merges the zero buffers of
    every layer's gradient scatter (a decomposed `stack` / `select` backward) into one node, which
    the backward would then hold from the last layer's backward to the first's; a fill is cheaper
    than the bytes held throughout. Only where backward work runs between two reads."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    work_before = [0]
    for n in nodes:
        work_before.append(work_before[-1] + (n in dependent))
    changed = False
    for n in nodes:
        if (n.op != "call_function" or n.all_input_nodes or n in dependent or _anchored(n, dependent)
                or op_class(n) != "free" or not isinstance(n.meta.get("val"), torch.Tensor)):
            continue
        reads: list[tuple[Node, list[Node]]] = []  # (reader, the views from `n` to what it reads)
        stack: list[tuple[Node, list[Node]]] = [(n, [])]
        while stack:
            v, path = stack.pop()
            for u in v.users:
                if u.op == "call_function" and op_class(u) == "view" and u.args and u.args[0] is v:
                    stack.append((u, [*path, u]))
                else:
                    reads.append((u, path))
        reads.sort(key=lambda r: pos[r[0]])
        copies: dict[Node, Node] = {}  # the copy the current group of reads shares
        for (prev, _), (u, path) in zip(reads, reads[1:]):
            if work_before[pos[u]] - work_before[pos[prev] + 1] > 0:
                copies = {}
                _copy_before(graph, u, [n], copies)
                changed = True
            elif not copies:
                continue  # still the first group: it reads the original
            _copy_before(graph, u, path, copies)  # the views this group's copy lacks
            read = path[-1] if path else n
            u.replace_input_with(read, copies[read])
    return changed


def _copy_before(graph: torch.fx.Graph, at: Node, nodes: list[Node], copies: dict[Node, Node]) -> None:
    """Copy each of `nodes` not in `copies` just before `at`, reading the copies made so far."""
    with graph.inserting_before(at):
        for m in nodes:
            if m not in copies:
                c = graph.node_copy(m, lambda a: copies.get(a, a))
                c.meta = {**m.meta, REMADE_FROM: m.meta.get(REMADE_FROM, m.name)}
                copies[m] = c


_CHAIN_LIMIT = 16  # ops remade for one late read at most
_CHAIN_TRIES = 64  # candidate chains weighed per graph at most (each one simulation of the graph)


def _storages(nodes: list[Node], memo: dict[Node, tuple[bool, int]] | None = None,
              ) -> tuple[dict[Node, Node], dict[Node, int]]:
    """Each node's storage (a view's is its base's) and each storage's bytes; none for the forward's
    graph inputs handed over (parameters, the batch: their caller holds them anyway). `memo` keeps
    each node's `_storage_kind` between the simulations of one graph as it is edited."""
    memo = {} if memo is None else memo
    root: dict[Node, Node] = {}
    size: dict[Node, int] = {}
    for n in nodes:
        kind = memo.get(n)
        if kind is None:
            kind = memo[n] = _storage_kind(n)
        is_view, nbytes = kind
        base = n.args[0] if is_view else None
        if is_view and base in root:
            root[n] = root[base]
        else:
            root[n] = n
            size[n] = nbytes
    return root, size


def _storage_kind(n: Node) -> tuple[bool, int]:
    """(whether `n` views its first argument's storage, the bytes it holds if it is a storage of
    its own). Neither changes when the node's inputs are swapped for copies of them."""
    base = n.args[0] if n.op == "call_function" and n.args else None
    is_view = isinstance(base, Node) and op_class(n) in ("view", "free")
    held = n.op == "output" or (n.op == "placeholder" and n.name.startswith("primals"))
    return is_view, 0 if held else tensor_nbytes(n.meta.get("val"))


def _live_curve(order: list[Node], root: dict[Node, Node], size: dict[Node, int]) -> list[int]:
    """Live bytes while each node of `order` runs (its output made, nothing after it freed yet)."""
    last: dict[Node, int] = {}
    for i, n in enumerate(order):
        last[root[n]] = max(last.get(root[n], i), i)
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], i), i)
    frees: dict[int, list[Node]] = {}
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live, curve = 0, []
    for i, n in enumerate(order):
        if root[n] is n:
            live += size[n]
        curve.append(live)
        for r in frees.get(i, ()):
            live -= size[r]
    return curve


def simulated_peak(graph: torch.fx.Graph, memo: dict[Node, tuple[bool, int]] | None = None) -> int:
    """Live bytes at the highest point of running `graph` node by node, each value freed after its
    last read (a view's reads count for its base's storage; inputs alive from the start, the
    forward's own graph inputs counting nothing: their caller holds them)."""
    nodes = list(graph.nodes)
    return max(_live_curve(nodes, *_storages(nodes, memo)), default=0)


def _remake_chains_for_late_users(graph: torch.fx.Graph, dependent: set[Node]) -> bool:
    """As `_remake_for_late_users`, where the op's inputs are not alive at the late read but are made
    by a short chain of recomputed pointwise ops and views from values that are (a normalisation's
    affine output and the activation after it, remade from the saved normalisation input and its
    statistics). An input the chain cannot remake (a reduction's output) but much smaller than the
    value is held to the late read instead (`_held_statistic`). The chain's values are alive together
    around the late read, so a copy is kept only where it lowers the graph's `simulated_peak`."""
    changed, tries = False, 0
    peak = None
    memo: dict[Node, tuple[bool, int]] = {}  # each node's storage kind, for every simulation below
    origin = lambda m: m.meta.get(REMADE_FROM, m.name)  # noqa: E731
    remade: set[str] = set()  # each forward value is remade by one chain at most: bounded extra work
    pos: dict[Node, int] = {}
    work_before: list[int] = []
    for n in list(graph.nodes):
        if tries >= _CHAIN_TRIES:
            break
        if not _remakeable(n, dependent):
            continue
        if not pos:  # positions as the graph stands (after each kept copy, renumbered)
            pos = {m: i for i, m in enumerate(graph.nodes)}
            work_before = [0]
            for m in graph.nodes:
                work_before.append(work_before[-1] + (m in dependent))
        users = sorted(n.users, key=pos.__getitem__)
        first, late = users[0], users[-1]
        if work_before[pos[late]] - work_before[pos[first] + 1] <= 0:
            continue

        chain, todo, ok = {n}, [n], True
        while todo and ok:
            for a in todo.pop().all_input_nodes:
                if a in chain or a.op in ("placeholder", "get_attr") or any(pos[w] >= pos[late] for w in a.users):
                    continue  # a backward input read later than before: the simulation weighs it
                cls = op_class(a) if a.op == "call_function" else "input"
                if (cls not in ("pointwise", "view") or a in dependent or _anchored(a, dependent)
                        or not isinstance(a.meta.get("val"), torch.Tensor) or len(chain) >= _CHAIN_LIMIT):
                    if _held_statistic(a, n):
                        continue  # held to the late read, not remade: the simulation weighs it
                    ok = False
                    break
                chain.add(a)
                todo.append(a)
        if not ok or len(chain) == 1 or any(origin(m) in remade for m in chain):
            continue  # not a chain (the one-op case is `_remake_for_late_users`'s), or remade already
        tries += 1
        if peak is None:
            peak = simulated_peak(graph, memo)
        later = [u for u in users if pos[u] > pos[first] and work_before[pos[u]] - work_before[pos[first] + 1] > 0]
        at = later[0]
        copies: dict[Node, Node] = {}
        with graph.inserting_before(at):
            for m in sorted(chain, key=pos.__getitem__):
                c = graph.node_copy(m, lambda a, copies=copies: copies.get(a, a))
                c.meta = {**m.meta, REMADE_FROM: m.meta.get(REMADE_FROM, m.name)}
                copies[m] = c
        for w in later:
            w.replace_input_with(n, copies[n])
        new_peak = simulated_peak(graph, memo)
        if new_peak < peak:
            peak, changed = new_peak, True
            remade.update(origin(m) for m in chain)
            pos = {}
            continue
        for w in later:
            w.replace_input_with(copies[n], n)
        for m in sorted(chain, key=pos.__getitem__, reverse=True):
            graph.erase_node(copies[m])
    return changed


_STATISTIC_RATIO = 16  # a chain's input this many times smaller than the remade value is held


def _held_statistic(node: Node, value: Node) -> bool:
    """A small tensor a remade chain may read where it was not made by the chain: a normalisation's
    mean or rstd (one number per row, the output of a reduction the chain cannot remake), whose
    bytes are a fraction of the value remade from it; holding it to the late read costs little."""
    val, whole = node.meta.get("val"), value.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or op_class(node) == "view":
        return False
    return tensor_nbytes(val) * _STATISTIC_RATIO <= tensor_nbytes(whole)


_HOIST_TRIES = 48  # orders weighed per graph at most (each one simulation of the graph)
_HOIST_USERS = 12  # backward ops after the peak whose recomputed inputs may move
_HOIST_ABOVE = 4  # backward ops the recomputation may move above


def _recompute_before_backward_allocations(graph: torch.fx.Graph, dependent: set[Node]) -> bool:
    """Move the recomputation a backward op reads above the backward ops just before it, where that
    lowers the graph's simulated peak. Placed just before its first user, a recomputation runs
    among the backward's own values: a decomposed GELU derivative (three temporaries the size of
    the hidden activation) runs after the gradient flowing into it and the layer's weight gradient
    are made, all alive together; run before them, it holds only its own temporaries. The moved
    nodes read no tangent (only saved values and each other), so any place after their own inputs
    is legal. Tried at the simulated peak, a few backward ops at a time, kept only if the peak falls."""
    order = list(graph.nodes)
    root, size = _storages(order)
    curve = _live_curve(order, root, size)
    best = max(curve, default=0)
    tries, changed = 0, False
    movable = lambda m: (m.op == "call_function" and m not in dependent  # noqa: E731
                         and not _anchored(m, dependent))
    # Backward ops a recomputation may move above, and side effects it may never move above.
    work = {n for n in order if n in dependent and n.op == "call_function" and op_class(n) not in ("view", "free")}
    effects = {n for n in order if n.op == "call_function" and (n.meta.get(BACKWARD_MUTATION) or n.is_impure())}
    while tries < _HOIST_TRIES:
        at = curve.index(best)
        pos = {n: i for i, n in enumerate(order)}
        users = [n for n in order[at:] if n in dependent and n.op == "call_function"][:_HOIST_USERS]
        found = None
        for u in users:
            above: list[Node] = []
            for d in reversed(order[:pos[u]]):
                if d in effects or len(above) == _HOIST_ABOVE:
                    break
                if d in work:
                    above.append(d)
            above.reverse()
            for d in reversed(above):
                moved, todo, ok = set(), [u], True
                while todo and ok:
                    for a in todo.pop().all_input_nodes:
                        if a in moved or pos[a] < pos[d] or a in dependent or a.op != "call_function":
                            continue
                        if not movable(a):
                            ok = False
                            break
                        moved.add(a)
                        todo.append(a)
                if not ok or not moved:
                    continue
                tries += 1
                block = [m for m in order[pos[d]:pos[u]] if m in moved]
                rest = [m for m in order[pos[d]:] if m not in moved]
                candidate = order[:pos[d]] + block + rest
                c = _live_curve(candidate, root, size)
                if max(c) < best and (found is None or max(c) < max(found[1])):
                    found = (candidate, c)
                if tries >= _HOIST_TRIES:
                    break
            if tries >= _HOIST_TRIES:
                break
        if found is None:
            break
        order, curve = found
        best = max(curve)
        changed = True
    if changed:
        cursor = order[0]
        for n in order[1:]:
            cursor.append(n)
            cursor = n
    return changed
