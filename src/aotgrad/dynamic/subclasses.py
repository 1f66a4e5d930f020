"""Symbolic sizes at the subclass boundary: one compiled plain graph serving every shape.

Traced on fakes with symbolic sizes (Dynamo's `dynamic=True` / `mark_dynamic`), a subclass's outer
size and stride, and the view arguments of outputs replayed at the subclass level, are SymInts.
The plain pipeline inside is shape-generic already (dynamic/shapes.py); only the boundary's
run time (subclass_runtime.build_run) bakes layouts into generated code. So the boundary of a
symbolic signature becomes a `SymbolicRun`: per call it reads the symbols' values off the caller's
leaves (a generated straight-line reader: `(l0, l2.a.shape[0], ...)`), and runs the boundary's
generated run built for those values (the boundary with every SymInt replaced, built once per
distinct set of values and kept in a small cache). The compiled graphs are shared by all shapes;
only the few lines of prologue/epilogue are generated per shape.

Nested ints (a jagged NestedTensor's ragged size, tied to its offsets) are not read off anything:
the NestedTensor rebuilds them from its offsets and ignores the outer size it is given at run time,
so they become -1, as upstream's `make_runtime_safe` does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from ..errors import UnsupportedOutputError
from ..signature.subclass_layout import (
    Opaque,
    SubclassLayout,
    flatten,
    guard_conditions,
    is_subclass,
    with_inner_tensors,
)

log = logging.getLogger("aotgrad.subclass")

_SKIP = frozenset({"spec", "out_spec", "ctx", "ctx_key", "cls", "op"})
_MAX_RUNS = 64  # generated runs kept per signature (one per distinct shape seen)


def is_nested_int(v: Any) -> bool:
    return isinstance(v, torch.SymInt) and v.node.is_nested_int()


def _symbols(v: Any) -> set:
    if isinstance(v, torch.SymInt) and not v.node.is_nested_int():
        return set(v.node.expr.free_symbols)
    return set()


def symbols_of(obj: Any, _depth: int = 0) -> set:
    """Free symbols of every (non-nested) SymInt in a boundary, a layout or a view chain."""
    if _depth > 16:
        return set()
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _symbols(obj) if isinstance(obj, torch.SymInt) else set(obj.node.expr.free_symbols)
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None), Opaque)):
        return set()
    if isinstance(obj, (list, tuple, set, frozenset)):
        return set().union(*(symbols_of(v, _depth + 1) for v in obj))
    if isinstance(obj, dict):
        return set().union(*(symbols_of(v, _depth + 1) for v in obj.values()))
    if is_dataclass(obj) and not isinstance(obj, type):
        return set().union(*(symbols_of(getattr(obj, f.name), _depth + 1) for f in fields(obj) if f.name not in _SKIP))
    return set()


def has_symbolic(obj: Any, _depth: int = 0) -> bool:
    """Whether any SymInt (nested ints included) remains in `obj`."""
    if _depth > 16:
        return False
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None), Opaque)):
        return False
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(has_symbolic(v, _depth + 1) for v in obj)
    if isinstance(obj, dict):
        return any(has_symbolic(v, _depth + 1) for v in obj.values())
    if is_dataclass(obj) and not isinstance(obj, type):
        return any(has_symbolic(getattr(obj, f.name), _depth + 1) for f in fields(obj) if f.name not in _SKIP)
    return False


# ---------------------------------------------------------------------------------------------
# Where the run time reads each symbol


def symbol_exprs(leaves: Sequence[Any], layouts: Sequence[SubclassLayout | None]) -> dict:
    """symbol -> source over the caller's leaves `l{i}` that reads it: an int argument that is the
    symbol, else a size, stride or offset of a plain argument, of a subclass argument or of one of
    its plain inner tensors (`l2.a.shape[0]`)."""
    found: dict = {}

    def offer(v: Any, src: str) -> None:
        if isinstance(v, torch.SymInt) and not v.node.is_nested_int():
            expr = v.node.expr
            if expr.is_Symbol and expr not in found:
                found[expr] = src

    def offer_tensor(t: torch.Tensor, src: str) -> None:
        for d, v in enumerate(t.shape):
            offer(v, f"{src}.shape[{d}]")
        for d, v in enumerate(t.stride()):
            offer(v, f"{src}.stride({d})")
        offer(t.storage_offset(), f"{src}.storage_offset()")

    for i, x in enumerate(leaves):
        offer(x, f"l{i}")
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        lay = layouts[i] if i < len(layouts) else None
        if lay is None:
            offer_tensor(x, f"l{i}")
            continue
        paths: list = []
        _inner_paths(lay, f"l{i}", paths)
        plains: list = []
        flatten(x, lay, plains)
        for path, t in zip(paths, plains):
            offer_tensor(t, path)
        if not x.is_nested:  # a NestedTensor's outer size holds its nested int
            offer_tensor(x, f"l{i}")
    return found


def _inner_paths(layout: SubclassLayout, prefix: str, out: list) -> None:
    for attr, inner in zip(layout.attrs, layout.inner):
        if inner is None:
            out.append(f"{prefix}.{attr}")
        elif not isinstance(inner, Opaque):
            _inner_paths(inner, f"{prefix}.{attr}", out)


# ---------------------------------------------------------------------------------------------
# Replacing SymInts by the values of one call


def specialize(obj: Any, env: dict, memo: dict | None = None, _depth: int = 0) -> Any:
    """`obj` with every SymInt replaced by its value under `env` (symbol -> int); nested ints
    become -1. Dataclasses are copied (shared ones once), everything else is kept as is."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.SymInt):
        return -1 if obj.node.is_nested_int() else int(obj.node.expr.xreplace(env))
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None), Opaque)) or _depth > 16:
        return obj
    if isinstance(obj, (list, tuple)):
        items = [specialize(v, env, memo, _depth + 1) for v in obj]
        new = items if isinstance(obj, list) else tuple(items)
    elif isinstance(obj, dict):
        new = {k: specialize(v, env, memo, _depth + 1) for k, v in obj.items()}
    elif is_dataclass(obj) and not isinstance(obj, type) and has_symbolic(obj):
        changes = {f.name: specialize(getattr(obj, f.name), env, memo, _depth + 1)
                   for f in fields(obj) if f.init and f.name not in _SKIP}
        if "symbolic" in changes:  # a SubclassLayout: its outer size and stride are ints now
            changes["symbolic"] = False
        new = replace(obj, **changes)
    else:
        return obj
    memo[id(obj)] = new
    return new


class SymbolicRun:
    """The run time of a boundary with symbolic layouts: per call, the generated run for the
    values of its symbols (built on first sight of those values)."""

    def __init__(self, boundary, build: Callable, names: list, reader: Callable):
        self.boundary, self.build, self.names, self.reader = boundary, build, names, reader
        self.runs: OrderedDict = OrderedDict()

    def __call__(self, leaves):
        key = self.reader(leaves)
        run = self.runs.get(key)
        if run is None:
            env = dict(zip(self.names, key))
            run = self.build(specialize(self.boundary, env))
            self.runs[key] = run
            if len(self.runs) > _MAX_RUNS:
                self.runs.popitem(last=False)
            log.debug("aotgrad: subclass boundary run generated for %s", env)
        return run(leaves)


def _reader(exprs: list[str], n: int) -> Callable:
    """Generated: the tuple of the symbols' values, read off the caller's `n` leaves."""
    src = "def read(leaves):\n"
    src += f"    ({''.join(f'l{i}, ' for i in range(n))}) = leaves\n"
    src += f"    return ({''.join(f'{e}, ' for e in exprs)})\n"
    scope: dict = {}
    exec(compile(src, "<aotgrad subclass symbol reader>", "exec"), scope)
    read = scope["read"]
    read.__aotgrad_source__ = src
    return read


def runner(boundary, leaves: Sequence[Any], build: Callable) -> Callable:
    """`build(boundary)` (the boundary's generated run), or, where the boundary holds SymInts, a
    `SymbolicRun` calling `build` on the boundary specialized per shape. Refuses (an `AotgradError`
    naming the output) a symbol the run time cannot read off the caller's arguments; the backend
    then compiles per shape."""
    parts = [boundary.sites, boundary.spread, boundary.outputs, boundary.layouts]
    if not has_symbolic(parts):
        return build(boundary)
    exprs = symbol_exprs(leaves, boundary.layouts)
    needed = symbols_of(parts)
    missing = needed - exprs.keys()
    if missing:
        where = next((f"output {k}" for k, o in enumerate(boundary.outputs) if symbols_of(o) & missing), "an input")
        raise UnsupportedOutputError(
            f"aotgrad: {where} of the subclass boundary has a symbolic size ({', '.join(map(str, missing))}) "
            "that cannot be read off the arguments; mark the inputs static."
        )
    names = sorted(needed, key=str)
    if not names:  # only nested ints: one generated run serves every call
        return build(specialize(boundary, {}))
    return SymbolicRun(boundary, build, names, _reader([exprs[s] for s in names], len(boundary.layouts)))


# ---------------------------------------------------------------------------------------------
# aot_function(dynamic=True): subclass arguments in a ShapeEnv of aotgrad's own (dynamic/shapes.py)


def symbolic_ok(x: torch.Tensor) -> bool:
    """A subclass argument `aot_function(dynamic=True)` traces with symbolic sizes: a traceable
    wrapper subclass, not a jagged NestedTensor (whose ragged size needs Dynamo's symbol)."""
    return is_subclass(x) and not x.is_nested


def guard_contexts(placeholders: Sequence[Any]) -> list | None:
    """`ShapeEnv.produce_guards`' input contexts: a SubclassSymbolicContext (nested as the subclass
    is) for each subclass placeholder, None (the default) for the others; None without subclasses."""
    if not any(is_subclass(t) for t in placeholders):
        return None
    return [_context(t) if is_subclass(t) else None for t in placeholders]


def _context(t: torch.Tensor):
    from torch._dynamo.source import (
        LocalSource,  # required by the context; produce_guards uses its own sources
    )
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        StatelessSymbolicContext,
        SubclassSymbolicContext,
    )

    def stateless(x):
        return StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * x.dim(),
                                        dynamic_strides=[DimDynamic.INFER_STRIDE] * x.dim(),
                                        constraint_sizes=[None] * x.dim(), constraint_strides=[None] * x.dim())

    attrs, _ = t.__tensor_flatten__()
    inner = {a: _context(getattr(t, a)) if is_subclass(getattr(t, a)) else stateless(getattr(t, a))
             for a in attrs if isinstance(getattr(t, a), torch.Tensor)}
    return SubclassSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim(),
                                   dynamic_strides=[DimDynamic.INFER_STRIDE] * t.dim(),
                                   constraint_sizes=[None] * t.dim(), constraint_strides=[None] * t.dim(),
                                   inner_contexts=inner, tensor_source=LocalSource("_subclass"))


def structure_conditions(fake: torch.Tensor, v: str, scope: dict) -> list[str]:
    """Guard conditions that argument `v` is a subclass of `fake`'s type, flatten context and
    nesting, over inner tensors of its dtypes, devices, requires_grad, ranks and static sizes, none
    sharing memory with another (the symbolic sizes are the ShapeEnv's guards)."""
    from ..signature.inputs import alias_key

    scope["_inner_alias_key"] = lambda t: alias_key(with_inner_tensors([t]))
    return [*guard_conditions(fake, v, scope, _inner_conditions), f"not _inner_alias_key({v})"]


def _inner_conditions(t: torch.Tensor, e: str, scope: dict) -> list[str]:
    n = len(scope)
    scope[f"_SD{n}"], scope[f"_SDEV{n}"] = t.dtype, t.device
    conds = [f"type({e}) in _PLAIN", f"{e}.dtype is _SD{n}", f"{e}.device == _SDEV{n}",
             f"{e}.requires_grad is {t.requires_grad}", f"{e}.layout is torch.strided", f"{e}.dim() == {t.dim()}"]
    for what, values in (("size", t.shape), ("stride", t.stride())):
        for d, s in enumerate(values):
            if isinstance(s, int) or s.node.expr.is_number:
                conds.append(f"{e}.{what}({d}) == {int(s)}")
    offset = t.storage_offset()
    if isinstance(offset, int) or offset.node.expr.is_number:
        conds.append(f"{e}.storage_offset() == {int(offset)}")
    return conds
