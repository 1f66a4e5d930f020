"""Compare a compiled function against eager, the way every aotgrad test does.

`check_against_eager(f, make_inputs)` runs `f` eagerly and through `aot_function` on two identical
copies of the inputs, then compares: outputs (values, dtype, `requires_grad`, `is_leaf`, whether each
output is a view of an input or of another output), the inputs after the call (values,
`requires_grad`, version bumps), an in-place op applied to every output afterwards, and the gradients
of every leaf that requires grad. Raises AssertionError with the first difference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .api import aot_function
from .compilers import nop
from .subclass_layout import is_subclass, layout_of


def _is_view_of_any(t: torch.Tensor, pool: list) -> bool:
    base = t._base
    return base is not None and any(base is p or base is getattr(p, "_base", None) for p in pool)


def _tensors(tree) -> list:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _leaves_requiring_grad(tree) -> list:
    out, seen = [], set()
    for x in _tensors(tree):
        if x.requires_grad and x.is_leaf and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


# torch.testing's default (rtol, atol) per dtype.
_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5)}


def _coarsest_float(tensors: list) -> torch.dtype | None:
    """The least precise floating dtype among the inputs (complex counted as its real dtype)."""
    dtypes = [x.real.dtype if x.is_complex() else x.dtype for x in tensors if x.is_floating_point() or x.is_complex()]
    return max(dtypes, key=lambda d: _TOLERANCES.get(d, (0, 0)), default=None)


def _assert_close(a, b, what: str, coarsest: torch.dtype | None = None) -> None:
    """A float64 result computed from float32 inputs (a float32 tensor times a float64 scalar, the
    scalar's gradient) carries float32 rounding: compare it with the coarsest input dtype's tolerance."""
    if isinstance(a, torch.Tensor) and (is_subclass(a) or is_subclass(b)):  # type, context, each inner tensor
        la, lb = layout_of(a), layout_of(b)
        if type(a) is not type(b) or la is None or lb is None or la.ctx_key != lb.ctx_key or la.attrs != lb.attrs:
            raise AssertionError(f"{what}: eager {type(a).__name__} vs compiled {type(b).__name__} (or other context)")
        for attr in la.attrs:
            _assert_close(getattr(a, attr), getattr(b, attr), f"{what}.{attr}", coarsest)
        return
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            raise AssertionError(f"{what}: eager gives a tensor, compiled gives {type(b)}")
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{what}: eager {a.dtype}{tuple(a.shape)} vs compiled {b.dtype}{tuple(b.shape)}")
        real = a.real.dtype if a.is_complex() else a.dtype
        tol = {}
        if coarsest in _TOLERANCES and _TOLERANCES[coarsest] > _TOLERANCES.get(real, (0, 0)) and real.is_floating_point:
            tol = dict(zip(("rtol", "atol"), _TOLERANCES[coarsest]))
        torch.testing.assert_close(b.detach(), a.detach(), equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)
    elif a != b and not (isinstance(a, float) and a != a and b != b):
        raise AssertionError(f"{what}: eager {a!r} vs compiled {b!r}")


def _run(f, make_inputs, mutate_outputs: bool):
    roots, args = make_inputs()
    result = {"roots": roots, "args": args}
    versions = [x._version for x in _tensors(args)]
    out = f(*args)
    _read_back(args)
    result["out"] = out
    flat = pytree.tree_leaves(out)
    result["meta"] = [
        (x.requires_grad, x.is_leaf, _is_view_of_any(x, _tensors(args)) or _is_view_of_any(x, [y for y in flat if y is not x]))
        if isinstance(x, torch.Tensor) else None
        for x in flat
    ]
    result["bumped"] = [x._version != v for x, v in zip(_tensors(args), versions)]
    diff = [x for x in flat if isinstance(x, torch.Tensor) and x.requires_grad]
    diff += [x for x in _tensors(args) if x.requires_grad and not x.is_leaf and x.grad_fn is not None]
    grads_of = _leaves_requiring_grad((roots, args))
    result["grads"] = None
    if diff and grads_of:
        loss = sum(_loss_term(x) for x in diff)
        if loss.requires_grad:
            result["grads"] = torch.autograd.grad(loss, grads_of, allow_unused=True)
    if mutate_outputs:
        after = []
        for x in flat:
            if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
                try:
                    x.add_(2)
                    after.append(("ok", x.detach().clone(), [a.detach().clone() for a in _tensors(args)]))
                except RuntimeError as e:
                    after.append(("error", type(e).__name__))
        result["after_mutation"] = after
    return result


def _read_back(args) -> None:
    """Every input is still a usable tensor after the call: a replayed metadata mutation that left
    symbolic sizes on it returns normally and only fails at its next use, far from the cause."""
    for i, x in enumerate(_tensors(args)):
        try:
            x.clone()
        except RuntimeError as e:
            raise AssertionError(f"input {i} cannot be read back after the call: {str(e).splitlines()[0]}") from None


def _loss_term(x: torch.Tensor) -> torch.Tensor:
    x = x.real if x.is_complex() else x
    w = torch.arange(x.numel(), dtype=x.dtype, device=x.device).reshape(x.shape).sin() + 2
    return (x * w).sum()


def check_against_eager(
    f: Callable,
    make_inputs: Callable[[], tuple[Any, tuple]],
    *,
    compiled: Callable | None = None,
    mutate_outputs: bool = True,
    **aot_kwargs,
) -> Callable:
    """`make_inputs()` returns `(roots, args)`: `args` are passed to `f`; gradients are compared for
    every leaf requiring grad among `roots` and `args` (roots let args be views or non-leaves)."""
    compiled = compiled or aot_function(f, nop, **aot_kwargs)
    ref = _run(f, make_inputs, mutate_outputs)
    test = _run(compiled, make_inputs, mutate_outputs)
    coarsest = _coarsest_float(_tensors((ref["roots"], ref["args"])))
    close = functools.partial(_assert_close, coarsest=coarsest)
    ref_flat, test_flat = pytree.tree_flatten(ref["out"]), pytree.tree_flatten(test["out"])
    if ref_flat[1] != test_flat[1]:
        raise AssertionError(f"output structure: eager {ref_flat[1]} vs compiled {test_flat[1]}")
    for i, (a, b) in enumerate(zip(ref_flat[0], test_flat[0])):
        close(a, b, f"output {i}")
    for i, (a, b) in enumerate(zip(ref["meta"], test["meta"])):
        if a != b:
            raise AssertionError(f"output {i} (requires_grad, is_leaf, is_view_of_input_or_output): eager {a} vs compiled {b}")
    for i, (a, b) in enumerate(zip(_tensors(ref["args"]), _tensors(test["args"]))):
        close(a, b, f"input {i} after the call")
        if a.requires_grad != b.requires_grad:
            raise AssertionError(f"input {i} requires_grad after the call: eager {a.requires_grad} vs compiled {b.requires_grad}")
    if ref["bumped"] != test["bumped"]:
        raise AssertionError(f"input version bumped: eager {ref['bumped']} vs compiled {test['bumped']}")
    for i, (a, b) in enumerate(zip(_tensors(ref["roots"]), _tensors(test["roots"]))):
        close(a, b, f"root {i} after the call")
    if (ref["grads"] is None) != (test["grads"] is None):
        raise AssertionError(f"gradients: eager {ref['grads'] is not None} vs compiled {test['grads'] is not None}")
    if ref["grads"] is not None:
        for i, (a, b) in enumerate(zip(ref["grads"], test["grads"])):
            if (a is None) != (b is None):
                raise AssertionError(f"grad {i}: eager {a is None and 'None'} vs compiled {b is None and 'None'}")
            if a is not None:
                close(a, b, f"grad {i}")
    for i, (a, b) in enumerate(zip(ref.get("after_mutation", []), test.get("after_mutation", []))):
        if a[0] != b[0]:
            raise AssertionError(f"in-place op on output {i} afterwards: eager {a[0]} vs compiled {b[0]}")
        if a[0] == "ok":
            close(a[1], b[1], f"output {i} after an in-place op on it")
            for j, (x, y) in enumerate(zip(a[2], b[2])):
                close(x, y, f"input {j} after an in-place op on output {i}")
    return compiled
