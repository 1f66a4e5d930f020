"""Second-order fuzzing: the fuzzer's programs, differentiated twice (`scripts/fuzz.py --order 2`).

For each generated program (testing/fuzz/), eagerly and compiled (the second compiled call takes the
cached path): a loss over the outputs, its gradient with `create_graph=True` with respect to every
leaf input requiring grad, then the gradient of a loss over those gradients. First-order values,
the first gradients and the second gradients must match eager (`--subclass`: with TwoTensor inputs,
through the subclass stage's differentiable boundary). A second-order gradient eager leaves
None (nothing connects it) counts as zeros: the differentiable backward connects every gradient
to the compiled function's inputs, and gives zeros there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...signature.subclass_layout import is_subclass, layout_of
from ..compare import _assert_close, _coarsest_float, _leaves_requiring_grad, _loss_term, _tensors
from .check import Outcome, _compile, _first_line, _quiet, _refusal_in, normalize
from .programs import Program, materialize

# Second derivatives in float32 go through more rounding than the first: looser than torch's default.
_FLOAT32 = (1e-4, 1e-4)
# Under the caller's autocast (fuzz/autocast.py) a value cast once per use in eager is cast once by
# aotgrad (trace/cse.py), and the second backward adds those uses' gradients in bfloat16 where eager
# adds them in float32: a bfloat16 rounding, the known gap test_second_order_through_a_value_cast_twice.
_FLOAT32_UNDER_AUTOCAST = (8e-3, 1e-4)


def second_order(fn, make_inputs) -> dict[str, Any] | None:
    """Outputs, first and second gradients of `fn` on fresh inputs (None: nothing to differentiate)."""
    roots, args = make_inputs()
    out = fn(*args)
    flat = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    diff = [x for x in flat if x.requires_grad]
    diff += [x for x in _tensors(args) if x.requires_grad and not x.is_leaf and x.grad_fn is not None]
    wrt = _leaves_requiring_grad((roots, args))
    if not diff or not wrt:
        return None
    # one root per term, not their sum: a plain output then gets a plain gradient beside a
    # TwoTensor one (--subclass), as each output's own type
    loss = [t for t in (_loss_term(x) for x in diff) if t.requires_grad]
    if not loss:
        return None
    first = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
    terms = [_loss_term(g * g) for g in first if g is not None and g.requires_grad]
    terms = [t for t in terms if t.requires_grad]
    second: tuple = (None,) * len(wrt)
    if terms:
        second = torch.autograd.grad(terms, wrt, allow_unused=True)

    def zeros(gs):
        return [g.detach() if g is not None else torch.zeros_like(w) for g, w in zip(gs, wrt)]

    return {
        "outputs": [x.detach() for x in flat],
        "first": zeros(first),
        "second": zeros(second),
        "coarsest": _coarsest_float(_tensors((roots, args))),
    }


def _compare(ref: dict | None, got: dict | None) -> None:
    if (ref is None) != (got is None):
        raise AssertionError(f"eager differentiates {ref is not None}, compiled {got is not None}")
    if ref is None:
        return
    coarsest = ref["coarsest"]
    for what in ("outputs", "first", "second"):
        if len(ref[what]) != len(got[what]):
            raise AssertionError(f"{what}: eager has {len(ref[what])}, compiled {len(got[what])}")
        for i, (a, b) in enumerate(zip(ref[what], got[what])):
            real = a.real.dtype if a.is_complex() else a.dtype
            if what == "second" and torch.float32 in (real, coarsest):
                _close_float32(a, b, f"second-order grad {i}")
            else:
                _assert_close(a, b, f"{what} {i}", coarsest)


def _close_float32(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Second-order values through float32: the looser tolerance, subclass components one by one."""
    if is_subclass(a) or is_subclass(b):
        la, lb = layout_of(a), layout_of(b)
        if type(a) is not type(b) or la is None or lb is None or la.ctx_key != lb.ctx_key or la.attrs != lb.attrs:
            raise AssertionError(f"{what}: eager {type(a).__name__} vs compiled {type(b).__name__} (or other context)")
        for attr in la.attrs:
            _close_float32(getattr(a, attr), getattr(b, attr), f"{what}.{attr}")
        return
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: eager {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    rtol, atol = _FLOAT32_UNDER_AUTOCAST if torch.is_autocast_enabled("cpu") else _FLOAT32
    torch.testing.assert_close(b.detach(), a.detach(), rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check_second_order(f: Callable, make_inputs: Callable, compiled: Callable) -> None:
    """One compiled call's outputs, first and second gradients against eager's (AssertionError if
    they differ): the check `check_program` makes, for a reproducer to run."""
    _compare(second_order(f, make_inputs), second_order(compiled, make_inputs))


class _Mismatch(Exception):
    pass


def check_program(prog: Program, *, eager_checked: bool = False, explain_mismatch: bool = True,
                  backend: str | None = None, wrap_inputs: Callable | None = None) -> Outcome:
    """`fuzz.check_program`'s contract, for second-order gradients (`wrap_inputs`: e.g. TwoTensor
    inputs, fuzz_subclass.with_two_tensor_inputs)."""
    with _quiet():
        try:
            f, make_inputs = materialize(prog)
            if wrap_inputs is not None:
                make_inputs = wrap_inputs(make_inputs)
            ref = second_order(f, make_inputs)
            _compare(ref, second_order(f, make_inputs))  # eager agrees with itself
        except Exception as e:
            return Outcome("skipped", "eager", repr(e))
        finally:
            torch.set_grad_enabled(True)
        if ref is None:
            return Outcome("skipped", "nothing to differentiate")
        call = 0
        try:
            compiled = _compile(f, prog, backend)
            for call in range(2):  # noqa: B007 - `call` is read in the handlers
                # eager again just before each compiled call: make_inputs moves closed-over state
                # along (fuzz/closures.Holder switches train/eval every second call), in pairs
                ref = second_order(f, make_inputs)
                got = second_order(compiled, make_inputs)
                try:
                    _compare(ref, got)
                except AssertionError as e:
                    raise _Mismatch(str(e)) from e
        except _Mismatch as e:
            where = "" if call == 0 else "[2nd call] "
            msg = _first_line(e)
            return Outcome("mismatched", where + normalize(msg), where + msg + "\n" + str(e))
        except Exception as e:
            refusal = _refusal_in(e)
            if refusal is not None:
                return Outcome("refused", f"{type(refusal).__name__}: {normalize(_first_line(refusal))}", str(refusal))
            import traceback

            where = "" if call == 0 else "[2nd call] "
            return Outcome("crashed", where + f"{type(e).__name__}: {normalize(_first_line(e))}",
                           where + f"{type(e).__name__}: {e}", traceback.format_exc())
        finally:
            torch.set_grad_enabled(True)
    return Outcome("matched")
