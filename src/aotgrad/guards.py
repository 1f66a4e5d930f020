"""What a compiled signature assumes about non-tensor arguments, and why a call recompiles.

A graph bakes in whatever the program read off a non-tensor argument. So each such argument is
keyed (`constant_key`) by what the program can read from it, without holding a strong reference to
the caller's object:

- plain values (int, float, bool, str, None, dtype, device, enum members...): by value;
- functions, classes, builtins and other callables: by identity, through a weak reference where the object takes one
  (a dead reference never equals a live object, so a recycled `id()` cannot match);
- other objects: by type and a snapshot of their attributes (`vars()`), each of which must itself be
  keyable this way — an attribute that changes recompiles, never a stale result;
- hashable values of other libraries (numpy scalars): by value;
- anything else (an object holding tensors, lists, modules; an `nn.Module` argument) is refused
  with an `UnsupportedInputError` that says what to pass instead.

`guard_condition` writes the matching check into the generated fast-path guard (inputs.make_guard),
and `recompile_reason` names what changed between two signatures, for the log and the recompile
warning (api.CompiledFunction).
"""

from __future__ import annotations

import enum
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .errors import UnsupportedInputError

VALUE_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
               torch.layout, enum.Enum, slice, type(Ellipsis))
_IDENTITY_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
                   torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_MAX_DEPTH = 3


class _Snapshot(tuple):
    """The attributes of an object argument: `(type, ((name, key), ...))`."""


def _identity(x: Any) -> Any:
    try:
        return ("obj", weakref.ref(x))
    except TypeError:  # builtins without weakref support live as long as their module
        return ("obj", x)


def constant_key(x: Any, where: str = "argument", depth: int = 0) -> Any:
    """The part of the signature for non-tensor `x` (see module docstring)."""
    if isinstance(x, VALUE_TYPES):
        return (type(x), x)
    if isinstance(x, torch.SymInt) and x.node.is_nested_int():  # a jagged size: which one, and its factor
        return (torch.SymInt, ("nested int", x.node.nested_int(), x.node.nested_int_coeff()))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise UnsupportedInputError(
            f"aotgrad: {where} is a symbolic {type(x).__name__[3:].lower()} ({x.node}) with no value to key the "
            "compiled graph on (an unbacked symbol); pass its value, or compile on fake "
            "tensors of the same ShapeEnv (torch.compile does) so it stays a symbol."
        )
    if isinstance(x, types.MethodType):  # a new bound-method object per attribute access
        return (types.MethodType, ("method", _identity(x.__func__), _identity(x.__self__)))
    if isinstance(x, _IDENTITY_TYPES) or (callable(x) and not isinstance(x, torch.nn.Module)):
        return (type(x), _identity(x))  # what a callable computes cannot be read off its attributes
    if isinstance(x, torch.nn.Module):
        raise UnsupportedInputError(
            f"aotgrad: {where} is an nn.Module ({type(x).__name__}); its parameters, buffers and training flag "
            "would be baked into the graph. Use aot_module(module, ...), or close over the module in the "
            "function instead of passing it."
        )
    if isinstance(x, tuple) and type(x).__hash__ is tuple.__hash__:  # e.g. torch.Size, a tuple subclass
        return (type(x), tuple(constant_key(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)))
    attrs = getattr(x, "__dict__", None)
    if attrs is not None and depth < _MAX_DEPTH and not isinstance(x, torch.Tensor):
        return _Snapshot(
            (type(x), tuple((k, constant_key(v, f"{where}.{k}", depth + 1)) for k, v in sorted(attrs.items())))
        )
    if attrs is None and type(x).__hash__ is not None and type(x).__eq__ is not object.__eq__:
        return (type(x), x)  # a value type of another library (a numpy scalar...)
    raise UnsupportedInputError(
        f"aotgrad: {where} is a {type(x).__name__}, whose contents aotgrad cannot guard (the graph would "
        "keep what the first call read from it). Pass the tensors it holds as tensor arguments and its "
        "settings as int/float/bool/str arguments (or an object whose attributes are such values)."
    )


def guard_condition(x: Any, v: str, i: int, scope: dict) -> list[str]:
    """Fast-path conditions on non-tensor argument `v` (expression) = `x` now; names go into `scope`."""
    scope[f"_T{i}"] = type(x)
    key = constant_key(x, f"argument {i}")
    if isinstance(x, VALUE_TYPES):
        if isinstance(x, enum.Enum):
            scope[f"_C{i}"] = x
            return [f"{v} is _C{i}"]
        scope[f"_C{i}"] = x
        return [f"type({v}) is _T{i}", f"{v} == _C{i}"]
    kind = key[1][0] if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple) else None
    if kind == "obj":
        ref = key[1][1]
        if isinstance(ref, weakref.ref):
            scope[f"_W{i}"] = ref
            return [f"_W{i}() is {v}"]
        scope[f"_C{i}"] = ref
        return [f"{v} is _C{i}"]
    scope["_constant_key"] = _safe_key
    scope[f"_K{i}"] = key
    return [f"_constant_key({v}) == _K{i}"]


def _safe_key(x: Any) -> Any:
    try:
        return constant_key(x)
    except UnsupportedInputError:
        return None


def weak_parts(key: tuple) -> list[weakref.ref]:
    """The weak references inside a signature (their death makes the entry unreachable)."""
    found: list[weakref.ref] = []

    def walk(k: Any) -> None:
        if isinstance(k, weakref.ref):
            found.append(k)
        elif isinstance(k, tuple):
            for p in k:
                walk(p)

    walk(key)
    return found


_TENSOR_FIELDS = ("type", "shape", "stride", "storage offset", "dtype", "device", "layout", "requires_grad",
                  "is_leaf")


def recompile_reason(old: tuple, new: tuple, names: Sequence[str]) -> str:
    """What differs between two signatures (inputs.signature), e.g. "args[0]: shape (3, 4) -> (5, 4)".

    `names` names each leaf (`leaf_names`)."""
    if old[0] != new[0]:
        return "the structure of the arguments (number, nesting, keyword names)"
    if old[1] != new[1]:
        return f"grad mode ({old[1]} -> {new[1]})"
    if old[2] != new[2]:
        return f"autocast ({_show(old[2]) if old[2] else 'off'} -> {_show(new[2]) if new[2] else 'off'})"
    reasons = []
    for i, (a, b) in enumerate(zip(old[3:-1], new[3:-1])):
        if a == b:
            continue
        name = names[i] if i < len(names) else f"leaf {i}"
        if _is_tensor_key(a) and _is_tensor_key(b):
            for field, x, y in zip(_TENSOR_FIELDS, a, b):
                if x != y:
                    reasons.append(f"{name}: {field} {_show(x)} -> {_show(y)}")
        else:
            reasons.append(f"{name}: value {_show(a)} -> {_show(b)}")
    if old[-1] != new[-1]:
        reasons.append("which arguments alias each other")
    return "; ".join(reasons) or "the signature"


def _is_tensor_key(k: Any) -> bool:
    return isinstance(k, tuple) and len(k) == len(_TENSOR_FIELDS) and isinstance(k[0], type) and issubclass(
        k[0], torch.Tensor
    )


def _show(x: Any) -> str:
    if isinstance(x, torch.Size):
        return str(tuple(x))
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], type):
        v = x[1]
        if isinstance(v, tuple) and v and v[0] == "obj":
            return f"{x[0].__name__} object"
        if isinstance(x, _Snapshot):
            return f"{x[0].__name__}({', '.join(f'{k}={_show(s)}' for k, s in v)})"
        return repr(v)
    return repr(x)


def part_names(reason: str) -> list[str]:
    """The parts of a reason that name what changed ("args[0]: shape"), for counting repeats."""
    out = []
    for r in reason.split("; "):
        name, _, rest = r.partition(": ")
        out.append(f"{name}: {rest.split(' ')[0]}" if rest else name)
    return out


def leaf_names(args: tuple, kwargs: dict, num_lifted: int) -> list[str]:
    """A readable name per flattened leaf: `args[1]`, `kwargs['k'][0]`, `closed-over tensor 0`."""
    paths = [p for p, _ in torch.utils._pytree.tree_flatten_with_path((args, kwargs))[0]]
    names = []
    for path in paths:
        top, rest = path[0].idx, torch.utils._pytree.keystr(path[1:])
        if top == 0 and path[1].idx < num_lifted:
            names.append(f"closed-over tensor {path[1].idx}")
        elif top == 0:
            names.append(f"args[{path[1].idx - num_lifted}]" + torch.utils._pytree.keystr(path[2:]))
        else:
            names.append("kwargs" + rest)
    return names
