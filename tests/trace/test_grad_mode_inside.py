"""Grad mode changed inside the program, and compiled functions called inside other traces.

Each case compares the compiled call with eager: outputs, `requires_grad`, whether a `grad_fn` is
there, and the gradients a backward through it gives.
"""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad import aot_function, nop


def _pair(*shapes, requires_grad=(True,)):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, generator=g) for s in shapes]
    xs = [x.requires_grad_(r) for x, r in zip(xs, list(requires_grad) + [requires_grad[-1]] * len(xs))]
    return xs, [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]


def _compare_outputs(e, c):
    assert type(c) is type(e)
    for a, b in zip(e if isinstance(e, tuple) else (e,), c if isinstance(c, tuple) else (c,)):
        assert b.requires_grad == a.requires_grad
        assert (b.grad_fn is None) == (a.grad_fn is None)
        torch.testing.assert_close(b, a)


def _compare_grads(xs_e, xs_c):
    for a, b in zip(xs_e, xs_c):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad)


def enable_grad_region(x, w):
    with torch.enable_grad():
        y = (x * w).sin()
    z = x * 2  # under the caller's no_grad: no grad_fn
    return y, z


def set_grad_enabled_region(x, w):
    with torch.set_grad_enabled(True):
        h = torch.tanh(x @ w)
        with torch.no_grad():
            h2 = h * 3
        return h.sum(), h2


@pytest.mark.parametrize("fn", [enable_grad_region, set_grad_enabled_region])
def test_enable_grad_inside_a_no_grad_call(fn):
    (x, w), (x2, w2) = _pair((4, 4), (4, 4), requires_grad=(False, True))
    compiled = aot_function(fn, nop)
    with torch.no_grad():
        e, c = fn(x, w), compiled(x2, w2)
    _compare_outputs(e, c)
    e[0].sum().backward()
    c[0].sum().backward()
    _compare_grads([x, w], [x2, w2])
    with torch.no_grad():  # the fast path gives the same
        c = compiled(x2, w2)
    assert c[0].grad_fn is not None and not c[1].requires_grad


def test_enable_grad_inside_a_no_grad_call_under_torch_compile():
    (x, w), (x2, w2) = _pair((4, 4), (4, 4), requires_grad=(False, True))
    torch._dynamo.reset()
    compiled = torch.compile(enable_grad_region, backend="aotgrad_eager")
    with torch.no_grad():
        e, c = enable_grad_region(x, w), compiled(x2, w2)
    _compare_outputs(e, c)
    e[0].sum().backward()
    c[0].sum().backward()
    _compare_grads([x, w], [x2, w2])


def test_output_of_a_new_leaf_is_refused():
    """Eager returns a tensor whose grad_fn leads to a leaf made inside the program; aotgrad's backward
    differentiates with respect to the inputs only, so it refuses rather than return it detached."""
    def f(x):
        t = x * 2
        t.requires_grad_()
        return t * 3

    assert f(torch.randn(3)).grad_fn is not None
    with pytest.raises(aotgrad.UnsupportedOutputError, match="requires_grad_"):
        aot_function(f, nop)(torch.randn(3))


def test_new_leaf_mixed_with_inputs_still_differentiates_the_inputs():
    def f(x, w):
        t = torch.ones(3).requires_grad_()
        return x * w * t

    (x, w), (x2, w2) = _pair((3,), (3,), requires_grad=(False, True))
    e, c = f(x, w), aot_function(f, nop)(x2, w2)
    _compare_outputs(e, c)
    e.sum().backward()
    c.sum().backward()
    _compare_grads([x, w], [x2, w2])


def test_compiled_function_called_inside_another():
    inner = aot_function(lambda a, b: (a.sin() * b, a.cos()), nop)

    def outer(x, y, z):
        s, c = inner(x, y)
        z.mul_(2)  # a mutation the outer function owns
        return s + c * z

    (x, y, z), (x2, y2, z2) = _pair((5,), (5,), (5,), requires_grad=(True, False, False))
    e = outer(x, y, z)
    compiled_before = len(inner.cache)
    c = aot_function(outer, nop)(x2, y2, z2)
    _compare_outputs(e, c)
    torch.testing.assert_close(z2, z)
    e.sum().backward()
    c.sum().backward()
    _compare_grads([x, y, z], [x2, y2, z2])
    assert len(inner.cache) == compiled_before  # traced through, not compiled for the trace's tensors


def test_compiled_module_called_inside_compiled_function():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    compiled_layer = aotgrad.aot_module(layer, nop)

    def f(x):
        return compiled_layer(x).relu().sum()

    x = torch.randn(2, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    f(x).backward()
    grads_e = [p.grad.clone() for p in layer.parameters()] + [x.grad]
    layer.zero_grad()
    aot_function(f, nop)(x2).backward()
    for a, b in zip(grads_e, [p.grad for p in layer.parameters()] + [x2.grad]):
        torch.testing.assert_close(b, a)


def test_requires_grad_on_an_input_sharing_memory_is_refused():
    """Fuzz seed 0 program 234: requires_grad_() on an input that views another, then a write into
    that other: in eager, whether the written input then requires grad depends on autograd's view
    tracking (it did there). Refused, not silently different."""
    def f(a0, a1):
        v1 = (a1 + a1).sum(0)
        a0.requires_grad_()
        a1.copy_(v1)
        return (a1,)

    def make():
        c0 = torch.randn(3, 3, 3)
        return c0.unsqueeze(2), c0

    f(*make())  # eager runs it
    with pytest.raises(aotgrad.UnsupportedMutationError, match="requires_grad_"):
        aot_function(f, nop)(*make())


def test_view_of_a_detached_input_marked_requires_grad_is_refused():
    """Fuzz seed 503 program 2903: eager returns a view that requires grad (and refuses in-place ops
    on it); aotgrad would rebuild it from the input without requires_grad."""
    def f(a0):
        v = a0.detach()[-8:22]
        v.requires_grad_()
        return (v,)

    assert f(torch.randn(2, 4, 3))[0].requires_grad
    with pytest.raises(aotgrad.UnsupportedOutputError, match="requires_grad_"):
        aot_function(f, nop)(torch.randn(2, 4, 3))
