"""The subclass stage's run time (issue 27, item 10): one autograd.Function per call where the call
allows it (subclass_runtime.build_fused_run), the boundary's detaches folded out of the graphs
(subclass_graphs.py). Every test compares with eager (test_subclasses.run_both / assert_same)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_same,
    check_nonleaf_subclass_argument,
    is_fused_run,
    nested,
    run_both,
    run_source,
    two,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.compile.compilers import nop
from aotgrad.errors import AotgradError, HigherOrderError
from aotgrad.subclass.graphs import drop_detaches


@pytest.mark.parametrize("make", [
    lambda: [two(3)],
    lambda: [nested(2, 3)],
    lambda: [two(3), torch.randn(3), 2],
    lambda: [two(3, requires_grad=False), two(3), 2],
])
def test_one_autograd_function_per_call(make):
    def f(x, *rest):
        y = rest[0] if rest else 1.0
        n = rest[1] if len(rest) > 1 else 0
        return (x * y).sin() + n, x.cos()

    compiled, _, _ = run_both(f, make)
    assert is_fused_run(compiled), run_source(compiled)


def test_plain_outputs_beside_subclass_outputs():
    compiled, got, _ = run_both(lambda x, y: (x.exp(), y * 2, x.a + y), lambda: [two(3), torch.randn(3, requires_grad=True)])
    assert is_fused_run(compiled)
    assert type(got[1]) is torch.Tensor and type(got[2]) is torch.Tensor


def test_plain_argument_with_subclass_gradient_takes_the_general_run():
    compiled, _, _ = run_both(lambda x, y: (x * y).sin(), lambda: [two(3), torch.randn(3, requires_grad=True)])
    assert not is_fused_run(compiled)


@pytest.mark.parametrize("which", [0, 1])
def test_gradient_left_none_where_eager_leaves_it(which):
    # each input reaches one output: backward through one leaves the other's .grad None, as eager
    def f(x, y):
        return x * 2, y * 3

    def make():
        return [two(3), torch.randn(3, requires_grad=True)]

    eager_in = make()
    ours_in = [TwoTensor(eager_in[0].a.clone(), eager_in[0].b.clone()).requires_grad_(),
               eager_in[1].detach().clone().requires_grad_()]
    compiled = aotgrad.aot_function(f, nop)
    expected, got = f(*eager_in), compiled(*ours_in)
    assert is_fused_run(compiled)
    expected[which].sum().backward()
    got[which].sum().backward()
    for x, y in zip(ours_in, eager_in):
        assert (x.grad is None) == (y.grad is None)
        if y.grad is not None:
            assert_same(x.grad, y.grad, "grad")


def test_inner_tensors_requiring_grad_take_the_general_run():
    def make():
        return [TwoTensor(torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))]

    compiled, _, _ = run_both(lambda x: x * 2, make)
    assert not is_fused_run(compiled)


def test_double_backward_through_the_fused_run():
    # the fused run's backward under create_graph=True is recorded (subclass_higher.py); more in
    # test_subclass_higher_order.py
    def f(x):
        return (x.sin() * x).sum()

    compiled = aotgrad.aot_function(f, nop)
    x = two(3)
    xe = TwoTensor(x.a.clone(), x.b.clone()).requires_grad_()
    out = compiled(x)
    assert is_fused_run(compiled)
    (g,), (ge,) = torch.autograd.grad(out, x, create_graph=True), torch.autograd.grad(f(xe), xe, create_graph=True)
    assert_same(g, ge, "first-order gradient")
    assert_same(torch.autograd.grad(g.sum(), x)[0], torch.autograd.grad(ge.sum(), xe)[0], "second-order gradient")


def test_double_backward_refused_by_name_on_the_general_run_with_a_spread_argument():
    compiled = aotgrad.aot_function(lambda x, y: ((x * y).sin() * x).sum(), nop)
    x, y = two(2), torch.randn(2, requires_grad=True)  # y's gradient is a TwoTensor: the general run
    out = compiled(x, y)
    assert not is_fused_run(compiled)
    with pytest.raises(HigherOrderError, match="create_graph.*input 1"):
        torch.autograd.grad(out, (x, y), create_graph=True)


def test_mutation_takes_the_general_run():
    def f(x, y):
        y.mul_(2)
        return x * y

    compiled, _, _ = run_both(f, lambda: [two(3), torch.randn(3)])
    assert not is_fused_run(compiled)


def test_forward_graph_holds_no_boundary_detaches():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    run_both(lambda x: x.sin(), lambda: [two(3)], compiler=compiler)
    fw = graphs[0]
    targets = [n.target for n in fw.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.sin.default] * 2, fw.code


def test_returned_detaches_stay_distinct_objects():
    def f(x):
        y = x * 2
        return y, y.detach(), x.detach()

    compiled, got, ins = run_both(f, lambda: [two(3)])
    assert got[0] is not got[1] and got[0].a is not got[1].a
    assert got[2].a is not ins[0].a
    assert got[2].a.untyped_storage().data_ptr() == ins[0].a.untyped_storage().data_ptr()


def test_drop_detaches_keeps_output_identity():
    def f(x):
        y = x.sin()
        return y, y.detach(), x.detach(), y.detach().cos()

    gm = make_fx(f)(torch.randn(3))
    dropped = drop_detaches(gm)
    out = gm.graph.output_node().args[0]
    # y.detach() beside y stays (distinct objects), x.detach() of the input stays, the cos reads y
    assert dropped == 1 and out[1] is not out[0] and out[2].op != "placeholder", gm.code
    x = torch.randn(3)
    for a, b in zip(gm(x), f(x)):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Item 3: in-place ops on a subclass input requiring grad (a non-leaf: eager rebases its history)


def _non_leaf_run(fn, nest=False, under_no_grad=False, extra_use=True):
    """`fn(y)` with `y = x * 2` from a leaf `x`, eagerly and compiled: outputs, `y` after the call
    (values, grad_fn set, version bumped), and the leaf's gradient through the outputs and `y`."""
    base = nested(3) if nest else two(3)
    results = []
    for run in (fn, aotgrad.aot_function(fn, nop)):
        x = TwoTensor(base.a.detach().clone(), base.b.detach().clone()).requires_grad_()
        y = x * 2
        v = y._version
        out = run(y)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.sum() for o in outs if o.requires_grad)
        if extra_use:
            loss = loss + (y * y).sum()  # y's new history, as eager rebased it
        loss.backward()
        results.append((outs, y, y._version - v, x.grad))
    (eo, ey, ev, eg), (go, gy, gv, gg) = results
    for a, b in zip(go, eo):
        assert_same(a, b, "output")
    assert_same(gy, ey, "input after the call")
    assert (gy.grad_fn is None) == (ey.grad_fn is None) and gv == ev
    assert_same(gg, eg, "grad of the leaf")


def test_inplace_on_non_leaf_subclass_input_rebases_history():
    def f(y):
        y.mul_(3)
        return y.sin()

    _non_leaf_run(f)


def test_inplace_on_non_leaf_input_then_returned():
    def f(y):
        y.add_(1)
        y.mul_(2)
        return y

    _non_leaf_run(f)


def test_inplace_on_nested_non_leaf_input():
    def f(y):
        y.mul_(2)
        return (y * 3).sum()

    _non_leaf_run(f, nest=True)


def test_inplace_on_input_viewed_by_an_output():
    """(Was refused.) The outputs view the argument after its history is rebased, as eager's do."""
    def f(y):
        y.mul_(2)
        return y[1:], y.detach().view(-1)

    check_nonleaf_subclass_argument(f, 3)


def test_inplace_on_subclass_view_requiring_grad_rebases_its_base():
    """(Was refused.) The base's gradient: the written part through the program, the rest as before."""
    def f(y):
        y.mul_(2)
        return y + 1

    results = []
    for run in (f, aotgrad.aot_function(f, nop)):
        torch.manual_seed(0)
        x = two(4)
        base = x * 1
        out = run(base[1:])
        results.append((out, base, torch.autograd.grad(out.sum() + base.sum(), x)[0]))
    for what, e, g in zip(("output", "base", "gradient"), *results):
        assert_same(g, e, what)


def test_write_of_value_requiring_grad_into_subclass_input_without_grad():
    def f(x, w):
        x.mul_(w)
        return x * 2

    results = []
    for run in (f, aotgrad.aot_function(f, nop)):
        x = TwoTensor(torch.arange(3.0), torch.arange(3.0) + 1)
        w = torch.tensor([2.0, 3.0, 4.0], requires_grad=True)
        v = x._version
        out = run(x, w)
        (out.sum() + (x * x).sum()).backward()
        results.append((out, x, x._version - v, w.grad))
    (eo, ex, ev, ew), (go, gx, gv, gw) = results
    assert_same(go, eo, "output")
    assert_same(gx, ex, "input after the call")
    assert gx.requires_grad and gv == ev
    assert_same(gw, ew, "grad of w")


def test_requires_grad_on_subclass_input_still_refused():
    def f(x):
        x.requires_grad_()
        return x * 2

    with pytest.raises(AotgradError, match="input 0"):
        aotgrad.aot_function(f, nop)(two(3, requires_grad=False))


@pytest.mark.parametrize("index", [392, 705, 1302, 1475, 1492, 1736, 1838, 3813])
def test_fuzz_found_in_place_writes_into_subclass_inputs(index):
    # `make fuzz SUBCLASS=1 SEED=1`: writes into inputs requiring grad that are leaves, views, viewed
    # by outputs (also through .detach()) or share memory crashed or mismatched once rebased
    from aotgrad.testing import fuzz
    from aotgrad.testing.fuzz import subclass as fuzz_subclass

    out = fuzz_subclass.check_program(fuzz.generate(1, index))
    assert out.kind in ("matched", "refused", "skipped"), out.message


@pytest.mark.parametrize("index", [2493, 2677, 3083, 3321, 4243, 4569, 4730, 5809, 6968, 7403, 10978, 14168])
def test_fuzz_found_mismatches_are_refused(index):
    """`make fuzz SUBCLASS=1 SEED=1`, programs past 2,000: silent wrong values from requires_grad_()
    or as_strided on a subclass value inside the program; now refused by name
    (subclass_trace_rules.py)."""
    from aotgrad.testing import fuzz
    from aotgrad.testing.fuzz import subclass as fuzz_subclass

    out = fuzz_subclass.check_program(fuzz.generate(1, index))
    assert out.kind == "refused", out.message
    assert any(w in out.message for w in ("requires_grad_()", "as_strided", "detach_()", "metadata of input"))


def test_no_grad_view_of_subclass_intermediate_is_a_leaf_and_inputs_get_no_gradient():
    """`make fuzz SUBCLASS=1 SEED=1` program 16735: a view of a TwoTensor intermediate taken under
    no_grad is a leaf requiring grad in eager, so nothing reaches the inputs (.grad stays None). The
    view's base was returned differentiable, which connected every input: zeros instead of None."""
    from aotgrad.testing import fuzz
    from aotgrad.testing.fuzz import subclass as fuzz_subclass

    def f(a0, a1):
        v4 = torch.cat([a1, a0])
        with torch.no_grad():
            v8 = v4.squeeze()
        return v8, v8 - 2

    results = []
    for run in (f, aotgrad.aot_function(f, nop)):
        a0 = TwoTensor(torch.arange(2.0), torch.arange(2.0) + 1).requires_grad_()
        a1 = TwoTensor(torch.ones(4), torch.ones(4) * 2).requires_grad_()
        view, out = run(a0, a1)
        (view.sum() + out.sum()).backward()
        results.append((view, out, a0, a1))
    (view, out, a0, a1), (e_view, e_out, e_a0, e_a1) = results[1], results[0]
    assert_same(view, e_view, "no_grad view")
    assert_same(out, e_out, "output")
    assert (view.requires_grad, view.is_leaf) == (e_view.requires_grad, e_view.is_leaf) == (True, True)
    assert_same(view.grad, e_view.grad, "the view's own .grad")
    assert e_a0.grad is None and e_a1.grad is None
    assert a0.grad is None and a1.grad is None
    out = fuzz_subclass.check_program(fuzz.generate(1, 16735))
    assert out.kind == "matched", out.message


def test_requires_grad_and_as_strided_on_a_subclass_value_refused_by_name():
    from aotgrad.errors import UnsupportedAliasingError, UnsupportedMutationError

    def new_leaf(x):
        y = x.detach() * 2
        y.requires_grad_()
        return y

    def strided(x):
        return x.as_strided((2,), (1,), 1)

    for fn, err in ((new_leaf, UnsupportedMutationError), (strided, UnsupportedAliasingError)):
        x = TwoTensor(torch.randn(4), torch.randn(4)).requires_grad_()
        with pytest.raises(err, match="computed" if fn is new_leaf else "subclass input 0"):
            aotgrad.aot_function(fn, nop)(x)


def test_call_under_no_grad_writing_leaf_requiring_grad_like_eager():
    # an optimizer step over subclass parameters: the whole call under no_grad
    def step(p, g):
        p.add_(g, alpha=-0.1)

    results = []
    for run in (step, aotgrad.aot_function(step, nop)):
        p = TwoTensor(torch.arange(3.0), torch.arange(3.0) + 1).requires_grad_()
        g = TwoTensor(torch.ones(3), torch.ones(3) * 2)
        with torch.no_grad():
            run(p, g)
        results.append(p)
    assert_same(results[1], results[0], "parameter after the step")
    assert results[1].is_leaf and results[1].requires_grad
