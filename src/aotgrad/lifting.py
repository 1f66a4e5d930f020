"""Tensors a program reaches without being passed them (closures, globals, attributes of modules it
closes over), lifted to graph inputs.

Traced as they are, such tensors become constants of the graph: a closed-over weight that requires
grad would silently get no gradient. So the trace runs under `Substitute`, a torch-function mode:
a real (not fake, not functional) tensor that requires grad and is not yet lifted aborts the trace
with `NeedsLifting`; the caller (`api.CompiledFunction`) then retraces with those tensors as extra
leading arguments, and the mode replaces each lifted tensor object by its graph input wherever the
program hands it to a torch function. Every call passes the tensors' current objects, so their
current values (and `requires_grad`) are read per call, and their gradients land in `.grad`.

Torch-function level, not aten level: autograd sits above the dispatcher, so the substitution has to
happen before autograd records the op for the gradient to reach the lifted input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils import _pytree as pytree

from . import subclass_layout
from .errors import AotgradError


class NeedsLifting(AotgradError):
    """Internal: the trace met real tensors that require grad; retrace with them lifted."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__(f"aotgrad: {len(tensors)} closed-over tensor(s) require grad; retracing with them lifted")
        self.tensors = tensors


def _is_real_grad_tensor(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and not isinstance(x, (FakeTensor, FunctionalTensor))
        and x.requires_grad
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
        and not subclass_layout.is_traced(x)  # rebuilt by the subclass stage from traced inner tensors
    )


def _maybe_outside(a: Any) -> bool:
    """Whether argument `a` may be or hold a tensor from outside the trace."""
    if isinstance(a, (FunctionalTensor, FakeTensor)):
        return False
    return isinstance(a, (torch.Tensor, list, tuple, dict))


class Substitute(torch.overrides.TorchFunctionMode):
    """Replace each lifted tensor object by its graph input; abort on a new real tensor requiring grad."""

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
                if _is_real_grad_tensor(x) and all(x is not f for f in found):
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


def _places(fn: Callable) -> list[tuple[str, Any, str]]:
    """Where `fn` can reach a tensor from, as (expression root name, object, how to read): its
    globals by name, its closure cells, and the parameters/buffers of modules found there (and of
    the module a bound method belongs to)."""
    places: list[tuple[str, Any, str]] = []
    modules: list[torch.nn.Module] = []
    code = getattr(fn, "__code__", None)
    if code is not None:
        g = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if name in g:
                places.append(("globals", g, f".get({name!r})"))
                if isinstance(g[name], torch.nn.Module):
                    modules.append(g[name])
        for cell in getattr(fn, "__closure__", None) or ():
            places.append(("cell", cell, ".cell_contents"))
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, torch.nn.Module):
                modules.append(value)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        modules.append(owner)
    for mod in modules:
        for sub in mod.modules():
            for k in sub._parameters:
                places.append(("params", sub._parameters, f".get({k!r})"))
            for k in sub._buffers:
                places.append(("buffers", sub._buffers, f".get({k!r})"))
    return places


def make_source_guard(fn: Callable, lifted: Sequence[torch.Tensor]) -> tuple[Callable[[], bool], Callable[[], list]]:
    """(check, read): `check()` is True while each lifted tensor that was found in a place `fn` reads
    (`_places`) is still the object there; `read()` reads those places again. A tensor found nowhere
    (reached through a helper function) is not checked: its rebinding goes unseen."""
    scope: dict[str, Any] = {}
    exprs: list[str] = []
    places = _places(fn)
    for i, t in enumerate(lifted):
        scope[f"_L{i}"] = t
        expr = f"_L{i}"
        for j, (_, obj, read) in enumerate(places):
            try:
                value = eval(f"_P{read}", {"_P": obj})
            except ValueError:  # an empty cell
                continue
            if value is t:
                scope[f"_P{j}"] = obj
                expr = f"_P{j}{read}"
                break
        exprs.append(expr)
    body = " and ".join(f"{e} is _L{i}" for i, e in enumerate(exprs) if e != f"_L{i}") or "True"
    src = f"def check():\n    return {body}\n\ndef read():\n    return [{', '.join(exprs)}]\n"
    exec(compile(src, "<aotgrad lifted-tensor guard>", "exec"), scope)
    return scope["check"], scope["read"]


def still_liftable(tensors: Sequence[Any]) -> bool:
    return all(_is_real_grad_tensor(t) for t in tensors)
