"""Parity, the remainder (issue 39): each case compared with eager."""

from __future__ import annotations

import torch

import aotgrad
from aotgrad.testing import check_against_eager


def _usable(t: torch.Tensor) -> None:
    """The caller's tensor works as a plain tensor (symbolic sizes left on it fail here)."""
    t.clone()
    assert all(type(v) is int for v in (*t.shape, *t.stride(), t.storage_offset()))


# -- (a) metadata mutations replayed under dynamic=True leave plain sizes --------------------------


def _unsqueeze_then_specialise(x0, x1, x2):
    x2.unsqueeze_(0)
    with torch.no_grad():
        x2.unsqueeze(0).expand([3, 1, 2, 1, 3, 2])  # specialises x2's sizes: the restride's SymInts are constants
        v1 = x0.unsqueeze(0)
        v2 = x2 - v1
    v1.fill_(3.0)
    return torch.logsumexp(v2, 4), v2


def test_replayed_metadata_mutation_leaves_plain_sizes_under_dynamic():
    cf = aotgrad.aot_function(_unsqueeze_then_specialise, aotgrad.nop, dynamic=True)
    for _ in range(3):
        def make():
            torch.manual_seed(0)
            args = (torch.randn((), dtype=torch.float64), torch.randn(1, dtype=torch.float64),
                    torch.randn(2, 1, 3, 2, dtype=torch.float64))
            return (), args
        check_against_eager(_unsqueeze_then_specialise, make, compiled=cf)
        _, (x0, x1, x2) = make()
        cf(x0, x1, x2)
        for x in (x0, x1, x2):
            _usable(x)


def _transpose_and_view(x, y):
    x.t_()
    y.unsqueeze_(1)
    return x.view(-1), y * 2


def test_metadata_mutations_with_changing_sizes_leave_plain_sizes():
    cf = aotgrad.aot_function(_transpose_and_view, aotgrad.nop, dynamic=True)
    for n, m in ((3, 4), (5, 2), (6, 7)):
        def make(n=n, m=m):
            torch.manual_seed(n)
            return (), (torch.randn(n, m).t().contiguous().t(), torch.randn(m, requires_grad=True).mul(1))
        check_against_eager(_transpose_and_view, make, compiled=cf)
        _, args = make()
        outs = cf(*args)
        for t in (*args, *outs):
            _usable(t)


# -- regression 1: SymInt / SymFloat example inputs in aot_module_simplified's fallback -------------


def _symbolic_number(value):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    if isinstance(value, int):
        return env.create_symintnode(env.create_symbol(value, ConstantSource("n")), hint=value)
    return env.create_symfloatnode(env.create_unspecified_symbol(value, ConstantSource("r")), hint=value)


class _Scale(torch.nn.Module):
    def forward(self, x, k, r):
        return (x * k).sin() * r, x.sum(0) + k


def test_aot_module_simplified_takes_symint_and_symfloat_examples():
    gm = torch.fx.symbolic_trace(_Scale())
    x = torch.randn(3, 4, requires_grad=True)
    compiled = aotgrad.aot_module_simplified(gm, [x, _symbolic_number(5), _symbolic_number(0.5)], aotgrad.nop)
    for k, r, n in ((5, 0.5, 3), (7, 0.5, 3), (5, 1.5, 6)):
        def make(k=k, r=r, n=n):
            torch.manual_seed(n)
            x = torch.randn(n, 4, requires_grad=True)
            return (x,), (x, k, r)
        check_against_eager(gm, make, compiled=compiled)


def _scaled_by_size(x, y):
    return (x * y.shape[0]).sin() + y.sum()


def test_torch_compile_dynamic_with_subclass_input_and_symint_inputs():
    from torch.testing._internal.two_tensor import TwoTensor

    torch._dynamo.reset()

    def backend(gm, example_inputs):
        return aotgrad.aot_module_simplified(gm, example_inputs, aotgrad.nop)

    compiled = torch.compile(_scaled_by_size, backend=backend, dynamic=True)
    for n in (3, 4, 5):
        def make(n=n):
            torch.manual_seed(n)
            a, b = torch.randn(n, 2), torch.randn(n, 2)
            x = TwoTensor(a, b).requires_grad_()
            return (x,), (x, torch.randn(n + 1))
        check_against_eager(_scaled_by_size, make, compiled=compiled)
    torch._dynamo.reset()
