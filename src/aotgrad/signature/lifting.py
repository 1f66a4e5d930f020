"""Tensors a program reaches without being passed them (closures, globals, attributes of modules it
closes over), lifted to graph inputs.

Traced as they are, such tensors would be constants of the graph, and the trace would run the
program on them: a closed-over weight that requires grad would silently get no gradient, a
`buf.add_(1)` would be applied once by the trace and once per call, a later value would not be
seen. So the trace runs under `Substitute`, a torch-function mode: a real (not fake, not
functional) tensor that is not yet lifted aborts the op before it runs with `NeedsLifting`; the
caller (`api.CompiledFunction`) then retraces with those tensors as extra leading arguments, and
the mode replaces each lifted tensor object by its graph input wherever the program hands it to a
torch function. Every call passes the tensors' current objects: their current values (and
`requires_grad`) are read per call, their mutations are applied once by the epilogue, as for
arguments, and their gradients land in `.grad`.

Torch-function level, not aten level: autograd sits above the dispatcher, so the substitution has to
happen before autograd records the op for the gradient to reach the lifted input.

Where each lifted tensor lives (a global, a closure cell, a module's parameter / buffer / attribute)
is found by `find_places`; `make_state_guard` turns that into the check that the same objects are
still there, together with the state guard of every module the program closes over
(module_state.py), and `with_state` folds it into each compiled entry's generated argument guard:
one check per call sees a rebound tensor, a reassigned parameter, `train()`/`eval()` or a new hook.
"""

from __future__ import annotations

import functools
import logging
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils import _pytree as pytree

from ..errors import AotgradError, UnsupportedMutationError
from . import module_state, subclass_layout

log = logging.getLogger("aotgrad.lifting")


class NeedsLifting(AotgradError):
    """Internal: the trace met real tensors from outside it; retrace with them lifted."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__(f"aotgrad: {len(tensors)} closed-over tensor(s) met in the trace; retracing with them lifted")
        self.tensors = tensors


def is_outside(x: Any) -> bool:
    """A caller's real tensor (not one of the trace's fakes, functional tensors or rebuilt subclasses)."""
    return (
        isinstance(x, torch.Tensor)
        and not isinstance(x, (FakeTensor, FunctionalTensor))
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
        and not torch._is_functional_tensor(x)  # functionalization's own wrappers, met below its mode
        and not subclass_layout.is_traced(x)  # rebuilt by the subclass stage from traced inner tensors
    )


def _is_traced_value(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not is_outside(x)


def _maybe_outside(a: Any) -> bool:
    """Whether argument `a` may be or hold a tensor from outside the trace."""
    if isinstance(a, (FunctionalTensor, FakeTensor)):
        return False
    return isinstance(a, (torch.Tensor, list, tuple, dict))


class Substitute(torch.overrides.TorchFunctionMode):
    """Replace each lifted tensor object by its graph input; abort, before the op runs, on a real
    tensor not lifted yet (so the trace never touches the caller's tensors)."""

    def __init__(self, lifted: Sequence[torch.Tensor], inputs: Sequence[Any]):
        super().__init__()
        self.by_id = {id(t): v for t, v in zip(lifted, inputs)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            # A higher-order op run eagerly inside the trace (`higher_order.map`) captures its body
            # with Dynamo, which would trace this method too and break the graph on its checks. The
            # op's captured inputs come back through this mode when the op itself is called.
            return func(*args, **kwargs)
        if not kwargs and not any(_maybe_outside(a) for a in args):  # the common case, without pytree
            return func(*args)
        found: list[torch.Tensor] = []

        def swap(x):
            if isinstance(x, torch.Tensor):
                v = self.by_id.get(id(x))
                if v is not None:
                    return v
                if is_outside(x) and all(x is not f for f in found):
                    found.append(x)
            return x

        args, kwargs = pytree.tree_map(swap, (args, kwargs))
        if found:
            raise NeedsLifting(found)
        return func(*args, **kwargs)


def with_lifted(fn: Callable, lifted: Sequence[torch.Tensor]) -> Callable:
    """`fn` taking the lifted tensors' current values as its first `len(lifted)` arguments."""
    n = len(lifted)
    lifted = list(lifted)

    def call(*args, **kwargs):
        with Substitute(lifted, args[:n]):
            return fn(*args[n:], **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def describe(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{type(t).__name__}{tuple(t.shape)}" for t in tensors)


# Where the program reads tensors from ------------------------------------------------------------

_MAX_DEPTH = 3  # functions reached through functions (helpers, a module's forward and its helpers)
_MAX_ITEMS = 64  # lists / tuples / dicts looked into (one level)


@dataclass(frozen=True)
class Place:
    """A slot the program reads a tensor from: `obj[key]` (`obj.get(key)` for a dict; a closure cell's
    contents when `key` is None), with a readable name for errors and logs."""

    obj: Any
    key: Any
    name: str

    def value(self) -> Any:
        try:
            if self.key is None:
                return self.obj.cell_contents
            if isinstance(self.obj, dict):
                return self.obj.get(self.key)
            return self.obj[self.key]
        except (ValueError, IndexError, KeyError, TypeError):  # an empty cell, a shrunk list
            return None

    def expr(self, var: str) -> str:
        if self.key is None:
            return f"{var}.cell_contents"
        return f"{var}.get({self.key!r})" if isinstance(self.obj, dict) else f"{var}[{self.key!r}]"


@dataclass
class Reach:
    """What a program reaches without being passed it: tensor places and closed-over modules."""

    places: list[Place]
    modules: list[tuple[str, nn.Module]]


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):  # lambdas and functions defined inside
            names |= _code_names(c)
    return names


def _is_plain_object(v: Any) -> bool:
    """An instance whose attributes may hold tensors or modules (not a class, a Python module, a
    function, or an object of torch's own)."""
    return (
        hasattr(v, "__dict__")
        and not isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor))
        and not _is_library(type(v))
    )


def _is_library(fn: Any) -> bool:
    return (getattr(fn, "__module__", None) or "").split(".")[0] in ("torch", "aotgrad", "functorch")


class _Walker:
    def __init__(self):
        self.reach = Reach([], [])
        self.seen: set[int] = set()
        self.keys: set[tuple[int, Any]] = set()

    def place(self, obj: Any, key: Any, name: str) -> None:
        if (id(obj), key) not in self.keys:
            self.keys.add((id(obj), key))
            self.reach.places.append(Place(obj, key, name))

    def function(self, fn: Any, depth: int) -> None:
        if isinstance(fn, types.MethodType):
            if isinstance(fn.__self__, nn.Module):
                self.module(fn.__self__, "self", depth)
            fn = fn.__func__
        if not isinstance(fn, types.FunctionType) or id(fn) in self.seen or depth > _MAX_DEPTH:
            return
        if depth and _is_library(fn):
            return
        self.seen.add(id(fn))
        g = fn.__globals__
        where = g.get("__name__", "?")
        for name in sorted(_code_names(fn.__code__)):
            if name in g:
                self.value(g[name], g, name, f"global {name!r} of {where}", name, depth)
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            self.value(v, cell, None, f"closure variable {var!r} of {fn.__qualname__}", var, depth)

    def value(self, v: Any, obj: Any, key: Any, name: str, short: str, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            self.place(obj, key, name)
        elif isinstance(v, nn.Module):
            self.module(v, short, depth)
        elif isinstance(v, (types.FunctionType, types.MethodType)):
            self.function(v, depth + 1)
        elif isinstance(v, (list, tuple, dict)) and len(v) <= _MAX_ITEMS and id(v) not in self.seen:
            self.seen.add(id(v))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(x, torch.Tensor):
                    self.place(v, k, f"{name}[{k!r}]")
                elif isinstance(x, nn.Module):
                    self.module(x, f"{short}[{k!r}]", depth)
        elif _is_plain_object(v) and id(v) not in self.seen and depth < _MAX_DEPTH:
            self.seen.add(id(v))  # an object holding state (a trainer's `self`, a namespace)
            for k, x in list(vars(v).items())[:_MAX_ITEMS]:
                self.value(x, vars(v), k, f"attribute '{short}.{k}'", f"{short}.{k}", depth + 1)

    def module(self, mod: nn.Module, root: str, depth: int) -> None:
        if id(mod) in self.seen:
            return
        self.reach.modules.append((root, mod))
        for path, sub in mod.named_modules():
            if id(sub) in self.seen and sub is not mod:
                continue
            self.seen.add(id(sub))
            at = f"{root}.{path}" if path else root
            for k in sub._parameters:
                self.place(sub._parameters, k, f"parameter '{at}.{k}'")
            for k in sub._buffers:
                self.place(sub._buffers, k, f"buffer '{at}.{k}'")
            for k, v in list(vars(sub).items()):
                if not k.startswith("_") or isinstance(v, torch.Tensor):
                    self.value(v, vars(sub), k, f"tensor attribute '{at}.{k}'", f"{at}.{k}", depth)
            if not _is_library(type(sub)):
                for f in vars(type(sub)).values():
                    if isinstance(f, types.FunctionType):
                        self.function(f, depth + 1)


def find_places(fn: Callable) -> Reach:
    """Where `fn` can reach a tensor from: its globals by name and closure cells, those of the
    functions it reaches there (`_MAX_DEPTH` deep, torch's own skipped), lists/tuples/dicts found
    there (one level), attributes of plain objects (a trainer's `self`), and the parameters,
    buffers and tensor attributes of modules found there (and of the module a bound method
    belongs to). A tensor reached otherwise (deeper, or returned by a call) is still lifted, its
    value read and its mutations applied per call, but its rebinding is not followed."""
    walker = _Walker()
    if isinstance(fn, nn.Module):
        walker.module(fn, type(fn).__name__, 0)
    else:
        walker.function(fn, 0)
    return walker.reach


def module_key(modules: Sequence[nn.Module]) -> tuple:
    """What a trace bakes in of the closed-over modules: submodule types, training flags, hooks,
    parameter/buffer names. A new key gets its own compiled entries (kept: toggling compiles once)."""
    key = []
    for mod in modules:
        names = [n for n, _ in mod.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in mod.named_buffers(remove_duplicate=False)]
        types_ = tuple(type(m) for _, m in mod.named_modules(remove_duplicate=False))
        key.append((types_, module_state.state_key(mod, names)))
    return tuple(key)


def expand(found: Sequence[torch.Tensor], reach: Reach, guarded: Sequence[nn.Module]) -> list[torch.Tensor]:
    """`found` plus every parameter and buffer of the closed-over modules owning one of them: a
    model met through a closure is lifted in one retrace, not one per tensor."""
    out = list(found)
    ids = {id(t) for t in out}
    for _, mod in reach.modules:
        if any(mod is g for g in guarded):
            continue
        state = [t for _, t in mod.named_parameters()] + [t for _, t in mod.named_buffers()]
        if any(id(t) in ids for t in state):
            for t in state:
                if id(t) not in ids:
                    ids.add(id(t))
                    out.append(t)
    return out


# The per-call check ------------------------------------------------------------------------------


def slots_of(lifted: Sequence[torch.Tensor], reach: Reach) -> list[Place | None]:
    """The place each lifted tensor is read from (None: reached through something not followed)."""
    at: dict[int, Place] = {}
    for p in reach.places:
        v = p.value()
        if isinstance(v, torch.Tensor):
            at.setdefault(id(v), p)
    slots = [at.get(id(t)) for t in lifted]
    for t, s in zip(lifted, slots):
        if s is None:
            log.info("aotgrad: a closed-over %s was found in no global, closure cell or module attribute; "
                     "its rebinding will not be followed (its value and mutations are)", describe([t]))
    return slots


def names_of(lifted: Sequence[torch.Tensor], slots: Sequence[Place | None]) -> list[str]:
    return [s.name if s is not None else f"a closed-over {describe([t])}" for t, s in zip(lifted, slots)]


@functools.lru_cache(maxsize=256)
def _code(src: str, filename: str) -> types.CodeType:
    """Compiled once per source: a rebound tensor gives the same source over other objects (compiling
    it was most of the ~90 us a call that finds the change spends)."""
    return compile(src, filename, "exec")


def make_state_guard(lifted: Sequence[torch.Tensor], slots: Sequence[Place | None],
                     modules: Sequence[nn.Module]) -> Callable[[], bool] | None:
    """One generated check, True while every lifted tensor is still the object in its place and
    every closed-over module's state (module_state.make_state_guard) is unchanged; None when there
    is nothing to check. A parameter or buffer of a guarded module needs no check of its own: the
    module's terms check every such slot's identity in one `map`."""
    scope: dict[str, Any] = {}
    terms = []
    covered = {id(d) for mod in modules for sub in mod.modules() for d in (sub._parameters, sub._buffers)}
    for i, (t, s) in enumerate(zip(lifted, slots)):
        if s is not None and id(s.obj) not in covered:
            scope[f"_L{i}"], scope[f"_P{i}"] = t, s.obj
            terms.append(f"{s.expr(f'_P{i}')} is _L{i}")
    for j, mod in enumerate(modules):
        terms += module_state.guard_terms(mod, scope, f"_m{j}")
    if not terms:
        return None
    src = "def check():\n    try:\n        return " + " and ".join(terms) + "\n    except Exception:\n        return False\n"
    exec(_code(src, "<aotgrad closed-over state guard>"), scope)
    check = scope["check"]
    check.__aotgrad_terms__ = terms  # with_state folds them into each entry's argument guard
    return check


def with_state(guard: Callable, state: Callable[[], bool] | None) -> Callable:
    """One generated function checking an entry's arguments (`guard`, from inputs.make_guard or
    dynamic_shapes.call_guard; or an earlier result of this) and then the closed-over state
    (`state`, from make_state_guard), so a call runs one check per entry. The arguments come first:
    an entry whose arguments do not match skips the state's terms. `__aotgrad_args__` keeps the
    argument guard, to fold again with the state guard that replaces `state`; where that one has
    the same terms over other objects (a rebound tensor), the earlier result is kept and its names
    rebound: no code is generated on the call that found the change."""
    previous, guard = guard, getattr(guard, "__aotgrad_args__", guard)
    if state is None:
        return guard
    terms = getattr(state, "__aotgrad_terms__", None)
    conds = getattr(guard, "__aotgrad_conds__", None)
    names = {k: v for k, v in state.__globals__.items() if k not in ("check", "__builtins__")}
    theirs = guard.__globals__
    if terms is None or conds is None or any(k in theirs and theirs[k] is not v for k, v in names.items()):
        scope = {"_args": guard, "_state": state}  # a name both use for other values: call both
        conds, terms = ["_args(args)"], ["_state()"]
    elif previous is not guard and getattr(previous, "__aotgrad_terms__", None) == terms:
        previous.__globals__.update(names)
        return previous
    else:
        scope = {**{k: v for k, v in theirs.items() if k not in ("guard", "__builtins__")}, **names}
    src = ("def guard(args):\n    if not (\n        " + "\n        and ".join(conds) + "\n    ):\n"
           "        return False\n    try:\n        return " + " and ".join(terms) + "\n"
           "    except Exception:  # a place that is gone (an emptied cell, a shrunk list)\n        return False\n")
    exec(_code(src, "<aotgrad guard with closed-over state>"), scope)
    combined = scope["guard"]
    combined.__aotgrad_source__ = src
    combined.__aotgrad_args__ = guard
    if "_state" not in scope:
        combined.__aotgrad_terms__ = terms
    return combined


def read_again(lifted: Sequence[torch.Tensor], slots: Sequence[Place | None], reach: Reach) -> list | None:
    """The tensors now in the lifted tensors' places (looked up by name in a fresh `reach`, so a
    replaced submodule's parameter is found); None when one is gone or no longer a tensor."""
    by_name = {p.name: p for p in reach.places}
    out = []
    for t, s in zip(lifted, slots):
        if s is None:
            out.append(t)
            continue
        p = by_name.get(s.name)
        v = p.value() if p is not None else None
        if not is_outside(v):
            return None
        out.append(v)
    return out


def snapshot(reach: Reach) -> list[tuple[Place, Any]]:
    return [(p, p.value()) for p in reach.places]


def restore_rebound(before: list[tuple[Place, Any]], fn: Callable) -> list[str]:
    """The trace must not leave a traced tensor where the caller's program keeps state (a module
    attribute assigned `self.calls = self.calls + 1`): put the old values back; return the names."""
    leaked = [(p, old) for p, old in before if _is_traced_value(p.value())]
    seen = {(id(p.obj), p.key) for p, _ in before}
    leaked += [(p, None) for p in find_places(fn).places
               if (id(p.obj), p.key) not in seen and _is_traced_value(p.value())]
    for p, old in leaked:
        if old is None and isinstance(p.obj, dict):
            p.obj.pop(p.key, None)
        elif p.key is None:
            p.obj.cell_contents = old
        else:
            p.obj[p.key] = old
    return [p.name for p, _ in leaked]


def rebound_error(names: Sequence[str]) -> UnsupportedMutationError:
    return UnsupportedMutationError(
        f"aotgrad: the program assigns a new tensor to {names[0]} (a tensor it is not passed); a "
        "compiled graph cannot rebind the caller's variables. Update it in place (`t.copy_(new)`, "
        "`t.add_(1)`), or pass it as an argument and return the new value."
    )


def rename_inputs(e: AotgradError, names: Sequence[str]) -> None:
    """Errors from the trace name graph inputs by position; the first `len(names)` are lifted
    tensors: name them by where the program reads them, the caller's arguments by their own index."""
    n = len(names)
    if not n or not e.args or not isinstance(e.args[0], str):
        return

    def sub(m: re.Match) -> str:
        i = int(m.group(2))
        return f"{m.group(1)}closed-over {names[i]}" if i < n else f"{m.group(1)}input {i - n}"

    e.args = (re.sub(r"(\b|^)(?:graph )?input (\d+)\b", sub, e.args[0]),) + e.args[1:]
