"""A force-field training step through torch.compile(backend="aotgrad") against eager.

The model of examples/force_field.py: an energy MLP over the pairwise distances of 64 atoms
(2,016 pairs per configuration, a batch of 4), forces = -dE/dpos taken inside the model with
`autograd.grad(create_graph=True)`, a loss on energies and forces, backward to the weights, AdamW.

Variants (each its own Dynamo code object, so their caches do not mix):
- "aotgrad": `torch._dynamo.config.trace_autograd_ops=True` (torch >= 2.13), so Dynamo puts
  `autograd.grad` into the graph: energy and forces are one graph, whose ordinary backward is the
  second-order gradient.
- "aotgrad (graph break)": Dynamo's default, splitting the model at `autograd.grad`: the backward
  differentiates the compiled energy graph twice (higher_order.py).
- "upstream inductor" with `trace_autograd_ops=True`; "upstream inductor (graph break)" refuses
  double backward.

1. Correctness: one step from the same weights; loss and every weight's gradient against eager.
2. Steady state: median step time (loss, zero_grad, backward, AdamW step), the variants taking
   turns step by step for `--seconds`; ratio = variant / eager. Target (aotgrad) <= 0.7.

    python benchmarks/force_field_bench.py [--seconds 10] [--batch 4] [--threads N] [--json out.json]
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
# name -> (torch.compile backend or None for eager, Dynamo's trace_autograd_ops)
IMPLS = {
    "eager": (None, False),
    "aotgrad": ("aotgrad", True),
    "aotgrad (graph break)": ("aotgrad", False),
    "upstream inductor": ("inductor", True),
    "upstream inductor (graph break)": ("inductor", False),
}


def _can_trace_autograd_grad() -> bool:
    return hasattr(torch._dynamo.config, "trace_autograd_ops")


def _setup(name: str, state: dict):
    model = EnergyMLP()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A code object of its own per variant: Dynamo does not guard on its config.
    ns = {"force_field_loss": force_field_loss, "model": model}
    exec(compile("def loss_fn(pos, e, f):\n    return force_field_loss(model, pos, e, f)\n", f"<{name}>", "exec"), ns)
    loss_fn = ns["loss_fn"]
    backend, trace = IMPLS[name]
    if backend is not None:
        loss_fn = torch.compile(loss_fn, backend=backend)

    def step_fn(*args):
        if not _can_trace_autograd_grad():
            return loss_fn(*args)
        with torch._dynamo.config.patch(trace_autograd_ops=trace):
            return loss_fn(*args)

    return model, opt, step_fn


def run(seconds: float, batch: int, log=print, impls: tuple[str, ...] = tuple(IMPLS)) -> dict:
    import aotgrad

    torch.manual_seed(0)
    torch._dynamo.reset()
    state = EnergyMLP().state_dict()
    data = make_data(batch, seed=0)
    result: dict = {"batch": batch, "threads": torch.get_num_threads(), "errors": {}, "ms": {},
                    "max_grad_diff": {}, "grads_match": {}, "load_before": os.getloadavg()}
    setups = {}
    grads = {}
    cache = aotgrad.config.cache
    aotgrad.config.cache = False  # steady state from fresh compiles: no entry from an earlier run
    try:
        for name in impls:
            if IMPLS[name][1] and not _can_trace_autograd_grad():
                result["errors"][name] = "this torch's Dynamo cannot trace torch.autograd.grad"
                continue
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
        (l0, g0) = grads["eager"]
        for name, (l1, g1) in grads.items():
            if name == "eager":
                continue
            rel = [(a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(g0, g1)]
            result["max_grad_diff"][name] = max([abs(l0 - l1).item()] + rel)
            result["grads_match"][name] = all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(g0, g1))
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
    finally:
        aotgrad.config.cache = cache
    result["ms"] = {name: median(t) * 1e3 for name, t in times.items()}
    result["steps"] = {name: len(t) for name, t in times.items()}
    result["load_after"] = os.getloadavg()
    return result


def report(result: dict) -> tuple[bool, str]:
    ms = result["ms"]
    print(f"\n== Force-field training step (64 atoms, batch {result['batch']}, energy + force loss, AdamW), "
          f"median ms/step, {result['threads']} threads, load average {result['load_before'][0]:.1f} "
          f"-> {result['load_after'][0]:.1f} ==")
    for name in IMPLS:
        if name in ms:
            ratio = ms[name] / ms["eager"]
            grads = "" if name == "eager" else (
                f"; gradients {'match' if result['grads_match'][name] else 'DIFFER'} "
                f"(largest relative difference {result['max_grad_diff'][name]:.1e})")
            print(f"  {name:31s} {ms[name]:8.2f} ms  {ratio:5.2f}x  ({result['steps'][name]} steps; first step "
                  f"{result['first_step_s'][name]:.1f} s{grads})")
        else:
            print(f"  {name:31s} error: {result['errors'].get(name, '?')[:150]}")
    ok = "aotgrad" in ms and result["grads_match"].get("aotgrad", False)
    ratio = ms["aotgrad"] / ms["eager"] if "aotgrad" in ms else None
    line = (f"force-field step aotgrad/eager {ratio:.2f} (target <= {TARGET}): "
            f"{'PASS' if ok and ratio <= TARGET else 'FAIL'}") if ratio is not None else "force-field step: aotgrad failed"
    print("  " + line)
    return ok, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated variants (eager is always run)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = tuple(dict.fromkeys(["eager", *[n.strip() for n in args.impls.split(",") if n.strip()]]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    result = run(args.seconds, args.batch, log=lambda m: print(m, file=sys.stderr, flush=True), impls=impls)
    report(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
