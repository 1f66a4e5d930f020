"""`make bench`: aotgrad vs upstream `functorch.compile`, measured in the same process.

1. Cold AOT compile time (nop compiler) on four models; target ratio aotgrad/upstream <= 0.5.
2. Per-call run-time overhead over eager on 1-element inputs; target
   (aotgrad - eager) / (upstream - eager) <= 0.5.
3. Partitioners: saved bytes of min-cut and the memory-budget sweep (partition_bench.py).
4. torch.compile: aotgrad+Inductor vs upstream Inductor, steady-state step and cold compile in one
   process (backend_bench.py), then cold compiles each in a fresh process (cold_compile_bench.py).
5. A force-field training step (forces = -dE/dpos inside the model, a second-order gradient)
   through torch.compile(backend="aotgrad") vs eager; target ratio <= 0.7 (force_field_bench.py).
6. Warm start: the first training step in a fresh process whose on-disk caches an earlier process
   filled, aotgrad vs upstream Inductor, cold numbers beside it (warm_start_bench.py).
7. Scale-out: the demo's GPT-2 on 2 ranks (torchrun) under DDP and FSDP2, aotgrad vs upstream
   Inductor taking turns step by step; target ratio <= 1.0 (distributed_bench.py).

Options: --repeats N (cold compiles per model and implementation, median; default 9),
--number N and --overhead-repeats N (timeit calls per sample and samples; default 3000 and 7),
--only NAME[,NAME] (compile-time models), --skip-compile, --skip-overhead, --skip-partition,
--skip-backend, --skip-force-field, --skip-fresh-compile, --skip-warm-start, --skip-distributed,
--json PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import compile_time  # noqa: E402
import overhead  # noqa: E402
import torch  # noqa: E402
from harness import fmt_ratio, implementations, table  # noqa: E402

TARGET = 0.5


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _us(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def report_compile(results: list[compile_time.ModelResult], repeats: int) -> tuple[bool, str]:
    print()
    print(f"== 1. Cold AOT compile time, nop compiler (median of {repeats} cold compiles, ms) ==")
    print("   fw = construct + first forward call; fw+bw = the same plus the first .backward() of out.sum()")
    print("   ratio = median(aotgrad) / median(upstream); min-ratio = min(aotgrad) / min(upstream)")
    headers = ["model", "aotgrad fw", "upstream fw", "ratio", "min-ratio",
               "aotgrad fw+bw", "upstream fw+bw", "ratio", "min-ratio", "check"]
    rows = []
    ratios: list[tuple[str, float | None]] = []
    for r in results:
        a, u = r.sides["aotgrad"], r.sides["upstream"]
        notes = []
        for name, s in r.sides.items():
            if s.error:
                notes.append(f"{name} {s.error}")
            elif s.mismatch:
                notes.append(f"{name} MISMATCH vs eager: {s.mismatch}")
        rf, rb = r.ratio("fw"), r.ratio("fwbw")
        ratios += [(f"{r.model} fw", rf), (f"{r.model} fw+bw", rb)]
        rows.append([
            r.model, _ms(a.ms("fw")), _ms(u.ms("fw")), fmt_ratio(rf), fmt_ratio(r.ratio("fw", "min")),
            _ms(a.ms("fwbw")), _ms(u.ms("fwbw")), fmt_ratio(rb), fmt_ratio(r.ratio("fwbw", "min")),
            "; ".join(notes) or "ok",
        ])
    print(table(headers, rows, "lrrrrrrrrl"))
    ok = bool(ratios) and all(v is not None and v <= TARGET for _, v in ratios) and all(
        not r.sides["aotgrad"].error and not r.sides["aotgrad"].mismatch for r in results
    )
    return ok, _summary("cold compile time ratio (aotgrad/upstream)", ratios, results_ok=ok)


def report_overhead(results: list[overhead.CaseResult], number: int, repeats: int) -> tuple[bool, str]:
    print()
    print(f"== 2. Per-call overhead over eager, x.sin() on a 1-element tensor, nop compiler "
          f"(best of {repeats} x {number} calls, µs/call) ==")
    headers = ["case", "eager", "aotgrad", "upstream", "aotgrad ovh", "upstream ovh", "ratio", "check"]
    rows = []
    ratios: list[tuple[str, float | None]] = []
    for r in results:
        ratio = r.ratio()
        ratios.append((r.case + (" (time ratio)" if r.ratio_kind == "time" else ""), ratio))
        notes = "; ".join(f"{k} {v}" for k, v in r.errors.items()) or "ok"
        rows.append([
            r.case, _us(r.us.get("eager")), _us(r.us.get("aotgrad")), _us(r.us.get("upstream")),
            _us(r.overhead("aotgrad")), _us(r.overhead("upstream")), fmt_ratio(ratio), notes,
        ])
    print(table(headers, rows, "lrrrrrrl"))
    print("   ratio = (aotgrad - eager) / (upstream - eager); for the TwoTensor case always the time ratio "
          "aotgrad / upstream (defined per case: overhead.Case.ratio_kind)")
    ok = bool(ratios) and all(v is not None and v <= TARGET for _, v in ratios) and not any(
        k == "aotgrad" for r in results for k in r.errors
    )
    return ok, _summary("run-time overhead ratio (aotgrad-eager)/(upstream-eager)", ratios, results_ok=ok)


def _summary(what: str, ratios: list[tuple[str, float | None]], results_ok: bool) -> str:
    known = [(k, v) for k, v in ratios if v is not None]
    missing = [k for k, v in ratios if v is None]
    worst = max(known, key=lambda kv: kv[1]) if known else None
    parts = [f"target {what} <= {TARGET}: {'PASS' if results_ok else 'FAIL'}"]
    if worst:
        parts.append(f"worst {worst[0]} = {worst[1]:.2f}")
    over = [f"{k} {v:.2f}" for k, v in known if v > TARGET]
    if over:
        parts.append("over target: " + ", ".join(over))
    if missing:
        parts.append("no ratio (error): " + ", ".join(missing))
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--number", type=int, default=3000)
    p.add_argument("--overhead-repeats", type=int, default=7)
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-partition", action="store_true")
    p.add_argument("--skip-backend", action="store_true", help="skip torch.compile+Inductor (4-5 min)")
    p.add_argument("--skip-fresh-compile", action="store_true",
                   help="skip cold torch.compile times measured in fresh processes (~13 min)")
    p.add_argument("--skip-force-field", action="store_true",
                   help="skip the force-field training step (second-order gradients; ~2-4 min)")
    p.add_argument("--skip-warm-start", action="store_true",
                   help="skip the warm-start benchmark (fresh processes with filled caches, ~15 min)")
    p.add_argument("--skip-distributed", action="store_true",
                   help="skip the 2-rank DDP/FSDP2 step-time benchmark (~3-5 min)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)

    # Upstream emits deprecation/user warnings on some paths; keep the tables readable.
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    impls = implementations()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"aotgrad vs upstream functorch.compile | torch {torch.__version__} | python {platform.python_version()} "
          f"| {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads | load avg {load:.2f} at start")
    if load > 0.5 * (os.cpu_count() or 1):
        print("   note: the machine is busy; single timings are noisy, compare the ratios (measured interleaved)")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    summaries: list[str] = []
    all_ok = True
    raw: dict = {}
    if not args.skip_compile:
        compile_time.process_warmup(impls)
        cres = compile_time.run(impls, args.repeats, args.only, log=log)
        ok, line = report_compile(cres, args.repeats)
        all_ok &= ok
        summaries.append(line)
        raw["compile_time"] = [
            {"model": r.model, **{n: {"fw_s": s.fw, "fwbw_s": s.fwbw, "error": s.error, "mismatch": s.mismatch}
                                  for n, s in r.sides.items()}}
            for r in cres
        ]
    if not args.skip_overhead:
        ores = overhead.run(impls, args.number, args.overhead_repeats, log=log)
        ok, line = report_overhead(ores, args.number, args.overhead_repeats)
        all_ok &= ok
        summaries.append(line)
        raw["overhead"] = [{"case": r.case, "us": r.us, "errors": r.errors} for r in ores]
    if not args.skip_partition:
        import partition_bench  # benchmarks/ is on sys.path when run as a script

        ok, lines, pres = partition_bench.run(log=log)
        all_ok &= ok
        summaries += lines
        raw["partition"] = partition_bench.to_json(pres)
    if not args.skip_backend:
        import backend_bench

        backend_bench.main([])
    if not args.skip_force_field:
        import force_field_bench

        fres = force_field_bench.run(10.0, 4, log=log)
        ok, line = force_field_bench.report(fres)
        all_ok &= ok
        summaries.append(line)
        raw["force_field"] = fres
    if not args.skip_fresh_compile:
        import cold_compile_bench

        cold_compile_bench.main(["--repeats", "2"])
        cold_compile_bench.main(["--repeats", "2", "--stack", "as-called",
                                 "--rows", "mlp,transformer,cnn_bn,pointwise200"])
    if not args.skip_warm_start:
        import warm_start_bench

        warm_start_bench.main(["--repeats", "2"])
    if not args.skip_distributed:
        import distributed_bench

        dres = distributed_bench.run(20, log=log)
        summaries += distributed_bench.report(dres)
        raw["distributed"] = dres

    print()
    print("== Summary ==")
    for i, line in enumerate(summaries, 1):
        print(f"{i}. {line}")
    print(f"(total {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1, default=str)
    # Benchmarks report; they do not fail the build.
    return 0


if __name__ == "__main__":
    sys.exit(main())
