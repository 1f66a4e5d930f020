"""Symbolic sizes in the backend: one plan per concrete signature (`_PerShape`), anchors that keep
Dynamo's size symbols bound, and whether a plan needs concrete sizes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from .. import config
from ..compile.compilers import AOTConfig
from ..dynamic.shapes import context_fake_mode as _context_fake_mode
from ..dynamic.shapes import free_symbols as _free_symbols
from ..inductor.context import _describe_failure, _must_propagate
from ..signature.subclass_layout import is_subclass, with_inner_tensors


class _PerShape:
    """aotgrad's own per-signature cache (exact shapes, generated guards) for graphs the backend
    cannot compile shape-generically. A signature that fails to compile raises a
    `BackendCompileError`, or with `config.fallback_to_eager` warns once and runs eagerly."""

    def __init__(self, fn: Callable, aot_config: AOTConfig):
        # the tracer: imported here, a load (which never compiles per shape) does not need it
        from ..api import CompiledFunction

        self.inner = CompiledFunction(fn, aot_config)

    def prepare(self, leaves: list) -> Callable:
        from ..api import _plan_depends_on_aliasing, compile_signature
        from ..signature import inputs as inputs_stage

        inner = self.inner
        spec = pytree.tree_flatten((tuple(leaves), {}))[1]
        key = inputs_stage.signature(leaves, spec)
        run = inner.cache.get(key)
        if run is not None:
            return run
        try:
            run = compile_signature(inner.fn, leaves, spec, inner.config)
            guard = inputs_stage.make_guard(leaves, spec, _plan_depends_on_aliasing(run.plan))
        except Exception as e:
            if _must_propagate(e):
                raise
            err = _describe_failure(e, inner.fn if isinstance(inner.fn, torch.fx.GraphModule) else None)
            if not config.fallback_to_eager:
                raise err from e
            warnings.warn(f"{err} Running this graph eagerly for these shapes "
                          "(aotgrad.config.fallback_to_eager).", stacklevel=2)
            fn = inner.fn

            def run(leaves):
                return fn(*leaves)

            guard = None
        inner.cache[key] = run
        if guard is not None:
            inner.fast.insert(0, (guard, run))
        return run

    def __call__(self, leaves) -> Any:
        for guard, run in self.inner.fast:
            if guard(leaves):
                return run(leaves)
        return self.prepare(list(leaves))(leaves)


class _Anchored:
    """Append a zero-stride anchor tensor for each free SymInt argument (see `_anchor_positions`)."""

    _ANCHOR = torch.empty(())

    def __init__(self, run: Callable, positions: list[int]):
        self.run, self.positions = run, positions

    def __call__(self, leaves) -> Any:
        anchor = self._ANCHOR
        return self.run([*leaves, *(anchor.expand(leaves[i]) for i in self.positions)])


def _anchor_positions(leaves: list) -> list[int]:
    """Positions of SymInt arguments that are a bare symbol no tensor argument's size carries."""
    import sympy

    known: set = set()
    # with subclasses, the graphs' inputs are their plain inner tensors, and Inductor reads a symbol
    # only off a size that is the bare symbol (a NestedTensor's offsets have size B + 1)
    subclasses = any(is_subclass(x) for x in leaves)
    for x in with_inner_tensors(leaves) if subclasses else leaves:
        if isinstance(x, torch.Tensor):
            for v in (*x.shape, *x.stride(), x.storage_offset()):
                if not subclasses or (isinstance(v, torch.SymInt) and v.node.expr.is_Symbol):
                    known |= _free_symbols(v)
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol) and x.node.expr not in known \
                and not x.node.is_nested_int():  # a ragged size: no tensor can have it as a size
            known.add(x.node.expr)
            out.append(i)
    return out


def _fake_anchors(leaves: list, positions: list[int]) -> list:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([x for x in leaves if isinstance(x, torch.Tensor)]) or _context_fake_mode()
    with mode if mode is not None else contextlib.nullcontext():
        base = torch.empty(())
        return [base.expand(leaves[i]) for i in positions]


def _ignoring_anchors(fn: Callable, n: int) -> Callable:
    def call(*args):
        return fn(*args[:n])

    return call


