"""The GPU training suite's CPU dry run (benchmarks/gpu_suite.py, issue 41): tiny configs, stand-in
vision models, the debugging compilers, a couple of steps; the same table as on a GPU. Keeps the
script from rotting between GPU sessions."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)

import gpu_models  # noqa: E402
import gpu_suite  # noqa: E402


def test_dry_run_prints_the_table(capsys, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "suite.json"
    rc = gpu_suite.main(["--tiny", "--device", "cpu", "--compilers", "eager", "--models", "gpt2,resnet50,vit",
                         "--steps", "1", "--warmup", "0", "--loss-steps", "2", "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, text
    assert "process warm-up (untimed)" in captured.err
    assert "| model" in text and "step ÷ ind" in text and "|Δloss| aot" in text
    for name in ("gpt2", "resnet50", "vit"):
        assert f"| {name} " in text
    assert "3/3 models pass" in text
    assert out.exists()


def test_every_model_builds_tiny_and_runs_eagerly():
    pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    for name, make in gpu_models.MODELS.items():
        sm = make("tiny", torch.device("cpu"), 1, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sm.module(*sm.batches[0])
        loss.backward()
        assert loss.dim() == 0 and torch.isfinite(loss), name


def test_stand_ins_have_the_full_sizes():
    # ResNet-50 has 25.6 M parameters, ViT-B/16 86.6 M: the stand-ins used on a GPU without timm.
    with torch.device("meta"):
        resnet, vit = gpu_models.ResNet(), gpu_models.ViT()
    assert round(sum(p.numel() for p in resnet.parameters()) / 1e6, 1) == 25.6
    assert round(sum(p.numel() for p in vit.parameters()) / 1e6, 1) == 86.6


def test_row_verdicts():
    row = gpu_suite.Row("m")
    row.variants = {"eager": gpu_suite.Variant(losses=[2.0, 1.9]),
                    "aotgrad": gpu_suite.Variant(losses=[2.0, 1.91], step_ms=[1, 2, 3], peak_bytes=80),
                    "inductor": gpu_suite.Variant(losses=[2.0, 1.905], step_ms=[2, 4, 6], peak_bytes=100)}
    assert row.passed() and row.ratio("step") == 0.5 and row.ratio("peak") == 0.8
    row.variants["aotgrad"].losses = [2.0, 2.5]
    assert not row.passed()
    row.variants["aotgrad"] = gpu_suite.Variant(error="RuntimeError: x")
    assert not row.passed() and row.ratio("step") is None
    assert "FAIL" in gpu_suite.report([row], torch.device("cpu"))


def test_pretend_gpu_rows_pass_on_training_alone():
    """On the pretend GPU losses are garbage (no kernel computes): a row passes when both compiled
    variants train, and no loss difference is reported."""
    row = gpu_suite.Row("m", pretend=True)
    row.variants = {"eager": gpu_suite.Variant(losses=[2.0]),
                    "aotgrad": gpu_suite.Variant(losses=[float("nan")], peak_bytes=80),
                    "inductor": gpu_suite.Variant(losses=[7.0], peak_bytes=100)}
    assert row.passed() and row.ratio("peak") == 0.8
    assert row.loss_diff("aotgrad") is None
    table = gpu_suite.report([row], torch.device("cpu"))
    assert "PASS" in table and "pretend GPU" in table and "nan" not in table
    row.variants["aotgrad"] = gpu_suite.Variant(error="RuntimeError: x")
    assert not row.passed()


def test_cpu_activation_peak_counts_the_allocator():
    """On CPU the peak comes from the profiler's allocator events: two 4 MB buffers alive at once,
    then one freed before a third, peak 8 MB above what was allocated before."""
    held = torch.randn(1000, 1000)

    def work():
        a = held * 2
        b = a * 3
        del a
        c = b + 1
        return c.sum()

    peak = gpu_suite.activation_peak(torch.device("cpu"), work)
    assert 8_000_000 <= peak < 8_100_000, peak
