"""The aot_function / aot_module path against eager: closed-over tensors, non-tensor arguments,
module state, recompile limits, data-dependent ops, logging and config (issue 26)."""

from __future__ import annotations

import copy
import enum
import gc
import logging
import os
import re
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import counting_compiler

import aotgrad
from aotgrad import AotgradError, UnsupportedInputError, aot_function, aot_module, aot_module_simplified, nop

ROOT = Path(__file__).resolve().parents[2]


# 1. closed-over tensors ---------------------------------------------------------------------------


def test_closure_tensor_gets_gradient_like_eager():
    torch.manual_seed(0)
    W = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    (x @ W).sum().backward()
    ref_w, ref_x = W.grad.clone(), x.grad.clone()
    W.grad, x.grad = None, None
    f = aot_function(lambda x: (x @ W).sum(), nop)
    f(x).backward()
    torch.testing.assert_close(W.grad, ref_w)
    torch.testing.assert_close(x.grad, ref_x)
    # its current value is read per call: an optimizer step changes the result
    with torch.no_grad():
        W.mul_(2)
    torch.testing.assert_close(f(x), (x @ W).sum())


def test_closure_over_module_weight_through_aot_function():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    x = torch.randn(2, 4)
    f = aot_function(lambda x: torch.tanh(lin(x)).sum(), nop)
    out = f(x)
    out.backward()
    eager = torch.tanh(ref(x)).sum()
    eager.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_closure_only_input_requiring_grad_builds_a_training_graph():
    W = torch.randn(3, requires_grad=True)
    f = aot_function(lambda x: (x * W).sum(), nop)
    f(torch.ones(3)).backward()
    torch.testing.assert_close(W.grad, torch.ones(3))


GLOBAL_W = torch.randn(4, requires_grad=True)


def _uses_global(x):
    return (x * GLOBAL_W).sum()


def test_rebound_global_and_reassigned_closed_over_parameter_are_followed():
    global GLOBAL_W
    f = aot_function(_uses_global, nop)
    x = torch.randn(4)
    f(x).backward()
    torch.testing.assert_close(GLOBAL_W.grad, x)
    GLOBAL_W = torch.randn(4, requires_grad=True)  # rebound: the new tensor is read and gets the grad
    out = f(x)
    torch.testing.assert_close(out, (x * GLOBAL_W).sum())
    out.backward()
    torch.testing.assert_close(GLOBAL_W.grad, x)
    lin = nn.Linear(4, 2)
    g = aot_function(lambda x: lin(x).sum(), nop)
    g(x)
    lin.weight = nn.Parameter(torch.randn(2, 4))
    out = g(x)
    torch.testing.assert_close(out, lin(x).sum())
    out.backward()
    torch.testing.assert_close(lin.weight.grad, x.expand(2, 4))


def test_global_tensor_in_module_through_aot_module():
    torch.manual_seed(0)
    scale = torch.randn(4, requires_grad=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.side = [nn.Linear(4, 4)]  # not a registered submodule: reached, not passed

        def forward(self, x):
            return (self.side[0](self.lin(x)) * scale).sum()

    m = M()
    ref = copy.deepcopy(m)
    ref_scale = scale.detach().clone().requires_grad_()
    x = torch.randn(2, 4)
    aot_module(m, nop)(x).backward()
    (ref.side[0](ref.lin(x)) * ref_scale).sum().backward()
    torch.testing.assert_close(scale.grad, ref_scale.grad)
    torch.testing.assert_close(m.side[0].weight.grad, ref.side[0].weight.grad)
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)


# 2. non-tensor arguments --------------------------------------------------------------------------


def test_mutated_object_attribute_recompiles():
    cfg = SimpleNamespace(scale=2.0, relu=False)
    f = aot_function(lambda x, c: (x.relu() if c.relu else x) * c.scale, nop)
    x = torch.randn(5)
    torch.testing.assert_close(f(x, cfg), x * 2.0)
    cfg.scale, cfg.relu = 3.0, True
    torch.testing.assert_close(f(x, cfg), x.relu() * 3.0)


class Cfg:
    def __init__(self, k):
        self.k = k


def test_new_equal_objects_share_one_compile_and_are_not_kept_alive():
    compiler = counting_compiler()
    f = aot_function(lambda x, c: x * c.k, compiler)
    x = torch.randn(3)
    refs = []
    for _ in range(20):
        c = Cfg(2)
        refs.append(weakref.ref(c))
        torch.testing.assert_close(f(x, c), x * 2)
        del c
    gc.collect()
    assert len(compiler.calls) == 1
    assert all(r() is None for r in refs)


def test_function_argument_is_guarded_weakly():
    compiler = counting_compiler()
    f = aot_function(lambda x, act: act(x), compiler)
    x = torch.randn(4)

    def double(t):
        return t * 2

    torch.testing.assert_close(f(x, double), x * 2)
    torch.testing.assert_close(f(x, torch.sin), x.sin())
    torch.testing.assert_close(f(x, double), x * 2)
    assert len(compiler.calls) == 2
    ref = weakref.ref(double)
    del double
    gc.collect()
    assert ref() is None
    assert len(f.cache) == 1  # the entry keyed on the dead function was dropped


def test_partial_and_numpy_scalar_arguments():
    import functools

    np = pytest.importorskip("numpy")
    f = aot_function(lambda x, g: g(x), nop)
    x = torch.randn(3)
    torch.testing.assert_close(f(x, functools.partial(torch.mul, other=2)), x * 2)
    torch.testing.assert_close(f(x, functools.partial(torch.mul, other=3)), x * 3)  # not the first's graph
    h = aot_function(lambda x, n: x * float(n), nop)
    torch.testing.assert_close(h(x, np.float32(2)), x * 2)
    torch.testing.assert_close(h(x, np.float32(3)), x * 3)


class Mode(enum.Enum):
    A = 1
    B = 2


def test_enum_argument_by_value():
    f = aot_function(lambda x, m: x + 1 if m is Mode.A else x - 1, nop)
    x = torch.randn(3)
    torch.testing.assert_close(f(x, Mode.A), x + 1)
    torch.testing.assert_close(f(x, Mode.B), x - 1)


def test_object_holding_a_tensor_is_refused():
    f = aot_function(lambda x, c: x * c.w, nop)
    with pytest.raises(UnsupportedInputError, match="tensor arguments"):
        f(torch.randn(3), SimpleNamespace(w=torch.randn(3)))


def test_module_argument_is_refused():
    f = aot_function(lambda x, m: m(x), nop)
    with pytest.raises(UnsupportedInputError, match="aot_module"):
        f(torch.randn(2, 3), nn.Linear(3, 3))


# 3. module state ----------------------------------------------------------------------------------


def test_eval_after_train_follows_eager():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    ref = copy.deepcopy(m)
    cm = aot_module(m, nop)
    x = torch.randn(8, 4)
    out = cm(x)
    ref(x)
    assert (out == 0).any()  # training: dropout on
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)
    m.eval()
    ref.eval()
    torch.testing.assert_close(cm(x), ref(x))  # dropout off, running stats used
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)  # and not updated
    torch.testing.assert_close(m[1].num_batches_tracked, ref[1].num_batches_tracked)
    m[1].train()  # one submodule's flag
    ref[1].train()
    torch.testing.assert_close(cm(x), ref(x))
    torch.testing.assert_close(m[1].running_var, ref[1].running_var)
    m.train()  # back to the first state: no new compile
    n = len(cm._module_state.by_key)
    cm(x)
    assert len(cm._module_state.by_key) == n


def test_reassigned_parameter_and_buffer_are_used():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    m.register_buffer("shift", torch.zeros(2))
    m.forward = lambda x: nn.functional.linear(x, m.weight, m.bias) + m.shift
    cm = aot_module(m, nop)
    x = torch.randn(4, 3)
    cm(x)
    m.weight = nn.Parameter(torch.randn(2, 3))
    m.shift = torch.ones(2)
    out = cm(x)
    torch.testing.assert_close(out, x @ m.weight.T + m.bias + 1)
    out.sum().backward()
    assert m.weight.grad is not None


def test_hooks_added_and_removed_after_compiling():
    m = nn.Linear(3, 3)
    cm = aot_module(m, nop)
    x = torch.randn(2, 3)
    torch.testing.assert_close(cm(x), m(x))
    h = m.register_forward_hook(lambda mod, inp, out: out * 10)
    torch.testing.assert_close(cm(x), m(x))
    h.remove()
    torch.testing.assert_close(cm(x), m(x))


def test_aot_module_simplified_follows_training_flag():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))
    fwd = aot_module_simplified(m, [torch.randn(2, 4)], nop)
    x = torch.randn(2, 4)
    m.eval()
    torch.testing.assert_close(fwd(x), m(x))
    m.train()
    torch.manual_seed(3)
    a = fwd(x)
    torch.manual_seed(3)
    torch.testing.assert_close(a, m(x))


# 4. recompile limit -------------------------------------------------------------------------------


def test_recompile_warning_names_what_changes_and_hard_limit_runs_eagerly():
    compiler = counting_compiler()
    f = aot_function(lambda x, n: x * n, compiler)
    x = torch.randn(3)
    with aotgrad.config.patch(recompile_limit=3, recompile_hard_limit=5):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for n in range(8):
                torch.testing.assert_close(f(x, n), x * n)
    texts = [str(w.message) for w in seen]
    limit = [t for t in texts if "recompile_limit" in t]
    assert len(limit) == 1 and "args[1]: value" in limit[0], texts
    assert sum("recompile_hard_limit" in t for t in texts) == 1
    assert len(compiler.calls) == 5


def test_recompile_reason_logged(caplog):
    f = aot_function(lambda x: x * 2, nop)
    with caplog.at_level(logging.DEBUG, logger="aotgrad"):
        f(torch.randn(3))
        f(torch.randn(4))
    assert any("recompiling" in r.getMessage() and "shape (3,) -> (4,)" in r.getMessage() for r in caplog.records)


# 5. data-dependent ops and compilers returning None -----------------------------------------------


@pytest.mark.parametrize("fn,op", [
    (lambda x: x * x.sum().item(), r"\.item\(\)"),
    (lambda x: x.nonzero(), "nonzero"),
    (lambda x: x.masked_select(x > 0), "masked_select"),
])
def test_data_dependent_op_named(fn, op):
    with pytest.raises(aotgrad.errors.DataDependentError, match=op) as e:
        aot_function(fn, nop)(torch.randn(4))
    assert "torch.compile" in str(e.value)


def test_compiler_returning_none_is_named():
    def broken_compiler(gm, example_inputs):
        return None

    with pytest.raises(AotgradError, match="broken_compiler returned None"):
        aot_function(lambda x: x.sin(), broken_compiler)(torch.randn(2))


# 6. observability ---------------------------------------------------------------------------------


def _with_torch_logs(spec: str, fn):
    torch._logging.set_logs(**{name: True for name in spec.split(",")})
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = H()
    logger = logging.getLogger("torch")
    logger.addHandler(handler)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    return "\n".join(records)


def test_torch_logs_show_graphs_under_aot_function():
    x = torch.randn(3, requires_grad=True)
    text = _with_torch_logs("aot_graphs,aot_joint_graph", lambda: aot_function(lambda x: x.sin(), nop)(x).sum().backward())
    assert "Joint graph (aotgrad)" in text and "Forward graph (aotgrad)" in text and "Backward graph (aotgrad)" in text
    assert "aten.sin" in text
    quiet = _with_torch_logs("aot_graphs", lambda: aot_function(lambda x: x.cos(), nop, enable_log=False)(x))
    assert "aotgrad" not in quiet


def test_torch_logs_show_graphs_under_backend():
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    text = _with_torch_logs("aot_graphs", lambda: torch.compile(lambda x: x.sin() * 2, backend="aotgrad_eager")(x))
    assert "Forward graph (aotgrad)" in text


def test_stage_logs_and_compile_times(caplog):
    aotgrad.compile_times(reset=True)
    with caplog.at_level(logging.DEBUG, logger="aotgrad"):
        aot_function(lambda x: x.exp(), nop)(torch.randn(2, requires_grad=True)).sum().backward()
    msgs = [r.getMessage() for r in caplog.records]
    for name in ("capture", "partition", "compile_forward", "compile_backward"):
        assert any(re.match(rf"aotgrad: {name}\b.* took [0-9.]+ s", m) for m in msgs), (name, msgs)
    times = aotgrad.compile_times()
    assert set(times) >= {"capture", "partition", "compile_forward", "compile_backward"}
    assert all(v["seconds"] >= 0 and v["count"] == 1 for v in times.values())


# 7. configuration ---------------------------------------------------------------------------------


def test_unknown_config_name_raises():
    with pytest.raises(AttributeError, match="recompile_limt"):
        aotgrad.config.recompile_limt = 3
    old = aotgrad.config.recompile_limit
    aotgrad.config.recompile_limit = 5
    assert aotgrad.config.recompile_limit == 5
    aotgrad.config.recompile_limit = old


def test_every_config_option_documented():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in aotgrad.config._NAMES:
        assert f"`{name}`" in page or f"config.{name}" in page, name
    assert "AOTGRAD_PRINT_RUNTIME" in page


def test_print_runtime_writes_the_generated_code_to_stderr():
    """AOTGRAD_PRINT_RUNTIME=1 turns on the `aotgrad.runtime.source` logger (no print in the library)."""
    code = "import torch, aotgrad; aotgrad.aot_function(lambda x: x.sin(), aotgrad.nop)(torch.randn(3, requires_grad=True))"
    env = {**os.environ, "AOTGRAD_PRINT_RUNTIME": "1", "AOTGRAD_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "def run(" in done.stderr and done.stdout == ""


def test_backend_honours_torch_activation_memory_budget():
    from aotgrad.backend.dynamo import AotgradBackend

    b = aotgrad.backend(fw_compiler=nop)
    assert isinstance(b, AotgradBackend)
    assert "memory_budget" not in repr(getattr(b._partition_fn(), "keywords", {}))
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        part = b._partition_fn()
    assert part.keywords["memory_budget"] == 0.5


# 8. Code blocks of the README and docs/ -------------------------------------------------------------


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


@pytest.mark.parametrize("page", _doc_pages(), ids=[str(p.relative_to(ROOT)) for p in _doc_pages()])
def test_documented_python_blocks_run(page, tmp_path, monkeypatch):
    """Each page's blocks in order, in one folder (a page's second block may load what its first
    saved), each as a script of its own."""
    blocks = _python_blocks(page)
    monkeypatch.chdir(tmp_path)  # blocks may write files (report.save_html, a saved compile)
    for i, block in enumerate(blocks):
        torch._dynamo.reset()
        exec(compile(block, f"{page.name} block {i}", "exec"), {"__name__": "readme"})


def test_the_readme_has_runnable_examples():
    assert len(_python_blocks(ROOT / "README.md")) >= 3
