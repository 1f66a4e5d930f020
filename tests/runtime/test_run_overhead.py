"""The generated run time's cheap paths (issue 27 item 10), against eager: the inline view test of
outputs, the distinct-object test by `is`, and the fused subclass forward holding the plain body."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from aotgrad import aot_function, nop
from aotgrad.subclass import runtime as subclass_runtime


def _merging(gm, example_inputs):
    """A compiler returning one tensor for the first two outputs where their values are equal (as
    Inductor does for equal aliases)."""

    def run(*args):
        outs = list(gm(*args))
        if torch.equal(outs[0], outs[1]):
            outs[1] = outs[0]
        return outs

    return run


def _viewing(gm, example_inputs):
    """A compiler returning the first output as a view of a fresh intermediate."""

    def run(*args):
        outs = list(gm(*args))
        outs[0] = outs[0].clone().view(-1)
        return outs

    return run


def _inputs(requires_grad: bool):
    torch.manual_seed(0)
    return torch.randn(3, requires_grad=requires_grad)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_outputs_a_compiler_merged_stay_distinct_objects(n, requires_grad):
    def f(x):
        return tuple(x * 2 for _ in range(n))

    x, y = _inputs(requires_grad), _inputs(requires_grad)
    ref, got = f(x), aot_function(f, _merging, nop)(y)
    assert len({id(o) for o in got}) == n
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
        assert g.requires_grad == r.requires_grad and (g.grad_fn is None) == (r.grad_fn is None)
    if requires_grad:
        sum(o.sum() * (k + 1) for k, o in enumerate(ref)).backward()
        sum(o.sum() * (k + 1) for k, o in enumerate(got)).backward()
        torch.testing.assert_close(y.grad, x.grad)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_an_output_a_compiler_made_a_view_is_no_view(requires_grad):
    def f(x):
        return x.sin(), x.cos()

    x, y = _inputs(requires_grad), _inputs(requires_grad)
    ref, got = f(x), aot_function(f, _viewing, nop)(y)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
        assert g._is_view() == r._is_view() and g.requires_grad == r.requires_grad
    got[0].add_(1)  # as in eager: in place on a non-view output (raises on a Function's view output)
    ref[0].add_(1)
    torch.testing.assert_close(got[0], ref[0])
    if requires_grad:
        (ref[0].sum() + ref[1].sum()).backward()
        (got[0].sum() + got[1].sum()).backward()
        torch.testing.assert_close(y.grad, x.grad)


def _two_outputs(x):
    return x.sin(), (x * 3).exp()


def _two_input():
    torch.manual_seed(0)
    a = torch.randn(4)
    return TwoTensor(a.clone(), a.clone() * 2).requires_grad_()


def _check_two(run_source_has: str):
    x, y = _two_input(), _two_input()
    f = aot_function(_two_outputs, nop)
    ref, got = _two_outputs(x), f(y)
    for r, g in zip(ref, got):
        assert type(g) is type(r) and g.requires_grad == r.requires_grad
        torch.testing.assert_close(g.a, r.a)
        torch.testing.assert_close(g.b, r.b)
    (ref[0].sum() + ref[1].sum()).backward()
    (got[0].sum() + got[1].sum()).backward()
    assert type(y.grad) is type(x.grad)
    torch.testing.assert_close(y.grad.a, x.grad.a)
    torch.testing.assert_close(y.grad.b, x.grad.b)
    _, run = f.fast[0]
    forward = next(v for k, v in run.__globals__.items() if k.startswith("_direct")).__self__.forward
    assert run_source_has in forward.__aotgrad_source__


def test_fused_forward_holds_the_plain_forward_body():
    _check_two("primals = (l0.a, l0.b, )")


def test_fused_forward_calls_the_plain_forward_where_it_cannot_hold_it(monkeypatch):
    monkeypatch.setattr(subclass_runtime, "_inline_forward", lambda *args: False)
    _check_two("_plain_fw")


def test_inline_forward_refuses_other_sources_and_clashing_names():
    from aotgrad.runtime.runner import _Source

    def forward(ctx, *primals):
        return primals

    forward.__aotgrad_source__ = "def forward(ctx, *primals):\n    return primals\n"
    assert not subclass_runtime._inline_forward(_Source(), forward, ["l0"])
    forward.__aotgrad_source__ = "def forward(ctx, *primals):\n    outs = primals\n    return outs\n"
    fw = _Source()
    fw.globals["_test_name"] = object()
    forward.__globals__["_test_name"] = object()  # this module's globals: a clash, then cleaned up
    try:
        assert not subclass_runtime._inline_forward(fw, forward, ["l0"])
        del fw.globals["_test_name"]
        assert subclass_runtime._inline_forward(fw, forward, ["l0"])
    finally:
        del forward.__globals__["_test_name"]
    assert fw.lines == ["    primals = (l0, )", "    outs = primals"]
