"""aotgrad.explain (issue 31): the report's content checked against known programs and against what
the compiled code actually saves (saved-tensor hooks around a call of the aot-compiled function)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import aot_function, aot_module, min_cut_rematerialization_partition, mincut_partitioner, nop


class _Packed:
    """What autograd packs for the backward during one call: tensors and unique storages."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def _pack(self, t):
        self.tensors.append(t)
        return t

    @property
    def shapes(self) -> Counter:
        return Counter((tuple(t.shape), t.dtype) for t in self.tensors)

    @property
    def storage_bytes(self) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors}.values())


class Counted(nn.Module):
    """A buffer mutated in place, an output that is a view of an intermediate."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        h = torch.tanh(self.fc1(x))
        return self.fc2(h), h.view(-1)


def _counted_inputs():
    torch.manual_seed(0)
    return Counted(), torch.randn(3, 8)


def test_module_plan_names_params_mutated_buffer_and_view_output():
    mod, x = _counted_inputs()
    r = aotgrad.explain(mod, x, partition_fn=min_cut_rematerialization_partition, budget_points=0, timeline=False)
    assert r.refusal is None
    names = [i.name for i in r.inputs]
    assert names == ["param 'fc1.weight'", "param 'fc1.bias'", "param 'fc2.weight'", "param 'fc2.bias'",
                     "buffer 'calls'", "arg 'x'"]
    assert all(i.requires_grad for i in r.inputs[:4])  # lifted as aot_module lifts them
    assert r.input_named("calls").facts == ("data mutated, copied back after the graph",)
    assert r.input_named("fc1.weight").facts == ("read only",)
    assert r.outputs[0].what == "graph output #1"
    assert r.outputs[1].what.startswith("view of an intermediate") and r.outputs[1].what.endswith("by view")
    assert [g.kind for g in r.graphs] == ["forward", "backward"]
    tanh = next(n for n in r.graphs[0].nodes if n.op == "aten.tanh")
    assert "test_explain.py" in tanh.source and "torch.tanh(self.fc1(x))" in tanh.source
    addmm = next(n for n in r.graphs[0].nodes if n.op == "aten.addmm")
    assert addmm.module == "fc1 (Linear)"
    assert mod.calls.item() == 0 and mod.fc1.weight.grad is None  # the caller's module is untouched


def test_saved_numbers_equal_what_the_compiled_module_saves():
    mod, x = _counted_inputs()
    for pf in (aotgrad.default_partition, min_cut_rematerialization_partition, mincut_partitioner(0.0)):
        r = aotgrad.explain(mod, x, partition_fn=pf, budget_points=0, timeline=False)
        compiled = aot_module(copy.deepcopy(mod), nop, partition_fn=pf)
        with _Packed() as packed:
            compiled(x.clone())
        res = r.residuals
        assert Counter((s.shape, s.dtype) for s in res.saved_tensors) == packed.shapes
        assert res.saved_bytes == sum(t.numel() * t.element_size() for t in packed.tensors)
        assert res.runtime_bytes == packed.storage_bytes
        eager = copy.deepcopy(mod)
        with _Packed() as seen:
            eager(x.clone())
        assert res.eager_bytes == seen.storage_bytes
        assert "3. Saved and recomputed" in str(r)


def _chain(x, w):
    h = x @ w
    return h.sin().cos().sum(), h.t()


def _chain_inputs():
    torch.manual_seed(1)
    return torch.randn(64, 32, requires_grad=True), torch.randn(32, 48, requires_grad=True)


def test_output_view_of_an_input_and_of_an_intermediate():
    def f(x, w):
        return x * w, x.t(), (x * w).view(-1)

    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    r = aotgrad.explain(f, x, w, timeline=False, budget_points=0)
    assert [i.name for i in r.inputs] == ["arg 'x'", "arg 'w'"]
    assert r.outputs[0].what == "graph output #0"
    assert r.outputs[1].what == "view of input 0 (arg 'x') rebuilt by t"
    assert r.outputs[2].what.startswith("view of an intermediate")


def test_min_cut_budget_curve_and_chosen_point_match_the_compiled_plans():
    x, w = _chain_inputs()
    r0 = aotgrad.explain(_chain, x, w, memory_budget=0.0, budget_points=5, timeline=False)
    r1 = aotgrad.explain(_chain, x, w, memory_budget=1.0, budget_points=0, timeline=False)
    assert [p.budget for p in r0.curve] == [0.0, 0.25, 0.5, 0.75, 1.0]
    ends = {p.budget: p for p in r0.curve}
    assert ends[0.0].saved_bytes == r0.chosen.saved_bytes and ends[0.0].recompute_flops == r0.chosen.recompute_flops
    assert ends[1.0].saved_bytes == r1.chosen.saved_bytes
    assert r0.chosen.saved_bytes < r1.chosen.saved_bytes  # budget 0 recomputes the matmul: x and w saved only
    assert r0.chosen.recompute_flops > r1.chosen.recompute_flops > 0 or r1.chosen.recompute_flops == 0
    assert any(x.op == "aten.mm" for x in r0.residuals.recomputed)
    saved = [p.saved_bytes for p in r0.curve]
    assert saved == sorted(saved)  # monotone in the budget
    for rep, budget in ((r0, 0.0), (r1, 1.0)):  # what the report says is what aot_function saves
        with _Packed() as packed:
            aot_function(_chain, nop, partition_fn=mincut_partitioner(budget))(*(t.detach().clone().requires_grad_()
                                                                               for t in (x, w)))
        assert rep.chosen.saved_bytes == rep.residuals.saved_bytes == sum(t.numel() * t.element_size()
                                                                          for t in packed.tensors)
    assert r0.residuals.saved_bytes == (64 * 32 + 32 * 48) * 4  # the two inputs


def test_memory_timeline_is_measured_and_matches_the_saved_activations():
    def f(x):
        return x.exp().exp().sum()

    x = torch.randn(1000, requires_grad=True)
    r = aotgrad.explain(f, x, partition_fn=aotgrad.default_partition, budget_points=0)  # saves the exps
    aot, eager = r.timelines
    assert (aot.label, eager.label) == ("aotgrad", "eager")
    # When the backward starts, what is alive is what the forward saved (two exp outputs, 4000 B
    # each, not counting inputs) plus the 4-byte loss.
    activations = sum(s.nbytes for s in r.residuals.saved_tensors if s.op != "input")
    assert activations == 8000
    assert aot.at_backward_start == activations + 4 == eager.at_backward_start
    assert aot.ops[: aot.backward_start] == ["exp", "exp", "sum"]
    assert aot.peak >= activations and aot.live[-1] == eager.live[-1] >= 4000  # x.grad stays alive
    text = str(r)
    assert "4. Memory timeline" in text and "peak" in text


def test_budget_zero_lowers_the_measured_memory_at_backward_start():
    def loss(x, w):
        return (x @ w).sin().cos().sum()

    x, w = _chain_inputs()
    r0 = aotgrad.explain(loss, x, w, memory_budget=0.0, budget_points=0)
    r1 = aotgrad.explain(loss, x, w, memory_budget=1.0, budget_points=0)
    # budget 0 saves only x and w (not counted: inputs); budget 1 the matmul's output
    assert r0.timelines[0].at_backward_start == 4  # the loss
    assert r1.timelines[0].at_backward_start == 4 + 64 * 48 * 4
    assert r1.timelines[1].at_backward_start == r0.timelines[1].at_backward_start  # eager is eager


def test_saved_residuals_lifts_a_module_passed_as_fn():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    rep = aotgrad.saved_residuals(mod, torch.randn(4, 6))
    assert not rep.inference
    assert {r.source for r in rep.residuals if r.op == "input"} == {"input"}
    assert rep.eager_bytes > 0 and rep.saved_bytes > 0


def test_refusal_is_reported_with_its_reason():
    def f(a):
        with torch.no_grad():
            a.unsqueeze_(-2)
        return a.reshape(2) + 3

    r = aotgrad.explain(f, torch.randn(2, requires_grad=True))
    assert r.refusal.startswith("UnsupportedMutationError") and "no_grad" in r.refusal
    assert "REFUSED" in str(r)
    assert "Refused" in _html(r)


def _html(report) -> str:
    from aotgrad.explain_html import render_html

    return render_html(report)


def test_html_is_self_contained_with_charts_and_collapsed_graphs(tmp_path):
    mod, x = _counted_inputs()
    r = aotgrad.explain(mod, x, partition_fn=min_cut_rematerialization_partition, budget_points=3)
    path = r.save_html(str(tmp_path / "r.html"))
    page = open(path, encoding="utf-8").read()
    assert "<script" not in page.lower() and "<link" not in page.lower() and " src=" not in page
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)  # only the SVG namespace
    assert "id='memory-timeline'" in page and "id='budget-curve'" in page and "id='chosen'" in page
    assert page.count("<details>") >= 4 and "<details open" not in page  # inputs, saved inputs, graphs
    assert "param &#x27;fc1.weight&#x27;" in page and "buffer &#x27;calls&#x27;" in page
    assert page.count("class='peak'") == 2
    # nodes link to the user's file (full path and line in the title); saved values to their node
    here = os.path.abspath(__file__)
    assert re.search(rf"<a href='file://{re.escape(here)}' title='{re.escape(here)}:\d+'>test_explain.py:\d+ in forward",
                     page)
    saved = r.residuals.residuals[-1].name
    assert f"href='#forward-{saved}'" in page and f"id='forward-{saved}'" in page
    assert "def forward(self" in str(r)  # small graphs' code is in the text too


def test_explain_dir_writes_a_report_per_compiled_graph_and_an_index(tmp_path):
    torch._dynamo.reset()

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            h = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    mod, x = Broken(), torch.randn(4, 8)
    with aotgrad.config.patch(explain_dir=str(tmp_path)):
        out = torch.compile(mod, backend="aotgrad_eager")(x)
    torch.testing.assert_close(out, mod(x))
    assert sorted(os.listdir(tmp_path)) == ["graph_000.html", "graph_001.html", "index.html"]
    index = (tmp_path / "index.html").read_text()
    assert index.index("graph_000.html") < index.index("graph_001.html")
    first, second = (tmp_path / "graph_000.html").read_text(), (tmp_path / "graph_001.html").read_text()
    assert "param &#x27;a.weight&#x27;" in first and "param &#x27;b.weight&#x27;" in second
    assert "a (Linear)" in first  # module path from Dynamo's node metadata
    torch._dynamo.reset()


def test_cli_runs_a_script_function_with_example_inputs(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import torch

        def step(x, w):
            return (x @ w).relu().sum()

        def make_inputs():
            return torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    """))
    out = tmp_path / "r.html"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    proc = subprocess.run([sys.executable, "-m", "aotgrad.explain", f"{script}:step", "--inputs", "make_inputs",
                           "--html", str(out), "--partitioner", "mincut", "--budget-points", "3"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1. Plan" in proc.stdout and "arg 'w'" in proc.stdout and "5. Memory budget" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr
    assert "id='budget-curve'" in out.read_text()


def test_module_stays_callable_after_importing_the_cli_module():
    import aotgrad.explain as cli

    r = cli(lambda x: x.sin(), torch.randn(3), timeline=False)
    assert r.residuals.inference and r.outputs[0].what == "graph output #0"


def test_explain_dir_with_dynamic_shapes_and_floats_dynamo_made_dynamic(tmp_path):
    """BatchNorm's eps and momentum reach the graph as 0-d tensors read with .item() under
    dynamic=True; the report takes their values (the compile itself is unchanged)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
    ref = copy.deepcopy(mod)
    compiled = torch.compile(mod, backend="aotgrad_eager", dynamic=True)
    x = torch.randn(5, 8)
    with aotgrad.config.patch(explain_dir=str(tmp_path)):
        out = compiled(x)
    torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(mod[1].running_mean, ref[1].running_mean)
    assert sorted(os.listdir(tmp_path)) == ["graph_000.html", "index.html"]
    page = (tmp_path / "graph_000.html").read_text()
    assert "eps=1e-05" in page and "momentum=0.1" in page
    assert "buffer &#x27;1.running_mean&#x27;" in page and "data mutated" in page
    torch._dynamo.reset()


def _dup(a, b):
    return a * b


def _set(a, b):
    a.set_(b.detach() * 2)
    return a + 1


def _meta(a):
    a.t_()
    return a * 2


def _overlap(a, b):
    a.add_(1)
    return a * b.sum()


def _no_grad(a, w):
    with torch.no_grad():
        a.mul_(2)
    return a * w


def _flip(a):
    a.requires_grad_()
    return a * 2


def _case_inputs(name):
    torch.manual_seed(0)
    if name == "dup":
        t = torch.randn(3, requires_grad=True)
        return (t, t)
    if name == "set":
        return torch.randn(3), torch.randn(3, requires_grad=True)
    if name == "overlap":
        base = torch.randn(6, requires_grad=True).clone()
        return base[:3], base[2:]
    if name == "no_grad":
        return torch.randn(3, requires_grad=True).clone(), torch.randn(3, requires_grad=True)
    return (torch.randn(2, 3),)


@pytest.mark.parametrize("fn, name, expected", [
    (_dup, "dup", [("b", "duplicate of arg 'a' (one graph input)")]),
    (_set, "set", [("a", "set_: storage swapped"), ("b", "read only")]),
    (_meta, "meta", [("a", "metadata mutated (size/stride/offset changed in place)")]),
    (_overlap, "overlap", [("a", "synthetic base: overlaps other mutated inputs; seen as as_strided(graph input 0 = "
                                 "base of arg 'a', [3], [1], 0)"),
                           ("a", "its base: data mutated, copied back after the graph"),
                           ("b", "synthetic base: overlaps other mutated inputs; seen as as_strided(graph input 0 = "
                                 "base of arg 'a', [4], [1], 2)")]),
    (_no_grad, "no_grad", [("a", "data mutated under no_grad / through .detach() (autograd does not see it), "
                                 "copied back after the graph")]),
    (_flip, "flip", [("a", "requires_grad_() switched on by the program")]),
])
def test_plan_facts_per_input(fn, name, expected):
    r = aotgrad.explain(fn, *_case_inputs(name), timeline=False, budget_points=0)
    assert r.refusal is None
    for arg, fact in expected:
        assert fact in r.input_named(f"'{arg}'").facts, r.input_named(f"'{arg}'").facts


def test_outputs_that_are_the_same_object_or_the_input_itself():
    def f(a):
        y = a * 2
        return y, y, a

    r = aotgrad.explain(f, torch.randn(4, requires_grad=True), timeline=False, budget_points=0)
    assert [o.what for o in r.outputs] == ["graph output #0", "alias of output 0 (the same tensor object)",
                                           "the input arg 'a' itself"]
