"""Per-call cost of the run time's None-gradient handling ("none_aware", runtime.py), nop compiler.

A compiled graph with two or more differentiable outputs calls `ctx.set_materialize_grads(False)`
in its forward, so an output that gets no gradient arrives as None, and the backward makes zeros
of the traced tangent's shape for it. Before: each forward also stored the outputs' shapes on
the context (`ctx.tangent_shapes = (o0.shape, o1.shape, )`); after: static shapes are constants
on the Function's backward class. Both are measured in the same run ("before" is the same build
with `runtime._static_tangent_shapes` returning None, the code generated for symbolic shapes).

    f(x, y) = (x.sin(), (x * y).cos())    x, y: 4 elements, requiring grad
    fwd            f(x, y)
    fwd+bwd        torch.autograd.backward(f(x, y), (g, g))
    fwd+bwd, None  f(x, y)[0].backward(g)   (output 1 gets no gradient)

timeit-style: `--number` calls per sample with the GC off, `--repeats` samples interleaved across
the variants, best sample reported (µs per call).

    python benchmarks/none_aware_overhead.py [--number 2000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import timeit
from unittest import mock

import torch

import aotgrad
from aotgrad.runtime import runner as runtime

CASES = {
    "fwd": "f(x, y)",
    "fwd+bwd": "torch.autograd.backward(f(x, y), (g, g))",
    "fwd+bwd, None": "f(x, y)[0].backward(g)",
}


def two_outputs(x, y):
    return x.sin(), (x * y).cos()


def _compiled(static: bool, x, y):
    f = aotgrad.aot_function(two_outputs, aotgrad.nop)
    if static:
        f(x, y)
    else:
        with mock.patch.object(runtime, "_static_tangent_shapes", lambda *a: None):
            f(x, y)  # compiles (and generates the run time) now
    return f


def _forward_source(f) -> str:
    """The generated `autograd.Function.forward` of `f`'s one compiled signature."""
    (run,) = f.cache.values()
    (apply,) = [v for k, v in run.__globals__.items() if k.startswith("_apply")]
    return apply.__self__.forward.__aotgrad_source__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y, g = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True), torch.ones(4)
    variants = {"eager": two_outputs, "before": _compiled(False, x, y), "after": _compiled(True, x, y)}
    assert "ctx.tangent_shapes" in _forward_source(variants["before"])
    assert "ctx.tangent_shapes" not in _forward_source(variants["after"])
    for name, f in variants.items():  # every variant computes eager's values and gradients
        xs = [t.detach().clone().requires_grad_() for t in (x, y)]
        ref = [t.detach().clone().requires_grad_() for t in (x, y)]
        f(*xs)[0].backward(g)
        two_outputs(*ref)[0].backward(g)
        assert all(a.grad is None if b.grad is None else torch.equal(a.grad, b.grad) for a, b in zip(xs, ref)), name
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':<16}" + "".join(f"{v:>10}" for v in variants) + f"{'after-before':>14}")
    for case, stmt in CASES.items():
        timers = {v: timeit.Timer(stmt, globals={"f": f, "x": x, "y": y, "g": g, "torch": torch})
                  for v, f in variants.items()}
        best = dict.fromkeys(timers, float("inf"))
        for t in timers.values():
            t.timeit(max(args.number // 10, 50))
        for _ in range(args.repeats):
            for v, t in timers.items():
                best[v] = min(best[v], t.timeit(args.number) / args.number * 1e6)
        print(f"{case:<16}" + "".join(f"{best[v]:>10.2f}" for v in variants)
              + f"{best['after'] - best['before']:>+14.2f}")
    # The two statements alone, on a real context (the compiled output's grad_fn): the whole call's
    # noise on a shared machine is larger than their cost.
    a, b = variants["after"](x, y)
    stmts = {"ctx.tangent_shapes = (a.shape, b.shape, )": 0.0, "ctx.set_materialize_grads(False)": 0.0}
    for stmt in stmts:
        timer = timeit.Timer(stmt, globals={"ctx": a.grad_fn, "a": a, "b": b})
        stmts[stmt] = min(timer.timeit(20000) / 20000 * 1e6 for _ in range(args.repeats))
        print(f"  {stmt:<48} {stmts[stmt]:.3f} us")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
