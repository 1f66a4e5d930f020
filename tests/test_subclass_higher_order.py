"""Higher-order gradients through tensor subclasses (subclass_higher.py): `create_graph=True`, then
another backward, through aotgrad-compiled functions with TwoTensor arguments, outputs and
parameters. Every value, gradient and second-order gradient is compared with eager in float64,
types and nesting included (test_subclasses.assert_same): the fused run (one Function per call)
and the general run (one per crossing), gradient penalties, Hessian-vector products, third order,
gradients with respect to the incoming gradient, modules, and the refusals."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from helpers import assert_fuzz_gate, is_fused_run, run_source
from test_subclasses import _clone, assert_same
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad import min_cut_rematerialization_partition
from aotgrad.compilers import nop
from aotgrad.errors import HigherOrderError

D = torch.float64


def two(*shape, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    t = TwoTensor(torch.randn(*shape, dtype=D, generator=g), torch.randn(*shape, dtype=D, generator=g))
    return t.requires_grad_() if requires_grad else t


def nested(*shape, seed=0):
    t = TwoTensor(two(*shape, seed=seed, requires_grad=False), two(*shape, seed=seed + 1, requires_grad=False))
    return t.requires_grad_()


def plain(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=D, generator=g).requires_grad_()


def _terms(outs):
    """One loss term per output (a plain output then gets a plain gradient, a subclass one its own)."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [(o * o).sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _second_order(fn, args, wrt):
    """Outputs, first gradients (create_graph) and the gradients of their squared sums."""
    out = fn(*args)
    xs = [args[i] for i in wrt]
    first = torch.autograd.grad(_terms(out), xs, create_graph=True)
    second = torch.autograd.grad(_terms(first), xs)
    return out, first, second


def check_second_order(fn, make, wrt=None, **aot_kwargs):
    """`fn` eagerly and compiled on equal inputs: outputs, first and second gradients the same."""
    eager_in = make()
    memo: dict = {}
    ours_in = [memo.setdefault(id(x), _clone(x)) for x in eager_in]  # keeps which arguments are one object
    wrt = wrt if wrt is not None else [i for i, x in enumerate(eager_in) if getattr(x, "requires_grad", False)]
    compiled = aotgrad.aot_function(fn, nop, **aot_kwargs)
    expected = _second_order(fn, eager_in, wrt)
    got = _second_order(compiled, ours_in, wrt)
    for what, e, g in zip(("output", "first", "second"), expected, got):
        e, g = (e, g) if isinstance(e, tuple) else ((e,), (g,))
        assert len(e) == len(g)
        for k, (a, b) in enumerate(zip(g, e)):
            assert_same(a, b, f"{what} {k}")
    for k, g in enumerate(got[1]):  # the first gradients carry history, as eager's
        assert g.requires_grad and g.grad_fn is not None, f"first gradient {k}"
    return compiled


PROGRAMS = {
    "sin_mul": (lambda x: (x.sin() * x).sum(), lambda: [two(3)]),
    "subclass_output": (lambda x: x.exp() * x, lambda: [two(2, 3)]),
    "nested": (lambda x: (x.cos() * x * x).sum(0), lambda: [nested(3, 2)]),
    "two_subclass_args": (lambda x, w: (x @ w).tanh(), lambda: [two(2, 3), two(3, 4, seed=1)]),
    "plain_and_subclass_outputs": (lambda x, w: ((x * x).sum(), (w.sin() * w).sum()),
                                   lambda: [two(3), plain(3, seed=2)]),
    "softmax": (lambda x: torch.softmax(x * x, -1) * x, lambda: [two(2, 4)]),
}


@pytest.mark.parametrize("partition", ["default", "mincut"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_second_order_matches_eager_fused_run(name, partition):
    fn, make = PROGRAMS[name]
    kw = {"partition_fn": min_cut_rematerialization_partition} if partition == "mincut" else {}
    compiled = check_second_order(fn, make, **kw)
    assert is_fused_run(compiled), run_source(compiled)
    check_second_order(fn, make, **kw)  # the cached path


GENERAL = {
    "view_output": (lambda x: (x.sin() * x).t(), lambda: [two(2, 3)]),
    "inner_requiring_grad": (lambda x: (x * x).exp(),
                             lambda: [TwoTensor(plain(3), plain(3, seed=1))]),
    "same_argument_twice": (lambda x, y: (x * y).sin(), lambda: [two(3)] * 2),  # one object twice
    "plain_argument_mutated": (lambda x, y: x.sin() * x + y.mul_(2), lambda: [two(3), torch.randn(3, dtype=D)]),
}


@pytest.mark.parametrize("name", sorted(GENERAL))
def test_second_order_matches_eager_general_run(name):
    fn, make = GENERAL[name]
    compiled = check_second_order(fn, make, wrt=[0])
    assert not is_fused_run(compiled), run_source(compiled)


def test_third_order_matches_eager():
    def f(x):
        return (x.sin() * x * x).sum()

    def third(fn, x):
        (g1,) = torch.autograd.grad(fn(x), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad((g2 * g2).sum(), x)
        return g1, g2, g3

    x = two(4)
    y = _clone(x)
    compiled = aotgrad.aot_function(f, nop)
    for k, (a, b) in enumerate(zip(third(compiled, y), third(f, x))):
        assert_same(a, b, f"order {k + 1}")


@pytest.mark.parametrize("fused", [True, False])
def test_gradient_with_respect_to_the_incoming_gradient(fused):
    # reverse-over-reverse: the incoming gradient v requires grad (a view output: the general run)
    def f(x, w):
        out = (x * w).tanh() * x
        return out if fused else out.t()

    def run(fn, x, w, v):
        (gx,) = torch.autograd.grad(fn(x, w), x, v if fused else v.t(), create_graph=True)
        return gx, torch.autograd.grad((gx * gx).sum(), (x, w, v))

    make = [two(2, 2), two(2, 2, seed=1), two(2, 2, seed=2)]
    ours = [_clone(t) for t in make]
    compiled = aotgrad.aot_function(f, nop)
    expected, got = run(f, *make), run(compiled, *ours)
    assert_same(got[0], expected[0], "first")
    for k, (a, b) in enumerate(zip(got[1], expected[1])):
        assert_same(a, b, f"second {k}")
    assert is_fused_run(compiled) == fused


def test_gradient_penalty_through_subclass_parameters():
    # a WGAN-GP style critic: the norm of d(out)/d(input), both TwoTensors, in the loss
    def critic(x, w1, w2):
        return ((x @ w1).tanh() @ w2).sum(-1)

    def step(fn, x, w1, w2):
        out = fn(x, w1, w2)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        penalty = ((gx * gx).sum(-1).sqrt() - 1).pow(2).mean()
        loss = out.mean() + 10 * penalty
        loss.backward()
        return loss, gx

    make = [two(4, 3), two(3, 5, seed=1), two(5, 2, seed=2)]
    ours = [_clone(t) for t in make]
    compiled = aotgrad.aot_function(critic, nop)
    expected, got = step(critic, *make), step(compiled, *ours)
    assert is_fused_run(compiled)
    for what, a, b in zip(("loss", "gx"), got, expected):
        assert_same(a, b, what)
    for k, (a, b) in enumerate(zip(ours, make)):
        assert_same(a.grad, b.grad, f"grad of input {k}")


class TwoLayer(nn.Module):
    def __init__(self, plain_w2=False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w1 = nn.Parameter(TwoTensor(torch.randn(3, 4, dtype=D, generator=g), torch.randn(3, 4, dtype=D, generator=g)))
        w2 = torch.randn(4, 1, dtype=D, generator=g)
        self.w2 = nn.Parameter(w2 if plain_w2 else TwoTensor(w2, w2 * 2))

    def forward(self, x):
        return (x @ self.w1).sin() @ self.w2


def _penalty_step(model, x):
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = out.sum() + (gx * gx).sum()
    loss.backward()
    return loss


def test_module_with_subclass_parameters_gradient_penalty():
    eager = TwoLayer()
    ours = TwoLayer()
    compiled = aotgrad.aot_module(ours, nop)
    x = two(2, 3, seed=5)
    xo = _clone(x)
    assert_same(_penalty_step(compiled, xo), _penalty_step(eager, x), "loss")
    assert_same(xo.grad, x.grad, "x.grad")
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        assert_same(p.grad, q.grad, f"{name}.grad")


def test_module_with_plain_parameter_meeting_subclasses_refused_by_name():
    # w2 is plain; its gradient is a TwoTensor (it meets x @ w1): refused under create_graph, not
    # a silently wrong w2.grad
    compiled = aotgrad.aot_module(TwoLayer(plain_w2=True), nop)
    with pytest.raises(HigherOrderError, match="plain tensor whose gradient is a TwoTensor"):
        _penalty_step(compiled, two(2, 3, seed=5))


def test_torch_compile_backend():
    def f(x, w):
        return (x * w).sin().sum()

    torch._dynamo.reset()
    try:
        make = [two(3), two(3, seed=1)]
        ours = [_clone(t) for t in make]
        compiled = torch.compile(f, backend="aotgrad_eager", fullgraph=True)
        expected = _second_order(f, make, [0, 1])
        got = _second_order(compiled, ours, [0, 1])
        for what, e, g in zip(("output", "first", "second"), expected, got):
            e, g = (e, g) if isinstance(e, tuple) else ((e,), (g,))
            for k, (a, b) in enumerate(zip(g, e)):
                assert_same(a, b, f"{what} {k}")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("wrt", [0, 1])
def test_plain_argument_with_subclass_gradient_refused_by_name(wrt):
    # y is plain but meets x: its gradient is a TwoTensor, and aotgrad traces y as one tensor, so
    # its second-order gradient would be split wrongly: a create_graph backward is refused, whichever
    # argument it is for (a later backward could reach y through the first gradients' history)
    def f(x, y):
        return (x * y).sin() * x

    x, y = two(3), plain(3)
    compiled = aotgrad.aot_function(f, nop)
    out = compiled(x, y)
    assert not is_fused_run(compiled)
    with pytest.raises(HigherOrderError, match="input 1 .a plain tensor whose gradient is a TwoTensor"):
        torch.autograd.grad(out.sum(), (x, y)[wrt], create_graph=True)
    (gx,) = torch.autograd.grad(compiled(x, y).sum(), x)  # first order: as before
    (gxe,) = torch.autograd.grad(f(x, y).sum(), x)
    assert_same(gx, gxe, "first-order gx")


def test_create_graph_after_the_graph_was_released_is_refused():
    compiled = aotgrad.aot_function(lambda x: (x.sin() * x).sum(), nop)
    x = two(3)
    out = compiled(x)
    assert is_fused_run(compiled)
    out.backward()
    with pytest.raises((HigherOrderError, RuntimeError), match="retain_graph|second time"):
        torch.autograd.grad(out, x, create_graph=True)


def test_first_order_backward_lets_go_of_the_arguments():
    compiled = aotgrad.aot_function(lambda x: x.sin() * x, nop)
    x = two(3)
    out = compiled(x * 2)
    assert is_fused_run(compiled)
    assert out.grad_fn.leaves is not None
    out.sum().backward()
    assert out.grad_fn.leaves is None  # the graph is freed: no reference to the argument is kept


def test_gradgradcheck_style_against_eager():
    # second-order directional derivatives through the compiled function vs eager's, for random
    # directions in every argument and in the incoming gradient
    def f(x, w):
        return (x * w).exp() / (1 + x * x)

    compiled = aotgrad.aot_function(f, nop)
    for seed in range(3):
        x, w, v = two(3, seed=seed), two(3, seed=seed + 10), two(3, seed=seed + 20)
        u = [two(3, seed=seed + 30, requires_grad=False) for _ in range(3)]
        results = []
        for fn, args in ((f, (x, w, v)), (compiled, tuple(_clone(t) for t in (x, w, v)))):
            gs = torch.autograd.grad(fn(*args[:2]), args[:2], args[2], create_graph=True)
            dot = sum((g * d).sum() for g, d in zip(gs, u))
            results.append(torch.autograd.grad(dot, args))
        for k, (a, b) in enumerate(zip(results[1], results[0])):
            assert_same(a, b, f"seed {seed}: second-order grad {k}")


def test_second_order_gradient_of_another_structure_refused_by_name():
    # eager's second-order gradient of x.grad is a TwoTensor of TwoTensors here; aotgrad cannot split
    # it into x.grad's two plain tensors: refused, naming the argument
    n = TwoTensor(two(3, seed=1, requires_grad=False), two(3, seed=2, requires_grad=False))
    compiled = aotgrad.aot_function(lambda x: (x.sin() * x).sum(), nop)
    x = two(3)
    (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    with pytest.raises(HigherOrderError, match="through input 0: the gradient of its TwoTensor"):
        torch.autograd.grad((g * n).sum(), x)


def test_fuzzer_second_order_with_two_tensor_inputs():
    # scripts/fuzz.py --order 2 --subclass: a few programs end to end (none may crash or mismatch)
    from aotgrad import fuzz, fuzz_order2, fuzz_subclass

    check = functools.partial(fuzz_order2.check_program, wrap_inputs=fuzz_subclass.with_two_tensor_inputs)
    summary = fuzz.run(12, 0, shrink_failures=False, out_dir=None, check_fn=check)
    assert summary.counts["matched"] >= 2, summary.report()
    # refusal budget (helpers.assert_fuzz_gate): per accepted refusal, the count measured when it was set
    assert_fuzz_gate(summary, "second order, TwoTensor inputs", {
        "HigherOrderError: higher-order gradient (create_graph=True) through a compiled": 1,
        "UnsupportedAliasingError: the program calls as_strided on a tensor subclass value the ": 1,
        "UnsupportedMutationError: aten.t_.default under no_grad on a leaf or a view that requi": 1,
        "UnsupportedMutationError: aten.transpose_.default under no_grad on a leaf or a view th": 1,
    })


@pytest.mark.parametrize("fused", [True, False])
def test_structurally_zero_second_order_gradient_is_eagers_zero_tensor(fused):
    # fuzz (--order 2 --subclass, seed 0, programs 128/472/704/953): the second derivative of abs is
    # autograd's efficient ZeroTensor, which eager's formula makes at the subclass level: a plain
    # ZeroTensor, not a TwoTensor of zeros
    def f(x):
        return x.abs() if fused else x.abs().t()

    x = two(2, 2)
    xe = _clone(x)
    compiled = aotgrad.aot_function(f, nop)
    (g,) = torch.autograd.grad((compiled(x) * 3).sum(), x, create_graph=True)
    (ge,) = torch.autograd.grad((f(xe) * 3).sum(), xe, create_graph=True)
    assert is_fused_run(compiled) == fused
    assert_same(g, ge, "first")
    (s,) = torch.autograd.grad((g * g).sum(), x)
    (se,) = torch.autograd.grad((ge * ge).sum(), xe)
    assert type(se) is torch.Tensor and se._is_zerotensor()
    assert_same(s, se, "second")
    assert s._is_zerotensor()


def test_forces_inside_the_compiled_function():
    # autograd.grad(create_graph=True) inside the program (forces = -dE/dx), then the training loss's
    # backward into the TwoTensor parameters: a first-order backward of a second-order program
    def forces(x, w):
        energy = ((x * w).sin() * x).sum()
        (g,) = torch.autograd.grad(energy, x, create_graph=True)
        return -g

    def step(fn, x, w):
        f = fn(x, w)
        (f * f).sum().backward()
        return f

    make = [two(3), two(3, seed=1)]
    ours = [_clone(t) for t in make]
    assert_same(step(aotgrad.aot_function(forces, nop), *ours), step(forces, *make), "forces")
    for k, (a, b) in enumerate(zip(ours, make)):
        assert_same(a.grad, b.grad, f"grad of input {k}")


def test_dtensor_parameters_gradient_penalty_one_rank():
    # DTensor parameters (Shard/Replicate) and a Replicate DTensor input on a one-rank gloo mesh
    import datetime

    import torch.distributed as dist
    from test_subclass_dtensor import _free_port

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (1,))

        def model():
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
            for name, p in list(m.named_parameters()):
                mod, attr = name.rsplit(".", 1)
                placements = [Shard(0)] if attr == "weight" else [Replicate()]
                setattr(m.get_submodule(mod), attr, nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements)))
            return m

        data = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
        grads = []
        for compiled in (False, True):
            m = model()
            x = distribute_tensor(data.clone(), mesh, [Replicate()]).requires_grad_()
            _penalty_step(aotgrad.aot_module(m, nop) if compiled else m, x)
            assert all(type(p.grad) is DTensor for p in m.parameters())
            grads.append([p.grad.full_tensor() for p in m.parameters()] + [x.grad.full_tensor()])
        for k, (a, b) in enumerate(zip(*grads)):
            torch.testing.assert_close(b, a, msg=f"grad {k}")
    finally:
        dist.destroy_process_group()


def test_mutated_input_refusal_names_the_callers_argument():
    # the plain pipeline refuses a second derivative through an input mutated in place; named as the
    # caller passed it (input 1), not as the flattened plain input (input 2)
    def f(x, y):
        return x.sin() * y.mul_(2)

    compiled = aotgrad.aot_function(f, nop)
    x, y = two(3), torch.randn(3, dtype=D)
    with pytest.raises(HigherOrderError, match=r"mutates input 1 in place"):
        torch.autograd.grad(compiled(x, y).sum(), x, create_graph=True)
