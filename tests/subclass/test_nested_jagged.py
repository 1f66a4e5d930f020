"""Jagged NestedTensors (issue 27 item 9) through `torch.compile(backend="aotgrad" | "aotgrad_eager")`.

Pointwise ops, `nn.Linear` applied to the NestedTensor, reductions over the dense (last) dimension;
forward and backward compared with eager component by component (values(), offsets()), the
output's offsets identity (eager's output shares its argument's offsets, hence its nested int), the
gradients of the NestedTensor and of the Linear's parameters; and the number of Dynamo graphs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import Counting

import aotgrad
from aotgrad.compile.compilers import nop
from aotgrad.errors import UnsupportedInputError

LENGTHS = ([2, 3], [4, 1, 2], [3, 3, 1, 2])


def njt(lengths, dim=5, requires_grad=True):
    return torch.nested.nested_tensor([torch.randn(n, dim) for n in lengths], layout=torch.jagged,
                                      requires_grad=requires_grad)


def same_offsets_as(x, requires_grad=True):
    """Another NestedTensor built with nested_tensor_from_jagged on `x`'s offsets (same nested int)."""
    return torch.nested.nested_tensor_from_jagged(torch.randn_like(x.values()), x.offsets()).requires_grad_(
        requires_grad)


def copy_of(x):
    """A NestedTensor equal to `x`, built from its values and offsets (nested_tensor_from_jagged)."""
    out = torch.nested.nested_tensor_from_jagged(x.values().detach().clone(), x.offsets().clone())
    return out.requires_grad_(x.requires_grad)


def assert_same(got, expected, what, got_in=(), eager_in=()):
    assert type(got) is type(expected), f"{what}: {type(got).__name__} vs {type(expected).__name__}"
    assert got.requires_grad == expected.requires_grad, f"{what}: requires_grad"
    if not expected.is_nested:
        torch.testing.assert_close(got, expected, msg=what)
        return
    assert got.dim() == expected.dim() and got._ragged_idx == expected._ragged_idx, what
    torch.testing.assert_close(got.values(), expected.values(), msg=f"{what}: values")
    assert torch.equal(got.offsets(), expected.offsets()), f"{what}: offsets"
    for k, (g, e) in enumerate(zip(got_in, eager_in)):  # which argument's offsets (nested int) it shares
        assert (got.offsets() is g.offsets()) == (expected.offsets() is e.offsets()), f"{what}: offsets of input {k}"


def check(fn, make_inputs, backend, module=None, lengths=LENGTHS, **compile_kwargs):
    """Compile `fn` once; at each set of lengths compare outputs and gradients with eager. Returns the
    number of Dynamo graphs."""
    torch._dynamo.reset()
    counting = Counting(backend)
    ours_module = copy.deepcopy(module) if module is not None else None
    compiled = torch.compile(fn if module is None else ours_module, backend=counting, **compile_kwargs)
    for lens in lengths:
        eager_in = make_inputs(lens)
        ours_in = [copy_of(x) for x in eager_in]
        expected = fn(*eager_in) if module is None else module(*eager_in)
        got = compiled(*ours_in)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"lengths {lens}: output {i}", ours_in, eager_in)
            # a later op between the output and the argument works as in eager (same nested int)
            if e.is_nested and e.shape == eager_in[0].shape:
                assert_same(g + ours_in[0], e + eager_in[0], f"lengths {lens}: output {i} + input 0")

        def loss(outs):
            return sum((o.values() if o.is_nested else o).pow(2).sum() for o in outs)

        loss(expected).backward()
        loss(got).backward()
        for i, (g, e) in enumerate(zip(ours_in, eager_in)):
            if e.requires_grad:
                assert_same(g.grad, e.grad, f"lengths {lens}: grad of input {i}", ours_in, eager_in)
        if module is not None:
            for (name, p), q in zip(module.named_parameters(), ours_module.parameters()):
                torch.testing.assert_close(q.grad, p.grad, msg=f"lengths {lens}: grad of {name}")
                p.grad = q.grad = None
    return counting.graphs


BACKENDS = ["aotgrad_eager", pytest.param("aotgrad", marks=pytest.mark.long)]


def _backend(name):
    return torch._dynamo.lookup_backend(name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise(backend):
    graphs = check(lambda x: (x * 2).sin() + x.cos(), lambda lens: [njt(lens)], _backend(backend))
    assert graphs <= 2  # the first graph static, then one with the batch size dynamic


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise_two_inputs_sharing_offsets(backend):
    def make(lens):
        x = njt(lens)
        return [x, same_offsets_as(x)]

    # the copies of the two arguments get offsets of their own: give the second the first's
    def fn(x, y):
        return (x * y.exp()).tanh(), x - y

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_backend(backend))
    for lens in LENGTHS:
        x, y = make(lens)
        x2 = copy_of(x)
        y2 = torch.nested.nested_tensor_from_jagged(y.values().detach().clone(), x2.offsets()).requires_grad_()
        expected, got = fn(x, y), compiled(x2, y2)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"lengths {lens}: output {i}", (x2, y2), (x, y))
        sum(o.values().sum() for o in expected).backward()
        sum(o.values().sum() for o in got).backward()
        assert_same(x2.grad, x.grad, "grad of x", (x2,), (x,))
        assert_same(y2.grad, y.grad, "grad of y", (x2,), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear(backend):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 4))
    graphs = check(None, lambda lens: [njt(lens)], _backend(backend), module=layer)
    assert graphs <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduction_over_the_dense_dimension(backend):
    graphs = check(lambda x: (x.mean(-1), x.amax(-1, keepdim=True), x.softmax(-1)), lambda lens: [njt(lens)],
                   _backend(backend))
    assert graphs <= 2


def test_dynamic_true_is_refused_naming_the_input():
    """dynamic=True makes the dense sizes symbolic too, where a nested int cannot multiply them
    (upstream traces with symbolic nested ints); refused with what to do, never a wrong value."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 3).relu(), backend="aotgrad_eager", dynamic=True)
    with pytest.raises(Exception, match=r"input \d+ is a jagged NestedTensor with a concrete ragged size"):
        compiled(njt([2, 3]))


def test_unsupported_symbolic_trace_is_refused_not_wrong():
    """An op the symbolic trace cannot replay at the subclass level (a transposed view returned):
    the per-shape fallback refuses, naming the input."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.transpose(1, 2), backend="aotgrad_eager")
    with pytest.raises(Exception, match=r"input \d+ is a jagged NestedTensor with a concrete ragged size"):
        compiled(njt([2, 3]))


def test_aot_function_is_refused_naming_the_input():
    with pytest.raises(UnsupportedInputError, match="input 0 is a jagged NestedTensor .* torch.compile"):
        aotgrad.aot_function(lambda x: x.sin(), nop)(njt([2, 3]))


def test_input_without_grad_and_plain_input():
    w = torch.randn(5, requires_grad=True)

    def fn(x, v):
        return x * v, (x * v).mean(-1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotgrad_eager")
    for lens in LENGTHS:
        x = njt(lens, requires_grad=False)
        x2, w2 = copy_of(x), w.detach().clone().requires_grad_()
        expected, got = fn(x, w), compiled(x2, w2)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"output {i}", (x2,), (x,))
        expected[1].values().sum().backward()
        got[1].values().sum().backward()
        torch.testing.assert_close(w2.grad, w.grad)
        w.grad = None


@pytest.mark.parametrize("case", ["values", "values_times_two", "offsets", "built_inside", "batch_scale"])
def test_outputs_read_off_the_nested_tensor(case):
    """Plain outputs that are (views of) its values or its offsets, a NestedTensor the program builds
    with nested_tensor_from_jagged, a product with its batch size (a symbolic int in the graph)."""
    fn = {
        "values": lambda x: x.values(),
        "values_times_two": lambda x: x.values() * 2,
        "offsets": lambda x: (x * 2, x.offsets()),
        "built_inside": lambda x: torch.nested.nested_tensor_from_jagged(x.values() * 2, x.offsets()),
        "batch_scale": lambda x: x * x.size(0),
    }[case]
    graphs = check(fn, lambda lens: [njt(lens)], aotgrad.aotgrad_eager)
    assert graphs <= 2
