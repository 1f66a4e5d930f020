"""Writes into subclass arguments that are views or share memory (issue 39, item 4).

Each program runs twice from the same seed, eagerly and compiled, over three calls of one compiled
function: outputs, the arguments and their base after the call, version counters, and gradients of a
loss that also reads the base after the write (autograd's CopySlices on the base) are compared."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import UnsupportedAliasingError


def _two(*shape, requires_grad=True):
    t = TwoTensor(torch.randn(*shape), torch.randn(*shape))
    return t.requires_grad_() if requires_grad else t


def _write_and_sin(x, w):
    x.mul_(w)
    return x.sin()


def _two_writes(x, w):
    y = x * 3
    x.mul_(w)
    x.add_(y)
    return x.sin() + y


def _column_write(x, w):
    x.mul_(w[:2])
    return x.exp()


CASES = {  # program, the view of the base it gets, whether the base requires grad, w a TwoTensor
    "row of a base requiring grad": (_write_and_sin, 0, True, False),
    "column of a base requiring grad": (_column_write, (slice(None), 1), True, False),
    "two writes, TwoTensor w": (_two_writes, 1, True, True),
    "row of a base without grad": (_two_writes, 1, False, False),
}


def _call(fn, index, base_requires_grad, w_subclass, seed):
    torch.manual_seed(seed)
    r = _two(2, 3, requires_grad=base_requires_grad)
    w = _two(3) if w_subclass else torch.randn(3, requires_grad=True)
    base = r * 2 if base_requires_grad else r.clone()
    x = base[index]
    out = fn(x, w)
    roots = [t for t in (r, w) if t.requires_grad]
    loss = out.sum() + (base * base).sum() + x.sum()  # the base read after the write too
    return out, base, x, (x._version, base._version), torch.autograd.grad(loss, roots)


@pytest.mark.parametrize("case", list(CASES))
def test_a_write_in_grad_mode_into_a_subclass_view(case):
    """Was refused ("modifies it in place while it is a view"). The view's write rebases its base's
    history through autograd's CopySlices, whose other part of the gradient must still reach the
    base's old history."""
    fn, index, base_requires_grad, w_subclass = CASES[case]
    compiled = aotgrad.aot_function(fn, aotgrad.nop)
    for seed in range(3):
        expected = _call(fn, index, base_requires_grad, w_subclass, seed)
        got = _call(compiled, index, base_requires_grad, w_subclass, seed)
        for what, e, g in zip(("output", "base", "view"), expected[:3], got[:3]):
            assert_same(g, e, what)
        assert got[3] == expected[3], "versions"
        for k, (e, g) in enumerate(zip(expected[4], got[4])):
            assert_same(g, e, f"gradient {k}")


def _add_then_multiply(x, y):
    x.add_(1)
    return x * y.reshape(x.shape) if x.numel() == y.numel() else x * y[: x.shape[0]]


SHARED = {  # two arguments over one TwoTensor base that does not require grad
    "overlapping views": lambda base: (base[:3], base[1:]),
    "disjoint views": lambda base: (base[:2], base[2:]),
    "the base and a view of it": lambda base: (base, base.view(2, 2)),
}


@pytest.mark.parametrize("case", list(SHARED))
def test_a_data_write_into_subclass_inputs_sharing_memory(case):
    """Was refused ("changes the metadata or storage ... or it shares memory with another input"):
    their inner tensors share memory as plain arguments do, and the write reaches the other."""
    compiled = aotgrad.aot_function(_add_then_multiply, aotgrad.nop)
    for seed in range(3):
        results = []
        for fn in (_add_then_multiply, compiled):
            torch.manual_seed(seed)
            base = _two(4, requires_grad=False)
            x, y = SHARED[case](base)
            results.append((fn(x, y), x, y, base, x._version))
        for what, e, g in zip(("output", "x", "y", "base", "version"), *results):
            assert_same(g, e, what)


def test_subclass_inputs_requiring_grad_that_share_memory_one_written_are_refused_by_name():
    def make():
        base = _two(4) * 1
        return base[:2], base[2:]

    compiled = aotgrad.aot_function(_add_then_multiply, aotgrad.nop)
    with pytest.raises(UnsupportedAliasingError, match=r"subclass inputs \[0, 1\] require grad and share memory"):
        compiled(*make())


def test_a_subclass_input_without_history_written_twice_in_grad_mode():
    """Its new history is two nodes back to none: every write recorded (was taken as unclear and refused)."""
    def fn(x, w):
        x.mul_(w)
        x.add_(w)
        return x.cos()

    compiled = aotgrad.aot_function(fn, aotgrad.nop)
    for seed in range(3):
        results = []
        for f in (fn, compiled):
            torch.manual_seed(seed)
            x, w = _two(3, requires_grad=False), torch.randn(3, requires_grad=True)
            out = f(x, w)
            results.append((out, x, torch.autograd.grad(out.sum() + x.sum(), w)[0]))
        for what, e, g in zip(("output", "x", "gradient of w"), *results):
            assert_same(g, e, what)


def _write_then_view_out(a):
    a.clamp_(-0.5, 0.5)
    v = a.split(1, 1)[2].permute(1, 0)
    return v, v, a.detach()


def test_outputs_viewing_a_subclass_input_written_in_grad_mode():
    """(Was refused: "viewed by an output".) The views are taken of the caller's argument after its
    history is rebased, so they carry the new history as eager's do (the fuzzer's --subclass
    --seed 23 program 17)."""
    compiled = aotgrad.aot_function(_write_then_view_out, aotgrad.nop)
    for seed in range(3):
        results = []
        for fn in (_write_then_view_out, compiled):
            torch.manual_seed(seed)
            r = _two(2, 3)
            a = r * 1
            v, w, d = fn(a)
            assert v._is_view() and v._base is a
            grad = torch.autograd.grad(v.sum() * 2 + w.exp().sum() + a.sum(), r)[0]
            results.append((v, w, d, a, grad, a._version))
        for what, e, g in zip(("view", "view again", "detached", "argument", "gradient", "version"), *results):
            assert_same(g, e, what)
