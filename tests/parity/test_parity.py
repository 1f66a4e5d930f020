"""Parity with torch 2.13's functorch.compile surface (issue 25, items 4, 6, 9-12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import BackwardTransposesSaved

import aotgrad

aten = torch.ops.aten


def _recording():
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    return graphs, compiler


def _inplace_targets(gm) -> set[str]:
    return {
        str(n.target) for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    }


def _program(x, y):
    a = x * 2
    a.add_(y)
    a.relu_()
    b = a.sin()
    b.mul_(3)
    y.add_(1)
    return b


def _eager_and_compiled(compile_fn, requires_grad=True):
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=requires_grad)
    y = torch.randn(5)
    xe, ye = x.detach().clone().requires_grad_(requires_grad), y.clone()
    expected = _program(xe, ye)
    got = compile_fn(_program)(x, y)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(y, ye)  # the input mutation
    assert got.requires_grad == expected.requires_grad
    if expected.requires_grad:
        expected.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(x.grad, xe.grad)


# ---- item 10: disable_functionalization ------------------------------------------------------


def test_disable_functionalization_keeps_inplace_ops_training():
    graphs, compiler = _recording()
    _eager_and_compiled(lambda f: aotgrad.aot_function(f, compiler, disable_functionalization=True))
    fw, bw = graphs
    assert {"aten.add_.Tensor", "aten.relu_.default", "aten.mul_.Tensor"} <= _inplace_targets(fw)
    assert _inplace_targets(bw), bw.code  # the backward's own temporaries are reused in place too
    for gm in (fw, bw):  # every node still carries its fake value
        assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")


def test_disable_functionalization_keeps_inplace_ops_inference():
    graphs, compiler = _recording()
    with torch.no_grad():
        _eager_and_compiled(lambda f: aotgrad.aot_function(f, compiler, disable_functionalization=True))
    (gm,) = graphs
    assert {"aten.add_.Tensor", "aten.relu_.default", "aten.mul_.Tensor"} <= _inplace_targets(gm)


def test_default_graphs_stay_functional():
    graphs, compiler = _recording()
    _eager_and_compiled(lambda f: aotgrad.aot_function(f, compiler))
    assert all(not _inplace_targets(gm) for gm in graphs)


def test_disable_functionalization_never_writes_graph_inputs():
    """The graph inputs are the caller's tensors (or saved activations): never mutated in place."""
    graphs, compiler = _recording()
    _eager_and_compiled(lambda f: aotgrad.aot_function(f, compiler, disable_functionalization=True))
    for gm in graphs:
        placeholders = set(gm.graph.find_nodes(op="placeholder"))
        for n in gm.graph.nodes:
            if n.op == "call_function" and str(n.target) in _inplace_targets(gm):
                assert n.args[0] not in placeholders, n.format_node()


def test_disable_functionalization_keyword_on_module_entry_points():
    mod = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = mod(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in mod.parameters()]
    for make in (
        lambda c: aotgrad.aot_module(mod, c, disable_functionalization=True),
        lambda c: aotgrad.aot_module_simplified(mod, [x], c, disable_functionalization=True),
    ):
        mod.zero_grad()
        graphs, compiler = _recording()
        out = make(compiler)(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        for p, g in zip(mod.parameters(), grads):
            torch.testing.assert_close(p.grad, g)
        assert "aten.relu_.default" in _inplace_targets(graphs[0])


def test_disable_functionalization_with_torch_optests_checker(monkeypatch):
    """torch's own OpInfo checker passes the keyword on every call (it raised TypeError before)."""
    from opinfo_swap import check_with_aotgrad

    x = torch.randn(3, 4, requires_grad=True)
    for disable in (False, True):
        check_with_aotgrad(monkeypatch, lambda t: torch.sin(t).mul_(2), (x,), {}, disable)


@pytest.mark.parametrize("name", ["nanquantile", "qr", "svd", "linalg.eigh", "linalg.qr", "linalg.svd"])
def test_disable_functionalization_never_makes_an_unsafe_inplace_op(name):
    """Ops the full sweep found torch.fx's reinplace rewriting wrongly: a broadcasting op turned into
    an in-place one on its smaller input (svd), an `add_(m, m.t())` (qr): run by torch's checker."""
    import opinfo_sweep
    from opinfo_swap import check_op

    assert check_op(opinfo_sweep.ops_by_id()[name], "aotgrad", True) == "pass"


def test_broadcasting_op_is_not_made_inplace():
    graphs, compiler = _recording()

    def f(x, y):
        s = x.sum() * 2
        return s + y  # `s` has shape []: add_ into it would not broadcast

    x, y = torch.randn(3, requires_grad=True), torch.randn(4)
    out = aotgrad.aot_function(f, compiler, disable_functionalization=True)(x, y)
    torch.testing.assert_close(out, f(x, y))
    (fw,) = graphs[:1]
    assert "aten.add_.Tensor" not in _inplace_targets(fw)
    assert "aten.mul_.Tensor" in _inplace_targets(fw)  # the scalar's own op is still made in place


@pytest.mark.long
def test_optests_aot_autograd_check_over_op_db():
    """torch's OpInfo checker over all of op_db, aotgrad and upstream, each with and without
    disable_functionalization: aotgrad passes every op upstream passes."""
    import opinfo_sweep
    from opinfo_swap import optests_sweep, summary

    results = optests_sweep(opinfo_sweep.get_op_db(), progress=print)
    text = summary(results)
    print(text)
    assert "upstream passes (disable_functionalization=False): 0" in text, text
    assert "upstream passes (disable_functionalization=True): 0" in text, text


# ---- item 11: node metadata and export names ----------------------------------------------------


def _meta_program(x, w):
    h = torch.sin(x)  # line: sin
    out = (h * w).sum()  # line: mul
    return out


def _check_graph_meta(gm, backward: bool):
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        assert "val" in n.meta, n.format_node()
        val = n.meta["val"]
        if isinstance(val, torch.Tensor):
            tm = n.meta["tensor_meta"]
            assert (tuple(tm.shape), tm.dtype, tuple(tm.stride)) == (tuple(val.shape), val.dtype, val.stride())
        if n.op == "call_function":
            assert bool(n.meta.get("autograd_backward")) == backward, n.format_node()


def test_graphs_carry_val_tensor_meta_stack_trace_and_backward_marks():
    graphs, compiler = _recording()
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = aotgrad.aot_function(_meta_program, compiler)(x, w)
    out.backward()
    fw, bw = graphs
    _check_graph_meta(fw, backward=False)
    _check_graph_meta(bw, backward=True)
    by_target = {n.target: n for n in fw.graph.nodes if n.op == "call_function"}
    assert by_target[aten.sin.default].stack_trace.rstrip().endswith("h = torch.sin(x)  # line: sin")
    assert "in _meta_program" in by_target[aten.sin.default].stack_trace
    assert by_target[aten.mul.Tensor].stack_trace.rstrip().endswith("# line: mul")
    # backward nodes take their forward node's trace: cos is sin's derivative
    (cos,) = [n for n in bw.graph.nodes if n.target is aten.cos.default]
    assert cos.stack_trace == by_target[aten.sin.default].stack_trace
    assert all(n.stack_trace for n in bw.graph.nodes if n.op == "call_function" and n.target is not aten.detach.default)


def test_stack_traces_under_torch_compile_come_from_dynamo_graph():
    graphs, compiler = _recording()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return torch.relu(y).sum()  # the relu line

    def backend(gm, example_inputs):
        return aotgrad.aot_module_simplified(gm, example_inputs, compiler)

    torch._dynamo.reset()
    m = M()
    x = torch.randn(2, 4)
    out = torch.compile(m, backend=backend)(x)
    torch.testing.assert_close(out, m(x))
    out.backward()
    fw, bw = graphs
    (relu,) = [n for n in fw.graph.nodes if n.target is aten.relu.default]
    assert "# the relu line" in relu.stack_trace
    (tb,) = [n for n in bw.graph.nodes if n.target is aten.threshold_backward.default]
    assert tb.stack_trace == relu.stack_trace and tb.meta["autograd_backward"]


def test_aot_export_module_names_inputs_as_upstream():
    from torch._functorch.aot_autograd import aot_export_module as upstream_export

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("b", torch.zeros(4))

        def forward(self, x):
            self.b.add_(1)
            return ((self.lin(x) + self.b).sum(),)

    x = torch.randn(2, 4)
    for joint in (False, True):
        kwargs = {"trace_joint": True, "output_loss_index": 0} if joint else {"trace_joint": False}
        results = []
        for export in (aotgrad.aot_export_module, upstream_export):
            m = M()
            with torch.no_grad() if not joint else torch.enable_grad():
                gm, sig = export(m, [x], **kwargs)
            results.append(([n.name for n in gm.graph.find_nodes(op="placeholder")], sig.user_inputs,
                             sig.inputs_to_parameters, sig.inputs_to_buffers))
        assert results[0] == results[1]
        assert results[0][0] == ["arg0_1", "arg1_1", "arg2_1", "arg3_1"]


# ---- item 12: refusals raised when upstream raises ------------------------------------------------


class _NoGradMetadataMutation(nn.Module):
    def forward(self, a):
        with torch.no_grad():
            a.unsqueeze_(-2)
        return a.reshape(2) + 3


def test_aot_module_simplified_compiles_from_example_inputs():
    calls = []

    def compiler(gm, example_inputs):
        calls.append(gm)
        return gm

    mod = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    compiled = aotgrad.aot_module_simplified(mod, [x], compiler)
    assert len(calls) == 1  # the forward, compiled before any call (upstream does the same)
    out = compiled(x)
    assert len(calls) == 1  # the first call reuses it
    torch.testing.assert_close(out, mod(x))


def test_aot_module_simplified_raises_refusal_at_call_time_of_the_api():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(aotgrad.UnsupportedMutationError, match="no_grad"):
        aotgrad.aot_module_simplified(_NoGradMetadataMutation(), [x], aotgrad.nop)


def _meta_mut_program(a, b):
    x, y = BackwardTransposesSaved.apply(a, b)
    return x * y


class _MetaMutModule(nn.Module):
    def forward(self, a, b):
        return _meta_mut_program(a, b)


def test_backward_refusal_raised_by_aot_module_simplified_with_its_type():
    """A refusal found while tracing the backward is raised before any call too (the backward is
    traced with the forward), as a BackwardMutationError."""
    a, b = torch.ones(3, 3, requires_grad=True), torch.ones(3, 3)
    with pytest.raises(aotgrad.BackwardMutationError, match="metadata"):
        aotgrad.aot_module_simplified(_MetaMutModule(), [a, b], aotgrad.nop)


# ---- item 9: LSTM in eval mode (oneDNN path on CPU) ------------------------------------------------


def _lstm_case(input_requires_grad: bool):
    torch.manual_seed(0)
    m = nn.LSTM(4, 8, num_layers=2, batch_first=True).eval()
    x = torch.randn(3, 5, 4, requires_grad=input_requires_grad)
    return m, x


def _run_lstm(m, fn, x):
    x.grad = None
    m.zero_grad()
    out, (h, c) = fn(x)
    (out.sum() + (h * 2).sum() + (c * 3).sum()).backward()
    return (out, h, c, x.grad), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("entry", ["aot_module", "torch.compile"])
def test_lstm_eval_forward_and_backward_like_eager(entry, input_requires_grad):
    assert torch._C._get_mkldnn_enabled()  # the fused oneDNN kernel is what eager runs here
    m, x = _lstm_case(input_requires_grad)
    expected, expected_param_grads = _run_lstm(m, m, x)
    torch._dynamo.reset()
    compiled = aotgrad.aot_module(m, aotgrad.nop) if entry == "aot_module" else torch.compile(
        m, backend="aotgrad_eager")
    got, param_grads = _run_lstm(m, compiled, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(param_grads, expected_param_grads)
    assert got[0].grad_fn is not None


def test_lstm_eval_inference_like_eager():
    m, x = _lstm_case(False)
    with torch.no_grad():
        expected = m(x)
        got = aotgrad.aot_module(m, aotgrad.nop)(x)
    torch.testing.assert_close(got, expected)
    assert not got[0].requires_grad


# ---- item 6: compiled autograd traces aotgrad's backward -------------------------------------------


def test_compiled_autograd_traces_aotgrad_backward_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)

    def train(x):
        out = m(x)
        out.sum().backward()
        return out

    def step(fn):
        m.zero_grad()
        return fn(x), [p.grad.clone() for p in m.parameters()]

    expected = step(train)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(train, backend="aotgrad_eager")
    with torch._dynamo.config.patch(compiled_autograd=True):
        for _ in range(2):
            got = step(compiled)
            torch.testing.assert_close(got, expected)
    breaks = list(counters["graph_break"])
    # The one break upstream has too: Dynamo does not trace `.backward()` itself; compiled autograd
    # then captures the backward, aotgrad's included, as one graph.
    assert len(breaks) == 1 and "backward()" in breaks[0], breaks
    assert counters["stats"]["unique_graphs"] == 2  # the forward graph and compiled autograd's graph


# ---- item 4: mutations in the backward pass (seed 000) -------------------------------------------


class _BwMutatesSaved(torch.autograd.Function):
    """Its backward doubles the saved input in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return g * 3


class _BwMutatesGradOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g.mul_(2)
        return g + 1


def _saved_input_mutated(a, b):
    return a * _BwMutatesSaved.apply(b)


def _grad_output_mutated(a, b):
    return _BwMutatesGradOutput.apply(a * b).sin()


def _compare_with_backward_mutation(f, requires_grad, *, compiled_fn=None):
    def make():
        return [torch.linspace(-1, 1, 9).view(3, 3).add(i).requires_grad_(r) for i, r in enumerate(requires_grad)]

    expected_inputs, inputs = make(), make()
    grad = torch.linspace(0.5, 2, 9).view(3, 3)
    expected = f(*expected_inputs)
    expected.backward(grad.clone())
    got = (compiled_fn or aotgrad.aot_function(f, aotgrad.nop))(*inputs)
    torch.testing.assert_close(got, expected)
    got.backward(grad.clone())
    for x, e in zip(inputs, expected_inputs):
        torch.testing.assert_close(x.detach(), e.detach())  # the backward's mutation, as eager's
        assert (x.grad is None) == (e.grad is None)
        if e.grad is not None:
            torch.testing.assert_close(x.grad, e.grad)
    return inputs


def test_backward_mutates_saved_input_that_requires_grad():
    inputs = _compare_with_backward_mutation(_saved_input_mutated, (True, True))
    assert inputs[1]._version > 0


def test_backward_mutates_saved_input_without_grad_still_works():
    _compare_with_backward_mutation(_saved_input_mutated, (True, False))


def test_backward_mutates_grad_output():
    _compare_with_backward_mutation(_grad_output_mutated, (True, True))


def test_backward_mutations_through_torch_compile_backend():
    torch._dynamo.reset()
    _compare_with_backward_mutation(_saved_input_mutated, (True, True),
                                    compiled_fn=torch.compile(_saved_input_mutated, backend="aotgrad_eager"))


def test_backward_metadata_mutation_of_grad_output_still_refused():
    class MetaMutGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            g.t_()
            return g.clone()

    with pytest.raises(aotgrad.BackwardMutationError, match="metadata"):
        aotgrad.aot_function(lambda a: MetaMutGrad.apply(a * 2), aotgrad.nop)(torch.ones(3, 3, requires_grad=True))


def _mutated_in_both(a, buf):
    from helpers import BwMutatesBuffer

    buf.mul_(2)  # forward mutation; BwMutatesBuffer's backward then does buf.add_(1)
    return BwMutatesBuffer.apply(a, buf) * 3


@pytest.mark.parametrize("entry", ["aot_function", "torch.compile"])
def test_input_mutated_in_forward_and_backward(entry):
    def make():
        return torch.linspace(-1, 1, 6).requires_grad_(), torch.linspace(1, 2, 6)

    (ea, ebuf), (a, buf) = make(), make()
    torch._dynamo.reset()
    compiled = (aotgrad.aot_function(_mutated_in_both, aotgrad.nop) if entry == "aot_function"
                else torch.compile(_mutated_in_both, backend="aotgrad_eager"))
    expected, got = _mutated_in_both(ea, ebuf), compiled(a, buf)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(buf, ebuf)  # the forward's mutation, before any backward
    grad = torch.linspace(0.5, 1.5, 6)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(buf, ebuf)  # and the backward's
    torch.testing.assert_close(a.grad, ea.grad)
    got2 = compiled(a, buf)  # the compiled entry again, on the mutated buffer
    torch.testing.assert_close(got2, _mutated_in_both(ea, ebuf))
    torch.testing.assert_close(buf, ebuf)



def test_backward_nodes_marked_on_the_make_fx_path_too():
    """Symbolic sizes make the lean recorder hand over to make_fx: backward nodes are still marked."""
    graphs, compiler = _recording()

    torch._dynamo.reset()
    backend = aotgrad.backend(fw_compiler=compiler, bw_compiler=compiler)
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend, dynamic=True)
    x = torch.randn(5, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, x.detach().cos() * 2)
    fw, bw = graphs[0], graphs[-1]
    ops = [n for n in bw.graph.nodes if n.op == "call_function"]
    assert ops and all(n.meta.get("autograd_backward") for n in ops)
    assert not any(n.meta.get("autograd_backward") for n in fw.graph.nodes)
