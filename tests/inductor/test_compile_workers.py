"""Inductor's Triton-compile workers are woken when aotgrad starts on a GPU graph, as Inductor's own
`compile_fx` wakes them, so they boot while aotgrad traces and partitions instead of during the first
kernel's compile (cold ViT-B/16 first step on the pretend H100: 22.2 s without, 20.6 s with; Inductor
18.8 s; scripts/pretend_gpu/first_step.py). A CPU graph builds C++ kernels, not Triton ones: no workers for it."""

from __future__ import annotations

import torch
from torch._inductor.async_compile import AsyncCompile
from torch._subclasses.fake_tensor import FakeTensorMode

from aotgrad.inductor.compilers import wake_compile_workers


def _woken(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(AsyncCompile, "wakeup", classmethod(lambda cls: calls.append(cls)))
    return calls


def test_a_graph_with_cuda_inputs_wakes_the_compile_workers(monkeypatch):
    calls = _woken(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(4, device="cuda"), torch.empty((), device="cpu"), 3]  # a CPU scalar (lr) beside
    assert wake_compile_workers(inputs)
    assert len(calls) == 1


def test_a_cpu_graph_wakes_none(monkeypatch):
    calls = _woken(monkeypatch)
    assert not wake_compile_workers([torch.zeros(3), 2.0])
    assert not wake_compile_workers([])
    assert calls == []
