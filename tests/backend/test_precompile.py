"""torch 2.13's precompile (`aot_compile`, `save_compiled_function`, `load_compiled_function`) and
the portable cache artifacts ("mega-cache") with aotgrad's backends (precompile.py,
cache_artifacts.py).

Round trips run this file as a job in fresh processes: `save` compiles, runs and saves; `load`, in
a new process with its own empty Inductor cache folder (another machine, as far as caches go), loads
and runs the same steps. Results are compared with eager's and with the cold run's (exactly).

    python tests/test_precompile.py save|load BACKEND FOLDER
    python tests/test_precompile.py mega-save|mega-load BACKEND FOLDER
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import aotgrad

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run as a script
from helpers import assert_same_results, run_job_script  # noqa: E402

HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------------------------
# The programs (module level: the saved bytecode refers to them by name)
# ----------------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _inputs() -> dict:
    torch.manual_seed(1)
    return {"x": torch.randn(5, 6), "a": torch.randn(4, 3, requires_grad=True), "b": torch.randn(4, 3),
            "w": torch.randn(3, 3, requires_grad=True)}


def mutate_and_alias(a, b):
    """Mutates `b` (no grad), returns a loss and a view of `a` (an output aliasing an input)."""
    b.mul_(2)
    return (a.sin() * b).sum(), a.view(-1)[2:7]


def energy(a, w):
    """Differentiated twice by the caller (create_graph=True)."""
    return torch.tanh(a @ w).pow(2).sum()


def _steps(model, step, g, h, inf, data, before_double=lambda: None) -> dict:
    """One training `step` of `model`, `g`'s mutation and alias, `inf` (the model under no_grad:
    BatchNorm statistics updated in an inference graph), then a double backward through `h`
    (`before_double()` is called before it: that backward traces its differentiable backward)."""
    out = step(data["x"])
    out.sum().backward()
    loss, view = g(data["a"], data["b"])
    loss.backward()
    with torch.no_grad():
        y = inf(data["x"] * 2)
    e = h(data["a"], data["w"])
    before_double()
    (gw,) = torch.autograd.grad(e, data["w"], create_graph=True)
    gw.pow(2).sum().backward()
    return {
        "out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": {n: t.clone() for n, t in model.named_buffers()},
        "loss": loss.detach(), "view": view.detach().clone(), "view_is_alias": view._base is data["a"],
        "a_grad": data["a"].grad, "b": data["b"].clone(), "gw": gw.detach(), "w_grad": data["w"].grad,
        "inference": y,
    }


def _compile(backend: str, model, data) -> tuple:
    def aot(fn, *args, no_grad=False):
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        if isinstance(fn, torch.nn.Module):
            compiled = compiled.forward
        with torch.set_grad_enabled(not no_grad):
            return compiled.aot_compile((args, {}))

    d = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in data.items()}
    return (aot(model, d["x"]), aot(mutate_and_alias, d["a"], d["b"]), aot(energy, d["a"], d["w"]),
            aot(model, d["x"], no_grad=True))


_NAMES = ("model", "g", "h", "inference")


def _count_captures() -> list:
    """aotgrad's captures in this process (a load must not trace)."""
    from aotgrad import api

    calls = []
    original = api._capture

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    api._capture = counting
    return calls


def _job(mode: str, backend: str, folder: str) -> None:
    from torch._dynamo.utils import counters

    captures = _count_captures()
    model, data = _model(), _inputs()
    if mode == "save":
        twin = copy.deepcopy(model)
        eager = _steps(twin, twin, mutate_and_alias, energy, twin, _inputs())
        compiled = _compile(backend, model, data)
        for name, fn in zip(_NAMES, compiled):
            fn.save_compiled_function(os.path.join(folder, f"{name}.bin"), external_data={"model": model})
        results = {"eager": eager}
    else:
        compiled = []
        for name in _NAMES:
            with open(os.path.join(folder, f"{name}.bin"), "rb") as f:
                compiled.append(torch.compiler.load_compiled_function(f, external_data={"model": model}))
        results = {}
    model_fn, g, h, inf = compiled

    def before_double():
        results["captures"] = len(captures)
        results["inductor_misses"] = counters["inductor"]["fxgraph_cache_miss"]
        results["inductor_hits"] = counters["inductor"]["fxgraph_cache_hit"]

    results["compiled"] = _steps(model, model_fn, g, h, inf, data, before_double)
    torch.save(results, os.path.join(folder, f"{mode}.pt"))


def _mega_job(mode: str, backend: str, folder: str) -> None:
    from aotgrad.cache import store as cache

    blob = os.path.join(folder, "artifacts.bin")
    if mode == "mega-load":
        with open(blob, "rb") as f:
            assert torch.compiler.load_cache_artifacts(f.read()) is not None
    model, data = _model(), _inputs()
    step = torch.compile(model, backend=backend)
    g = torch.compile(mutate_and_alias, backend=backend)
    out = step(data["x"])
    out.sum().backward()
    loss, view = g(data["a"], data["b"])
    loss.backward()
    results = {"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
               "buffers": {n: t.clone() for n, t in model.named_buffers()}, "loss": loss.detach(),
               "a_grad": data["a"].grad, "b": data["b"].clone(), "stats": cache.cache_stats()}
    if mode == "mega-save":
        artifacts = torch.compiler.save_cache_artifacts()
        assert artifacts is not None
        with open(blob, "wb") as f:
            f.write(artifacts[0])
        results["types"] = sorted(artifacts[1].artifacts)
    torch.save(results, os.path.join(folder, f"{mode}.pt"))


# ----------------------------------------------------------------------------------------------
# Helpers of the tests
# ----------------------------------------------------------------------------------------------


def _run(mode: str, backend: str, folder, cache_dir) -> dict:
    return run_job_script(HERE, mode, backend, folder, cache_dir)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [pytest.param("aotgrad", marks=pytest.mark.long), "aotgrad_eager"])
def test_saved_in_one_process_loaded_in_another(tmp_path, backend):
    """Training (module with BatchNorm, mutation and aliasing), a double backward and an inference
    graph: loaded in a fresh process with an empty Inductor cache, equal to the cold run exactly
    and to eager; the load traces nothing and compiles nothing with Inductor."""
    saved = _run("save", backend, tmp_path, tmp_path / "cache-save")
    loaded = _run("load", backend, tmp_path, tmp_path / "cache-load")
    assert_same_results(saved["compiled"], saved["eager"], exact=False, where="cold vs eager")
    assert_same_results(loaded["compiled"], saved["compiled"], exact=True, where="loaded vs cold")
    assert loaded["compiled"]["view_is_alias"]
    assert saved["captures"] > 0
    # Up to the double backward (which traces its differentiable backward, cold or loaded): no aotgrad
    # trace, and Inductor's code loaded by key, none compiled.
    assert loaded["captures"] == 0
    assert loaded["inductor_misses"] == 0
    if backend == "aotgrad":
        assert loaded["inductor_hits"] >= 5  # forward + backward of two graphs, the inference graph


@pytest.mark.parametrize("backend", [pytest.param("aotgrad", marks=pytest.mark.long), "aotgrad_eager"])
def test_mega_cache_round_trip_gives_aotgrad_hits(tmp_path, backend):
    saved = _run("mega-save", backend, tmp_path, tmp_path / "cache-a")
    assert "aotgrad" in saved["types"] and ("inductor" in saved["types"]) == (backend == "aotgrad")
    loaded = _run("mega-load", backend, tmp_path, tmp_path / "cache-b")
    assert saved["stats"]["hits"] == 0 and saved["stats"]["stores"] >= 2
    assert loaded["stats"]["hits"] >= 2 and loaded["stats"]["misses"] == 0, loaded["stats"]
    for k in ("out", "grads", "buffers", "loss", "a_grad", "b"):
        assert_same_results(loaded[k], saved[k], exact=True, where=k)


def _saved_file(tmp_path) -> tuple[str, bytes]:
    compiled = torch.compile(energy, fullgraph=True, backend="aotgrad_eager").aot_compile(
        ((torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)), {}))
    path = str(tmp_path / "energy.bin")
    compiled.save_compiled_function(path)
    with open(path, "rb") as f:
        return path, f.read()


def _load_bytes(data: bytes):
    import io

    return torch.compiler.load_compiled_function(io.BytesIO(data))


def test_tampered_file_refused(tmp_path):
    from aotgrad.backend.precompile import _MAGIC, PrecompileLoadError

    _, data = _saved_file(tmp_path)
    start = data.index(_MAGIC)
    payload = data.index(b"\n", data.index(b"\n", start + len(_MAGIC)) + 1) + 1
    tampered = bytearray(data)
    tampered[payload + 200] ^= 0x01
    with pytest.raises(PrecompileLoadError, match="content hash does not match"):
        _load_bytes(bytes(tampered))


def test_foreign_version_refused(tmp_path):
    from aotgrad.backend.precompile import PrecompileLoadError
    from aotgrad.cache.key import aotgrad_version

    _, data = _saved_file(tmp_path)
    mine = f"aotgrad={aotgrad_version()}".encode()
    assert mine in data
    foreign = data.replace(mine, b"aotgrad=" + b"0" * len(aotgrad_version()))
    with pytest.raises(PrecompileLoadError, match="saved by another version"):
        _load_bytes(foreign)


def _refused_at_aot_compile(fn, args, backend, match: str, **compile_kwargs) -> None:
    from aotgrad.backend.precompile import PrecompileError

    compiled = torch.compile(fn, fullgraph=True, backend=backend, **compile_kwargs)
    with pytest.raises(Exception, match=match) as info:
        compiled.aot_compile((args, {}))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    assert any(isinstance(x, PrecompileError) for x in chain), chain


def test_user_compiler_without_key_refused_at_aot_compile():
    def my_compiler(gm, example_inputs):
        return gm

    backend = aotgrad.backend(fw_compiler=my_compiler, bw_compiler=my_compiler)
    _refused_at_aot_compile(energy, (torch.randn(4, 3, requires_grad=True), torch.randn(3, 3)), backend,
                            "aotgrad_cache_key")


def test_symbolic_shapes_refused_at_aot_compile():
    _refused_at_aot_compile(energy, (torch.randn(4, 3, requires_grad=True), torch.randn(3, 3)), "aotgrad",
                            "dynamic shapes", dynamic=True)


def test_subclass_input_refused_at_aot_compile():
    from torch.testing._internal.two_tensor import TwoTensor

    a = TwoTensor(torch.randn(4, 3), torch.randn(4, 3)).requires_grad_()
    _refused_at_aot_compile(energy, (a, torch.randn(3, 3)), "aotgrad_eager", "subclasses are not cached")


def keyed_compiler(gm, example_inputs):
    """A user compiler that opts into saving (module level: pickled by name)."""
    return gm


keyed_compiler.aotgrad_cache_key = "tests.keyed_compiler v1"


def _round_trip_in_process(backend, tmp_path) -> None:
    """aot_compile, save, load (this process), and compare a training step with eager's."""
    a, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    compiled = torch.compile(energy, fullgraph=True, backend=backend).aot_compile(((a, w), {}))
    path = str(tmp_path / "energy.bin")
    compiled.save_compiled_function(path)
    with open(path, "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    results = []
    for fn in (energy, compiled, loaded):
        a2, w2 = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = fn(a2, w2)
        out.backward()
        results.append((out.detach(), a2.grad, w2.grad))
    for got in results[1:]:
        for x, y in zip(got, results[0]):
            torch.testing.assert_close(x, y)
    for x, y in zip(results[1], results[2]):
        assert torch.equal(x, y)


def test_user_compiler_with_key_round_trip(tmp_path):
    _round_trip_in_process(aotgrad.backend(fw_compiler=keyed_compiler, bw_compiler=keyed_compiler), tmp_path)


def test_backend_with_options_round_trip(tmp_path, monkeypatch):
    """`aotgrad.backend(...)` with Inductor and a memory budget: its partitioner and patches travel."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _round_trip_in_process(aotgrad.backend(memory_budget=0.5), tmp_path)


def test_local_compiler_refused_at_aot_compile():
    def local(gm, example_inputs):
        return gm

    local.aotgrad_cache_key = "local v1"
    backend = aotgrad.backend(fw_compiler=local, bw_compiler=local)
    _refused_at_aot_compile(energy, (torch.randn(4, 3, requires_grad=True), torch.randn(3, 3)), backend,
                            "cannot be pickled by name")


def test_plain_torch_compile_unchanged():
    """Outside aot_compile the backend still returns its plain function (no wrapper per call)."""
    from aotgrad.backend.precompile import PrecompiledGraph

    seen = []

    def spy(gm, example_inputs):
        seen.append(aotgrad.aotgrad_eager(gm, example_inputs))
        return seen[-1]

    torch._dynamo.reset()
    a = torch.randn(4, 3, requires_grad=True)
    torch.compile(energy, backend=spy)(a, torch.randn(3, 3)).backward()
    assert seen and not any(isinstance(s, PrecompiledGraph) for s in seen)


if __name__ == "__main__":
    job_mode, job_backend, job_folder = sys.argv[1:4]
    (_mega_job if job_mode.startswith("mega") else _job)(job_mode, job_backend, job_folder)
