"""The main path, trimmed to fit `make test`: `torch.compile(backend="aotgrad")` with Inductor on real
programs, each against eager.

- a small GPT-2 (`transformers`, built from a config: random init, no download, dropout off) and a
  small conv net with BatchNorm: three SGD steps; the loss, every parameter's gradient (each at its
  own scale: helpers.assert_grads_close), BatchNorm's running stats and the parameters after each step;
- DDP on 2 gloo ranks (127.0.0.1, tests/dist_worker.py) with Inductor: losses and final parameters
  against uncompiled DDP on every rank;
- input mutations (the epilogue's copy, the graph's own write) and a view of an input through
  Inductor, by aotgrad.testing.check_against_eager;
- a TwoTensor program (the subclass stage) through Inductor: outputs and gradients;
- a higher-order program (`autograd.grad(create_graph=True)` inside the model) through Inductor,
  compiled cold in one fresh process and loaded from aotgrad's on-disk cache in another: both against
  eager, the warm run identical to the cold one, every graph a hit.

The full sweeps (ten `transformers` families, FSDP2 with Inductor, OpInfo) are `make test-long`.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_grads_close

import aotgrad  # noqa: F401  (registers the backend)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_side_by_side(eager: nn.Module, batches, loss_fn) -> None:
    """Three SGD-with-momentum steps of `eager` and of a compiled copy, compared step by step (SGD: a
    parameter's update is linear in its gradient; AdamW's divides by its running size, so rounding noise
    in a near-zero gradient would move the parameter by up to the learning rate)."""
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aotgrad")
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(batches):
        expected, got = loss_fn(eager, batch), loss_fn(compiled, batch)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=lambda m, s=step: f"loss, step {s}: {m}")
        expected.backward()
        got.backward()
        assert_grads_close(eager, model)
        for (name, b), c in zip(eager.named_buffers(), model.buffers()):
            torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"buffer {n}: {m}")
        eager_opt.step()
        opt.step()
        eager_opt.zero_grad()
        opt.zero_grad()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"parameter {n}: {m}")


def test_gpt2_trains_like_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(config).train()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    _train_side_by_side(eager, batches, lambda m, t: m(input_ids=t, labels=t).loss)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def test_conv_net_trains_like_eager():
    torch.manual_seed(0)
    eager = ConvNet().train()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
    _train_side_by_side(eager, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_input_mutations_and_views_through_inductor():
    """What the run time does around Inductor's code, by aotgrad.testing.check_against_eager
    (outputs, aliasing, inputs after the call, version counters, gradients): an input requiring grad
    mutated in place (the epilogue's copy, recorded by autograd), a buffer-like input mutated (written
    by the compiled graph itself), an output that is a view of an input."""
    from aotgrad.testing import check_against_eager

    def f(x, buf):
        x.mul_(2)
        buf.add_(1)
        return (x * buf).sin(), x.view(-1)

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        leaf = torch.randn(3, 4, generator=g, requires_grad=True)
        return (leaf,), (leaf.clone(), torch.randn(3, 4, generator=g))

    compiled = torch.compile(f, backend="aotgrad")
    for _ in range(2):  # the second call takes the cached path
        check_against_eager(f, make_inputs, compiled=compiled)
        # nothing of the compile is left running on the caller's next steps (the overlap check's
        # C++ build is part of the compile, input_checks.py)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("aotgrad-")]


def test_ddp_with_inductor_on_two_ranks(tmp_path):
    import dist_worker
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is needed for the main path's DDP check")
    ranks = [r.get("ddp@aotgrad") for r in dist_worker.spawn(["ddp@aotgrad"], str(tmp_path), deadline_s=400)]
    for rank, r in enumerate(ranks):
        assert r is not None, f"rank {rank} reported nothing (it died or hung)"
        assert r["ok"], f"rank {rank}: {r['type']}: {r['error']}\n{r['trace']}"
        assert r["loss_diff"] <= 1e-4 and r["param_diff"] <= 1e-4, (rank, r)
        assert r["graphs"] >= 3, r  # DDPOptimizer split the model at bucket boundaries
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own data


def test_two_tensor_program_through_inductor():
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, y, z):
        return (x * y).sin() + z, x.view(-1)

    def inputs():
        g = torch.Generator().manual_seed(0)
        x = TwoTensor(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)).requires_grad_()
        y = TwoTensor(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g))
        return x, y, torch.randn(3, 4, generator=g, requires_grad=True)

    (x, y, z), (xs, ys, zs) = inputs(), inputs()
    expected, got = f(x, y, z), torch.compile(f, backend="aotgrad", fullgraph=True)(xs, ys, zs)
    for e, o in zip(expected, got):
        assert type(o) is TwoTensor and o.shape == e.shape and o.stride() == e.stride()
        torch.testing.assert_close(o.a, e.a)
        torch.testing.assert_close(o.b, e.b)
    assert got[1]._base is xs  # a view of the input, as in eager
    torch.autograd.backward([o.sum() for o in expected])
    torch.autograd.backward([o.sum() for o in got])
    assert type(xs.grad) is TwoTensor
    torch.testing.assert_close(xs.grad.a, x.grad.a)
    torch.testing.assert_close(xs.grad.b, x.grad.b)
    torch.testing.assert_close(zs.grad, z.grad)


# A force-field model: forces = -dE/dpos inside it (create_graph=True), trained on forces: its
# graph before autograd.grad is differentiated twice. Run as a fresh process (cold, then warm).
_FORCES_JOB = textwrap.dedent("""
    import copy, sys
    import torch
    import aotgrad

    class Energy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def forward(self, pos):
            d = (pos[:, None, :] - pos[None, :, :]).pow(2).sum(-1).add(1e-3).sqrt()
            e = self.net(d.reshape(-1, 1)).sum()
            (f,) = torch.autograd.grad(e, pos, create_graph=True)
            return e, -f

    def run(model, call):
        out = []
        for step in range(2):
            pos = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            e, f = call(pos.requires_grad_())
            (e.pow(2) + f.pow(2).mean()).backward()
            out.append([e.detach(), f.detach(), pos.grad] + [p.grad.clone() for p in model.parameters()])
        return out

    torch.manual_seed(0)
    model = Energy().double()
    ref = copy.deepcopy(model)
    eager = run(ref, ref)
    compiled = run(model, torch.compile(model, backend="aotgrad"))
    torch.save({"eager": eager, "compiled": compiled, "stats": aotgrad.cache_stats()}, sys.argv[1])
""")


def _forces_job(cache_dir, out) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "AOTGRAD_CACHE": "1"}
    proc = subprocess.run([sys.executable, "-c", _FORCES_JOB, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return torch.load(out, weights_only=False)


def test_create_graph_through_inductor_and_a_cache_hit_in_a_new_process(tmp_path):
    cold = _forces_job(tmp_path / "cache", tmp_path / "cold.pt")
    warm = _forces_job(tmp_path / "cache", tmp_path / "warm.pt")
    stored = cold["stats"]["stores"]
    assert stored >= 1 and cold["stats"]["hits"] == 0, cold["stats"]
    assert warm["stats"]["hits"] == stored and warm["stats"]["misses"] == 0, warm["stats"]
    for run in (cold, warm):
        for step, (got, expected) in enumerate(zip(run["compiled"], run["eager"])):
            for k, (o, e) in enumerate(zip(got, expected)):
                torch.testing.assert_close(o, e, msg=lambda m, s=step, k=k: f"step {s}, value {k}: {m}")
    for o, e in zip(sum(warm["compiled"], []), sum(cold["compiled"], [])):
        assert torch.equal(o, e)  # a hit runs what the cold compile built
