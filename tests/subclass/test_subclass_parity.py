"""Subclass programs torch 2.13's AOTAutograd runs and aotgrad once refused (issue 39, item 4).

Each compares with eager through `run_both` (outputs with their nesting, inputs after the call,
gradients' types and values), over three calls where the compiled function is reused."""

from __future__ import annotations

import torch
from helpers import _clone, assert_same, run_both, two

import aotgrad


def _mutate_plain_under_no_grad(x, t):
    with torch.no_grad():
        x.add_(1)
    return x * t


def _mutate_plain_from_inner(x, t):
    with torch.no_grad():
        x.add_(t.a)
    return x * t


def test_plain_input_mutated_beside_a_subclass_whose_product_gives_it_a_subclass_gradient():
    """x * t gives x a TwoTensor gradient, so x is passed once per inner gradient; the write into x
    was taken for inputs overlapping in memory (they are one tensor, passed twice)."""
    for fn in (_mutate_plain_under_no_grad, _mutate_plain_from_inner):
        run_both(fn, lambda: [torch.randn(3, requires_grad=True), two(3, requires_grad=True)])
        run_both(fn, lambda: [torch.randn(3, requires_grad=True), two(3, requires_grad=False)])


def test_reused_over_three_calls_with_new_values():
    torch.manual_seed(0)
    compiled = aotgrad.aot_function(_mutate_plain_under_no_grad, aotgrad.nop)
    for _ in range(3):
        x, t = torch.randn(3, requires_grad=True), two(3)
        xe, te = _clone(x), _clone(t)
        out, expected = compiled(x, t), _mutate_plain_under_no_grad(xe, te)
        assert_same(out, expected, "output")
        assert_same(x, xe, "x after the call")
        out.sum().backward()
        expected.sum().backward()
        assert_same(x.grad, xe.grad, "x.grad")
        assert_same(t.grad, te.grad, "t.grad")
