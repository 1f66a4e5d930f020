"""A force-field training step through torch.compile(backend="aotgrad") against eager.

The model of examples/force_field.py: an energy MLP over the pairwise distances of 64 atoms
(2,016 pairs per configuration, a batch of 4), forces = -dE/dpos taken inside the model with
`autograd.grad(create_graph=True)`, a loss on energies and forces, backward to the weights, AdamW.
That backward is a second-order gradient through the compiled energy graph (higher_order.py).
Upstream's `torch.compile(backend="inductor")` is tried too: it refuses double backward.

1. Correctness: one step from the same weights; loss and every weight's gradient against eager.
2. Steady state: median step time (loss, zero_grad, backward, AdamW step), the implementations
   taking turns step by step for `--seconds`; ratio = aotgrad / eager. Target <= 0.7.

    python benchmarks/force_field_bench.py [--seconds 10] [--batch 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from force_field import EnergyMLP, force_field_loss, make_data, train_step  # noqa: E402
from harness import error_text, median  # noqa: E402

TARGET = 0.7
IMPLS = ("eager", "aotgrad", "upstream inductor")


def _setup(name: str, state: dict):
    model = EnergyMLP()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(pos, e, f):
        return force_field_loss(model, pos, e, f)

    if name == "aotgrad":
        loss_fn = torch.compile(loss_fn, backend="aotgrad")
    elif name == "upstream inductor":
        loss_fn = torch.compile(loss_fn, backend="inductor")
    return model, opt, loss_fn


def run(seconds: float, batch: int, log=print) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    state = EnergyMLP().state_dict()
    data = make_data(batch, seed=0)
    result: dict = {"batch": batch, "errors": {}, "ms": {}, "max_grad_diff": None}
    setups = {}
    grads = {}
    for name in IMPLS:
        log(f"  force field: {name} first step ...")
        model, opt, loss_fn = _setup(name, state)
        t0 = time.perf_counter()
        try:
            loss = loss_fn(*data)
            loss.backward()
        except Exception as e:
            result["errors"][name] = error_text(e)
            continue
        result.setdefault("first_step_s", {})[name] = time.perf_counter() - t0
        grads[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
        setups[name] = (loss_fn, opt)
    if "aotgrad" in grads:
        (l0, g0), (l1, g1) = grads["eager"], grads["aotgrad"]
        diff = max([abs(l0 - l1).item()] + [(a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(g0, g1)])
        result["max_grad_diff"] = diff
        result["grads_match"] = all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(g0, g1))
    times: dict[str, list[float]] = {name: [] for name in setups}
    for loss_fn, opt in setups.values():  # warm up (a few steps each)
        for _ in range(3):
            train_step(loss_fn, opt, data)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or min(len(t) for t in times.values()) < 10:
        for name, (loss_fn, opt) in setups.items():
            t0 = time.perf_counter()
            train_step(loss_fn, opt, data)
            times[name].append(time.perf_counter() - t0)
    result["ms"] = {name: median(t) * 1e3 for name, t in times.items()}
    result["steps"] = {name: len(t) for name, t in times.items()}
    return result


def report(result: dict) -> tuple[bool, str]:
    ms = result["ms"]
    print(f"\n== Force-field training step (64 atoms, batch {result['batch']}, energy + force loss, AdamW), "
          "median ms/step ==")
    for name in IMPLS:
        if name in ms:
            print(f"  {name:18s} {ms[name]:8.2f} ms  ({result['steps'][name]} steps; first step "
                  f"{result['first_step_s'][name]:.1f} s)")
        else:
            print(f"  {name:18s} error: {result['errors'].get(name, '?')[:150]}")
    ok = "aotgrad" in ms and result.get("grads_match", False)
    ratio = ms["aotgrad"] / ms["eager"] if "aotgrad" in ms else None
    print(f"  gradients vs eager: {'match' if result.get('grads_match') else 'DIFFER'} "
          f"(largest relative difference {result['max_grad_diff']})")
    line = (f"force-field step aotgrad/eager {ratio:.2f} (target <= {TARGET}): "
            f"{'PASS' if ok and ratio <= TARGET else 'FAIL'}") if ratio is not None else "force-field step: aotgrad failed"
    print("  " + line)
    return ok, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    result = run(args.seconds, args.batch, log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
