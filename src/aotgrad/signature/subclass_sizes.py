"""A subclass's outer size and stride in a trace, in terms of SymInts the tracer knows.

Traced with symbolic sizes, a subclass layout's outer size and stride are SymInts of the caller's
fakes; `make_fx` records a node for every computation on a SymInt and knows only those of its
placeholders. So a subclass rebuilt in a trace gets its outer size rewritten over its inner
tensors' own sizes, strides and offsets (dynamic/subclasses.py has the rest of symbolic sizes at the
boundary; this module is apart so subclass_layout can use it without a cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def traced_outer(size: tuple, stride: tuple, inner: Sequence[Any]) -> tuple[tuple, tuple]:
    """`size` and `stride` over the SymInts of the `inner` tensors (those a `make_fx` trace tracks:
    its placeholders' sizes). Nested ints are kept (a NestedTensor ties them to its offsets); what
    cannot be expressed so stays as it is (the trace then fails, and the caller compiles per shape)."""
    env: dict = {}
    for p in inner:
        if isinstance(p, torch.Tensor):
            for v in (*p.shape, *p.stride(), p.storage_offset()):
                if isinstance(v, torch.SymInt) and not v.node.is_nested_int():
                    env.setdefault(v.node.expr, v)
    return (tuple(_traced(v, env) for v in size), tuple(_traced(v, env) for v in stride))


def _traced(v: Any, env: dict) -> Any:
    if not isinstance(v, torch.SymInt) or v.node.is_nested_int():
        return v
    try:
        return _evaluate(v.node.expr, env)
    except KeyError:
        pass
    for sym in v.node.expr.free_symbols - env.keys():
        _unify(v.node.shape_env, sym, env)
    try:
        return _evaluate(v.node.expr, env)
    except KeyError:
        return v


def _unify(shape_env, sym, env: dict) -> None:
    """An outer-size symbol of its own (Dynamo gives a subclass marked dynamic other symbols than its
    inner tensors): equal to an inner size of the same value under a guard (`sym == inner`, added
    to the ShapeEnv, so a call where they differ is compiled again), then read as that size."""
    import sympy

    hint = shape_env.backed_var_to_val.get(sym) if shape_env is not None else None
    if hint is None:
        return
    for expr, inner in env.items():
        if expr.is_Symbol and shape_env.backed_var_to_val.get(expr) == hint:
            shape_env.evaluate_expr(sympy.Eq(sym, expr))
            env[sym] = inner
            return


def _evaluate(expr, env: dict) -> Any:
    if expr in env:
        return env[expr]
    if expr.is_Integer:
        return int(expr)
    if expr.is_Add or expr.is_Mul:
        values = [_evaluate(a, env) for a in expr.args]
        out = values[0]
        for v in values[1:]:
            out = out + v if expr.is_Add else out * v
        return out
    raise KeyError(expr)


# ---------------------------------------------------------------------------------------------
# Jagged NestedTensors: the ragged size in a trace


def tie_ragged(cls: type, inner: dict, ctx: Any, size: tuple) -> None:
    """A jagged NestedTensor rebuilt in a trace takes its ragged size from its offsets' (or lengths')
    fake's memo: Dynamo's fakes hold a ShapeEnv symbol there that no placeholder carries (`make_fx`
    then refuses the NestedTensor's stride arithmetic on it), and the fresh fakes of a trace none
    (a new such symbol, or a failure without a ShapeEnv). Give that fake a real nested int instead:
    the outer size's own, or the one a symbolic ragged size stands for (its hint). Nested ints need
    no tracking: their arithmetic is exact and records nothing, and no graph computes with them."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import mb_unwrap_functional_tensor
    from torch.nested._internal.nested_int import NestedIntNode
    from torch.nested._internal.nested_tensor import NestedTensor

    if not issubclass(cls, NestedTensor):
        return
    ragged = size[ctx["ragged_idx"]]
    if not (isinstance(ragged, torch.SymInt) and ragged.node.is_nested_int()):
        return
    nested = ragged if isinstance(ragged.node, NestedIntNode) else ragged.node.hint
    source = inner.get("_lengths")
    fake = mb_unwrap_functional_tensor(inner["_offsets"] if source is None else source)
    memo = getattr(fake, "nested_int_memo", None)
    if isinstance(fake, FakeTensor) and isinstance(nested, torch.SymInt) and not isinstance(
            getattr(memo, "node", None), NestedIntNode):
        fake.nested_int_memo = nested


def sizes_match(shape: Sequence, outer: Sequence) -> bool:
    """A run-time size against a layout's: -1 (a nested int, subclass_symbolic.specialize) matches any."""
    return len(shape) == len(outer) and all(o == -1 or s == o for s, o in zip(shape, outer))


def integer_positions(plains: Sequence[torch.Tensor]) -> frozenset:
    """Positions of integer inner tensors (a NestedTensor's offsets): metadata, never differentiable,
    whose identity carries the nested int; passed as they are and reused for the gradient."""
    return frozenset(k for k, p in enumerate(plains) if not (p.is_floating_point() or p.is_complex()))
