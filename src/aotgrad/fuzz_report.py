"""The fuzzer's report: failures, the run's summary, standalone reproducer files and progress lines.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

from .fuzz_check import KINDS, Outcome
from .fuzz_programs import Program


@dataclass
class Failure:
    index: int
    outcome: Outcome
    program: Program
    shrunk: Program | None = None
    shrunk_outcome: Outcome | None = None  # the failure as the shrunk program shows it
    path: str | None = None


@dataclass
class Summary:
    seed: int
    n: int = 0
    skipped: int = 0
    counts: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    crashed: Counter = field(default_factory=Counter)
    mismatched: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    def add(self, index: int, prog: Program, out: Outcome) -> Failure | None:
        self.n += 1
        if out.kind == "skipped":
            self.skipped += 1
            return None
        self.counts[out.kind] += 1
        if out.kind == "refused":
            self.refused[out.key] += 1
        elif out.kind in ("crashed", "mismatched"):
            getattr(self, out.kind)[out.key] += 1
            fail = Failure(index, out, prog)
            self.failures.append(fail)
            return fail
        return None

    def report(self, top: int = 10) -> str:
        checked = sum(self.counts.values())
        lines = [
            f"programs: {self.n} (seed {self.seed}); eager raised, skipped: {self.skipped}; checked: {checked}",
            "  " + "  ".join(f"{k}: {self.counts[k]}" for k in KINDS),
        ]
        for kind, groups in (("refused", self.refused), ("crashed", self.crashed), ("mismatched", self.mismatched)):
            if groups:
                lines.append(f"{kind} (top {top} of {len(groups)} messages):")
                for key, c in groups.most_common(top if kind == "refused" else None):
                    lines.append(f"  {c:6d}  {key}")
        if self.failures:
            lines.append("reproducers:")
            seen = set()
            for fl in self.failures:
                if fl.path and (fl.outcome.kind, fl.outcome.key) not in seen:
                    seen.add((fl.outcome.kind, fl.outcome.key))
                    lines.append(f"  {fl.path}  ({fl.outcome.kind}: {fl.outcome.key[:90]})")
        return "\n".join(lines)


def write_reproducer(fail: Failure, seed: int, out_dir: str, backend: str | None = None, **options) -> str:
    """Write `fail`'s (shrunk) program as a standalone script; `options` (Program.reproducer's
    `subclass`, `order`) make it run as the fuzzer ran it."""
    os.makedirs(out_dir, exist_ok=True)
    prog = fail.shrunk or fail.program
    out = fail.shrunk_outcome if fail.shrunk_outcome is not None else fail.outcome
    kind = "crash" if fail.outcome.kind == "crashed" else "mismatch"
    path = os.path.join(out_dir, f"{kind}_{seed}_{fail.index}.py")
    header = (
        f"aotgrad fuzz reproducer: {fail.outcome.kind}, seed {seed}, program {fail.index}"
        f" ({'shrunk' if fail.shrunk else 'not shrunk'}; regenerate with aotgrad.fuzz.generate({seed}, {fail.index}))\n"
        f"key: {fail.outcome.key}\n"
        + "\n".join(out.message.splitlines()[:12])
        + "".join(f"\nat {w}" for w in _where(out.detail))
    )
    with open(path, "w") as fh:
        fh.write(prog.reproducer(header, backend, **options))
    return path


def _where(tb_text: str, n: int = 3) -> list[str]:
    """The innermost `n` frames of a formatted traceback, one line each."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb_text or "")
    return [f"{os.path.basename(f)}:{line} {fn}" for f, line, fn in frames[-n:]]


class Progress:
    """A one-line progress bar on a terminal (plain periodic lines otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.last_line = -1

    def update(self, done: int, summary: Summary) -> None:
        c = summary.counts
        stats = (f"matched {c['matched']} refused {c['refused']} crashed {c['crashed']} "
                 f"mismatched {c['mismatched']} skipped {summary.skipped}")
        if self.tty:
            fill = int(self.width * done / max(self.total, 1))
            bar = "#" * fill + "." * (self.width - fill)
            self.stream.write(f"\r[{bar}] {done}/{self.total} {stats}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            pct = int(10 * done / max(self.total, 1))
            if pct != self.last_line or done == self.total:
                self.last_line = pct
                self.stream.write(f"{done}/{self.total} {stats}\n")
                self.stream.flush()
