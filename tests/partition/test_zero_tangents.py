"""Backward graphs specialised for outputs that get no gradient (zero_tangents.py), against eager."""

from __future__ import annotations

import pytest
import torch

from aotgrad import aot_function, nop
from aotgrad.partition.zero_tangents import specialise


def _leaves(*shapes, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def _mlp(x, w1, w2):
    h = torch.tanh(x @ w1)
    y = h @ w2
    return y.sum(), y, h.sin(), (h @ w2).t()


class _Counting:
    """A nop compiler that records the operator count of each graph it gets."""

    def __init__(self):
        self.sizes = []

    def __call__(self, gm, example_inputs):
        self.sizes.append(sum(n.op == "call_function" for n in gm.graph.nodes))
        return gm


@pytest.mark.parametrize("used", [(0,), (1,), (2,), (3,), (0, 2), (1, 3)])
def test_backward_through_some_outputs_matches_eager(used):
    a, b = _leaves((8, 4), (4, 6), (6, 3)), _leaves((8, 4), (4, 6), (6, 3))
    bw = _Counting()
    cf = aot_function(_mlp, nop, bw_compiler=bw)
    oe, oc = _mlp(*a), cf(*b)
    sum(oe[i].sum() for i in used).backward()
    sum(oc[i].sum() for i in used).backward()
    for p, q in zip(a, b):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad)
            assert q.grad.stride() == p.grad.stride()
    # the graph compiled for this set of None tangents is smaller than the full backward
    assert len(bw.sizes) == 1 and bw.sizes[0] < _full_backward_size()


def _full_backward_size():
    bw = _Counting()
    cf = aot_function(_mlp, nop, bw_compiler=bw)
    a = _leaves((8, 4), (4, 6), (6, 3))
    sum(o.sum() for o in cf(*a)).backward()
    return bw.sizes[0]


def test_all_outputs_used_compiles_the_plain_backward_once():
    bw = _Counting()
    cf = aot_function(_mlp, nop, bw_compiler=bw)
    for _ in range(2):
        a = _leaves((8, 4), (4, 6), (6, 3))
        sum(o.sum() for o in cf(*a)).backward()
    assert len(bw.sizes) == 1


def test_each_set_of_unused_outputs_compiles_once():
    bw = _Counting()
    cf = aot_function(_mlp, nop, bw_compiler=bw)
    for used in [(0,), (1,), (0,), (1,)]:
        out = cf(*_leaves((8, 4), (4, 6), (6, 3)))
        sum(out[i].sum() for i in used).backward()
    assert len(bw.sizes) == 2


def test_zero_that_is_still_read_is_materialised_with_its_strides():
    """A transposed zero read by an operator the pass does not simplify (`cat`), and a product
    with zero (`mm`), an output: both read freshly made zeros."""
    g = torch.fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("tangent")
    x.meta["val"], t.meta["val"] = torch.empty(3, 2), torch.empty(2, 3)
    tt = g.call_function(torch.ops.aten.t.default, (t,))
    tt.meta["val"] = torch.empty(2, 3).t()
    cat = g.call_function(torch.ops.aten.cat.default, ([x, tt],))
    cat.meta["val"] = torch.empty(6, 2)
    mm = g.call_function(torch.ops.aten.mm.default, (tt, t))
    mm.meta["val"] = torch.empty(3, 3)
    g.output([cat, mm])
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    spec = specialise(gm, {1})
    assert spec is not None
    targets = [n.target for n in spec.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.t.default not in targets and torch.ops.aten.empty_strided.default in targets
    x_val = torch.randn(3, 2)
    out, prod = spec(x_val, torch.full((2, 3), float("nan")))  # the tangent's value is not read
    torch.testing.assert_close(out, torch.cat([x_val, torch.zeros(3, 2)]))
    torch.testing.assert_close(prod, torch.zeros(3, 3))


def test_nothing_to_simplify_gives_none():
    g = torch.fx.Graph()
    t = g.placeholder("tangent")
    t.meta["val"] = torch.empty(3)
    c = g.call_function(torch.ops.aten.cat.default, ([t, t],))
    c.meta["val"] = torch.empty(6)
    g.output([c])
    assert specialise(torch.fx.GraphModule(torch.nn.Module(), g), {0}) is None


def test_second_order_with_unused_outputs_matches_eager():
    """The force-field pattern: the gradient w.r.t. x only, then a loss on it backpropagated to
    the weights; the weights' first-order gradients get no gradient in the second backward."""

    def energy(x, w1, w2):
        return (torch.nn.functional.silu(x @ w1) @ w2).sum()

    a = [t.detach().double().requires_grad_() for t in _leaves((5, 3), (3, 7), (7, 1))]
    b = [t.detach().clone().requires_grad_() for t in a]
    cf = aot_function(energy, nop)
    for fn, ts in ((energy, a), (cf, b)):
        (g,) = torch.autograd.grad(fn(*ts), ts[0], create_graph=True)
        g.square().sum().backward()
    for p, q in zip(a, b):
        torch.testing.assert_close(q.grad, p.grad)


def test_backend_model_returning_loss_and_logits():
    torch._dynamo.reset()
    torch.manual_seed(0)
    me = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    mc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    mc.load_state_dict(me.state_dict())

    def step(m, x):
        logits = m(x)
        return logits.square().mean(), logits

    x = torch.randn(5, 6)
    compiled = torch.compile(step, backend="aotgrad_eager")
    for _ in range(2):
        step(me, x)[0].backward()
        compiled(mc, x)[0].backward()
    for p, q in zip(me.parameters(), mc.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
