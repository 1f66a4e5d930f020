"""Recomputed values are made where the backward first needs them (partition_order.py), and the
explain timeline's backward frees each saved value at its last use (compilers_freeing.py): the
measured live peak of a min-cut plan is then at most eager's (issue 41)."""

from __future__ import annotations

import functools
import os
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.compilers_freeing import freeing_nop
from aotgrad.partition_mincut import min_cut_rematerialization_partition

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))


def _readme_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), torch.randn(8, 16)


def test_recomputed_op_sits_just_before_its_first_user():
    model, x = _readme_model()
    graphs = []

    def bw_compiler(gm, example):
        graphs.append(gm)
        return aotgrad.nop(gm, example)

    part = functools.partial(min_cut_rematerialization_partition, memory_budget=0.5)
    compiled = aotgrad.aot_module(model, aotgrad.nop, bw_compiler, partition_fn=part)
    ref = nn.Sequential(*[m for m in model])  # same parameters: compare gradients below
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    ref(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    (bw,) = graphs
    nodes = [n for n in bw.graph.nodes if n.op == "call_function"]
    gelus = [n for n in nodes if n.target is torch.ops.aten.gelu.default]
    assert gelus, "the min-cut at budget 0.5 recomputes the GELU"
    for g in gelus:
        first_user = min(nodes.index(u) for u in g.users)
        assert nodes.index(g) == first_user - 1, bw.code
        assert nodes.index(g) > 0  # not at the backward's start: a matmul of the tangent comes first


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.0])
def test_live_peak_at_most_eager_on_the_readme_example(budget):
    model, x = _readme_model()
    report = aotgrad.explain(model, x, memory_budget=budget, budget_points=0)
    peaks = {t.label: t.peak for t in report.timelines}
    assert peaks["aotgrad"] <= peaks["eager"], peaks


def test_live_peak_at_most_eager_on_the_screenshot_model():
    es = pytest.importorskip("explain_screenshot")
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 96, (4, 32)), torch.randint(0, 96, (4, 32))
    for budget in (1.0, 0.5, 0.0):
        report = aotgrad.explain(es.TinyGPT(), idx, targets, memory_budget=budget, budget_points=0)
        peaks = {t.label: t.peak for t in report.timelines}
        assert peaks["aotgrad"] <= peaks["eager"], (budget, peaks)


def test_freeing_nop_frees_each_input_at_its_last_use():
    def f(a, b):
        c = a * 2
        return c + b

    gm = torch.fx.symbolic_trace(f)
    run = freeing_nop(gm, [])
    a, b = torch.ones(3), torch.ones(3)
    alive = weakref.ref(a)
    args = [a, b]
    del a
    out = run(args)
    assert args == [] and alive() is None
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    assert "args_list" not in gm.code  # the caller's module is unchanged


def test_freeing_nop_runs_each_getitem_right_after_its_tuple():
    # batch norm's output is dead once ReLU has read it, though its mean/invstd items live on: the
    # getitems run right after the op so the tuple (which holds every item) is let go at once.
    def f(x, w, b):
        res = torch.ops.aten.native_batch_norm.default(x, w, b, None, None, True, 0.1, 1e-5)
        y = res[0].relu()
        return y.sum() + res[1].sum() + res[2].sum()

    gm = torch.fx.symbolic_trace(f)
    run = freeing_nop(gm, [])
    x, w, b = torch.randn(4, 3, 8, 8), torch.ones(3), torch.zeros(3)
    torch.testing.assert_close(run([x, w, b]), f(x, w, b))
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    from aotgrad.compilers_freeing import _items_right_after_their_tuple

    _items_right_after_their_tuple(graph)
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert ops[1:4] == ["<built-in function getitem>"] * 3, ops
