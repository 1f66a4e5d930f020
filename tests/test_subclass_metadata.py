"""Metadata mutations of subclass inputs (issue 27 item 3): `t_()`, `transpose_`, `unsqueeze_`,
`squeeze_`, `as_strided_` on a TwoTensor argument, replayed on the caller's subclass as eager does
(subclass_metadata.py).

Each test runs the program eagerly and through aotgrad on copies of the same inputs and compares the
outputs and the caller's argument after the call at every level: the wrapper's and each inner
tensor's size, stride, offset, version counter, storage (still the caller's own) and values, and the
autograd state (requires_grad, is_leaf, grad_fn); then the gradients where eager has some. What stays
refused is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils import _pytree as pytree

import aotgrad
from aotgrad.compilers import nop
from aotgrad.errors import AotgradError, InplaceOnLeafError, UnsupportedMutationError
from aotgrad.subclass_layout import is_subclass

# ---------------------------------------------------------------------------------------------
# Comparison with eager, level by level


def _snapshot(x, storages=None):
    """Everything eager lets a caller see of tensor `x` (a subclass: every level)."""
    if not isinstance(x, torch.Tensor):
        return ("value", x)
    out = [type(x).__name__, tuple(x.shape), tuple(x.stride()), x.storage_offset(), x._version, x.requires_grad,
           x.is_leaf, x.grad_fn is None]
    if is_subclass(x):
        attrs, ctx = x.__tensor_flatten__()
        out += [(a, _snapshot(getattr(x, a), storages)) for a in attrs]
    else:
        out.append(x.detach().clone())
        if storages is not None:
            out.append(storages.get(id(x)) == x.untyped_storage().data_ptr())
    return out


def _storages(x, out=None) -> dict:
    """id -> storage pointer of every plain inner tensor of `x` (before the call)."""
    out = {} if out is None else out
    if is_subclass(x):
        for a in x.__tensor_flatten__()[0]:
            _storages(getattr(x, a), out)
    elif isinstance(x, torch.Tensor):
        out[id(x)] = x.untyped_storage().data_ptr()
    return out


def _same(a, b, what):
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{what}: {a} vs {b}"
        for k, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{k}]")
    elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], list):
        _same(a[1], b[1], f"{what}.{a[0]}")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, msg=what)
    else:
        assert a == b, f"{what}: eager {a} vs compiled {b}"


def _two(shape, requires_grad=False, nonleaf=False, nested=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g)
    if nested:
        x = TwoTensor(TwoTensor(a, a * 2), TwoTensor(a - 1, a * 3 + 1))
    else:
        x = TwoTensor(a, a * 2 + 1)
    if requires_grad:
        x.requires_grad_()
        root = x
        if nonleaf:
            x = x * 1
        return root, x
    return None, x


def run_both(f, make, grad_mode=True, calls=2):
    """`f` eagerly and compiled on equal inputs, `calls` times (the later calls take the cached path)."""
    compiled = aotgrad.aot_function(f, nop)
    for _ in range(calls):
        results = []
        for fn in (f, compiled):
            root, x = make()
            storages = _storages(x)
            with contextlib.nullcontext() if grad_mode else torch.no_grad():
                out = fn(x)
            loss = sum(o.sum() for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad)
            grad = None
            if root is not None and isinstance(loss, torch.Tensor):
                (grad,) = torch.autograd.grad(loss, root)
            results.append(([_snapshot(o) for o in pytree.tree_leaves(out)], _snapshot(x, storages), None if grad is None else _snapshot(grad)))
        (oe, xe, ge), (oc, xc, gc) = results
        _same(oe, oc, "output")
        _same(xe, xc, "argument after the call")
        _same(ge, gc, "gradient")
    return compiled


OPS = {
    "t_": lambda x: x.t_(),
    "transpose_": lambda x: x.transpose_(0, 1),
    "swapdims_": lambda x: x.swapdims_(1, 0),
    "unsqueeze_": lambda x: x.unsqueeze_(1),
    "squeeze_": lambda x: x.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda x: x.as_strided_((2, 2), (1, 3), 1),
    "t_t_": lambda x: x.t_().t_(),
}


# ---------------------------------------------------------------------------------------------
# Works as in eager


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("nested", [False, True])
def test_metadata_mutation_of_input_without_grad(op, nested):
    def f(x):
        OPS[op](x)
        return x * 2, x

    run_both(f, lambda: _two((2, 3), nested=nested))


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "as_strided_"])
@pytest.mark.parametrize("nonleaf", [False, True])
def test_metadata_mutation_under_no_grad_call_of_input_requiring_grad(op, nonleaf):
    def f(x):
        OPS[op](x)
        return x + 1

    run_both(f, lambda: _two((2, 3), requires_grad=True, nonleaf=nonleaf), grad_mode=False)


def test_metadata_then_data_mutation_and_data_then_metadata():
    def f(x):
        x.add_(1)
        x.t_()
        x.mul_(2)
        return x.sum(0)

    run_both(f, lambda: _two((2, 3)))


def test_views_of_the_argument_taken_after_the_metadata_mutation():
    def f(x):
        x.t_()
        return x[0], x.view(-1) if x.is_contiguous() else x.reshape(-1), x.diagonal()

    run_both(f, lambda: _two((3, 3)))


def test_output_computed_from_a_metadata_mutated_input_with_a_plain_input_requiring_grad():
    w = torch.randn(3, 4, requires_grad=True)

    def f(x):
        x.t_()
        return x @ w

    run_both(f, lambda: _two((3, 2)))


def test_generated_run_sets_every_level(caplog):
    """The replay is straight-line code in the generated run time, not a walk per call."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="aotgrad.runtime.source"):
        run_both(lambda x: x.t_() * 1, lambda: _two((2, 3), nested=True), calls=1)
    src = "\n".join(r.getMessage() for r in caplog.records)
    assert "l0.a.a, " in src and "_set_metadata" in src


# ---------------------------------------------------------------------------------------------
# Refused by name


def test_leaf_requiring_grad_in_grad_mode_refused_like_eager():
    def f(x):
        x.t_()
        return x * 2

    with pytest.raises(RuntimeError, match="leaf Variable"):
        f(_two((2, 3), requires_grad=True)[1])
    with pytest.raises(InplaceOnLeafError, match="input 0"):
        aotgrad.aot_function(f, nop)(_two((2, 3), requires_grad=True)[1])


def test_nonleaf_requiring_grad_in_grad_mode_refused_by_name():
    """Eager gives the argument new history (TBackward); aotgrad does not replay that on a subclass."""
    def f(x):
        x.t_()
        return x * 2

    f(_two((2, 3), requires_grad=True, nonleaf=True)[1])  # eager allows it
    with pytest.raises(UnsupportedMutationError, match="subclass input 0 .*new autograd history"):
        aotgrad.aot_function(f, nop)(_two((2, 3), requires_grad=True, nonleaf=True)[1])


def test_refusals_are_aotgrad_errors():
    assert issubclass(UnsupportedMutationError, AotgradError)
