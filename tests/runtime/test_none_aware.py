"""The run time's None-gradient handling (runtime.py, "none_aware"): a graph with two or more
differentiable outputs sees an output that gets no gradient as None and feeds the backward zeros of
the traced tangent's shape. Static shapes are constants (no per-call store on the context);
symbolic ones are read per call. Gradients against eager, None where eager leaves None."""

from __future__ import annotations

import pytest
import torch

import aotgrad


def _f(x, y, z):
    return x.sin().t(), (x * y)[1:], z.exp().sum()


def _forward_source(compiled) -> str:
    sources = []
    for run in compiled.cache.values():
        for k, v in run.__globals__.items():
            if k.startswith("_apply"):
                sources.append(v.__self__.forward.__aotgrad_source__)
    return "\n".join(sources)


def _check(compiled, shapes, grads_on):
    """Outputs `grads_on` get a gradient, the others None: values and gradients as eager's."""
    g = torch.Generator().manual_seed(len(shapes[0]))
    xs = [torch.randn(*s, generator=g, requires_grad=True) for s in (shapes[0], shapes[0], shapes[1])]
    ref = [x.detach().clone().requires_grad_() for x in xs]
    outs, want = compiled(*xs), _f(*ref)
    for a, b in zip(outs, want):
        torch.testing.assert_close(a, b)
    torch.autograd.backward([outs[i] for i in grads_on], [torch.ones_like(outs[i]) * 3 for i in grads_on])
    torch.autograd.backward([want[i] for i in grads_on], [torch.ones_like(want[i]) * 3 for i in grads_on])
    for a, b in zip(xs, ref):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("grads_on", [(0,), (1,), (2,), (0, 2), (0, 1, 2)])
def test_static_shapes_are_constants(grads_on):
    compiled = aotgrad.aot_function(_f, aotgrad.nop)
    _check(compiled, [(3, 4), (2,)], grads_on)
    src = _forward_source(compiled)
    assert "set_materialize_grads(False)" in src and "ctx.tangent_shapes" not in src


def test_symbolic_shapes_are_read_per_call():
    compiled = aotgrad.aot_function(_f, aotgrad.nop, dynamic=True)
    for shapes in ([(3, 4), (2,)], [(5, 2), (7,)]):
        _check(compiled, shapes, (1,))
        _check(compiled, shapes, (0, 2))
    assert len(compiled.cache) == 1  # one compiled signature for both shapes
    assert "ctx.tangent_shapes = " in _forward_source(compiled)
