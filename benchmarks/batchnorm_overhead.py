"""Per-call overhead of a training step whose compiled graph has non-differentiable outputs
(BatchNorm's updated running statistics), aotgrad against upstream, both with the nop compiler.

Such a graph's backward runs on the run time's None-aware path (runtime/runner.py: the gradients of
those outputs arrive as None instead of zeros autograd would make and keep alive). The step is
`m(x).sum().backward()` on `Linear(4, 4)` + `BatchNorm1d(4)`, x 8 x 4; samples of `--number` steps
interleaved across eager, aotgrad and upstream, best sample per variant; overhead = variant - eager.
Every variant is checked against eager first (loss, gradients, running statistics).

    python benchmarks/batchnorm_overhead.py [--number 200] [--repeats 25]
"""

from __future__ import annotations

import argparse
import gc
import os
import timeit
import warnings

import torch

import aotgrad


def _make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))


def _state(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in m.parameters()] + list(m.buffers())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from functorch.compile import aot_module as upstream_aot_module
    from functorch.compile import nop as upstream_nop

    x = torch.randn(8, 4)
    eager = _make()
    variants = {"eager": eager, "aotgrad": aotgrad.aot_module(_make(), aotgrad.nop),
                "upstream": upstream_aot_module(_make(), upstream_nop)}
    losses = {}
    for name, m in variants.items():
        losses[name] = m(x).sum()
        losses[name].backward()
    for name in ("aotgrad", "upstream"):
        torch.testing.assert_close(losses[name], losses["eager"])
        for a, b in zip(_state(variants[name]), _state(eager)):
            torch.testing.assert_close(a, b)

    def step(m):
        m(x).sum().backward()

    for m in variants.values():
        for _ in range(50):
            step(m)
    best = dict.fromkeys(variants, float("inf"))
    gc.disable()
    try:
        for _ in range(args.repeats):
            for name, m in variants.items():
                t = timeit.timeit(lambda m=m: step(m), number=args.number)
                best[name] = min(best[name], t / args.number * 1e6)
    finally:
        gc.enable()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print("  ".join(f"{k} {v:.1f} us" for k, v in best.items()))
    ours, theirs = best["aotgrad"] - best["eager"], best["upstream"] - best["eager"]
    print(f"overhead over eager: aotgrad {ours:.1f} us, upstream {theirs:.1f} us, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
