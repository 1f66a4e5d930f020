"""Differential fuzzing of aotgrad against eager: `python scripts/fuzz.py --n N --seed SEED`.

Generates N random programs (see `aotgrad.testing.fuzz`), checks each with `check_against_eager`, shrinks
every crash / mismatch and writes a standalone reproducer to fuzz-repros/, then prints a summary:
matched / refused (grouped by message) / crashed (grouped by exception) / mismatched.
Exits 1 if anything crashed or mismatched.

    python scripts/fuzz.py --n 2000 --seed 0
    python scripts/fuzz.py --seed 0 --only 258      # re-check (and shrink) one program
    python scripts/fuzz.py --seed 0 --show 258      # print one generated program
    python scripts/fuzz.py --n 500 --backend aotgrad_eager --reference aot_eager   # through torch.compile
    python scripts/fuzz.py --n 5000 --order 2       # second-order gradients (aotgrad.testing.fuzz.order2)
    python scripts/fuzz.py --n 2000 --subclass      # inputs are TwoTensors (aotgrad.testing.fuzz.subclass)
    python scripts/fuzz.py --n 1000 --order 2 --subclass   # both
    python scripts/fuzz.py --n 2000 --dynamic       # aot_function(dynamic=True), inputs read back per call
    python scripts/fuzz.py --n 2000 --autocast     # called and differentiated under the caller's bf16 autocast
    python scripts/fuzz.py --n 500 --closures     # every program reads closed-over state (aotgrad.testing.fuzz.closures)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

try:
    from aotgrad.testing import fuzz
except ImportError:  # not installed: use the checkout's src/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from aotgrad.testing import fuzz


def _mode_check(args):
    """The check this run applies to each program: the plain one, or the chosen modes' layered."""
    check_program = fuzz.check_program
    if args.subclass:
        from aotgrad.testing.fuzz import subclass as fuzz_subclass

        check_program = fuzz_subclass.check_program
    if args.order == 2:
        from aotgrad.testing.fuzz import order2 as fuzz_order2

        check_program = fuzz_order2.check_program
        if args.subclass:  # second order with TwoTensor inputs
            check_program = functools.partial(fuzz_order2.check_program,
                                              wrap_inputs=fuzz_subclass.with_two_tensor_inputs)
    if args.autocast:  # around any mode's check
        from aotgrad.testing.fuzz import autocast as fuzz_autocast

        check_program = functools.partial(fuzz_autocast.check_program, check=check_program)
    return check_program


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="number of programs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="index of the first program")
    ap.add_argument("--out", default="fuzz-repros", help="folder for reproducers ('' to write none)")
    ap.add_argument("--no-shrink", action="store_true", help="write failing programs as generated")
    ap.add_argument("--shrink-per-key", type=int, default=3,
                    help="shrink at most this many failures per distinct message (default 3)")
    ap.add_argument("--top", type=int, default=10, help="refusal messages to list")
    ap.add_argument("--only", type=int, help="check (and shrink) only program number ONLY; print it")
    ap.add_argument("--show", type=int, help="print program number SHOW and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--backend", default=None,
                    help="compile through torch.compile(backend=BACKEND) (e.g. aotgrad_eager) instead of aot_function")
    ap.add_argument("--reference", default=None,
                    help="with --backend: re-check each failure under this backend (e.g. upstream's aot_eager); "
                         "failures it shares do not fail the run")
    ap.add_argument("--order", type=int, choices=(1, 2), default=1,
                    help="2: also differentiate each program's gradients (create_graph=True) and compare those")
    ap.add_argument("--subclass", action="store_true",
                    help="make every floating input a TwoTensor (the subclass stage, aotgrad.testing.fuzz.subclass)")
    ap.add_argument("--dynamic", action="store_true",
                    help="compile with aot_function(dynamic=True) (symbolic sizes; every input read back per call)")
    ap.add_argument("--closures", action="store_true",
                    help="every program reads closed-over state (aotgrad.testing.fuzz.closures), not 15%% of them")
    ap.add_argument("--autocast", action="store_true",
                    help="call each program and its backward under bfloat16 autocast (aotgrad.testing.fuzz.autocast)")
    args = ap.parse_args(argv)
    if args.closures:
        from aotgrad.testing.fuzz import closures as fuzz_closures

        fuzz_closures.PROBABILITY = 1.0
    check_program = _mode_check(args)
    repro = {"subclass": args.subclass, "order": args.order, "autocast": args.autocast}  # reproducers run as this run checks

    if args.show is not None:
        print(_generate(args, args.show).reproducer(backend=args.backend, **repro))
        return 0
    if args.only is not None:
        prog = _generate(args, args.only)
        out = check_program(prog, backend=args.backend)
        print(f"{out.kind}: {out.message or out.key}")
        if out.kind in ("crashed", "mismatched"):
            if not args.no_shrink:
                prog = fuzz.shrink(prog, out, still_fails=lambda p: check_program(
                    p, backend=args.backend).same_failure(out))
            print(prog.reproducer(out.message.splitlines()[0] if out.message else "", args.backend, **repro))
            if out.detail:
                print(out.detail)
            return 1
        print(prog.reproducer(backend=args.backend, **repro))
        return 0

    t0 = time.time()
    summary = fuzz.run(
        args.n, args.seed, start=args.start,
        shrink_failures=not args.no_shrink, shrink_per_key=args.shrink_per_key,
        out_dir=args.out or None,
        progress=None if args.quiet else fuzz.Progress(args.n),
        backend=args.backend,
        check_fn=check_program,
        dynamic=args.dynamic,
        reproducer_options=repro,
    )
    print(summary.report(top=args.top))
    own = len(summary.failures)
    if args.backend and args.reference:
        # The shrunk program too: it shows the same failure under aotgrad, and may show it under
        # the reference where the original did not (an Inductor bug reached by fewer ops). The
        # mode's own check, so the reference runs under the same caller state (autocast, order 2).
        shared = [f.index for f in summary.failures
                  if any(check_program(p, backend=args.reference).kind in ("crashed", "mismatched")
                         for p in (f.program, f.shrunk) if p is not None)]
        own -= len(shared)
        print(f"{len(shared)} of {len(summary.failures)} failures also fail under backend={args.reference!r}: {shared}")
    print(f"{time.time() - t0:.1f}s")
    return 1 if own else 0


def _generate(args, index: int):
    prog = fuzz.generate(args.seed, index)
    return fuzz.with_dynamic(prog) if args.dynamic else prog


if __name__ == "__main__":
    sys.exit(main())
