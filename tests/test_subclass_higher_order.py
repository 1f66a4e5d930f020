"""Higher-order gradients through tensor subclasses (subclass_higher.py): `create_graph=True`, then
another backward, through aotgrad-compiled functions with TwoTensor arguments, outputs and
parameters. Every value, gradient and second-order gradient is compared with eager in float64,
types and nesting included (test_subclasses.assert_same): the fused run (one Function per call)
and the general run (one per crossing), gradient penalties, Hessian-vector products, third order,
gradients with respect to the incoming gradient, modules, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_subclasses import _clone, assert_same
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad import min_cut_rematerialization_partition
from aotgrad.compilers import nop
from aotgrad.errors import HigherOrderError

D = torch.float64


def two(*shape, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    t = TwoTensor(torch.randn(*shape, dtype=D, generator=g), torch.randn(*shape, dtype=D, generator=g))
    return t.requires_grad_() if requires_grad else t


def nested(*shape, seed=0):
    t = TwoTensor(two(*shape, seed=seed, requires_grad=False), two(*shape, seed=seed + 1, requires_grad=False))
    return t.requires_grad_()


def plain(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=D, generator=g).requires_grad_()


def _source(compiled) -> str:
    (_, run), = compiled.fast
    return run.__aotgrad_source__


def _fused(compiled) -> bool:
    src = _source(compiled)
    return src.count("_apply") == 1 and "_unwrap" not in src and "_wrap" not in src


def _terms(outs):
    """One loss term per output (a plain output then gets a plain gradient, a subclass one its own)."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [(o * o).sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _second_order(fn, args, wrt):
    """Outputs, first gradients (create_graph) and the gradients of their squared sums."""
    out = fn(*args)
    xs = [args[i] for i in wrt]
    first = torch.autograd.grad(_terms(out), xs, create_graph=True)
    second = torch.autograd.grad(_terms(first), xs)
    return out, first, second


def check_second_order(fn, make, wrt=None, **aot_kwargs):
    """`fn` eagerly and compiled on equal inputs: outputs, first and second gradients the same."""
    eager_in = make()
    memo: dict = {}
    ours_in = [memo.setdefault(id(x), _clone(x)) for x in eager_in]  # keeps which arguments are one object
    wrt = wrt if wrt is not None else [i for i, x in enumerate(eager_in) if getattr(x, "requires_grad", False)]
    compiled = aotgrad.aot_function(fn, nop, **aot_kwargs)
    expected = _second_order(fn, eager_in, wrt)
    got = _second_order(compiled, ours_in, wrt)
    for what, e, g in zip(("output", "first", "second"), expected, got):
        e, g = (e, g) if isinstance(e, tuple) else ((e,), (g,))
        assert len(e) == len(g)
        for k, (a, b) in enumerate(zip(g, e)):
            assert_same(a, b, f"{what} {k}")
    for k, g in enumerate(got[1]):  # the first gradients carry history, as eager's
        assert g.requires_grad and g.grad_fn is not None, f"first gradient {k}"
    return compiled


PROGRAMS = {
    "sin_mul": (lambda x: (x.sin() * x).sum(), lambda: [two(3)]),
    "subclass_output": (lambda x: x.exp() * x, lambda: [two(2, 3)]),
    "nested": (lambda x: (x.cos() * x * x).sum(0), lambda: [nested(3, 2)]),
    "two_subclass_args": (lambda x, w: (x @ w).tanh(), lambda: [two(2, 3), two(3, 4, seed=1)]),
    "plain_and_subclass_outputs": (lambda x, w: ((x * x).sum(), (w.sin() * w).sum()),
                                   lambda: [two(3), plain(3, seed=2)]),
    "softmax": (lambda x: torch.softmax(x * x, -1) * x, lambda: [two(2, 4)]),
}


@pytest.mark.parametrize("partition", ["default", "mincut"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_second_order_matches_eager_fused_run(name, partition):
    fn, make = PROGRAMS[name]
    kw = {"partition_fn": min_cut_rematerialization_partition} if partition == "mincut" else {}
    compiled = check_second_order(fn, make, **kw)
    assert _fused(compiled), _source(compiled)
    check_second_order(fn, make, **kw)  # the cached path


GENERAL = {
    "view_output": (lambda x: (x.sin() * x).t(), lambda: [two(2, 3)]),
    "inner_requiring_grad": (lambda x: (x * x).exp(),
                             lambda: [TwoTensor(plain(3), plain(3, seed=1))]),
    "same_argument_twice": (lambda x, y: (x * y).sin(), lambda: [two(3)] * 2),  # one object twice
    "plain_argument_mutated": (lambda x, y: x.sin() * x + y.mul_(2), lambda: [two(3), torch.randn(3, dtype=D)]),
}


@pytest.mark.parametrize("name", sorted(GENERAL))
def test_second_order_matches_eager_general_run(name):
    fn, make = GENERAL[name]
    compiled = check_second_order(fn, make, wrt=[0])
    assert not _fused(compiled), _source(compiled)
