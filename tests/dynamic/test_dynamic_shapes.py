"""Symbolic sizes outside the backend (issue 25 item 8): `aot_function(dynamic=True)`,
`aot_module_simplified` on a caller's fakes and ShapeEnv (and under Dynamo), export with
`dynamic_shapes=True`. Each compares against eager (or upstream's export where eager has none)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import aotgrad
from aotgrad.errors import DataDependentError
from aotgrad.testing import check_against_eager


def _counting():
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return aotgrad.nop(gm, example_inputs)

    return graphs, compiler


def _mlp(x, w):
    h = (x @ w).relu() * x.shape[0]
    return h.sum(1), h.view(-1)


def _det(make):
    """Same inputs on each call (eager and compiled run on twin copies)."""

    def seeded():
        torch.manual_seed(0)
        return make()

    return seeded


def _inputs(b, n=4):
    @_det
    def make():
        w = torch.randn(n, 7, requires_grad=True)  # 7: no batch size below is duck-sized with it
        x = torch.randn(b, n, requires_grad=True)
        return (x, w), (x, w)

    return make


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_one_graph_serves_many_batch_sizes(partition):
    graphs, compiler = _counting()
    part = {"default": aotgrad.default_partition, "min_cut": aotgrad.min_cut_rematerialization_partition}[partition]
    compiled = aotgrad.aot_function(_mlp, compiler, partition_fn=part, dynamic=True)
    for b in (3, 5, 8, 13):
        check_against_eager(_mlp, _inputs(b), compiled=compiled)
    assert len(graphs) == 2, "forward and backward compiled once for four batch sizes"
    assert len(compiled.symbolic) == 1 and not compiled.recompiles


def test_without_dynamic_each_shape_compiles():
    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(_mlp, compiler)
    for b in (3, 5):
        check_against_eager(_mlp, _inputs(b), compiled=compiled)
    assert len(graphs) == 4


def test_backward_takes_sizes_as_symbolic_ints():
    """As upstream's partitioners: the forward returns the sizes the backward needs as SymInts."""
    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(_mlp, compiler, dynamic=True)
    check_against_eager(_mlp, _inputs(6), compiled=compiled)
    fw, bw = graphs
    fw_out = fw.graph.output_node().args[0]
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in fw_out)
    bw_in = [n.meta.get("val") for n in bw.graph.find_nodes(op="placeholder")]
    assert any(isinstance(v, torch.SymInt) for v in bw_in)
    assert any(isinstance(s, torch.SymInt) for v in bw_in if isinstance(v, torch.Tensor) for s in v.shape)


@pytest.mark.parametrize("size", [1, 0])
def test_zero_one_specialization_recompiles(size):
    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(_mlp, compiler, dynamic=True)
    check_against_eager(_mlp, _inputs(5), compiled=compiled)
    check_against_eager(_mlp, _inputs(size), compiled=compiled)
    assert len(graphs) == 4 and len(compiled.recompiles) == 1
    check_against_eager(_mlp, _inputs(7), compiled=compiled)  # the first entry again
    assert len(graphs) == 4


def test_shape_guard_from_the_program_recompiles_when_violated():
    def f(x):
        return x * 2 if x.shape[0] > 4 else x * 3 + 1

    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(f, compiler, dynamic=True)
    sizes_and_compiles = [(6, 2), (9, 2), (3, 4), (2, 4), (5, 4)]
    for b, expected in sizes_and_compiles:
        check_against_eager(f, _det(lambda b=b: ((x := torch.randn(b, 2, requires_grad=True),), (x,))), compiled=compiled)
        assert len(graphs) == expected, b


def test_size_specialized_by_the_program_is_checked_exactly():
    """`x.shape[1] == 4` specializes that size to 4 (a replacement in the ShapeEnv, no longer a
    symbol): a call with another width must not reuse the graph."""

    def f(x):
        return x * 2 if x.shape[1] == 4 else x * 3

    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(f, compiler, dynamic=True)
    for (b, n), expected in (((5, 4), 2), ((7, 4), 2), ((5, 6), 4), ((8, 9), 4), ((6, 4), 4)):
        check_against_eager(f, _det(lambda b=b, n=n: ((x := torch.randn(b, n, requires_grad=True),), (x,))),
                            compiled=compiled)
        assert len(graphs) == expected, (b, n)


def test_duck_sized_equal_sizes_are_guarded():
    def f(x, y):
        return x @ y

    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(f, compiler, dynamic=True)

    def make(n, m):
        return _det(lambda: ((x := torch.randn(n, m, requires_grad=True), y := torch.randn(m, n)), (x, y)))

    check_against_eager(f, make(3, 3), compiled=compiled)
    check_against_eager(f, make(4, 4), compiled=compiled)
    assert len(graphs) == 2
    check_against_eager(f, make(3, 5), compiled=compiled)  # sizes no longer equal: a new entry
    assert len(graphs) == 4


def test_mutation_view_output_and_inference():
    def f(x, buf):
        buf.add_(x.sum(0))
        y = x.t()
        return y, y[:, 1:] * 2

    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(f, compiler, dynamic=True)
    for b in (3, 6):
        check_against_eager(f, _det(lambda b=b: ((x := torch.randn(b, 4, requires_grad=True), c := torch.zeros(4)), (x, c))),
                            compiled=compiled)
    with torch.no_grad():
        for b in (3, 6):
            check_against_eager(f, _det(lambda b=b: ((x := torch.randn(b, 4), c := torch.zeros(4)), (x, c))),
                                compiled=compiled)


def test_keyword_call_finds_the_symbolic_entry():
    def f(x, *, scale):
        return (x * scale).sin()

    graphs, compiler = _counting()
    compiled = aotgrad.aot_function(f, compiler, dynamic=True)
    for b in (3, 7):
        x = torch.randn(b, 2, requires_grad=True)
        out = compiled(x, scale=2.0)
        torch.testing.assert_close(out, f(x, scale=2.0))
        out.sum().backward()
        torch.testing.assert_close(x.grad, (torch.cos(x * 2.0) * 2.0).detach())
    assert len(graphs) == 2
    compiled(torch.randn(4, 2), scale=3.0)  # another constant: a new entry
    assert len(graphs) == 3


def test_aot_module_parameters_static_inputs_dynamic():
    mod = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    graphs, compiler = _counting()
    compiled = aotgrad.aot_module(mod, compiler, dynamic=True)
    for b in (2, 5, 9):
        x = torch.randn(b, 4)
        mod.zero_grad()
        ref = mod(x)
        ref.sum().backward()
        ref_grads = [p.grad.clone() for p in mod.parameters()]
        mod.zero_grad()
        out = compiled(x)
        out.sum().backward()
        torch.testing.assert_close(out, ref)
        for p, g in zip(mod.parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g)
    assert len(graphs) == 2
    params = [n.meta["val"] for n in graphs[0].graph.find_nodes(op="placeholder")][:4]
    assert all(isinstance(s, int) for p in params for s in p.shape)


# -- aot_module_simplified on a caller's fakes -------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x[:4]).relu().reshape(-1, 2) * 2, x.sum(1)


def _symbolic_fake(env: ShapeEnv, x: torch.Tensor, mode: FakeTensorMode):
    dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
    return mode.from_tensor(x, source=LocalSource("x"), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def test_simplified_compiles_from_fakes_and_guards_into_callers_shape_env():
    gm = torch.fx.symbolic_trace(_Net())
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    fake = _symbolic_fake(env, torch.randn(6, 4, requires_grad=True), mode)
    graphs, compiler = _counting()
    run = aotgrad.aot_module_simplified(gm, [fake], compiler)
    assert len(graphs) >= 1, "compiled from the fake example inputs, before any call"
    assert any(str(g.expr) == "s77 >= 4" or "4" in str(g.expr) for g in env.guards), env.guards
    compiled_now = len(graphs)
    for b, recompiles in ((6, False), (9, False), (3, True), (1, True)):
        before = len(graphs)
        x = torch.randn(b, 4, requires_grad=True)
        x2 = x.detach().requires_grad_()
        gm.zero_grad()
        ref = gm(x2)
        (ref[0].sum() + ref[1].sum()).backward()
        ref_grads = [p.grad.clone() for p in gm.parameters()]
        gm.zero_grad()
        out = run(x)
        (out[0].sum() + out[1].sum()).backward()
        for a, e in zip(out, ref):
            torch.testing.assert_close(a, e)
        torch.testing.assert_close(x.grad, x2.grad)
        for p, g in zip(gm.parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g)
        assert (len(graphs) > before + (1 if b == 6 else 0)) == recompiles, (b, len(graphs), before)
    assert compiled_now <= 2


def test_simplified_static_fakes_without_shape_env_guard_exact_sizes():
    gm = torch.fx.symbolic_trace(_Net())
    mode = FakeTensorMode()
    graphs, compiler = _counting()
    with torch.no_grad():
        run = aotgrad.aot_module_simplified(gm, [mode.from_tensor(torch.randn(5, 4))], compiler)
    assert len(graphs) == 1
    with torch.no_grad():
        for b in (5, 7):
            x = torch.randn(b, 4)
            for a, e in zip(run(x), gm(x)):
                torch.testing.assert_close(a, e)
    assert len(graphs) == 2  # 7 rows is another signature


def test_simplified_refusal_raised_from_fakes():
    class NoGradMetadataMutation(nn.Module):
        def forward(self, a):
            with torch.no_grad():
                a.unsqueeze_(-2)
            return a.reshape(-1) + 3

    env = ShapeEnv()
    fake = _symbolic_fake(env, torch.randn(3, requires_grad=True), FakeTensorMode(shape_env=env))
    with pytest.raises(aotgrad.UnsupportedMutationError, match="no_grad"):
        aotgrad.aot_module_simplified(NoGradMetadataMutation(), [fake], aotgrad.nop)


def test_simplified_under_dynamo_uses_its_symbolic_sizes():
    graphs, compiler = _counting()

    def backend(gm, example_inputs):
        return aotgrad.aot_module_simplified(gm, example_inputs, fw_compiler=compiler)

    lin = nn.Linear(4, 3)

    def f(x):
        y = lin(x).relu() * x.shape[0]
        if x.shape[0] > 5:
            y = y * 2
        return y.sum(0), y.view(-1)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, dynamic=True)
    for b, compiles in ((3, 2), (4, 2), (7, 4), (8, 4)):
        x = torch.randn(b, 4, requires_grad=True)
        x2 = x.detach().requires_grad_()
        out, ref = compiled(x), f(x2)
        (out[0].sum() + out[1].sum()).backward()
        (ref[0].sum() + ref[1].sum()).backward()
        for a, e in zip(out, ref):
            torch.testing.assert_close(a, e)
        torch.testing.assert_close(x.grad, x2.grad)
        assert len(graphs) == compiles, b
    torch._dynamo.reset()


# -- export with symbolic sizes ------------------------------------------------------------------------


class _Counted(nn.Module):
    def __init__(self, loss: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(3))
        self.loss = loss

    def forward(self, x):
        self.calls.add_(1)
        y = self.lin(x).relu() * x.shape[0]
        out = y.sum(0) + self.calls
        return (out.sum(), y.view(-1).detach()) if self.loss else (out, y.view(-1))


def _is_free(s) -> bool:
    """A size still symbolic after the trace's guards (not specialized to a number)."""
    return isinstance(s, torch.SymInt) and bool(s.node.expr.free_symbols)


def _state(mod):
    return [t.detach().clone() for t in [*mod.parameters(), *mod.buffers()]]


@pytest.mark.parametrize("trace_joint", [False, True])
def test_export_dynamic_shapes_one_graph_for_many_sizes(trace_joint):
    import copy

    from torch._functorch.aot_autograd import aot_export_module as upstream_export

    torch.manual_seed(0)
    mod = _Counted(loss=trace_joint)
    kw = {"trace_joint": trace_joint, "dynamic_shapes": True, "output_loss_index": 0 if trace_joint else None}
    args = (torch.randn(5, 4),)
    gm, sig = aotgrad.aot_export_module(copy.deepcopy(mod), args, **kw)
    up_gm, up_sig = upstream_export(copy.deepcopy(mod), args, **kw)
    for f in ("parameters", "buffers", "user_inputs"):
        assert getattr(sig, f) == getattr(up_sig, f), f
    for f in ("inputs_to_parameters", "inputs_to_buffers"):
        assert getattr(sig, f) == getattr(up_sig, f), f
    for f in ("buffers_to_mutate", "user_inputs_to_mutate"):
        assert list(getattr(sig, f).values()) == list(getattr(up_sig, f).values()), f
    assert sig.in_spec == up_sig.in_spec and sig.out_spec == up_sig.out_spec
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    up_vals = [n.meta["val"] for n in up_gm.graph.find_nodes(op="placeholder")]
    shapes = [[_is_free(s) for s in v.shape] for v in vals]
    assert shapes == [[False, False], [False], [False], [True, False]]
    if not trace_joint:  # upstream's joint export retraces (make_fx) and specializes its inputs
        assert shapes == [[_is_free(s) for s in v.shape] for v in up_vals]
    state = _state(mod)
    for got, expected in zip(gm(*state, *args), up_gm(*state, *args)):
        torch.testing.assert_close(got, expected)
    for b in (2, 7, 11):  # upstream's joint graph is specialized by its retrace; ours is not
        x = torch.randn(b, 4)
        ref = copy.deepcopy(mod)
        with torch.enable_grad() if trace_joint else torch.no_grad():
            outs = ref(x)
        n_mut = len(sig.buffers_to_mutate)
        got = gm(*_state(mod), x)
        torch.testing.assert_close(got[0], ref.calls)
        for g, e in zip(got[n_mut:n_mut + 2], outs):
            torch.testing.assert_close(g, e)
        if trace_joint:
            outs[0].backward()
            for g, p in zip(got[n_mut + 2:], ref.parameters()):
                torch.testing.assert_close(g, p.grad)


def test_export_joint_simple_traces_symbolic_sizes_of_fake_inputs():
    def f(x, w):
        return ((x @ w).sin() * x.shape[0],)

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x = _symbolic_fake(env, torch.randn(5, 4, requires_grad=True), mode)
    w = mode.from_tensor(torch.randn(4, 3, requires_grad=True), static_shapes=True)
    gm = aotgrad.aot_export_joint_simple(f, (x, w), trace_joint=True)
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    assert isinstance(placeholders[0].shape[0], torch.SymInt)
    for b in (2, 9):
        xr = torch.randn(b, 4, requires_grad=True)
        wr = torch.randn(4, 3, requires_grad=True)
        (out,) = f(xr, wr)
        tangent = torch.randn_like(out)
        out.backward(tangent)
        got = gm(xr.detach(), wr.detach(), tangent)
        torch.testing.assert_close(got[0], out)
        torch.testing.assert_close(got[-2], xr.grad)
        torch.testing.assert_close(got[-1], wr.grad)


def test_data_dependent_op_still_refused_with_dynamic():
    """A symbolic trace of masked_select makes an unbacked size; the graph would carry no check of
    what was assumed about it, so dynamic=True refuses it as static tracing does."""

    def f(x):
        return torch.masked_select(x, x > 0) * 2

    compiled = aotgrad.aot_function(f, aotgrad.nop, dynamic=True)
    with pytest.raises(DataDependentError):
        compiled(torch.randn(5))
