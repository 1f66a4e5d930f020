"""Module state that a traced graph bakes in, guarded per call for `aot_module` and
`aot_module_simplified`.

A trace of `module(...)` fixes each submodule's `training` flag (dropout on or off, BatchNorm
updating its running stats or not) and the hooks that ran; the parameters and buffers are graph
inputs, but which tensor objects they are is read when the module is wrapped. So every call first
runs one check (`make_state_guard`: the flags, the identity of each parameter, buffer and
submodule, the hook dictionaries' keys, global module hooks included). When it fails, the state is
read again: a reassigned parameter is simply passed instead of the old one, and a new combination of
flags and hooks gets its own compiled function (kept, so train()/eval() toggling compiles once each).
"""

from __future__ import annotations

import operator
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


def guard_terms(mod: nn.Module, scope: dict[str, Any], tag: str = "") -> list[str]:
    """Conditions, over names this adds to `scope` (suffixed `tag`), that are True while `mod`'s
    state is what it is now: the flags, the identity of each parameter, buffer and submodule, the
    hook dictionaries' keys. Each is a `map` over C functions (`attrgetter`, `dict.get`,
    `operator.is_`, `len`), no Python code per submodule: on a 73-submodule MLP a generated `and`
    chain per submodule took 86 us a call, this takes a few. Callers put them in their one
    generated check (lifting.make_state_guard inlines those of every closed-over module)."""
    mods = [m for _, m in mod.named_modules(remove_duplicate=False)]
    sized: list[dict] = []
    owners: list[dict] = []
    keys: list[str] = []
    objs: list[Any] = []
    for m in mods:
        for dname in ("_parameters", "_buffers", "_modules"):
            d = getattr(m, dname)
            sized.append(d)
            for k, x in d.items():
                owners.append(d)
                keys.append(k)
                objs.append(x)
    hooks = [d for _, d in _hook_dicts(mod)]
    scope.update({"_training": operator.attrgetter("training"), "_get": dict.get, "_is": operator.is_})
    names = {"mods": mods, "flags": [m.training for m in mods], "sized": sized, "sizes": [len(d) for d in sized],
             "owners": owners, "keys": keys, "objs": objs, "hooks": hooks, "hook_sizes": [len(d) for d in hooks],
             "filled": [(d, tuple(d)) for d in hooks if d]}
    scope.update({f"_{k}{tag}": v for k, v in names.items()})
    return [
        f"list(map(_training, _mods{tag})) == _flags{tag}",
        f"list(map(len, _sized{tag})) == _sizes{tag}",
        f"all(map(_is, map(_get, _owners{tag}, _keys{tag}), _objs{tag}))",
        f"list(map(len, _hooks{tag})) == _hook_sizes{tag}",
        f"all(tuple(d) == k for d, k in _filled{tag})",
    ]


def make_state_guard(mod: nn.Module, state: list) -> Callable[[], bool]:
    """A check that is True while `mod`'s state is what it is now (`guard_terms`)."""
    scope: dict[str, Any] = {}
    src = "def guard():\n    return (\n        " + "\n        and ".join(guard_terms(mod, scope)) + "\n    )\n"
    exec(compile(src, "<aotgrad module state guard>", "exec"), scope)
    return scope["guard"]


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
