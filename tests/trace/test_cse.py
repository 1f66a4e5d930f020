"""Common-subexpression elimination (cse.py): repeats are merged, and nothing that would change
a result, an alias relation or a random stream is."""

from __future__ import annotations

import torch
import torch.fx

from aotgrad import aot_function, default_partition, nop
from aotgrad.testing import check_against_eager
from aotgrad.trace.cse import eliminate_common_subexpressions

aten = torch.ops.aten


def _graphs(f, *args):
    seen = []

    def keep(gm, _):
        seen.append(gm)
        return gm

    out = aot_function(f, keep, keep)(*args)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return seen


def _count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def _leaf(*shape):
    def make():
        torch.manual_seed(0)
        x = torch.randn(*shape, requires_grad=True)
        return (x,), (x,)
    return make


def test_repeated_computation_runs_once_in_forward_and_backward():
    def f(x):
        return (x.sin() * 2).sum() + (x.sin() * 2).sum()

    fw, bw = _graphs(f, torch.randn(4, requires_grad=True))
    assert _count(fw, aten.sin.default) == 1
    assert _count(bw, aten.cos.default) <= 1
    check_against_eager(f, _leaf(4))


class _RecomputingBackward(torch.autograd.Function):
    """A backward that computes again what the forward computed (as decompositions do)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin() * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.sin() * 2)


def test_backward_reuses_what_forward_computed():
    """The joint graph's backward computation of `sin(x) * 2` is the forward's node, so the
    partitioner sees one value (to save or recompute), not two."""
    sins = []

    def partition(joint, inputs, **kwargs):
        sins.append(_count(joint, aten.sin.default))
        return default_partition(joint, inputs, **kwargs)

    def f(x):
        return _RecomputingBackward.apply(x).sum()

    aot_function(f, nop, partition_fn=partition)(torch.randn(4, requires_grad=True)).backward()
    assert sins == [1]
    check_against_eager(f, _leaf(4))


def test_equal_outputs_stay_distinct_tensors():
    def f(x):
        return x + 1, x + 1, (x * 2).view(-1), (x * 2).view(-1)

    compiled = check_against_eager(f, _leaf(2, 3))
    a, b, c, d = compiled(torch.randn(2, 3))
    assert a.data_ptr() != b.data_ptr() and c.data_ptr() != d.data_ptr()
    assert c._base is not d._base


def test_equal_reshapes_of_a_non_contiguous_input_stay_two_copies():
    """Each `reshape` of a non-contiguous tensor is `clone` + `_unsafe_view`, a view whose schema
    does not say so; the two clones were merged, and the outputs shared memory (fuzz seed 288,
    program 8399)."""

    def f(x):
        x.transpose_(0, 1)
        return x.reshape(-1), x.reshape(-1)

    def make():
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
        return (x,), (x,)

    compiled = check_against_eager(f, make)
    a, b = compiled(torch.randn(3, 4))
    assert a.data_ptr() != b.data_ptr()


def test_equal_gradients_stay_distinct_tensors():
    def f(x, y):
        return (x * 3).sum() + (y * 3).sum()

    def make():
        torch.manual_seed(0)
        x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        return (x, y), (x, y)

    check_against_eager(f, make)
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    aot_function(f, nop)(x, y).backward()
    assert x.grad.data_ptr() != y.grad.data_ptr()


def test_random_ops_are_not_merged():
    def f(x):
        return x * torch.rand_like(x) + x * torch.rand_like(x)

    torch.manual_seed(0)
    want = f(torch.ones(8))
    torch.manual_seed(0)
    got = aot_function(f, nop)(torch.ones(8))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scalars_that_look_equal_are_kept_apart():
    def f(x, i, b):
        plus, minus = torch.full_like(x, 0.0), torch.full_like(x, -0.0)
        return 1 / plus, 1 / minus, i + 1, i + 1.0, (b + 1).sum(), (b + True).sum()

    x, i, b = torch.randn(3), torch.arange(3), torch.tensor([True, False, True])
    got, want = aot_function(f, nop)(x, i, b), f(x, i, b)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_one_value_written_into_two_inputs_keeps_both_writes():
    """Kept in the graph (keep_inference_input_mutations), two inputs get the same new value: its
    computation is merged, the two copy_ nodes are not."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    def f(a, b, c):
        a.copy_(c.sin())
        b.copy_(c.sin())
        return c * 2

    def make():
        torch.manual_seed(0)
        a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
        return (a, b, c), (a, b, c)

    compiled = aot_function(f, keep, keep_inference_input_mutations=True)
    check_against_eager(f, make, compiled=compiled)
    (gm,) = graphs
    assert _count(gm, aten.sin.default) == 1 and _count(gm, aten.copy_.default) == 2


def test_pass_leaves_tagged_and_mutating_nodes():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    s1 = g.call_function(aten.sin.default, (x,))
    s2 = g.call_function(aten.sin.default, (x,))
    c1 = g.call_function(aten.copy_.default, (x, s1))
    c2 = g.call_function(aten.copy_.default, (x, s1))
    t1 = g.call_function(aten.cos.default, (x,))
    t2 = g.call_function(aten.cos.default, (x,))
    t2.meta["keep"] = True
    g.output((s2, c1, c2, t1, t2))
    assert eliminate_common_subexpressions(g, keep_apart=("keep",)) == 1  # s2 into s1 only
    assert list(g.output_node().args[0]) == [s1, c1, c2, t1, t2]
    assert [n.target for n in g.nodes].count(aten.copy_.default) == 2
