"""`torch.autograd.grad` traced by Dynamo into the graph aotgrad compiles
(`torch._dynamo.config.trace_autograd_ops=True`, torch >= 2.13): forces, gradient penalties and
MAML steps become one graph with no graph break at `autograd.grad`, and their second-order
gradients are the compiled graph's ordinary first-order backward. Every value and gradient against
eager in float64; the graph count shows that Dynamo did not break there (else these tests would
only repeat test_higher_order.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import Critic, Energy

import aotgrad
from aotgrad import default_partition, min_cut_rematerialization_partition, nop
from aotgrad.testing import check_against_eager

D = torch.float64

pytestmark = pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                                reason="this torch's Dynamo cannot trace torch.autograd.grad")


@pytest.fixture(autouse=True)
def _trace_autograd_ops():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield
    torch._dynamo.reset()


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


class Counting:
    """A backend that counts the Dynamo graphs it is given and hands them to `inner`."""

    def __init__(self, inner):
        self.inner, self.graphs = inner, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def calls_autograd_grad(self) -> bool:
        return any(n.target is torch.autograd.grad for g in self.graphs for n in g.graph.nodes)


BACKENDS = {
    "aotgrad_eager": lambda: "aotgrad_eager",
    "nop_default_partition": lambda: aotgrad.backend(fw_compiler=nop, bw_compiler=nop, partition_fn=default_partition),
    "nop_mincut": lambda: aotgrad.backend(fw_compiler=nop, bw_compiler=nop,
                                          partition_fn=min_cut_rematerialization_partition),
}


def _backend(name):
    b = BACKENDS[name]()
    return torch._dynamo.lookup_backend(b) if isinstance(b, str) else b


def _force_loss(model, pos, e_ref, f_ref):
    e, f = model(pos)
    return (e - e_ref).pow(2) + (f - f_ref).pow(2).mean()


def _check_force_field_steps(inner_backend, steps: int = 2) -> None:
    """`steps` training steps of the force-field model through torch.compile against eager (loss,
    position and parameter gradients), then: one Dynamo graph, and it calls autograd.grad."""
    torch.manual_seed(0)
    model = Energy().double()
    ref = copy.deepcopy(model)
    backend = Counting(inner_backend)
    compiled = torch.compile(model, backend=backend)
    e_ref, f_ref = torch.tensor(1.0, dtype=D), torch.randn(7, 3, dtype=D)
    for step in range(steps):
        pos = torch.randn(7, 3, dtype=D, generator=torch.Generator().manual_seed(step)).requires_grad_()
        pos_ref = pos.detach().clone().requires_grad_()
        got, want = _force_loss(compiled, pos, e_ref, f_ref), _force_loss(ref, pos_ref, e_ref, f_ref)
        close(got, want)
        got.backward()
        want.backward()
        close(pos.grad, pos_ref.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            close(p.grad, q.grad)
            p.grad = q.grad = None
    assert len(backend.graphs) == 1 and backend.calls_autograd_grad(), [g.code for g in backend.graphs]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_force_field_step_is_one_graph_and_matches_eager(name):
    _check_force_field_steps(_backend(name))


@pytest.mark.parametrize("how", ["torch.compile", "aot_module", "aot_module_mincut"])
def test_forces_then_create_graph_again_third_order(how):
    """A second derivative of the forces through the graph that computes them: the higher-order
    path (higher_order.py) runs over a graph that itself differentiates (Tanh: the unpacked saved
    output, tracer.ENGINE_UNPACK; SiLU: `silu_backward` decomposed on retry, where aot_module's
    default partition used to raise an aliasing error for the saved weight and its transpose)."""
    torch.manual_seed(0)
    model = Energy().double()
    if how == "torch.compile":
        compiled = torch.compile(model, backend=_backend("aotgrad_eager"))
    else:
        kw = {"partition_fn": min_cut_rematerialization_partition} if how.endswith("mincut") else {}
        compiled = aotgrad.aot_module(model, nop, **kw)
    pos = torch.randn(5, 3, dtype=D).requires_grad_()
    out = []
    for m in (compiled, model):
        e, f = m(pos)
        (h,) = torch.autograd.grad(f.pow(2).sum(), pos, create_graph=True)
        params = list(model.parameters())
        out.append((e, f, h, *torch.autograd.grad(h.sin().sum(), [pos, *params], allow_unused=True, materialize_grads=True)))
    for a, b in zip(*out):
        close(a, b)


def _critic_loss(critic, real, fake, alpha):
    """A WGAN-GP critic loss, the penalty's `autograd.grad` inside the compiled function."""
    mixed = alpha * real + (1 - alpha) * fake
    score = critic(mixed)
    (g,) = torch.autograd.grad(score.sum(), mixed, create_graph=True)
    penalty = (g.norm(2, dim=1) - 1).pow(2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gradient_penalty_inside_the_compiled_function(name):
    torch.manual_seed(0)
    critic = Critic().double()
    ref = copy.deepcopy(critic)
    backend = Counting(_backend(name))
    compiled = torch.compile(lambda r, f, a: _critic_loss(critic, r, f, a), backend=backend)
    real, fake, alpha = torch.randn(8, 4, dtype=D), torch.randn(8, 4, dtype=D), torch.rand(8, 1, dtype=D)
    fake.requires_grad_()
    fake_ref = fake.detach().clone().requires_grad_()
    got, want = compiled(real, fake, alpha), _critic_loss(ref, real, fake_ref, alpha)
    close(got, want)
    got.backward()
    want.backward()
    close(fake.grad, fake_ref.grad)
    for p, q in zip(critic.parameters(), ref.parameters()):
        close(p.grad, q.grad)
    assert backend.calls_autograd_grad()


def _mlp(params, x):
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def _maml(params, xs, ys, xq, yq):
    g = torch.autograd.grad(F.mse_loss(_mlp(params, xs), ys), params, create_graph=True)
    fast = [p - 0.1 * gi for p, gi in zip(params, g)]
    return F.mse_loss(_mlp(fast, xq), yq)


@pytest.mark.parametrize("name", ["aotgrad_eager", "nop_mincut"])
def test_maml_step_inside_the_compiled_function(name):
    backend = Counting(_backend(name))
    compiled = torch.compile(_maml, backend=backend)
    torch.manual_seed(0)
    data = [torch.randn(5, k, dtype=D) for k in (3, 1, 3, 1)]
    shapes = [(3, 8), (8,), (8, 1), (1,)]

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        params = [torch.randn(*s, dtype=D, generator=g).requires_grad_() for s in shapes]
        return params, (params, *data)

    check_against_eager(_maml, make_inputs, compiled=compiled)
    assert backend.calls_autograd_grad()


@pytest.mark.parametrize("create_graph", [True, False])
def test_returned_gradient_and_its_autograd_metadata(create_graph):
    """The gradient the program returns, with and without create_graph, and an unused input
    (allow_unused): values, requires_grad, grad_fn presence and every gradient as eager."""

    def f(x, w, unused):
        y = (x * w).tanh().sum() + (unused * 0).sum().detach()
        gx, gu = torch.autograd.grad(y, (x, unused), create_graph=create_graph, retain_graph=True, allow_unused=True)
        return gx * 2, gu, y

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        x, w, u = (torch.randn(4, dtype=D, generator=g).requires_grad_() for _ in range(3))
        return (x, w, u), (x, w, u)

    compiled = torch.compile(f, backend=_backend("aotgrad_eager"))
    check_against_eager(f, make_inputs, compiled=compiled, mutate_outputs=False)


@pytest.mark.long
def test_force_field_step_through_inductor():
    """backend="aotgrad": Inductor compiles the graph that contains the force computation."""
    _check_force_field_steps(torch._dynamo.lookup_backend("aotgrad"), steps=1)


ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu}


@pytest.mark.parametrize("partition", ["default", "mincut"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_third_order_through_a_program_with_its_own_create_graph_grad(act, partition):
    """aot_function, no Dynamo. The program's `autograd.grad(create_graph=True)` unpacks tanh's
    saved output: autograd gives it tanh's history, the graph records `detach(detach(tanh))`; `R`
    must not cut there (third derivatives were silently wrong, 6e-2 off, before
    tracer.ENGINE_UNPACK). silu: `silu_backward` has no derivative and is decomposed on retry;
    inputs sharing memory must not turn that into an aliasing refusal."""
    a = ACTIVATIONS[act]

    def f(x, w, w2):
        e = (a(x[:, None] * w) @ w2).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        return e, -g

    kw = {"partition_fn": min_cut_rematerialization_partition} if partition == "mincut" else {}
    cf = aotgrad.aot_function(f, nop, **kw)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(5, dtype=D, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(5, 5, dtype=D, generator=g).t().requires_grad_()  # a view: shares w2's storage
    out = []
    for fn in (cf, f):
        e, force = fn(x, w, w2)
        (h,) = torch.autograd.grad(force.pow(2).sum(), x, create_graph=True)
        out.append((e, force, h, *torch.autograd.grad(h.sin().sum(), (x, w, w2), allow_unused=True,
                                                       materialize_grads=True)))
    for p, q in zip(*out):
        close(p, q)
