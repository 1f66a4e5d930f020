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

from .. import observe

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


_INLINE = 32  # up to this many items of a kind, one inline condition each; past it, one `map`


def guard_terms(mod: nn.Module, scope: dict[str, Any], tag: str = "") -> list[str]:
    """Conditions, over names this adds to `scope` (suffixed `tag`), that are True while `mod`'s
    state is what it is now: the flags, the identity of each parameter, buffer and submodule, the
    hook dictionaries' keys. They may raise (a state entry that is gone): callers catch that as
    False. Callers put them in their one generated check (lifting.make_state_guard inlines those of
    every closed-over module, lifting.with_state those into each entry's argument guard).

    Dictionaries empty now (most hook dictionaries, a leaf's `_modules`) are checked in one C loop
    (`not any(...)`). Of each other kind (flags, sizes and keys of the other dictionaries, the
    entries' identities), up to `_INLINE` items get one condition each (`_dict3[k] is _obj5`: 25-50 ns,
    where a `map` term costs 0.3-0.5 us whatever its length), more get one `map` over C functions
    (`attrgetter`, `dict.get`, `operator.is_`, `len`): on a 73-submodule MLP a generated `and`
    chain per submodule took 86 us a call, the maps a few."""
    mods = [m for _, m in mod.named_modules(remove_duplicate=False)]
    sized = [getattr(m, dname) for m in mods for dname in ("_parameters", "_buffers", "_modules")]
    entries = [(d, k, x) for d in sized for k, x in d.items()]
    hooks = [d for _, d in _hook_dicts(mod)]
    filled = [d for d in sized if d]
    scope.update({"_training": operator.attrgetter("training"), "_get": dict.get, "_is": operator.is_})
    terms = []
    flags = [m.training for m in mods]
    if len(mods) <= _INLINE and all(type(f) is bool for f in flags):
        for i, (m, f) in enumerate(zip(mods, flags)):
            scope[f"_mod{i}{tag}"] = m
            terms.append(f"_mod{i}{tag}.training is {f}")
    else:
        scope[f"_mods{tag}"], scope[f"_flags{tag}"] = mods, flags
        terms.append(f"list(map(_training, _mods{tag})) == _flags{tag}")
    empty = [d for d in sized + hooks if not d]
    if empty:
        scope[f"_empty{tag}"] = empty
        terms.append(f"not any(_empty{tag})")
    names = {id(d): f"_dict{i}{tag}" for i, d in enumerate(filled)}
    if len(filled) <= _INLINE:
        for d in filled:
            scope[names[id(d)]] = d
            terms.append(f"len({names[id(d)]}) == {len(d)}")
    else:
        scope[f"_sized{tag}"], scope[f"_sizes{tag}"] = filled, [len(d) for d in filled]
        terms.append(f"list(map(len, _sized{tag})) == _sizes{tag}")
    if len(entries) <= _INLINE:
        for i, (d, k, x) in enumerate(entries):
            scope[names[id(d)]], scope[f"_obj{i}{tag}"] = d, x
            terms.append(f"{names[id(d)]}[{k!r}] is _obj{i}{tag}")
    elif entries:
        owners, keys, objs = (list(c) for c in zip(*entries))
        scope.update({f"_owners{tag}": owners, f"_keys{tag}": keys, f"_objs{tag}": objs})
        terms.append(f"all(map(_is, map(_get, _owners{tag}, _keys{tag}), _objs{tag}))")
    for i, d in enumerate(d for d in hooks if d):  # the same number of hooks may be other ones
        scope[f"_hooks{i}{tag}"], scope[f"_hook_keys{i}{tag}"] = d, tuple(d)
        terms.append(f"tuple(_hooks{i}{tag}) == _hook_keys{i}{tag}")
    return terms


def make_state_guard(mod: nn.Module, state: list) -> Callable[[], bool]:
    """A check that is True while `mod`'s state is what it is now (`guard_terms`)."""
    scope: dict[str, Any] = {}
    src = ("def guard():\n    try:\n        return (\n            " + "\n            and ".join(guard_terms(mod, scope))
           + "\n        )\n    except Exception:  # an entry that is gone\n        return False\n")
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
