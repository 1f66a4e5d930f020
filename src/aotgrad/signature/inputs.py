"""Stage 1 — inputs: flatten the caller's arguments, key them, and lay them out as graph inputs.

A compiled graph is only valid for arguments like the ones it was traced with. `signature` is the
cache key: for each tensor its type, shape, strides, offset, dtype, device, `requires_grad`,
leaf-ness and which other arguments share its storage; for each non-tensor its value, identity (held
weakly) or attribute snapshot (signature/guards.py); plus grad mode. Anything else changes the key, so a graph that no longer fits is never reused.

`layout_for` decides the graph inputs ("primals"): one per distinct tensor (duplicates collapse), or
one *synthetic base* per group of arguments that view one storage when the program mutates them,
so the mutation reaches every alias inside the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import UnsupportedAliasingError, UnsupportedInputError
from ..plan import BaseOfLeaf, FromLeaf, InputLayout, StorageOfLeaf, SymbolSource, ViewOfPrimal
from . import guard_tensors, guards, subclass_layout
from .ambient import any_autocast, autocast_key

_HASHABLE_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten((args, kwargs))


def _storage_id_via_object(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# Which storage a tensor uses, as an int: the address of its StorageImpl. `torch._C._storage_id`
# reads it without building a Python storage object; on an optimizer step's few hundred inputs,
# right after the kernel ran, that is ~3x cheaper (50 us against 150 us per call).
storage_id = getattr(torch._C, "_storage_id", _storage_id_via_object)


def _constant_key(v: Any) -> Any:
    if isinstance(v, _HASHABLE_CONSTANTS):
        return (type(v), v)
    return guards.constant_key(v)


def tensor_key(t: torch.Tensor) -> tuple:
    if t.layout is not torch.strided:  # no strides or offset: the key only leads to check_supported's refusal
        return (type(t), t.shape, t.dtype, t.device, t.layout, t.requires_grad, t.is_leaf)
    key = (
        type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.layout,
        t.requires_grad, t.is_leaf,
    )
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # type, nesting, context, inner keys
        return key + subclass_layout.signature_part(t, tensor_key)
    return key


def alias_key(leaves: Sequence[Any]) -> tuple:
    """Which tensor leaves are the same object, and which share a storage (canonical numbering)."""
    seen_obj: dict[int, int] = {}
    seen_storage: dict[int, int] = {}
    key = []
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if id(x) in seen_obj:
            key.append((i, "same", seen_obj[id(x)]))
            continue
        seen_obj[id(x)] = i
        if x.layout is not torch.strided or is_wrapper(x):
            continue
        s = storage_id(x)
        if s in seen_storage:
            j = seen_storage[s]
            base_i, base_j = x._base, leaves[j]._base
            key.append((i, "storage", j, base_i is not None and base_i is base_j, base_i is leaves[j]))
        else:
            seen_storage[s] = i
    return tuple(key)


def is_wrapper(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(
        t, torch._subclasses.FakeTensor
    )


def being_traced(leaves: Sequence[Any]) -> bool:
    """Whether these are a trace's stand-ins (functional or fake tensors), not a caller's tensors."""
    return any(
        isinstance(x, (FunctionalTensor, torch._subclasses.FakeTensor)) for x in leaves if isinstance(x, torch.Tensor)
    )


def signature(leaves: Sequence[Any], spec: pytree.TreeSpec) -> tuple:
    """The cache key of a call (see module docstring)."""
    parts = [spec, torch.is_grad_enabled(), autocast_key()]
    for x in leaves:
        parts.append(tensor_key(x) if isinstance(x, torch.Tensor) else _constant_key(x))
    parts.append(alias_key(leaves))
    if any(isinstance(x, torch.Tensor) and is_wrapper(x) for x in leaves):  # inner tensors sharing memory
        parts.append(alias_key(subclass_layout.with_inner_tensors(leaves)))
    return tuple(parts)


def check_supported(leaves: Sequence[Any]) -> None:
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and is_wrapper(x):
            raise UnsupportedInputError(
                f"aotgrad: input {i} is a tensor subclass ({type(x).__name__}); aotgrad does not trace "
                "tensor subclasses yet. Pass its inner tensors as separate inputs."
            )
        if isinstance(x, torch.Tensor) and x.layout is not torch.strided:
            raise UnsupportedInputError(
                f"aotgrad: input {i} has layout {x.layout}; only strided (dense) tensors can be graph "
                "inputs. Convert it with .to_dense() before the call."
            )


def storage_groups(leaves: Sequence[Any]) -> list[list[int]]:
    """Groups (size >= 2) of distinct tensor leaves that share one storage."""
    groups: dict[int, list[int]] = {}
    seen_obj: set[int] = set()
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and id(x) not in seen_obj:
            seen_obj.add(id(x))
            if x.layout is torch.strided and not is_wrapper(x):
                groups.setdefault(storage_id(x), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def layout_for(
    leaves: Sequence[Any], spec: pytree.TreeSpec, merge_groups: Sequence[Sequence[int]] = ()
) -> InputLayout:
    """One primal per distinct tensor, except `merge_groups`, which each become one synthetic base."""
    constants: dict[int, Any] = {}
    sources: list = []
    leaf_primal: list = [None] * len(leaves)
    leaf_views: dict[int, ViewOfPrimal] = {}
    first_leaf: dict[int, int] = {}
    group_of = {i: g for g in merge_groups for i in g}
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            constants[i] = x
            continue
        if id(x) in first_leaf:  # the same tensor passed twice: one graph input
            j = first_leaf[id(x)]
            leaf_primal[i] = leaf_primal[j]
            if j in leaf_views:
                leaf_views[i] = leaf_views[j]
            continue
        first_leaf[id(x)] = i
        if i in group_of:
            g = group_of[i]
            if i == g[0]:
                sources.append(_synthetic_base_source(leaves, g))
            primal = len(sources) - 1 if i == g[0] else leaf_views[g[0]].primal
            leaf_views[i] = ViewOfPrimal(primal, tuple(x.shape), tuple(x.stride()), x.storage_offset())
            continue
        leaf_primal[i] = len(sources)
        sources.append(FromLeaf(i))
    return InputLayout(spec, len(leaves), constants, tuple(sources), tuple(leaf_primal), leaf_views)


def _synthetic_base_source(leaves: Sequence[Any], group: Sequence[int]):
    members = [leaves[i] for i in group]
    if any(m.dtype != members[0].dtype for m in members):
        raise UnsupportedAliasingError(
            f"aotgrad: inputs {list(group)} share one storage with different dtypes and one is mutated; "
            "pass separate tensors (clone one of them)."
        )
    roots = {id(m._base if m._base is not None else m) for m in members}
    head = members[0]
    # A base of another dtype (view_as_real, .real of a complex tensor) cannot hold the members as
    # strided views in their own element units.
    same_dtype_base = head._base is None or head._base.dtype == head.dtype
    if len(roots) == 1 and same_dtype_base:
        if head._base is not None:
            return BaseOfLeaf(group[0])
        return FromLeaf(group[0])
    if not any(m.requires_grad for m in members):
        return StorageOfLeaf(group[0])
    if not same_dtype_base:
        raise UnsupportedAliasingError(
            f"aotgrad: inputs {list(group)} share one storage, one of them is mutated and requires grad, and "
            f"they are views of a {head._base.dtype} tensor while they are {head.dtype} (e.g. view_as_real); "
            "pass separate tensors (clone one of them)."
        )
    raise UnsupportedAliasingError(
        f"aotgrad: inputs {list(group)} overlap in memory, one of them is mutated, and they do not come "
        "from one autograd base (e.g. they were made with .detach() or under no_grad). Pass views of "
        "one tensor, or clone the inputs before the call."
    )


def storage_base(t: torch.Tensor) -> torch.Tensor:
    """A flat 1-D tensor over all of `t`'s storage (used as a synthetic base without autograd).

    A view of `t.detach()`, so it shares `t`'s version counter: the epilogue's writes into it bump the
    caller's tensors as eager's in-place ops on them do."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.detach().as_strided((n,), (1,), 0)


def primal_values(layout: InputLayout, leaves: Sequence[Any]) -> list[torch.Tensor]:
    """The real tensors passed as primals (compile-time twin of the generated prologue)."""
    out = []
    for src in layout.primal_sources:
        x = leaves[src.leaf]
        if isinstance(src, FromLeaf):
            out.append(x)
        elif isinstance(src, BaseOfLeaf):
            out.append(x._base)
        else:
            out.append(storage_base(x))
    return out


def make_guard(leaves: Sequence[Any], spec: pytree.TreeSpec, check_aliasing: bool):
    """Generated straight-line check that positional `args` match this signature, or None when the
    call had keyword arguments or nested containers (those take the slow path: flatten + key).

    It checks what `signature` keys on, except storage sharing between distinct tensors, which it
    checks only when `check_aliasing` (the plan mutates an input or merged aliased inputs): a
    functional graph gives eager's results for inputs that overlap in memory.
    """
    n = len(leaves)
    if spec != pytree.tree_flatten((tuple(leaves), {}))[1]:
        return None
    scope: dict[str, Any] = {"_grad_enabled": torch.is_grad_enabled, "_alias_key": alias_key}
    conds = [f"len(args) == {n}", f"_grad_enabled() is {torch.is_grad_enabled()}"]
    autocast = autocast_key()
    scope["_any_autocast"] = any_autocast
    if autocast:
        scope["_autocast_key"], scope["_AC"] = autocast_key, autocast
        conds.append("_autocast_key() == _AC")
    else:
        conds.append("not _any_autocast()")
    first: dict[int, int] = {}
    for i, x in enumerate(leaves):
        v = f"args[{i}]"
        scope[f"_T{i}"] = type(x)
        if isinstance(x, torch.Tensor):
            if id(x) in first:
                conds.append(f"{v} is args[{first[id(x)]}]")
                continue
            first[id(x)] = i
            scope[f"_S{i}"], scope[f"_ST{i}"] = x.shape, x.stride()
            scope[f"_D{i}"], scope[f"_DEV{i}"] = x.dtype, x.device
            if type(x) is not torch.Tensor and is_traceable_wrapper_subclass(x):
                conds += subclass_layout.guard_conditions(x, v, scope, _inner_tensor_conds)
            conds += [
                f"type({v}) is _T{i}", f"{v}.storage_offset() == {x.storage_offset()}",
                guard_tensors.metadata(x, v, f"_S{i}", f"_ST{i}", f"_D{i}", f"_DEV{i}"),
            ]
            if check_aliasing and x.requires_grad:  # without grad it is a leaf (requires_grad is checked)
                conds.append(f"{v}.is_leaf is {x.is_leaf}")
        elif isinstance(x, _HASHABLE_CONSTANTS):
            scope[f"_C{i}"] = x
            conds += [f"type({v}) is _T{i}", f"{v} == _C{i}"]
        else:
            conds += guards.guard_condition(x, v, i, scope)
    if check_aliasing:
        scope["_AK"] = alias_key(leaves)
        conds.append("_alias_key(args) == _AK")
    if "_inner_tensors" in scope:  # subclass arguments: their inner tensors' identities (merged primals)
        conds += _inner_identity_conds(leaves, scope.pop("_inner_tensors"))
        if check_aliasing:
            scope["_inner"], scope["_IAK"] = subclass_layout.with_inner_tensors, alias_key(
                subclass_layout.with_inner_tensors(leaves))
            conds.append("_alias_key(_inner(args)) == _IAK")
    conds = guard_tensors.resolve(conds, scope)
    src = "def guard(args):\n    return (\n        " + "\n        and ".join(conds) + "\n    )\n"
    exec(compile(src, "<aotgrad guard>", "exec"), scope)
    guard = scope["guard"]
    guard.__aotgrad_source__ = src
    guard.__aotgrad_conds__ = conds  # lifting.with_state folds them with the state's
    return guard


def _inner_identity_conds(leaves: Sequence[Any], inner: list[tuple[torch.Tensor, str]]) -> list[str]:
    """`is` checks for inner tensors that were one object (with each other or an argument) when compiled."""
    first: dict[int, str] = {id(x): f"args[{i}]" for i, x in reversed(list(enumerate(leaves)))
                             if isinstance(x, torch.Tensor)}
    conds = []
    for t, v in inner:
        if first.setdefault(id(t), v) != v:
            conds.append(f"{v} is {first[id(t)]}")
    return conds


def _inner_tensor_conds(t: torch.Tensor, v: str, scope: dict) -> list[str]:
    """A plain inner tensor of a subclass argument, checked as a plain argument is."""
    scope.setdefault("_inner_tensors", []).append((t, v))
    n = len(scope)
    scope[f"_IT{n}"], scope[f"_IS{n}"], scope[f"_IST{n}"] = type(t), t.shape, t.stride()
    scope[f"_ID{n}"], scope[f"_IDEV{n}"] = t.dtype, t.device
    leaf = [f"{v}.is_leaf is {t.is_leaf}"] if t.requires_grad else []  # without grad it is a leaf
    return [
        f"type({v}) is _IT{n}", *leaf, f"{v}.storage_offset() == {t.storage_offset()}",
        guard_tensors.metadata(t, v, f"_IS{n}", f"_IST{n}", f"_ID{n}", f"_IDEV{n}"),
    ]


def symbol_sources(leaves: Sequence[Any], symbols: set) -> tuple[SymbolSource, ...]:
    """For each symbol, a place in the (fake, symbolic) leaves the run time can read it from: an int
    argument that is the symbol, else a tensor size, stride or storage offset that is. Symbols found
    nowhere are left out (the caller then compiles per concrete shape)."""
    found: dict = {}

    def offer(symbolic: Any, leaf: int, accessor: str) -> None:
        if isinstance(symbolic, torch.SymInt):
            expr = symbolic.node.expr
            if expr in symbols and expr not in found:
                found[expr] = SymbolSource(str(expr), leaf, accessor)

    for i, x in enumerate(leaves):
        offer(x, i, "")
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            for d, v in enumerate(x.shape):
                offer(v, i, f".shape[{d}]")
            for d, v in enumerate(x.stride()):
                offer(v, i, f".stride({d})")
            offer(x.storage_offset(), i, ".storage_offset()")
    return tuple(found.values())
