"""The plain data passed between pipeline stages.

inputs.py builds an `InputLayout`; capture.py produces a `Captured` (the joint or inference graph plus
a `Plan` of what the program did to its inputs and outputs); partition.py splits the graph;
runtime.py turns the `Plan` into straight-line Python. Everything here is frozen and holds no
tensors, so a plan can be printed, compared and cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import TreeSpec

# ----------------------------------------------------------------------------------------------
# Inputs: how caller arguments become graph inputs ("primals").
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FromLeaf:
    """Primal is the caller's flat argument `leaf`."""

    leaf: int


@dataclass(frozen=True)
class BaseOfLeaf:
    """Primal is `leaves[leaf]._base`: one graph input for inputs that are views of one tensor."""

    leaf: int


@dataclass(frozen=True)
class StorageOfLeaf:
    """Primal is a flat 1-D tensor over the whole storage of `leaves[leaf]` (no autograd base)."""

    leaf: int


PrimalSource = FromLeaf | BaseOfLeaf | StorageOfLeaf


@dataclass(frozen=True)
class ViewOfPrimal:
    """A caller argument the graph sees as `as_strided(primal, size, stride, offset)`."""

    primal: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class InputLayout:
    """How the flat caller arguments (pytree leaves) map to graph inputs.

    `leaf_primal[i]` is the primal a tensor leaf *is* (None for constants and for views of a
    synthetic base, which are listed in `leaf_views`).
    """

    spec: TreeSpec
    num_leaves: int
    constants: dict[int, Any]
    primal_sources: tuple[PrimalSource, ...]
    leaf_primal: tuple[int | None, ...]
    leaf_views: dict[int, ViewOfPrimal] = field(default_factory=dict)

    @property
    def num_primals(self) -> int:
        return len(self.primal_sources)


# ----------------------------------------------------------------------------------------------
# What the program did to each primal.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputMutation:
    """Facts about one primal, read off its functional wrapper at the end of the forward.

    `data`: its values changed. `visible_to_autograd`: some data mutation happened in grad mode on a
    tensor autograd tracks (else all were under `no_grad` or through `.detach()`). `metadata`: its
    size/stride/offset changed (`t_`, `as_strided_`...). `storage`: `set_` swapped its storage.
    `in_backward`: the backward pass mutated its data (kept in the backward graph).
    """

    data: bool = False
    visible_to_autograd: bool = False
    seen_by_autograd: bool = False  # some in-place op on it (data or metadata) changed its grad_fn
    metadata: bool = False
    storage: bool = False
    in_backward: bool = False
    kept_in_graph: bool = False

    @property
    def any(self) -> bool:
        return self.data or self.metadata or self.storage


# ----------------------------------------------------------------------------------------------
# Epilogue actions on the caller's tensors, in order.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restride:
    """`primal.as_strided_(size, stride, offset)`: replay a metadata mutation (under `no_grad` when
    the program did it there, so autograd's view of the input is unchanged as in eager)."""

    primal: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    no_grad: bool = False


@dataclass(frozen=True)
class RestrideLeaf:
    """Like `Restride`, for a caller argument that the graph saw as a view of a synthetic base."""

    leaf: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    no_grad: bool = False


@dataclass(frozen=True)
class BumpVersion:
    """`increment_version(primal)`: eager bumped its version counter (an in-place op on it or a
    view of it) and no copy_ in the epilogue does."""

    primal: int


@dataclass(frozen=True)
class Detach:
    """`primal.detach_()`: the program detached the input in place."""

    primal: int


@dataclass(frozen=True)
class CopyInto:
    """`primal.copy_(fw_out[value])`, recorded by autograd when `grad` is True."""

    primal: int
    value: int
    grad: bool


@dataclass(frozen=True)
class SetToOutput:
    """`primal.set_(fw_out[value])` under no_grad: replay a `set_` to a new tensor."""

    primal: int
    value: int


@dataclass(frozen=True)
class SetToPrimal:
    """`primal.set_(other)` under no_grad: the program set one input to another's storage."""

    primal: int
    other: int


@dataclass(frozen=True)
class SetRequiresGrad:
    """`primal.requires_grad_(True)` before the call: the program flipped it on a leaf."""

    primal: int


EpilogueAction = Restride | RestrideLeaf | CopyInto | SetToOutput | SetToPrimal | Detach | BumpVersion


# ----------------------------------------------------------------------------------------------
# Outputs: how each user output is produced.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewStep:
    """One aten view op replayed on the previous value: `op(prev, *args, **kwargs)[item]`."""

    op: Any
    args: tuple
    kwargs: tuple
    item: int | None = None


@dataclass(frozen=True)
class ViewChain:
    """How to rebuild an aliasing output from its base, in the caller's autograd world.

    `steps` replay view ops (so `._base`, `grad_fn` and later in-place ops behave as in eager); when
    no faithful chain exists `as_strided` holds (size, stride, offset) instead (one step). The first
    `no_grad_steps` steps replay under `torch.no_grad()` (the program made those views there);
    `detach` detaches the result. `multi_output`: the eager view came from a multi-output view op
    (unbind, split, chunk) that an `as_strided` chain does not replay; the run time marks the result
    so that in-place ops on it fail as in eager.
    """

    steps: tuple[ViewStep, ...] = ()
    as_strided: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
    no_grad_steps: int = 0
    detach: bool = False
    multi_output: bool = False
    # The program marked the view with requires_grad_() while its base (an input) does not require
    # grad: eager makes it an autograd leaf requiring grad, and so does the run time after the rebuild.
    requires_grad: bool = False


@dataclass(frozen=True)
class GraphOutput:
    """The user output is forward-graph output `index`."""

    index: int


@dataclass(frozen=True)
class Constant:
    """A non-tensor output (int, float, None, ...) fixed at trace time."""

    value: Any


@dataclass(frozen=True)
class InputItself:
    """The user output is the caller's tensor argument `leaf` (same Python object)."""

    leaf: int


@dataclass(frozen=True)
class AliasOfPrimal:
    """The user output is a view of primal `primal`, regenerated after the epilogue."""

    primal: int
    chain: ViewChain


@dataclass(frozen=True)
class AliasOfLeaf:
    """The user output is a view of the caller's argument `leaf`, one of several inputs that share a
    storage and reach the graph as one flat tensor (`StorageOfLeaf`). `chain` starts with an
    as_strided in storage coordinates, so it replays on the caller's tensor as on the flat one; the
    output's `._base` is then the caller's tensor's, as in eager."""

    leaf: int
    chain: ViewChain


@dataclass(frozen=True)
class AliasOfGraphOutput:
    """The user output is a view of forward-graph output `index` (an intermediate base)."""

    index: int
    chain: ViewChain


@dataclass(frozen=True)
class SameAs:
    """The program returned the same tensor object at an earlier output `position`."""

    position: int


@dataclass(frozen=True)
class AliasOfOutput:
    """A view of the (already rebuilt) user output at `position`, e.g. `v, v[1:]`."""

    position: int
    chain: ViewChain


OutputSource = (
    GraphOutput | Constant | InputItself | AliasOfPrimal | AliasOfLeaf | AliasOfGraphOutput | SameAs | AliasOfOutput
)


# ----------------------------------------------------------------------------------------------
# Forward graph outputs, named by what they are.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MutatedInputValue:
    """The new value of primal `primal` after the program's mutations."""

    primal: int


@dataclass(frozen=True)
class UserOutput:
    """User output `position` (flat index in the output pytree)."""

    position: int


@dataclass(frozen=True)
class IntermediateBase:
    """A tensor the program did not return, but whose views it did.

    `leaf_requires_grad`: no returned view reaches it in autograd (all were taken under `no_grad`),
    so the graph returns it non-differentiable (else the inputs would get zero grads instead of
    None); it still requires grad in eager, which views taken of it under `no_grad` inherit, so the
    run time makes it a leaf that requires grad."""

    leaf_requires_grad: bool = False


FwOutputKind = MutatedInputValue | UserOutput | IntermediateBase


@dataclass(frozen=True)
class FwOutput:
    kind: FwOutputKind
    differentiable: bool


@dataclass(frozen=True)
class SymbolSource:
    """Where the run time reads symbol `name` (a dynamic size baked into view arguments or restrides):
    `l{leaf}{accessor}`, e.g. `l3.shape[1]`, or the int argument `l5` itself (accessor "")."""

    name: str
    leaf: int
    accessor: str


@dataclass(frozen=True)
class Plan:
    """Everything the run time needs to know about one compiled signature.

    `out_sources` has one entry per leaf of the output pytree, then one per hidden base: a tensor the
    program did not return (a `.detach()` of an input) whose views it returned, rebuilt once so
    those views share one `._base` as in eager.
    """

    layout: InputLayout
    mutations: tuple[InputMutation, ...]
    fw_outputs: tuple[FwOutput, ...]
    out_spec: TreeSpec
    out_sources: tuple[OutputSource, ...]
    prologue: tuple[SetRequiresGrad, ...]
    epilogue: tuple[EpilogueAction, ...]
    is_training: bool
    symbol_sources: tuple[SymbolSource, ...] = ()
    # Primals that require grad but get no gradient from the graph: handed to the autograd.Function
    # detached, so a backward does not walk their history, which eager's would not reach either.
    grad_free: tuple[int, ...] = ()
    # The caller's autocast state the program was traced under (ambient.autocast_key): its casts
    # are in the graph, so the graph runs with autocast off.
    autocast: tuple = ()
    # False for a training plan of a call made under no_grad whose program turned grad mode on
    # (`torch.enable_grad()`): the autograd.Function is applied with grad mode on, as those ops ran.
    grad_mode_at_call: bool = True
    # An inference plan for a call in grad mode with inputs requiring grad, because nothing the
    # program returns or writes needs a gradient (upstream's rule): its graph runs under no_grad.
    inference_under_grad: bool = False

    @property
    def num_fw_outputs(self) -> int:
        return len(self.fw_outputs)

    @property
    def primals_changed_after_forward(self) -> set[int]:
        """Primals an epilogue action touches (copy_, as_strided_, set_, detach_); a leaf-targeted
        action touches the synthetic base its leaf is a view of."""
        views = self.layout.leaf_views
        return {a.primal if hasattr(a, "primal") else views[a.leaf].primal for a in self.epilogue}


def symbols_in(obj: Any, _depth: int = 0) -> set:
    """The sympy symbols of every symbolic value in `obj` (a plan, or any part of one)."""
    if _depth > 12:
        return set()
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(obj.node.expr.free_symbols)
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
        return set()
    if isinstance(obj, (list, tuple)):
        return set().union(*(symbols_in(v, _depth + 1) for v in obj))
    if isinstance(obj, dict):
        return set().union(*(symbols_in(v, _depth + 1) for v in obj.values()))
    if is_dataclass(obj) and not isinstance(obj, type):
        skip = {"constants", "spec", "out_spec"}
        return set().union(*(symbols_in(getattr(obj, f.name), _depth + 1) for f in fields(obj) if f.name not in skip))
    return set()


@dataclass
class Captured:
    """Output of capture: the graph (joint or inference) and its plan."""

    graph: torch.fx.GraphModule
    plan: Plan
    num_tangents: int = 0
