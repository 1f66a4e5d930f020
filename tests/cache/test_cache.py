"""The on-disk cache (cache.py): a hit in a new process gives what a cold compile gives, without a
capture; bad entries, unsafe folders and uncacheable graphs fall back to compiling.

Cross-process tests run tests/cache_job.py in fresh processes (each pays torch's import); the
others use the cache in this process, in a temporary cache folder, with `torch._dynamo.reset()`
between compiles so the second compile goes to disk.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import pytest
import torch
from helpers import assert_same_results

import aotgrad
from aotgrad.cache import store as cache

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cache_job.py")


def _env(cache_dir) -> dict:
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "AOTGRAD_CACHE": "1"}


def _job(backend: str, cache_dir, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, JOB, backend, str(out), *extra], env=_env(cache_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, out) -> dict:
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    return torch.load(out, weights_only=False)


def _run_job(backend, cache_dir, out, *extra) -> dict:
    return _finish(_job(backend, cache_dir, out, *extra), out)


def _entries(cache_dir) -> list[str]:
    root = os.path.join(str(cache_dir), "aotgrad")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _check_cross_process(backend: str, tmp_path, *extra) -> dict:
    cold = _run_job(backend, tmp_path / "c", tmp_path / "cold.pt", *extra)
    warm = _run_job(backend, tmp_path / "c", tmp_path / "warm.pt", *extra)
    stored = cold["stats"]["stores"]
    assert stored >= 1 and cold["stats"]["hits"] == 0 and cold["captures"] == stored, cold["stats"]
    if backend == "aotgrad":  # each training graph's entry gets its backward's Inductor key
        assert cold["stats"]["updates"] >= 1, cold["stats"]
    assert len(_entries(tmp_path / "c")) == stored
    assert warm["stats"]["hits"] == stored and warm["stats"]["misses"] == 0, warm["stats"]
    assert warm["captures"] == 0  # no trace, no partitioning: everything came from the cache
    for run in (cold, warm):
        assert_same_results(run["compiled"], run["eager"], exact=False)
        assert run["compiled"]["view_is_alias"]
    assert_same_results(warm["compiled"], cold["compiled"], exact=True)
    return warm


def test_hit_in_a_new_process_is_the_cold_compile(tmp_path):
    """Training graph with BatchNorm, an inference graph updating BatchNorm's buffers in place, a
    graph mutating an input and returning a view of another (aotgrad_eager)."""
    _check_cross_process("aotgrad_eager", tmp_path)


def test_inductor_hit_in_a_new_process(tmp_path):
    """Inductor's compiled code is loaded by the FX-graph keys stored with the entry (the backward's
    added once it compiled): no graph unpickled, none hashed again, results identical to cold."""
    warm = _check_cross_process("aotgrad", tmp_path, "small")
    assert warm["fx"].get("fxgraph_cache_hit") == 2 and not warm["fx"].get("fxgraph_cache_miss"), warm["fx"]
    assert warm["calls"] == {"graphs_unpickled": 0, "inductor_keys_computed": 0}, warm["calls"]


def _check_forces_cross_process(backend: str, tmp_path) -> None:
    """A force-field model (autograd.grad(create_graph=True) inside, through torch.compile) in a
    fresh process hitting every entry: the same values and gradients as eager and as the cold run;
    only the pristine forward/backward graphs of the graph differentiated twice are unpickled."""
    cold = _run_job(backend, tmp_path / "c", tmp_path / "cold.pt", "forces")
    warm = _run_job(backend, tmp_path / "c", tmp_path / "warm.pt", "forces")
    stored = cold["stats"]["stores"]
    assert stored >= 1 and cold["stats"]["hits"] == 0, cold["stats"]
    assert warm["stats"]["hits"] == stored and warm["stats"]["misses"] == 0, warm["stats"]
    if backend == "aotgrad":
        assert cold["calls"]["graphs_unpickled"] == 0 and warm["calls"]["graphs_unpickled"] == 2, warm["calls"]
    for run in (cold, warm):
        assert_same_results(run["compiled"], run["eager"], exact=False)
    assert_same_results(warm["compiled"], cold["compiled"], exact=True)


def test_create_graph_after_a_hit_in_a_new_process(tmp_path):
    _check_forces_cross_process("aotgrad_eager", tmp_path)


@pytest.mark.long
def test_create_graph_after_an_inductor_hit_in_a_new_process(tmp_path):
    _check_forces_cross_process("aotgrad", tmp_path)


def test_two_processes_writing_the_same_entries(tmp_path, cached):
    """Two processes compile the same graphs at once (two ranks): each either stores or hits, no
    entry is torn, and a third compile hits every entry."""
    jobs = [_job("aotgrad_eager", tmp_path / "c", tmp_path / f"w{i}.pt") for i in range(2)]
    runs = [_finish(p, tmp_path / f"w{i}.pt") for i, p in enumerate(jobs)]
    for r in runs:
        assert r["stats"]["stores"] + r["stats"]["hits"] == 3 and r["stats"]["corrupt"] == 0, r["stats"]
        assert_same_results(r["compiled"], r["eager"], exact=False)
    files = _entries(tmp_path / "c")
    assert len(files) == 3 and not [f for f in files if os.path.basename(f).startswith(".tmp")]
    cached(tmp_path / "c")
    _workload()
    stats = aotgrad.cache_stats()
    assert stats["hits"] == 3 and stats["corrupt"] == 0, stats


# ----------------------------------------------------------------------------------------------
# In this process


@pytest.fixture
def cached(monkeypatch):
    """Turn the cache on in a given folder; counters reset; Dynamo's in-memory caches cleared."""

    def use(folder):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        monkeypatch.setenv("AOTGRAD_CACHE", "1")
        torch._dynamo.reset()
        aotgrad.cache_stats(reset=True)
        cache._warned.clear()

    yield use
    torch._dynamo.reset()


def _f(x, y):
    y.add_(1)
    return (x.sin() * y).sum(), x[1:]


def _workload(backend="aotgrad_eager"):
    from cache_job import g, inputs, workload

    model, x, a, b = inputs()
    return workload(model, torch.compile(g, backend=backend), x, a, b, backend=backend)


def _compile_f(backend="aotgrad_eager"):
    torch._dynamo.reset()
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.zeros(3, 4)
    loss, view = torch.compile(_f, backend=backend)(x, y)
    loss.backward()
    ref_x = x.detach().clone().requires_grad_()
    ref_y = torch.zeros(3, 4)
    ref_loss, ref_view = _f(ref_x, ref_y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(y, ref_y)
    assert view._base is x and torch.equal(view, ref_view)


def _corrupt(path: str, how: str) -> None:
    data = open(path, "rb").read()
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip":
        data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
    elif how == "version":
        data = data.replace(b"format=", b"format=9", 1)
    elif how == "empty":
        data = b""
    open(path, "wb").write(data)


@pytest.mark.parametrize("how", ["truncate", "flip", "version", "empty"])
def test_bad_entry_is_ignored_with_one_warning_and_rewritten(tmp_path, cached, caplog, how):
    cached(tmp_path)
    _compile_f()
    (path,) = _entries(tmp_path)
    good = open(path, "rb").read()
    _corrupt(path, how)
    with caplog.at_level(logging.WARNING, logger="aotgrad.cache"):
        _compile_f()
        _compile_f()  # the same bad file again would warn again: it was rewritten instead
    stats = aotgrad.cache_stats()
    assert stats["corrupt"] == 1 and stats["hits"] == 1 and stats["stores"] == 2, stats
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ignoring entry" in warnings[0].getMessage()
    assert open(path, "rb").read() == good


def test_other_aotgrad_version_is_a_miss(tmp_path, cached, monkeypatch):
    cached(tmp_path)
    _compile_f()
    monkeypatch.setattr(cache, "aotgrad_version", lambda: "another-version")
    monkeypatch.setattr(sys.modules["aotgrad.cache.key"], "aotgrad_version", lambda: "another-version")
    _compile_f()
    stats = aotgrad.cache_stats()
    assert stats["hits"] == 0 and stats["misses"] == 2 and stats["stores"] == 2, stats


def test_cache_off(tmp_path, cached, monkeypatch):
    cached(tmp_path)
    with aotgrad.config.patch(cache=False):
        _compile_f()
    monkeypatch.setenv("AOTGRAD_CACHE", "0")
    _compile_f()
    assert _entries(tmp_path) == [] and aotgrad.cache_stats() == dict.fromkeys(aotgrad.cache_stats(), 0)


def test_clear_cache(tmp_path, cached):
    cached(tmp_path)
    _compile_f()
    assert len(_entries(tmp_path)) == 1
    aotgrad.clear_cache()
    assert _entries(tmp_path) == []
    _compile_f()
    assert aotgrad.cache_stats()["hits"] == 0 and len(_entries(tmp_path)) == 1


def test_folder_others_can_write_is_refused(tmp_path, cached, caplog):
    cached(tmp_path)
    _compile_f()
    folder = os.path.join(str(tmp_path), "aotgrad")
    os.chmod(folder, 0o777)
    try:
        with caplog.at_level(logging.WARNING, logger="aotgrad.cache"):
            _compile_f()
    finally:
        os.chmod(folder, 0o700)
    stats = aotgrad.cache_stats()
    assert stats["hits"] == 0 and stats["stores"] == 1, stats
    assert any("writable by other users" in r.getMessage() for r in caplog.records)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_key_covers_aotgrad_config(tmp_path, cached):
    cached(tmp_path)
    _compile_f()
    with aotgrad.config.patch(inductor_graph_passes=False):
        _compile_f()
    _compile_f()
    stats = aotgrad.cache_stats()
    assert stats["stores"] == 2 and stats["hits"] == 1, stats


def test_unknown_compiler_is_not_cached_and_says_why(tmp_path, cached, caplog):
    cached(tmp_path)

    def my_compiler(gm, example_inputs):
        return gm.forward

    with caplog.at_level(logging.INFO, logger="aotgrad.cache"):
        _compile_f(aotgrad.backend(fw_compiler=my_compiler))
    assert aotgrad.cache_stats()["uncacheable"] == 1 and _entries(tmp_path) == []
    assert any("my_compiler" in r.getMessage() and "aotgrad_cache_key" in r.getMessage() for r in caplog.records)
    my_compiler.aotgrad_cache_key = "my_compiler v1"  # the opt-in
    _compile_f(aotgrad.backend(fw_compiler=my_compiler))
    _compile_f(aotgrad.backend(fw_compiler=my_compiler))
    stats = aotgrad.cache_stats()
    assert stats["stores"] == 1 and stats["hits"] == 1, stats


def test_dynamic_shapes_are_not_cached(tmp_path, cached, caplog):
    cached(tmp_path)
    with caplog.at_level(logging.INFO, logger="aotgrad.cache"):
        x = torch.randn(3, 4, requires_grad=True)
        torch.compile(lambda x: x.sin().sum(), backend="aotgrad_eager", dynamic=True)(x).backward()
    assert aotgrad.cache_stats()["uncacheable"] == 1 and _entries(tmp_path) == []
    assert any("dynamic shapes" in r.getMessage() for r in caplog.records)


def test_concurrent_stores_never_show_a_torn_entry(tmp_path, cached):
    import threading

    cached(tmp_path)
    key = "ab" * 32
    stop = threading.Event()
    loads: list = []

    def writer(size):
        while not stop.is_set():
            cache._store(key, {"payload": b"x" * size})

    def reader():
        for _ in range(300):
            loads.append(cache._load(key))

    threads = [threading.Thread(target=writer, args=(n,)) for n in (10, 1 << 20)]
    for t in threads:
        t.start()
    reader()
    stop.set()
    for t in threads:
        t.join()
    assert aotgrad.cache_stats()["corrupt"] == 0
    assert all(e is None or len(e["payload"]) in (10, 1 << 20) for e in loads)


# ----------------------------------------------------------------------------------------------
# Inductor's artifacts under aotgrad's entries


def _count_graph_loads(monkeypatch) -> list:
    from aotgrad.cache import load as cache_load

    loads: list = []
    load_graph = cache_load.load_graph
    monkeypatch.setattr(cache_load, "load_graph", lambda *a, **k: loads.append(1) or load_graph(*a, **k))
    return loads


def _count_pristine_loads(monkeypatch) -> list:
    """Graphs of a hit's differentiable / None-gradient backward unpickled (cache_higher.py)."""
    from aotgrad.cache import load as cache_load

    loads: list = []
    load = cache_load._Graphs.load
    monkeypatch.setattr(cache_load._Graphs, "load", lambda self, data: loads.append(1) or load(self, data))
    return loads


def test_deleted_inductor_artifact_is_a_miss_with_its_reason(tmp_path, cached, caplog, monkeypatch):
    """An aotgrad entry whose Inductor compiled code is gone: a miss saying so, a compile that
    matches eager, the entry rewritten; the next compile hits without unpickling a graph."""
    import shutil

    cached(tmp_path)
    _compile_f("aotgrad")
    assert aotgrad.cache_stats()["updates"] == 1  # the backward's key, once it compiled
    shutil.rmtree(tmp_path / "fxgraph")
    cached(tmp_path)
    with caplog.at_level(logging.INFO, logger="aotgrad.cache"):
        _compile_f("aotgrad")
    stats = aotgrad.cache_stats(reset=True)
    assert stats["hits"] == 0 and stats["misses"] == 1 and stats["corrupt"] == 0 and stats["stores"] == 1, stats
    assert any("not in its cache" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    loads = _count_graph_loads(monkeypatch)
    cached(tmp_path)
    _compile_f("aotgrad")
    assert aotgrad.cache_stats()["hits"] == 1 and loads == []


def test_backward_compiled_after_a_hit_is_added_to_the_entry(tmp_path, cached, monkeypatch):
    """A process that ran only the forward stores no backward key; the next one compiles the
    backward from the stored graph (restrided as Inductor saved its inputs), matches eager and adds
    the key; the third loads both graphs' compiled code."""
    cached(tmp_path)
    x = torch.randn(3, 4, requires_grad=True)
    torch.compile(_f, backend="aotgrad")(x, torch.zeros(3, 4))  # no backward
    assert aotgrad.cache_stats()["stores"] == 1 and aotgrad.cache_stats()["updates"] == 0
    loads = _count_graph_loads(monkeypatch)
    cached(tmp_path)
    _compile_f("aotgrad")
    stats = aotgrad.cache_stats()
    assert stats["hits"] == 1 and stats["updates"] == 1 and loads == [1], (stats, loads)
    loads.clear()
    cached(tmp_path)
    _compile_f("aotgrad")
    assert aotgrad.cache_stats()["hits"] == 1 and loads == []


def _two_outputs(x, y):
    return x.sin() * 2, (x * y).t(), y.cos().sum()


def test_hit_generates_the_cold_run_time_code(tmp_path, cached, monkeypatch, caplog):
    """The run time built from an entry's GraphFacts (no graph loaded) is the code a cold compile
    generates: the same prologue/epilogue, `autograd.Function`, None-gradient handling and
    differentiable backward (higher_order.py), whose graphs a first-order backward never loads."""
    caplog.set_level(logging.DEBUG, logger="aotgrad.runtime.source")
    sources, loads = [], []
    for hit in (False, True):
        cached(tmp_path)
        if hit:
            loads = _count_pristine_loads(monkeypatch)
        x = torch.randn(3, 4, requires_grad=True)
        y = torch.randn(3, 4, requires_grad=True)
        caplog.clear()
        a, b, c = torch.compile(_two_outputs, backend="aotgrad_eager")(x, y)
        sources.append("\n".join(r.getMessage() for r in caplog.records if r.name == "aotgrad.runtime.source"))
        (a.sum() + b.sum() + c).backward(retain_graph=True)  # every output gets a gradient
        assert loads == []
    assert aotgrad.cache_stats()["hits"] == 1
    assert "set_materialize_grads(False)" in sources[0] and "ctx.primals = primals" in sources[0]
    assert sources[0] == sources[1]


def _second_order(fn, loads: list, *shapes) -> dict:
    """Values and a first-order backward where only output 1 gets a gradient (the None-tangent
    backward), then first and second derivatives (create_graph=True through output 0, the others'
    gradients None), of `fn`; `loads` (pristine graphs unpickled) after each."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in shapes]
    outs = fn(*xs)
    (outs[1] * 3).sum().backward()
    out = {"outs": [o.detach() for o in outs], "none_grads": [x.grad for x in xs], "loads": [len(loads)]}
    first = torch.autograd.grad(fn(*xs)[0].sum(), xs, create_graph=True, allow_unused=True, materialize_grads=True)
    second = torch.autograd.grad(sum((d * d.cos()).sum() for d in first), xs, allow_unused=True,
                                 materialize_grads=True)
    out.update(first=[d.detach() for d in first], second=list(second), loads=out["loads"] + [len(loads)])
    return out


def test_create_graph_and_none_gradients_after_a_hit(tmp_path, cached, monkeypatch):
    """After a hit, a backward where some outputs get no gradient runs the backward specialised for
    their zeros (zero_tangents.py), from the pristine backward graph unpickled then; create_graph=True
    unpickles the pristine forward too and gives eager's (and the cold compile's) second derivatives."""
    from aotgrad.partition import zero_tangents

    specialised: list = []
    specialise = zero_tangents.specialise
    monkeypatch.setattr(zero_tangents, "specialise", lambda *a: specialised.append(specialise(*a)) or specialised[-1])
    results = []
    for hit in (False, True):
        cached(tmp_path)
        specialised.clear()
        loads = _count_pristine_loads(monkeypatch)
        results.append(_second_order(torch.compile(_two_outputs, backend="aotgrad_eager"), loads, (3, 4), (3, 4)))
        assert aotgrad.cache_stats()["hits"] == int(hit)
        assert results[-1].pop("loads") == ([1, 2] if hit else [0, 0])  # bw, then fw: each once
        assert specialised and specialised[0] is not None  # the zero-tangent backward, hit or not
    eager = _second_order(_two_outputs, [], (3, 4), (3, 4))
    eager.pop("loads")
    assert_same_results(results[0], eager, exact=False)
    assert_same_results(results[1], results[0], exact=True)


def test_entry_without_pristine_graphs_refuses_create_graph(tmp_path, cached, monkeypatch):
    """An entry whose pristine graphs could not be pickled is still a hit: first-order gradients
    (None ones included, through the plain backward) as eager's; create_graph=True refused, as a
    cold compile without a differentiable backward refuses it."""
    from aotgrad.cache import serialize as cache_serialize
    from aotgrad.errors import AotgradError

    monkeypatch.setattr(cache_serialize, "record", lambda *a: None)
    for _ in range(2):
        cached(tmp_path)
        x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        a, b, c = torch.compile(_two_outputs, backend="aotgrad_eager")(x, y)
        (b * 3).sum().backward(retain_graph=True)
        (_two_outputs(xr, yr)[1] * 3).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad)
        torch.testing.assert_close(y.grad, yr.grad)
    assert aotgrad.cache_stats()["hits"] == 1
    with pytest.raises(AotgradError, match="create_graph"):
        torch.autograd.grad(a.sum(), x, create_graph=True)
