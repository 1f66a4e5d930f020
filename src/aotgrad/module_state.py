"""Module state that a traced graph bakes in, guarded per call for `aot_module` and
`aot_module_simplified`.

A trace of `module(...)` fixes each submodule's `training` flag (dropout on or off, BatchNorm
updating its running stats or not) and the hooks that ran; the parameters and buffers are graph
inputs, but which tensor objects they are is read when the module is wrapped. So every call first
runs one generated check (`make_state_guard`: the flags, the identity of each parameter, buffer and
submodule, the hook dictionaries' keys, global module hooks included). When it fails, the state is
read again: a reassigned parameter is simply passed instead of the old one, and a new combination of
flags and hooks gets its own compiled function (kept, so train()/eval() toggling compiles once each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
import torch.nn.modules.module as module_globals

from . import observe

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hook_dicts(mod: nn.Module) -> list[tuple[str, dict]]:
    out = [(f"torch.nn global {name}", getattr(module_globals, name)) for name in _GLOBAL_HOOKS]
    for path, m in mod.named_modules(remove_duplicate=False):
        out += [(f"{path or 'the module'}.{d}", getattr(m, d)) for d in _HOOK_DICTS if hasattr(m, d)]
    return out


def state_key(mod: nn.Module, names: list[str]) -> tuple:
    """What selects a compiled function: the training flags, the hooks, the state's names."""
    flags = tuple(m.training for _, m in mod.named_modules(remove_duplicate=False))
    hooks = tuple(tuple(d) for _, d in _hook_dicts(mod))
    return (flags, hooks, tuple(names))


def describe_change(old: tuple, new: tuple) -> str:
    if old[0] != new[0]:
        return "a submodule's training flag changed (train()/eval())"
    if old[1] != new[1]:
        return "module hooks were added or removed"
    return "the module's parameters or buffers were added, removed or renamed"


def make_state_guard(mod: nn.Module, state: list) -> Callable[[], bool]:
    """One generated expression that is True while `mod`'s state is what it is now."""
    scope: dict[str, Any] = {}
    conds = ["True"]
    ids: dict[int, int] = {}

    def name(obj: Any, prefix: str) -> str:
        k = ids.setdefault(id(obj), len(ids))
        scope[f"{prefix}{k}"] = obj
        return f"{prefix}{k}"

    for _, m in mod.named_modules(remove_duplicate=False):
        v = name(m, "_m")
        conds.append(f"{v}.training is {m.training}")
        for dname in ("_parameters", "_buffers", "_modules"):
            d = getattr(m, dname)
            conds.append(f"len({v}.{dname}) == {len(d)}")
            for k, x in d.items():
                conds.append(f"{v}.{dname}.get({k!r}) is {name(x, '_o')}")
    for _, d in _hook_dicts(mod):
        if d:
            conds.append(f"tuple({name(d, '_d')}) == {tuple(d)!r}")
        else:
            conds.append(f"not {name(d, '_d')}")
    src = "def guard():\n    return (\n        " + "\n        and ".join(conds) + "\n    )\n"
    exec(compile(src, "<aotgrad module guard>", "exec"), scope)
    guard = scope["guard"]
    guard.__aotgrad_source__ = src
    return guard


class ModuleState:
    """The compiled function and state tensors to call for `mod`'s current state."""

    def __init__(self, mod: nn.Module, named_state: Callable, make_compiled: Callable[[list[str]], Any]):
        self.mod = mod
        self.named_state = named_state
        self.make_compiled = make_compiled
        self.by_key: dict[tuple, Any] = {}
        self.key: tuple | None = None
        self.refresh()

    def refresh(self) -> None:
        names, state = self.named_state(self.mod)
        key = state_key(self.mod, names)
        if self.key is not None and key != self.key:
            observe.log_recompile(type(self.mod), describe_change(self.key, key))
        compiled = self.by_key.get(key)
        if compiled is None:
            compiled = self.by_key[key] = self.make_compiled(names)
        self.key, self.compiled, self.state = key, compiled, state
        self.guard = make_state_guard(self.mod, state)

    def current(self) -> tuple[Any, list]:
        if not self.guard():
            self.refresh()
        return self.compiled, self.state
