"""Cold `torch.compile` time, aotgrad+Inductor vs upstream Inductor, each compile in a fresh process.

backend_bench.py measures cold compiles one after the other in one process; there a compile's time
depends on what the process compiled before (measured: +-25% for the same graph, whichever backend
went second). Here every compile runs in its own new Python process, which is also how a training
job meets it: imports, an untimed warm-up compile (one-time process costs), then one cold compile
(empty Inductor cache, caches off) timed until the compiled step returns with no work of either
backend left running; its result is checked against eager (a mismatch is reported, not timed).
Backends alternate which goes first in each repeat.

Two stack modes, each its own table. `as-called`: the compile is called as a training script
calls it; this is what users get. `roomy`: the whole timed compile, for both backends, runs on a
roomy interpreter stack (`aotgrad.interpreter_stack.on_roomy_stack`), which compares the two
pipelines without CPython's stack-chunk effect: CPython 3.11+ maps and unmaps a 16 KiB chunk of
its frame stack whenever a hot call returns across a chunk boundary, and where the boundaries fall
depends on how deep the caller's stack is. aotgrad runs its own compile work on a roomy stack in
both modes; upstream only in `roomy` mode. Measured before aotgrad did so: the same AdamW graph
compiled in 11.4-12.2 s or 14.3-17.1 s depending only on two extra frames in the harness
(670,000 against 285,000 mmap/munmap pairs); that was the "harness dependence" this benchmark
used to warn about.

Rows: the GPT-2 training step of the demo (forward + backward) and AdamW's `step()` over its
parameters (the other graph the demo's first step compiles); on request (`--rows`) also the training
step of each model of models.py, whose in-process compile times in backend_bench.py depend on
what the process compiled before (make bench runs them: mlp 0.91x, transformer 0.83x, cnn_bn 0.90x,
pointwise200 0.90x in the latest run).

    python benchmarks/cold_compile_bench.py [--repeats 3] [--rows gpt2,adamw] [--stack as-called,roomy]
    python benchmarks/cold_compile_bench.py --rows mlp,transformer,cnn_bn,pointwise200 --stack as-called
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

BACKENDS = ("aotgrad", "inductor")
ROWS = {"gpt2": "gpt2 train step", "adamw": "gpt2 AdamW.step", "mlp": "mlp train step",
        "transformer": "transformer train step", "cnn_bn": "cnn_bn train step",
        "pointwise200": "pointwise200 train step"}
DEFAULT_ROWS = ("gpt2", "adamw")
STACKS = ("as-called", "roomy")


def child(backend: str, row: str, stack: str = "as-called") -> dict:
    """One cold compile in this (fresh) process: {"seconds", "mismatch"}. The timer stops when the
    compiled step has returned, with nothing of either backend still running (aotgrad's overlap
    check is built inside its compile, input_checks.py); its result is then checked against the
    same step run eagerly (`mismatch`: None, or what differs)."""
    import backend_bench as bb
    import torch
    from harness import compare, state_of, sum_outputs

    from aotgrad.interpreter_stack import on_roomy_stack

    bb.warm_up_process()
    pristine, inputs = bb.all_models()["gpt2" if row == "adamw" else row]()
    if row != "adamw":
        mod, inp = copy.deepcopy(pristine), bb._clone_inputs(inputs)
        ref_mod, ref_inp = copy.deepcopy(pristine), bb._clone_inputs(inputs)
        sum_outputs(ref_mod(*ref_inp)).backward()
        expected = state_of(ref_mod, ref_inp)

        def compile_once():
            sum_outputs(torch.compile(mod, backend=backend)(*inp)).backward()

        def result():
            return state_of(mod, inp)
    else:
        mod, opt = bb._adamw_setup(pristine)
        ref_mod, ref_opt = bb._adamw_setup(pristine)
        ref_opt.step()
        expected = dict(ref_mod.named_parameters())

        def compile_once():
            torch.compile(opt.step, backend=backend)()

        def result():
            return dict(mod.named_parameters())
    with bb._cold():
        t0 = time.perf_counter()
        if stack == "roomy":
            on_roomy_stack(compile_once)
        else:
            compile_once()
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mismatch": compare(expected, result(), rtol=1e-3, atol=1e-4)}


def run_child(backend: str, row: str, stack: str) -> float | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, row, stack]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            if res["mismatch"] is not None:  # a compile whose step gives another result is not timed
                print(f"    {backend} {row}: result differs from eager: {res['mismatch']}")
                return None
            return res["seconds"]
    print(f"    {backend} {row}: failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return None


def measure(stack: str, row_names: list[str], repeats: int, fmt_ratio) -> tuple[list[list[str]], bool]:
    """Table rows for one stack mode, and whether every median ratio meets the target."""
    rows, verdict = [], True
    for row in row_names:
        times: dict[str, list[float]] = {b: [] for b in BACKENDS}
        pairs = []
        for rep in range(repeats):
            got = {}
            for b in (BACKENDS if rep % 2 == 0 else BACKENDS[::-1]):
                got[b] = run_child(b, row, stack)
                print(f"  {ROWS[row]} ({stack}): {b} {got[b] if got[b] is None else round(got[b], 2)} s", flush=True)
            if all(v is not None for v in got.values()):
                for b in BACKENDS:
                    times[b].append(got[b])
                pairs.append(got["aotgrad"] / got["inductor"])
        if not pairs:
            rows.append([ROWS[row], "-", "-", "-", "-", "failed"])
            verdict = False
            continue
        a, u = statistics.median(times["aotgrad"]), statistics.median(times["inductor"])
        verdict &= a / u <= 1.0
        rows.append([ROWS[row], f"{a:.1f}", f"{u:.1f}", fmt_ratio(a / u),
                     fmt_ratio(min(times["aotgrad"]) / min(times["inductor"])),
                     " ".join(f"{r:.2f}" for r in pairs)])
    return rows, verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh-process compiles per backend and row (default 3)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated subset of {','.join(ROWS)} (default {','.join(DEFAULT_ROWS)})")
    p.add_argument("--stack", default=",".join(STACKS), help=f"comma-separated subset of {','.join(STACKS)}")
    p.add_argument("--child", nargs=3, metavar=("BACKEND", "ROW", "STACK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("cold_compile_bench.py needs transformers (the demo's GPT-2): pip install transformers")
        return 0
    from harness import fmt_ratio, table

    row_names = [r for r in args.rows.split(",") if r]
    unknown = [r for r in row_names if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; available: {list(ROWS)}")
    for stack in [m for m in args.stack.split(",") if m]:
        rows, verdict = measure(stack, row_names, args.repeats, fmt_ratio)
        print()
        print(f"== cold torch.compile, each compile in a fresh process, stack {stack} (median of {args.repeats}) ==")
        print(table(["graph", "aotgrad s", "inductor s", "ratio", "min-ratio", "per-repeat ratios"], rows, "lrrrrl"))
        print(f"target cold compile time ratio aotgrad/upstream <= 1.0 (medians, stack {stack}): "
              f"{'PASS' if verdict else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
