"""Second-order gradients through writes into `as_strided` views (fuzz seed 29, program 116).

torch's own derivative of `as_strided_scatter` with respect to its `self` passes the scattered
region's gradient where it should pass the rest's. Eager never differentiates that op for an
in-place write through an `as_strided` view (it records `CopySlices`), but the graphs aotgrad
differentiates again hold the functional form: the second derivative came out 4x eager's. A program
calling `as_strided_scatter` itself gets torch's formula, in eager and in aotgrad alike.
"""

from __future__ import annotations

import pytest
import torch

from aotgrad import aot_function, nop


def _write_through_0d_view(a):
    v = a.abs()
    v.as_strided((), (), 2).sub_(-0.25)
    return v.as_strided((), (), 2) ** 2


def _write_through_1d_view(a):
    v = a.abs()
    v.as_strided((2,), (1,), 1).sub_(-0.25)
    return v.as_strided((2,), (1,), 1) ** 2


def _base_read_after_write(a):
    v = a * 1
    v.as_strided((2,), (1,), 1).mul_(2)
    return v * v


def _explicit_scatter(a):
    b = a * a
    return torch.as_strided_scatter(b, b.sum(0) * 3, (2,), (1,), 1) ** 2


def _explicit_scatter_of_own_rows(a):
    b = a.abs() + 1
    return torch.as_strided_scatter(b * b, b[0] * b[0], (2,), (1,), 1) * b


def _second_order(fn, a):
    x = a.detach().clone().requires_grad_()
    out = fn(x)
    (first,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (second,) = torch.autograd.grad((first * first).sum(), x)
    return out.detach(), first.detach(), second


@pytest.mark.parametrize("fn", [_write_through_0d_view, _write_through_1d_view, _base_read_after_write,
                                _explicit_scatter, _explicit_scatter_of_own_rows])
def test_second_order_matches_eager(fn):
    torch.manual_seed(0)
    a = torch.randn(2, 2)
    compiled = aot_function(fn, nop)
    expected = _second_order(fn, a)
    for _ in range(2):  # the second call takes the cached path
        for got, want in zip(_second_order(compiled, a), expected):
            torch.testing.assert_close(got, want)


def test_torch_formula_is_still_the_one_eager_uses():
    """The premise: if torch fixes its formula, the explicit-call cases above still compare with
    eager, and this test says the rewrite may go."""
    x = torch.randn(4, requires_grad=True)
    out = torch.ops.aten.as_strided_scatter.default(x, torch.randn(2), [2], [1], 1)
    (grad,) = torch.autograd.grad((out * torch.arange(4.0)).sum(), x)
    assert grad.tolist() == [0.0, 1.0, 2.0, 0.0]  # the complement, [0, 0, 0, 3], would be right
