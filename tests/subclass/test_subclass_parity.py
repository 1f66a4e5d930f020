"""Subclass programs torch 2.13's AOTAutograd runs and aotgrad once refused (issue 39, item 4).

Each compares with eager through `run_both` (outputs with their nesting, inputs after the call,
gradients' types and values), over three calls where the compiled function is reused."""

from __future__ import annotations

import pytest
import torch
from helpers import BwMutatesBuffer, _clone, assert_same, nested, run_both, two
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import UnsupportedMutationError


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


def _write_under_no_grad(x, t):
    with torch.no_grad():
        t.add_(1)
    return x * t


def _write_through_detach(x, t):
    t.detach().mul_(2)
    return x * t + t


def _write_into_a_view_under_no_grad(x, t):
    v = t[1:]
    with torch.no_grad():
        v.add_(1)
    return x * t


def _make(leaf: bool, view: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    base = TwoTensor(torch.randn(4, generator=g), torch.randn(4, generator=g)).requires_grad_()
    t = base if leaf else base * 1
    if view:
        t = t[:3]
    return base, torch.randn(3 if view else 4, generator=g, requires_grad=True), t


@pytest.mark.parametrize("fn", [_write_under_no_grad, _write_through_detach, _write_into_a_view_under_no_grad])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "nonleaf"])
@pytest.mark.parametrize("view", [False, True], ids=["whole", "view"])
def test_writes_autograd_does_not_see_into_a_subclass_requiring_grad(fn, leaf, view):
    """Eager changes the data and keeps the history (an optimizer-style update of a leaf, a view of
    one): so does aotgrad now, over three calls, with the base's gradient as eager's."""
    compiled = aotgrad.aot_function(fn, aotgrad.nop)
    for seed in range(3):
        base_e, x_e, t_e = _make(leaf, view, seed)
        base_o, x_o, t_o = _make(leaf, view, seed)
        expected, out = fn(x_e, t_e), compiled(x_o, t_o)
        assert_same(out, expected, "output")
        assert_same(t_o, t_e, "input after the call")
        assert_same(base_o, base_e, "its base after the call")
        assert t_o._version == t_e._version
        expected.sum().backward()
        out.sum().backward()
        assert_same(x_o.grad, x_e.grad, "x.grad")
        assert_same(base_o.grad, base_e.grad, "the subclass leaf's grad")


def _branch_on_requires_grad(x):
    return x * 2 if x.requires_grad else x * 3


def test_a_subclass_argument_requires_grad_under_no_grad_as_the_callers():
    """Under no_grad the trace rebuilt the argument from its inner tensors without requires_grad, so
    a program asking `x.requires_grad` took the other branch (a silent mismatch)."""
    compiled = aotgrad.aot_function(_branch_on_requires_grad, aotgrad.nop)
    for seed in range(3):
        torch.manual_seed(seed)
        x = two(3)
        with torch.no_grad():
            assert_same(compiled(x), _branch_on_requires_grad(x), "output")


@pytest.mark.parametrize("backend", ["aotgrad_eager", "aotgrad"])
def test_compiled_autograd_accumulates_a_subclass_parameters_gradient(backend):
    """Compiled autograd hands the backend AccumulateGrad on a TwoTensor parameter (issue 39 item 9):
    its gradient was lost (`.grad` None) because the trace's rebuilt parameter did not require grad."""
    from torch._dynamo import compiled_autograd

    def f(x, w):
        return (x * w).sin()

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        x = TwoTensor(torch.randn(4, generator=g), torch.randn(4, generator=g)).requires_grad_()
        return x, torch.randn(4, generator=g, requires_grad=True)

    for seed in range(3):  # a fresh Dynamo each time: a second backward into an existing TwoTensor .grad
        torch._dynamo.reset()  # fails inside Dynamo for every backend in torch 2.13 (eager too)
        x, w = make(seed)
        x_e, w_e = make(seed)
        with compiled_autograd._enable(torch.compile(backend=backend)):
            torch.compile(f, backend=backend)(x, w).sum().backward()
        f(x_e, w_e).sum().backward()
        assert_same(x.grad, x_e.grad, "x.grad")
        assert_same(w.grad, w_e.grad, "w.grad")
    torch._dynamo.reset()


def _backward_writes_buffer(x, buf):
    return BwMutatesBuffer.apply(x, buf)


def _both_passes_write_buffer(x, buf):
    buf.add_(1)
    return BwMutatesBuffer.apply(x, buf)


@pytest.mark.parametrize("fn", [_backward_writes_buffer, _both_passes_write_buffer])
@pytest.mark.parametrize("plain_x", [True, False], ids=["plain_x", "two_x"])
def test_a_subclass_buffer_written_in_the_backward(fn, plain_x):
    """A custom Function's backward updating a TwoTensor buffer (Float8-style scaling state), alone
    or after a forward write: the caller's buffer after the forward and after the backward, its
    version, and the gradients as eager's, over three calls."""
    compiled = aotgrad.aot_function(fn, aotgrad.nop)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True) if plain_x else two(3)
        buf = two(3, requires_grad=False)
        x_e, buf_e = _clone(x), _clone(buf)
        out, expected = compiled(x, buf), fn(x_e, buf_e)
        assert_same(out, expected, "output")
        assert_same(buf, buf_e, "buffer after the forward")
        assert buf._version == buf_e._version
        out.sum().backward()
        expected.sum().backward()
        assert_same(buf, buf_e, "buffer after the backward")
        assert buf._version == buf_e._version
        assert_same(x.grad, x_e.grad, "x.grad")


class _BwMutatesItsInputRequiringGrad(BwMutatesBuffer):
    """BwMutatesBuffer whose buffer requires grad (and gets a zero gradient)."""

    @staticmethod
    def backward(ctx, g):
        grad_x, _ = BwMutatesBuffer.backward(ctx, g)
        return grad_x, g * 0


def test_a_backward_write_into_a_subclass_requiring_grad_is_refused_by_name():
    def f(x, w):
        return _BwMutatesItsInputRequiringGrad.apply(x, w)

    with pytest.raises(UnsupportedMutationError, match="backward writes into subclass input 1"):
        aotgrad.aot_function(f, aotgrad.nop)(two(3), two(3))


def test_metadata_mutation_under_no_grad_of_an_argument_requiring_grad_with_no_grad_views_out():
    """Fuzz seed 4, program 124, TwoTensor inputs: `squeeze_`/`t_` under no_grad of a leaf requiring
    grad, then no_grad views of it returned. Letting no_grad data writes through must not let this
    through too: the run time's version bump lands after the views, which eager's reading of their
    grad_fn then refuses (a crash). It stays refused, naming the input."""
    from aotgrad.testing import fuzz
    from aotgrad.testing.fuzz import subclass as fuzz_subclass

    outcome = fuzz_subclass.check_program(fuzz.generate(4, 124))
    assert outcome.kind == "refused", outcome
    assert "InplaceOnLeafError" in str(outcome) and "input 1" in str(outcome), outcome


def _plain_program(x, w):
    return torch.sin(x) * w, (x * 2).sum()


@pytest.mark.parametrize("through", ["aot_function", "torch.compile"])
def test_a_plain_output_whose_gradient_is_a_subclass_gets_eagers_gradients(through):
    """A plain program whose output is multiplied into a TwoTensor loss: its gradient is a TwoTensor,
    the backward was traced for a plain one; it runs op by op over it, as eager's backward does
    (Inductor's compiled backward could not take it)."""
    torch._dynamo.reset()
    compiled = (aotgrad.aot_function(_plain_program, aotgrad.nop) if through == "aot_function"
                else torch.compile(_plain_program, backend="aotgrad", fullgraph=True))
    for _ in range(3):
        x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        xc, wc = _clone(x), _clone(w)
        scale = two(4, requires_grad=False)
        y, s = _plain_program(x, w)
        yc, sc = compiled(xc, wc)
        assert_same(yc, y, "output 0")
        ((y * scale).sum() + s).backward()
        ((yc * scale).sum() + sc).backward()
        assert type(xc.grad) is TwoTensor and type(x.grad) is TwoTensor
        assert_same(xc.grad, x.grad, "grad of x")
        assert_same(wc.grad, w.grad, "grad of w")
        plain_again = compiled(xc, wc)[0]  # a plain gradient afterwards: the compiled backward again
        plain_again.sum().backward()


def _returns_its_plain_argument(a, t):
    return a * t, a


def test_a_plain_argument_with_a_subclass_gradient_returned_as_is_is_the_callers_tensor():
    """The argument is passed as stand-ins (its gradient is a TwoTensor); returned as is, the caller
    gets the argument itself, a leaf, as from eager (was: the stand-in, a non-leaf)."""
    compiled, got, ours = run_both(_returns_its_plain_argument,
                                   lambda: [torch.randn(3, requires_grad=True), two(3)])
    assert got[1] is ours[0] and got[1].is_leaf
    for _ in range(2):
        a, t = torch.randn(3, requires_grad=True), two(3)
        assert compiled(a, t)[1] is a


def _plain_output_beside_a_subclass(a, s):
    v = a * a
    return v, v * s


def test_a_plain_output_of_a_subclass_program_given_a_subclass_gradient_is_refused_by_name():
    """Inside the subclass stage the graph holds flattened subclass values: a subclass gradient for a
    plain output cannot run op by op there (the fuzzer's program 1077, --subclass --seed 77)."""
    compiled = aotgrad.aot_function(_plain_output_beside_a_subclass, aotgrad.nop)
    a = torch.randn(3, requires_grad=True)
    v, w = compiled(a, two(3, requires_grad=False))
    with pytest.raises(aotgrad.AotgradError, match="plain tensor but its incoming gradient is a TwoTensor"):
        (v.sum() + w.sum()).backward()  # a TwoTensor loss: v's gradient is a TwoTensor
    v, w = compiled(a, two(3, requires_grad=False))
    (v.sum() + w.sum().a).backward()  # plain gradients: runs
    assert a.grad is not None


def _gradient_as(make_grad):
    """A custom Function (x * 2) whose backward returns `make_grad(g)`: eager accumulates it as is."""

    class GradientAs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return make_grad(g)

    return GradientAs


_LessNestedGradient = _gradient_as(lambda g: g.a * 2)  # one level less nested than the argument
_MixedGradient = _gradient_as(lambda g: TwoTensor(g.a.a * 2, g.b))  # a plain part and a TwoTensor part
_PlainGradient = _gradient_as(lambda g: g.a * 3)  # a TwoTensor's gradient as a plain tensor


@pytest.mark.parametrize("fn, make", [
    (lambda x, w: _LessNestedGradient.apply(x).sin() * w, lambda: [nested(3), torch.randn(3, requires_grad=True)]),
    (lambda x, w: _MixedGradient.apply(x).cos() + w, lambda: [nested(3), torch.randn(3, requires_grad=True)]),
], ids=["less-nested", "mixed"])
def test_an_arguments_gradient_nested_less_deeply_than_the_argument(fn, make):
    """Eager's gradient of a nested subclass argument can be less nested (a custom Function's
    backward): it travels through the argument's inner tensors and is rebuilt as eager's, over three
    calls (was: refused as 'cannot be split into the argument's inner tensors')."""
    compiled = None
    for _ in range(3):
        compiled = run_both(fn, make)[0] if compiled is None else compiled
        eager_in = make()
        ours = [_clone(x) for x in eager_in]
        fn(*eager_in).sum().backward()
        compiled(*ours).sum().backward()
        assert type(ours[0].grad) is type(eager_in[0].grad)
        assert type(getattr(ours[0].grad, "a", None)) is type(getattr(eager_in[0].grad, "a", None))
        assert_same(ours[0].grad, eager_in[0].grad, "grad of x")
        assert_same(ours[1].grad, eager_in[1].grad, "grad of w")


def test_a_plain_gradient_for_a_subclass_argument_stays_refused_by_name():
    """A plain gradient altogether is not carried (the fuzzer's --subclass --seed 77 program 702: a
    plain tensor written with a TwoTensor value gives one whose eager counterpart is a TwoTensor)."""
    compiled = aotgrad.aot_function(lambda x, w: _PlainGradient.apply(x) * w, aotgrad.nop)
    with pytest.raises(aotgrad.AotgradError, match="is a plain tensor, which cannot be split"):
        compiled(two(3), torch.randn(3, requires_grad=True)).sum().backward()


def test_a_less_nested_gradient_under_create_graph_is_refused_by_name():
    """Only a custom Function's backward gives such a gradient, and a second derivative through a
    custom Function is refused first, by the plain run's higher-order check (the subclass stage's
    own refusal of a less nested gradient, `higher._refuse_spread`, stays behind it as a guard)."""
    compiled = aotgrad.aot_function(lambda x: _LessNestedGradient.apply(x).sin(), aotgrad.nop)
    x = nested(3)
    y = compiled(x).sum()
    with pytest.raises(aotgrad.HigherOrderError, match="inside a custom autograd.Function"):
        torch.autograd.grad(y, x, create_graph=True)


def _writes_and_returns_its_plain_argument(a, t):
    a.mul_(2)
    return a, a * t


def test_a_written_plain_argument_with_a_subclass_gradient_returned_as_is_is_refused():
    """Not the caller's tensor as is (its new history is the plain run's): the fuzzer's --subclass
    --seed 77 program 409 returned the caller's argument without that history, a wrong gradient."""
    compiled = aotgrad.aot_function(_writes_and_returns_its_plain_argument, aotgrad.nop)
    r = torch.randn(3, requires_grad=True)
    with pytest.raises(aotgrad.AotgradError, match="output 0 aliases input"):
        compiled(r.clone(), two(3))


def _three_outputs(x, w):
    return torch.sin(x) * w, x.cos(), (x * 2).sum()


def test_a_subclass_gradient_beside_outputs_without_gradient_runs_op_by_op():
    """Only the first output gets a gradient, a TwoTensor; the others get None: the backward still
    runs op by op (zeros in their place), not the compiled backward specialised for the None ones
    (Inductor's kernels cannot take a TwoTensor)."""
    torch._dynamo.reset()
    compiled = torch.compile(_three_outputs, backend="aotgrad", fullgraph=True)
    for seed in range(3):
        grads = []
        for run in (_three_outputs, compiled):
            torch.manual_seed(seed)
            x, w = torch.randn(4, requires_grad=True), torch.randn(4)
            scale = two(4, requires_grad=False)
            (run(x, w)[0] * scale).sum().backward()
            grads.append(x.grad)
        assert_same(grads[1], grads[0], "grad of x")
