"""Subclasses with symbolic sizes (issue 27 item 8): one compile serves several sizes.

Under `torch.compile(dynamic=True)` or `mark_dynamic`, a TwoTensor's inner tensors keep symbolic
sizes; the boundary's run time is generated per shape from one compiled plain graph
(subclass_symbolic.py). Every call is compared with eager: outputs (types, nesting, values
component by component), inputs after the call, every gradient; and the number of Dynamo compiles
and of aotgrad traces is counted."""

from __future__ import annotations

import pytest
import torch
from helpers import Counting, _clone, assert_same, nested, two
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad import observe
from aotgrad.dynamic.subclasses import SymbolicRun, specialize


def _captures() -> int:
    return observe.compile_times().get("capture", {}).get("count", 0)


def check_sizes(fn, make_inputs, sizes, backend=aotgrad.aotgrad_eager, mark=None, **compile_kwargs):
    """Compile `fn` once, call it at each size, compare with eager; returns (Dynamo graphs, the
    number of aotgrad traces after the first size)."""
    torch._dynamo.reset()
    counting = Counting(backend)
    compiled = torch.compile(fn, backend=counting, fullgraph=True, **compile_kwargs)
    traces_after_first = None
    for k, n in enumerate(sizes):
        eager_in = make_inputs(n)
        ours_in = [_clone(x) for x in eager_in]
        if mark is not None:
            for x in ours_in:
                torch._dynamo.mark_dynamic(x, mark)
        expected, got = fn(*eager_in), compiled(*ours_in)
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"size {n}: output {i}")
        for i, (x, y) in enumerate(zip(ours_in, eager_in)):
            assert_same(x, y, f"size {n}: input {i} after the call")
        torch.autograd.backward([o.sum() for o in expected if o.requires_grad])
        torch.autograd.backward([o.sum() for o in got if o.requires_grad])
        for i, (x, y) in enumerate(zip(ours_in, eager_in)):
            if y.requires_grad:
                assert y.grad is not None
                assert_same(x.grad, y.grad, f"size {n}: grad of input {i}")
        if k == 0:
            traces_after_first = _captures()
    return counting.graphs, _captures() - traces_after_first


def _program(x, y):
    # a subclass output, a view of the subclass input, a subclass built from a plain input, a reduction
    return (x * 2).sin() + y, x.view(-1), TwoTensor(y * 2, y.exp()), x.sum()


def _inputs(n):
    return [two(n, 4), torch.randn(n, 4, requires_grad=True)]


def test_dynamic_true_one_compile_serves_several_sizes():
    graphs, retraces = check_sizes(_program, _inputs, (3, 5, 7), dynamic=True)
    assert graphs == 1 and retraces == 0


def test_mark_dynamic_one_compile_serves_several_sizes():
    graphs, retraces = check_sizes(_program, _inputs, (3, 5, 7), mark=0)
    assert graphs == 1 and retraces == 0


def test_views_with_symbolic_arguments():
    def f(x):
        return x.t() * 2, x[1:], x.reshape(-1, 2)

    graphs, retraces = check_sizes(f, lambda n: [two(n, 4)], (3, 5, 7), dynamic=True)
    assert graphs == 1 and retraces == 0


def test_nested_two_tensor_symbolic():
    def f(x, y):
        return (x * y).cos(), x.sum(1)

    graphs, retraces = check_sizes(f, lambda n: [nested(n, 3), nested(n, 3, requires_grad=False)], (2, 5),
                                   dynamic=True)
    assert graphs == 1 and retraces == 0


def test_without_dynamic_each_size_is_its_own_graph():
    """The control (so the counts above can fail): `dynamic=False`, one graph per size."""
    graphs, _ = check_sizes(_program, _inputs, (3, 5, 7), dynamic=False)
    assert graphs == 3


@pytest.mark.long
def test_dynamic_inductor():
    graphs, retraces = check_sizes(_program, _inputs, (3, 5, 7), backend=torch._dynamo.lookup_backend("aotgrad"), dynamic=True)
    assert graphs == 1 and retraces == 0


def test_one_generated_run_per_shape():
    """The boundary's run time is generated once per distinct shape, not per call."""
    torch._dynamo.reset()
    runs = []
    real_call = SymbolicRun.__call__

    def spy(self, leaves):
        runs.append(self)
        return real_call(self, leaves)

    try:
        SymbolicRun.__call__ = spy
        f = torch.compile(lambda x: x * 2, backend="aotgrad_eager", dynamic=True)
        for n in (3, 5, 3, 5, 7):
            out = f(two(n, 2))
            assert out.shape == (n, 2)
    finally:
        SymbolicRun.__call__ = real_call
    assert len(runs) == 5 and all(r is runs[0] for r in runs)
    assert len(runs[0].runs) == 3


def test_specialize_replaces_every_symint():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = mode.from_tensor(two(3, 4))
    from aotgrad.signature.subclass_layout import layout_of

    lay = layout_of(fake)
    assert lay.symbolic and any(isinstance(v, torch.SymInt) for v in lay.outer_size)
    env = {s.node.expr: 9 for s in lay.outer_size if isinstance(s, torch.SymInt)}
    env.update({s.node.expr: 4 for s in lay.outer_stride if isinstance(s, torch.SymInt)})
    out = specialize(lay, env)
    assert not out.symbolic and all(type(v) is int for v in (*out.outer_size, *out.outer_stride))


# ---------------------------------------------------------------------------------------------
# aot_function(dynamic=True)


def _aot_check(compiled, fn, eager_in):
    ours_in = [_clone(x) for x in eager_in]
    expected, got = fn(*eager_in), compiled(*ours_in)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same(g, e, f"output {i}")
    torch.autograd.backward([o.sum() for o in expected if o.requires_grad])
    torch.autograd.backward([o.sum() for o in got if o.requires_grad])
    for i, (x, y) in enumerate(zip(ours_in, eager_in)):
        assert_same(x, y, f"input {i} after the call")
        if y.requires_grad:
            assert_same(x.grad, y.grad, f"grad of input {i}")


def test_aot_function_dynamic_one_trace_serves_several_sizes():
    def f(x, y):
        return (x * 2).sin() + y, x.view(-1), x.sum()

    compiled = aotgrad.aot_function(f, aotgrad.nop, dynamic=True)
    for k, n in enumerate((3, 5, 7)):
        _aot_check(compiled, f, [two(n, 4), torch.randn(n, 4, requires_grad=True)])
        if k == 0:
            after_first = _captures()
    assert _captures() == after_first and len(compiled.symbolic) == 1


def test_aot_function_dynamic_guard_keeps_nesting_and_inner_aliasing_apart():
    """The symbolic entry's guard checks the subclass's type, nesting, inner tensors and their
    aliasing: another nesting, or a TwoTensor whose two inner tensors are one, compiles again."""
    def f(x):
        return x * 2 + 1

    compiled = aotgrad.aot_function(f, aotgrad.nop, dynamic=True)
    _aot_check(compiled, f, [two(3, 4)])
    entries = len(compiled.symbolic) + len(compiled.cache)
    _aot_check(compiled, f, [nested(5, 4)])
    assert len(compiled.symbolic) + len(compiled.cache) > entries
    entries = len(compiled.symbolic) + len(compiled.cache)
    a = torch.randn(6, 4)
    shared = TwoTensor(a, a)
    assert not compiled.symbolic[-1][1]([shared])  # the first entry's guard refuses it
    out = compiled(shared)
    assert_same(out, f(TwoTensor(a.clone(), a.clone())), "output with one inner tensor twice")
    assert len(compiled.symbolic) + len(compiled.cache) > entries
