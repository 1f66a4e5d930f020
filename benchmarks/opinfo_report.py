"""Run the OpInfo sweep (tests/opinfo_sweep.py) over torch's op_db and print / save a report.

    .venv/bin/python benchmarks/opinfo_report.py                    # all ops, first 2 samples each
    .venv/bin/python benchmarks/opinfo_report.py --max-samples 0    # all samples of every op
    .venv/bin/python benchmarks/opinfo_report.py --ops add mm 'nn.functional.*' --json out.json

Prints aotgrad's and upstream functorch.compile's pass rates, and the ops where aotgrad fails/errors
while upstream passes, grouped by error message.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import opinfo_sweep as sweep  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="*", help="op ids or glob patterns (default: all of op_db)")
    parser.add_argument("--max-samples", type=int, default=sweep.DEFAULT_MAX_SAMPLES,
                        help="samples per op; 0 for all (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=sweep.DEFAULT_TIMEOUT_S, help="seconds per op and compiler")
    parser.add_argument("--json", help="write per-op results here")
    parser.add_argument("--quiet", action="store_true", help="no per-op progress lines")
    args = parser.parse_args()

    ops = sweep.get_op_db()
    if args.ops:
        ops = [op for op in ops if any(fnmatch.fnmatchcase(sweep.op_id(op), pat) for pat in args.ops)]
    max_samples = args.max_samples if args.max_samples > 0 else 10**9

    start = time.perf_counter()
    results = sweep.sweep(ops, max_samples=max_samples, timeout_s=args.timeout,
                          progress=None if args.quiet else print)
    elapsed = time.perf_counter() - start
    summary = sweep.summarize(results)
    print()
    print(sweep.format_report(results, summary))
    print(f"\n{len(ops)} ops, {args.max_samples or 'all'} samples each, {elapsed:.0f}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({name: {k: asdict(v) for k, v in row.items()} for name, row in results.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
