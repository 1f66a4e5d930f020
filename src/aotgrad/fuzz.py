"""Differential random-program fuzzer: eager vs `aot_function(f, nop)`.

Generates small straight-line tensor programs (views, out-of-place ops, in-place ops on
intermediates / views / inputs, metadata mutations, `no_grad` blocks, `.detach()`, aliasing and
duplicate outputs) over 1-3 roots passed as leaves, non-leaf clones, duplicates or overlapping views,
runs each through `aotgrad.testing.check_against_eager`, and classifies the result:

* ``matched``    - compiled behaves like eager;
* ``refused``    - aotgrad raised an `AotgradError` (a deliberate refusal);
* ``crashed``    - any other exception from the compiled side (a bug);
* ``mismatched`` - a silent wrong result (the worst kind of bug).

Programs whose *eager* run (including the gradient and output-mutation checks of
`check_against_eager`) raises are skipped. Every program is a `Program` (a list of statements that
render to Python source) that is generated deterministically from ``(seed, index)``; it is executed
from its rendered source, so a failing program can be written out verbatim as a standalone
reproducer after being shrunk (statements, returned values and arguments dropped one at a time while
eager still runs and the failure stays the same).

    from aotgrad import fuzz
    summary = fuzz.run(200, seed=0)           # or: python scripts/fuzz.py --n 200 --seed 0
    print(summary.report())

Modules: programs and their generator in fuzz_programs.py, the runner in fuzz_check.py, the shrinker
in fuzz_shrink.py, the summary and reproducers in fuzz_report.py; this one drives a run and keeps the
public names importable from `aotgrad.fuzz`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

from .fuzz_check import KINDS, Outcome, check_program, explain, normalize
from .fuzz_programs import NoGrad, Program, Stmt, generate, materialize, view_expr
from .fuzz_report import Failure, Progress, Summary, write_reproducer
from .fuzz_shrink import shrink

__all__ = [
    "KINDS",
    "Failure",
    "NoGrad",
    "Outcome",
    "Program",
    "Progress",
    "Stmt",
    "Summary",
    "check_program",
    "explain",
    "generate",
    "materialize",
    "normalize",
    "run",
    "shrink",
    "view_expr",
    "write_reproducer",
]


def run(
    n: int,
    seed: int = 0,
    *,
    shrink_failures: bool = True,
    shrink_per_key: int = 3,
    out_dir: str | None = "fuzz-repros",
    progress: Progress | None = None,
    start: int = 0,
    backend: str | None = None,
    check_fn: Callable | None = None,
    reproducer_options: dict | None = None,
) -> Summary:
    """Generate and check programs `start .. start+n-1` of run `seed` (through `torch.compile` with
    `backend`, if given).

    Crashes and mismatches are shrunk (at most `shrink_per_key` per distinct failure message; the
    others are written as generated) and written to `out_dir` (None: keep them in the summary only),
    with `reproducer_options` (Program.reproducer's `subclass`, `order`: what `check_fn` checks).
    """
    summary = Summary(seed)
    shrunk_keys: Counter = Counter()
    check = functools.partial(check_fn or check_program, backend=backend)  # check_fn: e.g. fuzz_order2's
    for k, i in enumerate(range(start, start + n)):
        prog = generate(seed, i)
        out = check(prog)
        fail = summary.add(i, prog, out)
        if fail is not None:
            key = (out.kind, out.key)
            if shrink_failures and shrunk_keys[key] < shrink_per_key:
                shrunk_keys[key] += 1
                fail.shrunk = shrink(prog, out, still_fails=lambda p, out=out: check(p).same_failure(out))
                fail.shrunk_outcome = check(fail.shrunk)
            if out_dir is not None:
                fail.path = write_reproducer(fail, seed, out_dir, backend, **(reproducer_options or {}))
        if progress is not None:
            progress.update(k + 1, summary)
    return summary
