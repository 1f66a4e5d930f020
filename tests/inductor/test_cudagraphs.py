"""CUDA graphs with backend="aotgrad" (inductor/cudagraphs.py): what is asked of Inductor and why a
graph runs without them, decided and checked on CPU (the recording itself needs a GPU:
scripts/cuda_check.py, benchmarks/gpu_suite.py).

Inductor bumps counters["inductor"]["cudagraph_skips"] only for a graph whose `cudagraphs` box
arrived on, so the counter shows that the request reached `compile_fx_inner` (or the cache's
`post_compile`).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.utils import BoxedBool

import aotgrad
from aotgrad.inductor import cudagraphs
from aotgrad.inductor.compilers import link_backward

KWARGS_LOG = "aotgrad.inductor"
SKIP_LOG = "aotgrad.inductor.cudagraphs"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(cudagraphs, "_said", set())  # each test hears each reason once
    yield
    torch._dynamo.reset()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _graph_kwargs(caplog) -> list[tuple]:
    """(kind, cudagraphs, static_input_idxs) per graph aotgrad handed to compile_fx_inner."""
    return [(r.args[0], r.args[2], list(r.args[3])) for r in caplog.records
            if r.name == KWARGS_LOG and r.msg.startswith("aotgrad: %s graph %s to compile_fx_inner")]


def _skips(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == SKIP_LOG and r.levelno == level]


def test_reduce_overhead_on_cpu_runs_without_cuda_graphs_says_why_once_and_matches_eager(caplog):
    caplog.set_level(logging.DEBUG, logger="aotgrad.inductor")
    torch.manual_seed(0)
    eager = _net()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aotgrad", mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(5, 8)
        out, ref = compiled(x), eager(x)
        torch.testing.assert_close(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    for b, c in zip(model.buffers(), eager.buffers()):  # BatchNorm's running stats, written by the forward
        torch.testing.assert_close(b, c)
    with torch.no_grad():  # an inference graph: asks too, says nothing new
        torch.testing.assert_close(compiled(x), eager(x))

    kinds = _graph_kwargs(caplog)
    assert [(k, on) for k, on, _ in kinds] == [("forward", True), ("backward", False), ("inference", True)], kinds
    said = _skips(caplog)
    assert len(said) == 1 and "forward" in said[0] and "cpu tensors" in said[0], said
    # Inductor got the request for the forward and the inference graph, and turned it down.
    assert counters["inductor"]["cudagraph_skips"] == 2


def test_static_inputs_are_the_parameters_and_buffers(caplog):
    caplog.set_level(logging.DEBUG, logger="aotgrad.inductor")
    model = _net()
    torch.compile(model, backend="aotgrad", mode="reduce-overhead")(torch.randn(5, 8)).sum().backward()
    (forward, static), = [(k, s) for k, _, s in _graph_kwargs(caplog) if k == "forward"]
    n_state = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    assert len(static) == n_state == 9  # every input but x
    assert sorted(static) == static and static[-1] <= n_state


def test_static_leaf_positions_read_dynamo_marks():
    seen = {}

    def record(gm, example_inputs):
        seen["names"] = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        seen["static"] = cudagraphs.static_leaf_positions(gm, 0, example_inputs)
        seen["lifted"] = cudagraphs.static_leaf_positions(gm, 2, example_inputs)
        return gm.forward

    torch.compile(_net(), backend=record)(torch.randn(5, 8))
    names = seen["names"]
    assert [names[i] for i in seen["static"]] == [n for n in names if "parameters" in n or "buffers" in n]
    assert len(seen["static"]) == len(names) - 1
    # lifted state (get_attr parameters) comes first and is static
    assert seen["lifted"] == [0, 1] + [i + 2 for i in seen["static"]]


def test_requested_only_when_the_config_asks(caplog):
    caplog.set_level(logging.DEBUG, logger="aotgrad.inductor")
    torch.compile(_net(), backend="aotgrad")(torch.randn(5, 8)).sum().backward()
    assert [(k, on, s) for k, on, s in _graph_kwargs(caplog)] == [("forward", False, []), ("backward", False, [])]
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch._dynamo.reset()
    caplog.clear()
    torch.compile(torch.sin, backend="aotgrad", options={"triton.cudagraphs": True})(torch.randn(4))
    assert [(k, on) for k, on, _ in _graph_kwargs(caplog)] == [("inference", True)]
    assert counters["inductor"]["cudagraph_skips"] == 1


def test_dynamic_shapes_on_cpu_match_eager():
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    w = torch.randn(8, 4, requires_grad=True)
    cf = torch.compile(f, backend="aotgrad", mode="reduce-overhead", dynamic=True)
    for n in (3, 5, 9):
        x = torch.randn(n, 8)
        we = w.detach().clone().requires_grad_()
        out, ref = cf(x, w), f(x, we)
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(w.grad, we.grad)
        w.grad = None


def _placeholders(gm):
    return gm.graph.find_nodes(op="placeholder")


def test_saved_static_inputs_and_their_views_are_static_in_the_backward():
    def fw(w, x, b):
        return x @ w.t() + b, w, w.t(), x, (x * 2)

    gm = torch.fx.symbolic_trace(fw)
    # forward outputs: 1 user output, then saved: w, w.t(), x, x*2; w and b are static (0 and 2)
    assert cudagraphs.static_saved(gm, 1, [0, 2]) == [0]  # w.t() is a method call here, not an aten view
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(fw)(torch.randn(3, 4), torch.randn(2, 4), torch.randn(3))
    assert cudagraphs.static_saved(traced, 1, [0, 2]) == [0, 1]  # the aten view of w too
    assert cudagraphs.static_saved(traced, 1, []) == []


def test_backward_shares_its_forwards_box():
    fw = torch.fx.symbolic_trace(lambda x: (x.sin(), x))
    bw = torch.fx.symbolic_trace(lambda x, g: (g * x.cos(),))
    assert cudagraphs.backward_kwargs(bw, fw)["cudagraphs"].value is False  # no known forward
    link_backward(bw, fw)
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        fwd = cudagraphs.forward_kwargs(fw, [torch.randn(2)], cudagraphs.StaticInputs(), is_inference=False)
    fw.meta[cudagraphs.STATIC_SAVED] = [0]
    assert cudagraphs.backward_kwargs(bw, fw)["cudagraphs"].value is False  # Inductor has not wrapped the forward
    fwd["boxed_forward_device_index"].set(0)  # as Inductor's post-compile does when it wraps the forward
    bwd = cudagraphs.backward_kwargs(bw, fw)
    assert bwd["cudagraphs"] is fwd["cudagraphs"] and bwd["boxed_forward_device_index"] is fwd["boxed_forward_device_index"]
    assert bwd["static_input_idxs"] == [0]
    BoxedBool.disable(fwd["cudagraphs"])  # Inductor turned the forward's off: the backward follows
    assert cudagraphs.backward_kwargs(bw, fw) == {"cudagraphs": fwd["cudagraphs"], "static_input_idxs": [],
                                                  "boxed_forward_device_index": fwd["boxed_forward_device_index"]}


def test_static_inputs_by_identity_or_dynamo_mark():
    a, b, c = torch.randn(2), torch.randn(2), torch.randn(2)
    torch._dynamo.mark_static_address(c)
    static = cudagraphs.StaticInputs([a])
    assert static.indices([b, a, 3, c]) == [1, 3]


def test_a_reason_is_said_once(caplog):
    caplog.set_level(logging.DEBUG, logger=SKIP_LOG)
    cudagraphs.say("forward", "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n  x.add_(1)")
    cudagraphs.say("inference", "skipping cudagraphs due to mutated inputs (2 instances)")
    cudagraphs.say("forward", "skipping cudagraphs due to cpu device (arg0_1)", said_by_inductor=True)
    assert _skips(caplog) == ["aotgrad: the forward graph runs without CUDA graphs: mutated inputs (1 instances)"]
    assert len(_skips(caplog, logging.DEBUG)) == 2


def test_a_cache_hit_asks_for_cuda_graphs_too(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=SKIP_LOG)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    aotgrad.cache_stats(reset=True)

    def f(x, w):
        return (x @ w).relu().sum()

    w = torch.randn(4, 3, requires_grad=True)
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        caplog.clear()
        torch.compile(f, backend="aotgrad", mode="reduce-overhead")(torch.randn(2, 4), w).backward()
        # the forward's request reached Inductor (compile or post_compile) and was turned down
        assert counters["inductor"]["cudagraph_skips"] == 1
        assert any("cpu tensors" in m for m in _skips(caplog, logging.WARNING) + _skips(caplog, logging.DEBUG))
    assert aotgrad.cache_stats()["hits"] == 1


def test_graphs_compiled_inside_a_backward_run_without_cuda_graphs(caplog):
    """create_graph=True: the differentiable backward's graphs compile while the backward runs; the
    trees would take them for a new forward in the middle of it."""
    caplog.set_level(logging.DEBUG, logger="aotgrad.inductor")

    def f(x, w):
        return (x @ w).tanh().square().sum()

    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    we = w.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.compile(f, backend="aotgrad", mode="reduce-overhead")(x, w), w, create_graph=True)
    (ge,) = torch.autograd.grad(f(x, we), we, create_graph=True)
    torch.testing.assert_close(g, ge)
    g.square().sum().backward()
    ge.square().sum().backward()
    torch.testing.assert_close(w.grad, we.grad)
    assert any("create_graph" in m for m in _skips(caplog)), _skips(caplog)


def _clearing(gm, example_inputs):
    """A compiler whose graphs take their inputs as cudagraph trees do: the list, emptied once read."""

    def run(args):
        out = gm(*args)
        args.clear()
        return out

    run._boxed_call = True
    return run


def test_the_run_time_hands_each_graph_a_list_it_may_empty():
    """Cudagraph trees empty the input list they are given (so the inputs can be freed); the
    generated run time must not read a list after handing it over: forward, backward, inference,
    with an input mutation, a view output and a saved input."""

    def f(x, y, buf):
        buf.add_(1)
        z = (x * y).sin()
        return z.sum(), z.t(), x.view(-1)

    be = aotgrad.backend(fw_compiler=_clearing, bw_compiler=_clearing, inference_compiler=_clearing)
    cf = torch.compile(f, backend=be)
    for grad in (True, False):
        x, y = torch.randn(3, 4, requires_grad=grad), torch.randn(3, 4, requires_grad=grad)
        xe, ye = (t.detach().clone().requires_grad_(grad) for t in (x, y))
        buf, bufe = torch.zeros(2), torch.zeros(2)
        with torch.set_grad_enabled(grad):
            outs, refs = cf(x, y, buf), f(xe, ye, bufe)
        for o, r in zip(outs, refs):
            torch.testing.assert_close(o, r)
        torch.testing.assert_close(buf, bufe)
        if grad:
            (outs[0] + outs[1].square().sum()).backward()
            (refs[0] + refs[1].square().sum()).backward()
            torch.testing.assert_close(x.grad, xe.grad)
            torch.testing.assert_close(y.grad, ye.grad)
