"""Inductor's CPU ISA probe runs in aotgrad's thread, once, and is over when aotgrad's call returns.

The probe's result is cached per process, so each case runs in a fresh interpreter (the child
below): it records every `VecISA.check_build` (which ISA, which test code, on which thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.abspath(__file__)


def _child(case: str) -> dict:
    import threading

    from torch._inductor import cpu_vec_isa

    import aotgrad
    from aotgrad.inductor import isa_probe

    builds = []
    check_build = cpu_vec_isa.VecISA.check_build

    def recording(self, code):
        builds.append([str(self), hash(code), threading.current_thread().name])
        return check_build(self, code)

    cpu_vec_isa.VecISA.check_build = recording
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)

    def f(x, w):
        return (x @ w).relu().sin().sum()

    out = {}
    if case == "backend":
        compiled = torch.compile(f, backend="aotgrad")
        got = compiled(x, w)
        got.backward()
        expected = f(x.detach().requires_grad_(), w.detach().requires_grad_())
        out["same"] = bool(torch.allclose(got, expected, atol=1e-5))
    elif case == "patched":
        compiled = torch.compile(f, backend="aotgrad", options={"cpp.vec_isa_ok": True})
        with torch.no_grad():  # an inference graph: one compile is enough here
            compiled(x, w)
    out["builds"] = builds
    out["probe_threads_alive"] = [t.name for t in threading.enumerate() if t.name == "aotgrad-isa-probe"]
    out["started_again"] = isa_probe.start()
    out["cached"] = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    out["hits"] = aotgrad.cache_stats().get("hits", 0)
    return out


def _run(case: str, tmp_path) -> dict:
    env = {**os.environ, "AOTGRAD_CACHE": "0", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, HERE, case], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="Inductor probes vector ISAs on x86 CPUs only")
def test_the_probe_runs_once_in_aotgrads_thread_and_ends_with_the_call(tmp_path):
    got = _run("backend", tmp_path)
    assert got["same"]
    assert got["builds"], "Inductor compiled C++ kernels without probing: nothing to hide"
    assert {name for *_, name in got["builds"]} == {"aotgrad-isa-probe"}
    pairs = [tuple(b[:2]) for b in got["builds"]]
    assert len(pairs) == len(set(pairs)), f"an ISA was probed twice: {pairs}"
    assert got["probe_threads_alive"] == []
    assert got["cached"] == 1 and got["started_again"] is False


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="Inductor probes vector ISAs on x86 CPUs only")
def test_options_that_decide_the_probe_keep_it_on_inductors_path(tmp_path):
    """`cpp.vec_isa_ok` given to this compile changes what the probe answers: it runs where
    Inductor asks, under the option, not in a thread that would read the option unpatched."""
    got = _run("patched", tmp_path)
    assert "aotgrad-isa-probe" not in {name for *_, name in got["builds"]}
    assert got["probe_threads_alive"] == []


def test_only_graphs_all_on_the_cpu_start_the_probe():
    """A GPU graph with a CPU scalar (an optimizer's lr) must not wait for a probe Inductor would
    never run; meta tensors stand in for another device here."""
    from aotgrad.backend.dynamo import _cpu_graph
    from aotgrad.backend.precompile import _cpu_graph as _saved_cpu_graph

    assert _cpu_graph([torch.randn(2), 3])
    assert not _cpu_graph([torch.randn(2), torch.empty(2, device="meta")])
    assert not _cpu_graph([3, 2.0])
    cpu = ("tensor", (2,), (1,), 0, torch.float32, "cpu", False)  # as precompile saves it
    other = ("tensor", (2,), (1,), 0, torch.float32, "meta", False)
    assert _saved_cpu_graph((cpu, ("value", 3)))
    assert not _saved_cpu_graph((cpu, other))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(_child(sys.argv[1])))
