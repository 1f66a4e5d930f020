"""Issue 38 item 4: the rough edges a new user hit with `aotgrad.explain` / `saved_residuals`."""

from __future__ import annotations

import functools
import glob
import importlib
import re

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.errors import AotgradError, DataDependentError
from aotgrad.explain_memory import Timeline
from aotgrad.explain_peak import peak_note


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), torch.randn(8, 16)


def test_the_trace_looks_like_compiling_to_libraries_that_ask():
    seen = []

    def f(x):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    aotgrad.aot_function(f, aotgrad.nop)(torch.ones(2, requires_grad=True))
    assert seen == [True] and not torch.compiler.is_compiling()


def test_transformers_model_with_labels_traces():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 64, (2, 16))
    kwargs = dict(input_ids=x, labels=x, attention_mask=torch.ones_like(x))
    report = aotgrad.explain(model, budget_points=0, timeline=False, **kwargs)
    assert report.refusal is None, report.refusal
    compiled = aotgrad.aot_module(model, aotgrad.nop)
    torch.testing.assert_close(compiled(**kwargs).loss, model(**kwargs).loss)


def test_a_refusal_carries_the_users_source_line():
    def g(x):
        if x.sum() > 0:  # data-dependent branch
            return x * 2
        return x

    with pytest.raises(DataDependentError) as info:
        aotgrad.aot_function(g, aotgrad.nop)(torch.ones(3, requires_grad=True))
    assert __file__ in str(info.value) and "if x.sum() > 0" in str(info.value)


def test_numpy_inside_gives_aotgrad_error():
    def f(x):
        return x * float(x.detach().numpy().sum())

    with pytest.raises(AotgradError, match=r"\.numpy\(\)") as info:
        aotgrad.aot_function(f, aotgrad.nop)(torch.ones(3, requires_grad=True))
    assert "tensor subclasses" not in str(info.value) and "x.detach().numpy()" in str(info.value)


def test_explain_uses_the_backends_partitioner_by_default():
    model, x = _mlp()
    report = aotgrad.explain(model, x, budget_points=0, timeline=False)
    assert report.partitioner.startswith("mincut_partitioner"), report.partitioner
    default = aotgrad.explain(model, x, partition_fn=aotgrad.default_partition, budget_points=0, timeline=False)
    assert default.partitioner == "default_partition"


def test_saved_residuals_takes_explains_keywords():
    model, x = _mlp()
    rep = aotgrad.saved_residuals(model, x, memory_budget=0.5)  # not passed to the model
    assert "memory_budget=0.5" in rep.partitioner
    part = functools.partial(aotgrad.min_cut_rematerialization_partition, memory_budget=0.5)
    same = aotgrad.saved_residuals(model, x, partition_fn=part)
    assert rep.saved_bytes == same.saved_bytes
    text = str(rep)
    m = re.search(r"recomputed in the backward: (\d+) ops", text)
    if m:  # a count of ops is followed by their table
        after = text[m.end():].splitlines()
        assert after[1].split() == ["count", "op", "source"] and len(after) > 2 and after[2].strip()


def test_no_op_count_above_an_empty_table():
    model, x = _mlp()
    text = str(aotgrad.saved_residuals(model, x))  # default_partition: views at most
    assert "recomputed in the backward: 0 ops" not in text
    assert re.search(r"recomputed in the backward: nothing", text)


def test_explain_dir_pages_keep_layer_indices(tmp_path, monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(self.ln_1(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.h:
                x = b(x)
            return x

    torch._dynamo.reset()
    monkeypatch.setattr(aotgrad.config, "explain_dir", str(tmp_path))
    backend = importlib.import_module("aotgrad.backend").aotgrad_eager
    torch.compile(Model(), backend=backend)(torch.randn(2, 8, requires_grad=True)).sum().backward()
    pages = [p for p in glob.glob(str(tmp_path / "*.html")) if not p.endswith("index.html")]
    text = "".join(open(p, encoding="utf-8").read() for p in pages)
    assert "h.0.ln_1 (LayerNorm)" in text and "h.1.ln_1 (LayerNorm)" in text
    assert ">h.ln_1 (LayerNorm)<" not in text


def test_peak_note_says_why_aotgrad_is_above_eager():
    def tl(label, live, start):
        return Timeline(label, live=live, ops=[f"op{i}" for i in range(len(live))], backward_start=start,
                        at_backward_start=live[start - 1])

    fmt = lambda n: f"{n} B"  # noqa: E731
    assert peak_note([tl("aotgrad", [1, 2, 3], 2), tl("eager", [1, 2, 3], 2)], fmt) is None
    note = peak_note([tl("aotgrad", [1, 2, 9], 2), tl("eager", [1, 4, 3], 2)], fmt)
    assert "above eager's 4 B" in note and "backward" in note and "recomputed" in note
    note = peak_note([tl("aotgrad", [1, 6, 9], 2), tl("eager", [1, 4, 3], 2)], fmt)
    assert "memory_budget" in note
