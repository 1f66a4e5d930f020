"""A job for tests/test_cache.py, run in a fresh process: compile a small training step with
`torch.compile(backend=...)` and record its results next to eager's and aotgrad's counters.

    python tests/cache_job.py BACKEND OUT.pt [small | forces]

What it runs (with eager copies alongside): a Linear + BatchNorm + Linear model's training step
(gradients, BatchNorm's running stats); the same model called under `no_grad` (an inference graph
that updates the running stats in place); `g(a, b)`, which mutates `b` and returns a view of `a`.
`forces`: instead, two training steps of a force-field energy model that takes
`autograd.grad(..., create_graph=True)` inside (Dynamo splits it there: the graph before it is
differentiated twice), float64. It counts aotgrad's captures (`api._capture`) so the test can tell a hit from a compile.
"""

from __future__ import annotations

import copy
import sys

import torch


def workload(model, g, x, a, b, small=False, backend=None):
    if small:  # only g: one training graph
        loss, view = g(a, b)
        loss.backward()
        return {"loss": loss.detach(), "view": view.detach().clone(), "view_is_alias": view._base is a,
                "a_grad": a.grad, "b": b.clone()}
    call = model if backend is None else torch.compile(model, backend=backend)
    out = call(x)
    out.sum().backward()
    with torch.no_grad():
        inf = call(x * 2)
    loss, view = g(a, b)
    loss.backward()
    return {
        "out": out.detach(), "inf": inf,
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": {n: t.clone() for n, t in model.named_buffers()},
        "loss": loss.detach(), "view": view.detach().clone(), "view_is_alias": view._base is a,
        "a_grad": a.grad, "b": b.clone(),
    }


class Energy(torch.nn.Module):
    """An MLP over pairwise distances; forces = -dE/dpos, taken inside the model."""

    def __init__(self, h=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, h), torch.nn.Tanh(), torch.nn.Linear(h, 1))

    def forward(self, pos):
        d = (pos[:, None, :] - pos[None, :, :]).pow(2).sum(-1).add(1e-3).sqrt()
        e = self.net(d.reshape(-1, 1)).sum()
        (f,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -f


def forces_workload(model, call) -> dict:
    out: dict = {}
    for step in range(2):
        pos = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        e, f = call(pos.requires_grad_())
        loss = e.pow(2) + f.pow(2).mean()
        loss.backward()
        out[f"step{step}"] = {"e": e.detach(), "f": f.detach(), "pos_grad": pos.grad,
                              "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 6)
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, 3)
    return model, x, a, b


def g(a, b):
    b.mul_(2)
    return (a * b).sum(), a.t()


def main(backend: str, out_path: str, mode: str = "") -> None:
    import aotgrad
    import aotgrad.api as api

    captures = [0]
    capture = api._capture

    def counting(*args, **kwargs):
        captures[0] += 1
        return capture(*args, **kwargs)

    api._capture = counting
    calls = _count_calls()
    if mode == "forces":
        torch.manual_seed(0)
        model = Energy().double()
        ref = copy.deepcopy(model)
        eager = forces_workload(ref, ref)
        compiled = forces_workload(model, torch.compile(model, backend=backend))
        torch.save({"eager": eager, "compiled": compiled, "stats": aotgrad.cache_stats(), "calls": calls}, out_path)
        return
    small = mode == "small"
    model, x, a, b = inputs()
    eager = workload(copy.deepcopy(model), g, x, a.detach().clone().requires_grad_(), b.clone(), small)
    compiled = workload(model, torch.compile(g, backend=backend), x, a, b, small, backend)
    from torch._dynamo.utils import counters

    fx = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    torch.save({"eager": eager, "compiled": compiled, "stats": aotgrad.cache_stats(), "captures": captures[0],
                "fx": fx, "calls": calls}, out_path)


def _count_calls() -> dict:
    """Counts, filled as the job runs, of graphs the cache unpickled and graphs Inductor hashed."""
    from torch._inductor.codecache import FxGraphCache

    from aotgrad.cache import load as cache_load

    calls = {"graphs_unpickled": 0, "inductor_keys_computed": 0}
    load_graph, prepare_key = cache_load.load_graph, FxGraphCache.prepare_key

    def counting_load(*args, **kwargs):
        calls["graphs_unpickled"] += 1
        return load_graph(*args, **kwargs)

    def counting_key(*args, **kwargs):
        calls["inductor_keys_computed"] += 1
        return prepare_key(*args, **kwargs)

    cache_load.load_graph = counting_load
    FxGraphCache.prepare_key = staticmethod(counting_key)
    return calls


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4])
