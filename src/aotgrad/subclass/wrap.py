"""The subclass stage: flatten traceable wrapper subclasses at the boundary, plain tensors inside.

A call with subclass arguments (signature/subclass_layout.py) is compiled as a call of a *plain* function over
the subclasses' inner tensors, through the ordinary pipeline unchanged:

    fn_plain(*plain_leaves):                     # traced by trace/capture.py like any function
        x = _Wrap.apply(site, a, b)              # rebuild TwoTensor(a, b): __tensor_unflatten__
        out = fn(x, ...)                         # the subclass's __torch_dispatch__ runs on the
                                                 # functional inner tensors: plain aten graph
        return _Unwrap.apply(site, out)          # __tensor_flatten__: plain outputs

Two small autograd Functions keep the autograd boundary at the subclass level: `_Wrap` (plain ->
subclass; its backward flattens the subclass gradient) and `_Unwrap` (subclass -> plain; its backward
rebuilds the subclass gradient). The run time puts the same two around the compiled plain function:
each subclass argument is unwrapped (its gradient is rebuilt as the subclass the trace saw arrive),
each subclass output rewrapped (its incoming gradient is checked against the trace's guess, the
output's own layout, and flattened). Why this design: mutations, aliasing, partitioning, the
compilers and the generated run time all stay the plain pipeline's, and a compiler never sees a
subclass. Outputs that are a subclass argument itself, or views of one, are returned as eager
returns them (the argument, or its view replayed on the caller's subclass).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..dynamic import subclasses as subclass_symbolic
from ..errors import (
    AotgradError,
    InplaceOnLeafError,
    UnsupportedAliasingError,
    UnsupportedInputError,
    UnsupportedMutationError,
    UnsupportedOutputError,
)
from ..plan import FromLeaf, ViewChain
from ..signature.subclass_layout import (
    SubclassLayout,
    flatten,
    is_subclass,
    layout_of,
    rebuild,
)
from ..signature.subclass_sizes import integer_positions
from ..trace import analysis
from . import higher as subclass_higher
from . import metadata as subclass_metadata
from . import nested_jagged
from .crossings import _Gather, _Site, _Spread, _Unwrap, _Wrap
from .graphs import with_folded_detaches
from .runtime import build_fused_run, build_run, fusable
from .trace_rules import SubclassTraceRules

log = logging.getLogger("aotgrad.subclass")


def any_subclass(leaves: Sequence[Any]) -> bool:
    return any(type(x) is not torch.Tensor and is_subclass(x) for x in leaves if isinstance(x, torch.Tensor))


class NeedsGradSpread(AotgradError):
    """Internal: plain argument `leaf` gets a subclass gradient; compile again with it spread."""

    def __init__(self, leaf: int, layout: SubclassLayout):
        super().__init__(f"aotgrad: input {leaf} gets a {layout.describe()} gradient")
        self.leaf, self.layout = leaf, layout


# ---------------------------------------------------------------------------------------------
# What each user output is


@dataclass(frozen=True)
class PlainOut:
    position: int


@dataclass(frozen=True)
class SubclassOut:
    site: _Site
    start: int
    requires_grad: bool
    leaf_requires_grad: bool = False  # a base of no_grad views only: a leaf requiring grad, as eager's


@dataclass(frozen=True)
class LeafOut:
    leaf: int


@dataclass(frozen=True)
class ViewOfLeafOut:
    leaf: int
    chain: ViewChain
    creation_meta: Any = None  # eager's CreationMeta of the view where it is not DEFAULT


@dataclass(frozen=True)
class ViewOut:
    """A view of another output entry (a user output, or an intermediate base rebuilt for it)."""

    base: int
    chain: ViewChain
    creation_meta: Any = None


@dataclass(frozen=True)
class SameAs:
    entry: int


# ---------------------------------------------------------------------------------------------
# One signature's boundary


def _layout_of_plain(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset())


@dataclass
class Boundary:
    """The subclass stage for one signature: how caller leaves map to plain leaves and back."""

    spec: Any
    layouts: list[SubclassLayout | None]  # per caller leaf
    ranges: list[tuple[int, int]]  # per caller leaf: its plain leaves
    sites: dict[int, _Site]  # per subclass caller leaf
    first: dict[int, int]  # leaf -> the first leaf that is the same object
    spread: dict[int, _Site]  # plain leaves whose gradient is a subclass (`_Spread`)
    requires_grad: list[bool]  # per caller leaf
    outputs: list = field(default_factory=list)
    bumped: set = field(default_factory=set)  # subclass arguments whose version eager bumps
    rebased: set = field(default_factory=set)  # subclass arguments written in grad mode (history rebased)
    rebased_at: dict = field(default_factory=dict)  # rebased argument -> (its new value's plain outputs, site)
    num_plain_outputs: int = 0
    bumps: dict = field(default_factory=dict)  # subclass argument -> version bumps by the program
    unclear_history: set = field(default_factory=set)  # rebased, but not one data write per node
    relayouts: dict = field(default_factory=dict)  # argument -> its metadata after the call (subclass_metadata)
    written_in_backward: set = field(default_factory=set)  # arguments (not requiring grad) the backward writes
    restore_requires_grad: bool = True  # under no_grad, rebuild arguments requiring grad requiring it
    early_views: set = field(default_factory=set)  # outputs viewing an argument as it was before that
    detached: set = field(default_factory=set)  # arguments the program detach_()es
    num_user: int = 0
    out_spec: Any = None

    @classmethod
    def of(cls, leaves: Sequence[Any], spec, spread: dict[int, SubclassLayout]) -> Boundary:
        layouts, ranges, sites, first, seen = [], [], {}, {}, {}
        spread_sites = {i: _Site(g, f"input {i}", grad_layout=g) for i, g in spread.items()}
        pos = 0
        for i, x in enumerate(leaves):
            _refuse_nested(x, f"input {i}")
            lay = layout_of(x) if isinstance(x, torch.Tensor) else None
            if isinstance(x, torch.Tensor):
                first[i] = seen.setdefault(id(x), i)
            n = 1 if lay is None else lay.num_plain
            if i in spread_sites:  # a repeated argument too: each is spread on its own, as the prologue does
                n = spread_sites[i].layout.num_plain
            elif first.get(i, i) != i:  # the same tensor again: as wide as its first occurrence
                n = ranges[first[i]][1] - ranges[first[i]][0]
            layouts.append(lay)
            ranges.append((pos, pos + n))
            pos += n
            if lay is not None:
                sites[i] = _Site(lay, f"input {i}")
        requires_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
        return cls(spec, layouts, ranges, sites, first, spread_sites, requires_grad)

    def plain_leaves(self, leaves: Sequence[Any]) -> list:
        """The plain arguments of the compiled plain function (the run-time prologue's twin)."""
        out: list = []
        grad = torch.is_grad_enabled()
        for i, x in enumerate(leaves):
            lay = self.layouts[i]
            if self.first.get(i, i) != i:  # the same tensor again: the same plain tensors
                out.extend(out[slice(*self.ranges[self.first[i]])])
            elif i in self.spread:  # the stand-ins after the first only carry gradients: their own memory
                first, *rest = _Spread.apply(self.spread[i], x)  # here, so a write into the argument is
                out.extend([first, *(r.clone() for r in rest)])  # not taken for inputs overlapping
            elif lay is None:
                out.append(x)
            elif grad and x.requires_grad:
                out.extend(_Unwrap.apply(self.sites[i], x))
            else:
                flatten(x, lay, out)
        return out

    def restores_requires_grad(self) -> bool:
        """Whether the trace (under no_grad) rebuilds a subclass argument requiring grad as requiring it."""
        return not torch.is_grad_enabled() and any(
            rg and lay is not None for rg, lay in zip(self.requires_grad, self.layouts))

    def num_plain(self, num_leaves: int) -> int:
        return self.ranges[num_leaves - 1][1] if num_leaves else 0

    # -- trace side ---------------------------------------------------------------------------

    def plain_function(self, fn: Callable) -> Callable:
        def fn_plain(*plain):
            leaves, rebuilt, inner_of, gathered = [], {}, {}, {}
            for i, lay in enumerate(self.layouts):
                start, stop = self.ranges[i]
                if self.first.get(i, i) != i:  # the same tensor again (a spread one included)
                    leaves.append(leaves[self.first[i]])
                    continue
                if i in self.spread:
                    leaves.append(_Gather.apply(self.spread[i], *plain[start:stop]))
                    gathered[id(leaves[-1])] = i  # returned as is: the caller's argument, as eager's
                    continue
                if lay is None:
                    leaves.append(plain[start])
                    if isinstance(plain[start], torch.Tensor) and plain[start].requires_grad:
                        plain[start].register_hook(_needs_spread(i))
                    continue
                inner = plain[start:stop]
                if torch.is_grad_enabled() and any(p.requires_grad for p in inner):
                    t = _Wrap.apply(self.sites[i], *inner)
                else:
                    t = rebuild(lay, inner)
                    if self.restore_requires_grad and self.requires_grad[i] and not t.requires_grad:
                        t.requires_grad_()  # under no_grad, as the caller's (AccumulateGrad, `if x.requires_grad`)
                rebuilt[id(t)] = i
                inner_of[i] = subclass_metadata.plain_tensors(t, lay)  # to tell they stay the same objects
                leaves.append(t)
            args, kwargs = pytree.tree_unflatten(leaves, self.spec)
            before = {i: _state(leaves[i]) for i in rebuilt.values()}
            versions = {i: leaves[i]._version for i in rebuilt.values()}
            # a plain argument passed as is gets its metadata mutation replayed by the plain run; one whose
            # gradient is a subclass (`_Spread`) is passed as detached aliases, which do not carry it back
            plain_meta = {i: _layout_of_plain(leaves[i]) for i in self.spread}
            gathered_versions = {k: leaves[i]._version for k, i in gathered.items()}
            with SubclassTraceRules(rebuilt) as rules:
                out = fn(*args, **kwargs)
            # a written one is not the caller's tensor as is: its new value and history come from the
            # plain run (where an output aliasing it is refused, as for plain arguments)
            gathered = {k: i for k, i in gathered.items() if leaves[i]._version == gathered_versions[k]}
            for i, meta in plain_meta.items():
                if _layout_of_plain(leaves[i]) != meta:
                    raise UnsupportedMutationError(
                        f"aotgrad: the program changes the metadata of input {i} ({tuple(meta[0])} -> "
                        f"{tuple(leaves[i].shape)}: t_(), transpose_(), as_strided_()...) and its gradient is a "
                        "tensor subclass; the subclass stage does not replay it there. Use the out-of-place op "
                        "and return the result, or run this part eagerly.")
            self.relayouts, self.detached = {}, set()
            for i, state in before.items():
                after = _state(leaves[i])
                if after[0] != state[0]:  # t_(), unsqueeze_()...: replayed after each call
                    self.relayouts[i] = subclass_metadata.record(i, self.layouts[i], leaves[i], inner_of[i], state[0])
                    state = (after[0], *state[1:])
                if i in rules.detached and subclass_metadata.detached(i, state, after, self.requires_grad[i]):
                    self.detached.add(i)
                    state = after
                _check_state(i, self.layouts[i], state, after)
            self.bumped = {i for i, v in versions.items() if leaves[i]._version != v}  # in-place ops on it
            self.bumps = {i: leaves[i]._version - v for i, v in versions.items()}  # as many as eager's
            # written in grad mode: autograd rebased the argument's history (subclass_runtime._Rebase)
            self.rebased = {i for i, st in before.items() if _rebased(st, _state(leaves[i]))}
            # every write in grad mode (one autograd node each), else some ran under no_grad
            self.unclear_history = {i for i in self.rebased
                                    if not _writes_all_recorded(leaves[i].grad_fn, before[i][2], self.bumps[i])}
            flat, self.out_spec = pytree.tree_flatten(out)
            return self._flatten_outputs(flat, rebuilt, gathered) + self._rebased_values(leaves)

        fn_plain.__qualname__ = getattr(fn, "__qualname__", "fn") + "[subclasses flattened]"
        return fn_plain

    def _rebased_values(self, leaves: list) -> tuple:
        """Hidden outputs after the user's: each rebased argument's new value, differentiable (a
        clone: an alias of the input would be rebuilt as a view, detached)."""
        values: list = []
        self.rebased_at = {}
        for i in sorted(self.rebased):
            lay = layout_of(leaves[i]) if i in self.relayouts else self.layouts[i]  # refused later if relayouted
            site = _Site(lay, f"input {i}")
            self.rebased_at[i] = (self.num_plain_outputs + len(values), site)
            values += [p.clone() for p in _Unwrap.apply(site, leaves[i])]
        return tuple(values)

    def _view_chain(self, o: torch.Tensor, k: int, leaf: int | None) -> tuple[ViewChain, Any]:
        """`_chain`; for a view of an argument whose metadata the program changed after taking it,
        the chain on the argument as it was (replayed before its metadata is set: subclass_metadata)."""
        try:
            return _chain(o, k)
        except UnsupportedOutputError:
            early = subclass_metadata.chain_before(self.relayouts.get(leaf), lambda meta: _chain(o, k, meta))
            if early is None:
                raise
            self.early_views.add(k)
            return early

    def _flatten_outputs(self, flat: list, rebuilt: dict[int, int], gathered: dict[int, int]) -> tuple:
        """The plain values the graph returns for the user's outputs; `self.outputs` says how each
        user output is rebuilt (entries past `self.num_user` are bases of views, rebuilt first)."""
        self.outputs, self.num_user = [], len(flat)
        entries: dict[int, int] = {}  # id(subclass tensor) -> its entry, so a base is built once
        plain: list = []
        pending = list(enumerate(flat))
        # a base rebuilt only for its views is differentiable only if some view has a grad path to it
        # (one taken under no_grad is a leaf in eager): else every input would get zeros, not None
        grad_bases: set[int] = set()
        for k, o in enumerate(flat):
            self.outputs.append(None)
            if isinstance(o, torch.Tensor) and is_subclass(o):
                entries.setdefault(id(o), k)
        while pending:
            k, o = pending.pop(0)
            _refuse_nested(o, f"output {k}")
            if id(o) in gathered:
                self.outputs[k] = LeafOut(gathered[id(o)])
            elif not (isinstance(o, torch.Tensor) and is_subclass(o)):
                self.outputs[k] = PlainOut(len(plain))
                plain.append(o)
            elif id(o) in rebuilt:
                self.outputs[k] = LeafOut(rebuilt[id(o)])
            elif entries[id(o)] != k:
                self.outputs[k] = SameAs(entries[id(o)])
            elif o._is_view() and is_subclass(o._base):
                base = o._base
                if id(base) not in entries:  # an intermediate: rebuilt too, then the view taken
                    entries[id(base)] = len(self.outputs)
                    self.outputs.append(None)
                    pending.append((entries[id(base)], base))
                if o.grad_fn is not None:
                    grad_bases.add(id(base))
                self.outputs[k] = ViewOut(entries[id(base)], *self._view_chain(o, k, rebuilt.get(id(base))))
            else:
                site = _Site(layout_of(o), f"output {k}")
                differentiable = o.requires_grad and o.grad_fn is not None  # else a leaf, as eager's
                leaf = differentiable and k >= self.num_user and id(o) not in grad_bases
                self.outputs[k] = SubclassOut(site, len(plain), differentiable and not leaf, leaf)
                differentiable = differentiable and not leaf
                if differentiable:
                    plain.extend(_Unwrap.apply(site, o))
                else:
                    flatten(o, site.layout, plain)
        for k, o in enumerate(self.outputs):  # a view of an input: the caller's subclass is the base
            if isinstance(o, ViewOut) and isinstance(self.outputs[o.base], LeafOut):
                self.outputs[k] = ViewOfLeafOut(self.outputs[o.base].leaf, o.chain, o.creation_meta)
        self.num_plain_outputs = len(plain)
        return tuple(plain)

    # -- after the trace ----------------------------------------------------------------------

    def check_mutations(self, plan) -> list[int]:
        """Subclass arguments the program writes into (their version is bumped per call); refuse what
        the flattened run time cannot give as eager does."""
        leaf_of_plain = {}
        for i, lay in enumerate(self.layouts):
            if lay is not None:
                for p in range(*self.ranges[i]):
                    leaf_of_plain[p] = i
        mutated, written = set(), set()
        leaves_requiring_grad = self.requires_grad
        for src, m in zip(plan.layout.primal_sources, plan.mutations):
            i = leaf_of_plain.get(src.leaf)
            if i is None or not (m.any or m.in_backward):
                continue
            if m.visible_to_autograd and not leaves_requiring_grad[i]:
                raise UnsupportedMutationError(
                    f"aotgrad: the program writes a value that requires grad into subclass input {i} "
                    f"({self.layouts[i].describe()}), which does not; aotgrad does not give a subclass input "
                    "autograd history. Return the value instead."
                )
            if m.in_backward and leaves_requiring_grad[i]:
                raise UnsupportedMutationError(
                    f"aotgrad: the backward writes into subclass input {i} ({self.layouts[i].describe()}), "
                    "which requires grad; aotgrad writes a subclass input in the backward only where it "
                    "does not (a buffer). Return the new value instead."
                )
            if m.in_backward:  # the plain backward writes the caller's inner tensors; the version: run time
                self.written_in_backward.add(i)
            # a data write into an argument sharing memory with another (the plain stage passes their
            # inner tensors through one base, and writes the base back): as plain arguments
            shared_data_only = not isinstance(src, FromLeaf) and m.data and not m.metadata
            if (not isinstance(src, FromLeaf) and not shared_data_only) or m.storage:  # metadata: subclass_metadata
                raise UnsupportedMutationError(
                    f"aotgrad: the program changes the metadata or storage of subclass input {i} "
                    f"({self.layouts[i].describe()}) in place (or it shares memory with another input); "
                    "aotgrad cannot express that on the subclass's inner tensors. Return the new value "
                    "instead."
                )
            if m.metadata and i not in self.relayouts:  # restrided back where it was: versions only
                self.relayouts[i] = subclass_metadata.versions_only(i, self.layouts[i])
            mutated.add(i)
            if m.data:
                written.add(i)
        # in-place metadata ops only, not replayed (transpose_(0, 0)); replayed ones: subclass_metadata
        self.unclear_history |= self.rebased - written - set(self.relayouts)
        return sorted(mutated | self.bumped)

    def refuse_grad_mutations(self, leaves: Sequence[Any], mutated: list[int], plan=None) -> None:
        """Writes into a subclass argument requiring grad (or given history by one). A write autograd
        does not see (under no_grad, through .detach()) changes data only, as in eager: it reaches the
        caller's inner tensors, the history stays. A write in grad mode: into a leaf requiring grad
        it is refused, as eager refuses it; a non-leaf (a view too) has its history rebased by the run
        time (subclass_runtime._Rebase), before the outputs viewing it are taken, where it shares memory
        with no other argument and each write was one autograd node."""
        if not torch.is_grad_enabled():  # a call under no_grad (an optimizer step): data writes only
            return
        storages = [_storages(x) for x in leaves]
        for i in mutated:
            x = leaves[i]
            if i not in self.rebased and not x.requires_grad:
                continue
            shared = any(storages[i] & storages[j] for j in range(len(leaves)) if j != i)
            if i not in self.rebased and not shared and i not in self.relayouts and i not in self.detached:
                continue  # data only (no metadata change): history unchanged, as in eager
            if x.requires_grad and x.is_leaf:
                raise InplaceOnLeafError(
                    f"aotgrad: input {i} ({self.layouts[i].describe()}) is a leaf that requires grad and the "
                    "program modifies it in place in grad mode, which eager refuses. Modify it under "
                    "torch.no_grad(), or mutate a clone."
                )
            if shared or i in self.unclear_history:
                raise UnsupportedMutationError(
                    f"aotgrad: subclass input {i} ({self.layouts[i].describe()}) requires grad (or is given it) "
                    "and the program modifies it in place while it shares memory with another input, or "
                    "with writes autograd does not record (no_grad, .detach(), metadata only) beside "
                    "writes it records; aotgrad rebases a subclass's history only where it shares memory "
                    "with no other input and autograd recorded each write. Clone it first."
                )

    def runner(self, run_plain: Callable, mutated: list[int], examples: Sequence[Any] = (),
               inner_requires_grad: bool = True) -> Callable:
        """The run time around the compiled plain function: one autograd.Function for the whole call
        where the call allows it (subclass_runtime.build_fused_run), else one per crossing."""
        for site in (*self.sites.values(), *self.spread.values(), *(s for _, s in self.rebased_at.values())):
            site.tracing = False
        for o in self.outputs:
            if isinstance(o, SubclassOut):
                o.site.tracing = False
        subclass_higher.mark_spread(self)
        if fusable(self, run_plain, mutated, inner_requires_grad):
            run = build_fused_run(self, run_plain, examples)
            if run is not None:
                return run
        fns = {"unwrap": _fast_apply(_Unwrap), "spread": _fast_apply(_Spread), "wrap": _fast_apply(_Wrap),
               "replay": _replay}
        return build_run(self, run_plain, mutated, fns)


def _refuse_nested(x: Any, name: str) -> None:
    if isinstance(x, torch.Tensor) and x.is_nested and x.layout is not torch.jagged:  # jagged: subclass/nested_jagged.py
        raise UnsupportedInputError(
            f"aotgrad: {name} is a NestedTensor of layout {x.layout}; only jagged NestedTensors "
            "(layout=torch.jagged) are supported. Build it with layout=torch.jagged."
        )


def _fast_apply(fn: type) -> Callable:
    """`fn.apply` without `Function.apply`'s per-argument Python work (default-argument binding,
    functorch's dead-wrapper unwrapping) when no functorch transform is active, as is the case
    for a plain call."""
    direct = super(torch.autograd.Function, fn).apply
    slow = fn.apply
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return slow(*args) if transforms_active() else direct(*args)

    return apply


def _needs_spread(i: int) -> Callable:
    def check(grad):
        if grad is not None and is_subclass(grad):
            raise NeedsGradSpread(i, layout_of(grad))

    return check


def _state(t: torch.Tensor) -> tuple:
    return _metadata(t), t.requires_grad, t.grad_fn


def _storages(x: Any) -> set:
    """The storages of a subclass argument's plain inner tensors (empty for anything else)."""
    if not (isinstance(x, torch.Tensor) and is_subclass(x)):
        return {x.untyped_storage()._cdata} if isinstance(x, torch.Tensor) else set()
    inner: list = []
    flatten(x, layout_of(x), inner)
    return {t.untyped_storage()._cdata for t in inner}


def _writes_all_recorded(node, start, bumps: int) -> bool:
    """Whether the argument's new history is one node per version bump back to `start` (its grad_fn
    before the program): every in-place op on it ran in grad mode."""
    if start is None:  # no history before: each write's node leads to the previous by its first edge
        for _ in range(bumps):
            if node is None:
                return False
            node = node.next_functions[0][0] if node.next_functions else None
        return node is None
    frontier, seen = [(node, 0)], set()
    while frontier:
        n, depth = frontier.pop(0)
        if n is start:
            return depth == bumps
        if n is None or depth >= bumps or id(n) in seen:
            continue
        seen.add(id(n))
        frontier += [(m, depth + 1) for m, _ in n.next_functions]
    return False


def _rebased(before: tuple, after: tuple) -> bool:
    """Whether an in-place op in grad mode gave the argument a new history (requires_grad after it,
    a grad_fn of its own), as eager's write of a value requiring grad does."""
    return after[1] and after[2] is not None and after[2] is not before[2]


def _check_state(i: int, layout: SubclassLayout, before: tuple, after: tuple) -> None:
    """Refuse what the program did to subclass input `i` that the flattened run time cannot replay on
    the caller's subclass: metadata changed in place, autograd state changed (a write of a value
    requiring grad, detach_(), requires_grad_())."""
    what = None
    if after[0] != before[0]:
        what = "changes the metadata of", "(t_(), transpose_(), as_strided_()...)"
    elif _rebased(before, after):  # a write in grad mode: replayed (subclass_runtime._Rebase)
        return
    elif after[1] != before[1] or (after[2] is not before[2] and not before[1]):
        what = "changes the autograd state of", "(detach_(), requires_grad_())"
    if what is not None:
        raise UnsupportedMutationError(
            f"aotgrad: the program {what[0]} subclass input {i} ({layout.describe()}) in place {what[1]}; aotgrad "
            "cannot replay that on the caller's subclass. Return a new tensor instead."
        )


def _metadata(t: torch.Tensor) -> tuple:
    """Sizes, strides and offsets of a subclass and of its plain inner tensors."""
    plains: list = []
    flatten(t, layout_of(t), plains)
    return tuple((tuple(x.shape), tuple(x.stride()), x.storage_offset()) for x in (t, *plains))


def _chain(o: torch.Tensor, k: int, base_meta: tuple | None = None) -> tuple[ViewChain, Any]:
    """The view ops that made subclass output `o` from its base, to replay on the rebuilt base (of
    `base_meta` where given, else as the base is now), and the view's CreationMeta where it is not
    DEFAULT (in-place ops on it then fail as in eager)."""
    base = o._base
    probe = analysis._probe_like(base, base.requires_grad, base_meta)
    inner: list = []
    flatten(o, layout_of(o), inner)
    if not all(analysis.may_replay(t, probe) for t in inner if isinstance(t, torch.Tensor)):
        # the trace marked its inner views unsafe to replay (a base restrided in place): libtorch
        # has crashed replaying such view functions
        raise UnsupportedOutputError(
            f"aotgrad: output {k} is a view of a {type(base).__name__} restrided in place after the view "
            "was taken; aotgrad cannot replay it on the rebuilt subclass. Return a .clone() of it."
        )
    recorded = analysis._record_chain(o, probe)
    if recorded is None or analysis.meta_of(recorded[1]) != analysis.meta_of(o):
        raise UnsupportedOutputError(
            f"aotgrad: output {k} is a view of a {type(base).__name__} whose view ops cannot be replayed "
            "on the rebuilt subclass (or whose metadata was changed in place). Return a .clone() of it."
        )
    steps = recorded[0]
    meta = torch._C._autograd._get_creation_meta(o)
    meta = None if meta == torch._C._autograd.CreationMeta.DEFAULT else meta
    no_grad_steps = 0
    if base.requires_grad and o.grad_fn is None:  # taken under no_grad: replayed under it
        no_grad_steps = len(steps)
    elif base.requires_grad:  # the first steps taken under no_grad, the last ones with grad
        names, reached = analysis._autograd_path(o, base)
        if not reached:
            if len(names) > len(steps):
                raise UnsupportedOutputError(
                    f"aotgrad: output {k} is a view of a {type(base).__name__} taken partly under no_grad, "
                    "in steps aotgrad cannot tell apart. Return a .clone() of it."
                )
            no_grad_steps = len(steps) - len(names)
    return ViewChain(steps=steps, no_grad_steps=no_grad_steps), meta


def _replay(base: torch.Tensor, chain: ViewChain) -> torch.Tensor:
    value = base
    for k, step in enumerate(chain.steps):
        with torch.no_grad() if k < chain.no_grad_steps else contextlib.nullcontext():
            value = step.op(value, *step.args, **dict(step.kwargs))
            if step.item is not None:
                value = value[step.item]
    return value


def _aliasing_refusal(boundary: Boundary, leaves: list) -> AotgradError | None:
    """Subclass arguments requiring grad that share memory with another argument, one of them
    written: their inner tensors reach the plain stage as detached aliases, without the autograd
    base that would let it rebase their histories as eager does."""
    storages = [_storages(x) for x in leaves]
    names = [i for i, lay in enumerate(boundary.layouts) if lay is not None and boundary.requires_grad[i]
             and any(storages[i] & storages[j] for j in range(len(leaves)) if j != i)]
    if not names:
        return None
    return UnsupportedAliasingError(
        f"aotgrad: subclass inputs {names} require grad and share memory with another input, and the "
        "program writes into one of them; aotgrad passes such inputs' inner tensors without their common "
        "autograd base, so it cannot replay the write on the others as eager does (one view of a base "
        "that is not passed is fine, and inputs that do not require grad are). Pass the base once and "
        "take the views inside the function."
    )


def compile_signature(fn: Callable, leaves: list, spec, config, compile_plain: Callable) -> Callable:
    """Compile a call with subclass arguments: the plain pipeline over their inner tensors, with the
    boundary's prologue/epilogue around its run time."""
    nested_jagged.refuse_static(leaves)
    spread: dict[int, SubclassLayout] = {}
    restore_requires_grad = True
    while True:
        boundary = Boundary.of(leaves, spec, spread)
        boundary.restore_requires_grad = restore_requires_grad
        plain_leaves = boundary.plain_leaves(leaves)
        plain_spec = pytree.tree_flatten((tuple(plain_leaves), {}))[1]
        plain_config = replace(config, num_params_buffers=boundary.num_plain(config.num_params_buffers))
        if not spread:  # the boundary's own detaches (subclass/graphs.py); _Gather's views keep theirs
            plain_config = with_folded_detaches(plain_config)
        try:
            run_plain = compile_plain(boundary.plain_function(fn), plain_leaves, plain_spec, plain_config)
            break
        except UnsupportedAliasingError as e:  # said of the plain inputs: say it of the caller's
            raise _aliasing_refusal(boundary, leaves) or e from e
        except NeedsGradSpread as e:  # a plain argument whose gradient is a subclass
            if e.leaf in spread:
                raise
            spread[e.leaf] = e.layout
        except AotgradError:
            # Under no_grad, arguments requiring grad are rebuilt requiring grad (as the caller's);
            # autograd's view checks then refuse some traces eager runs (a no_grad view of an
            # argument whose metadata the program changes): such a program is traced as before.
            if not (restore_requires_grad and boundary.restores_requires_grad()):
                raise
            restore_requires_grad = False
    compiled = getattr(run_plain, "compiled", None)
    if compiled is not None:
        compiled.dispatch_backward = False
    mutated = boundary.check_mutations(run_plain.plan)
    subclass_metadata.refuse_detached(boundary, leaves)
    boundary.refuse_grad_mutations(leaves, mutated, run_plain.plan)
    subclass_higher.name_mutated_inputs(boundary, getattr(run_plain, "compiled", None))
    log.debug("aotgrad: subclass arguments %s flattened into %d plain inputs",
              {i: s.layout.describe() for i, s in boundary.sites.items()}, len(plain_leaves))
    inner: list = []
    for i in boundary.sites:
        flatten(leaves[i], boundary.layouts[i], inner)
    # integer inner tensors (a NestedTensor's offsets) need the general run, which keeps them
    inner_requires_grad = any(p.requires_grad for p in inner) or bool(integer_positions(inner))
    # generated per shape where the boundary's sizes are symbolic (dynamic/subclasses.py)
    run = subclass_symbolic.runner(
        boundary, leaves, lambda b: b.runner(run_plain, mutated, plain_leaves, inner_requires_grad))
    run.plan = run_plain.plan
    run.compiled = run_plain.compiled
    run.boundary = boundary
    return run
