"""The fuzzer's shrinker: drop statements, returned values and arguments one at a time while eager
still runs and the failure stays the same.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from .fuzz_check import Outcome, check_program
from .fuzz_programs import NoGrad, Program


def _candidates(prog: Program):
    """Smaller variants of `prog`, biggest cuts first."""
    body = list(prog.body)
    for i in range(len(body)):  # drop a statement / a whole block
        yield dataclasses.replace(prog, body=tuple(body[:i] + body[i + 1 :]))
    for i, s in enumerate(body):
        if isinstance(s, NoGrad):
            yield dataclasses.replace(prog, body=tuple(body[:i] + list(s.body) + body[i + 1 :]))  # unwrap
            for j in range(len(s.body)):
                inner = s.body[:j] + s.body[j + 1 :]
                if inner:
                    yield dataclasses.replace(prog, body=tuple(body[:i] + [dataclasses.replace(s, body=inner)] + body[i + 1 :]))
    for i in range(len(prog.returns)):
        if len(prog.returns) > 1:
            yield dataclasses.replace(prog, returns=prog.returns[:i] + prog.returns[i + 1 :])
    if len(prog.returns) == 1 and prog.single:
        yield dataclasses.replace(prog, single=False)
    if prog.config:
        yield dataclasses.replace(prog, config=())
    for i in range(len(prog.args)):  # drop an argument
        if len(prog.args) > 1:
            yield dataclasses.replace(prog, args=prog.args[:i] + prog.args[i + 1 :])
    for i, line in enumerate(prog.setup):  # simpler inputs
        if ".requires_grad_()" in line:
            yield dataclasses.replace(prog, setup=_replace(prog.setup, i, line.replace(".requires_grad_()", "")))
        if "dtype=torch.float64" in line or "dtype=torch.complex64" in line:
            yield dataclasses.replace(
                prog, setup=_replace(prog.setup, i, re.sub(r"torch\.(float64|complex64)", "torch.float32", line))
            )
    for i, (p, e) in enumerate(prog.args):  # pass the clone / the root instead of a view
        for alt in _arg_alternatives(prog, e):
            yield dataclasses.replace(prog, args=prog.args[:i] + ((p, alt),) + prog.args[i + 1 :])


def _assignment(line: str) -> tuple[str, str] | None:
    """`(name, rhs)` of a setup line `name = rhs`; None for other lines (`global W0`, fuzz_closures)."""
    parts = line.split(" = ", 1)
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _arg_alternatives(prog: Program, e: str) -> list[str]:
    defs = dict(a for a in map(_assignment, prog.setup) if a is not None)
    rhs = defs.get(e, "")
    m = re.match(r"([rc]\d+)\b", rhs)
    return [m.group(1)] if m and m.group(1) != e else []


def _replace(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def _clean(prog: Program) -> Program:
    """Drop setup lines and roots no argument needs (does not change behaviour). Lines that assign
    nothing (`global W0`) stay, and so do the globals they declare (the program reads them)."""
    used = {e for _, e in prog.args}
    used |= {g for line in prog.setup if line.startswith("global ") for g in line[7:].replace(",", " ").split()}
    setup = list(prog.setup)
    changed = True
    while changed:
        changed = False
        for line in list(setup):
            a = _assignment(line)
            if a is not None and a[0] not in used:
                if any(re.search(rf"\b{a[0]}\b", o[1]) for o in map(_assignment, setup) if o is not None and o[0] != a[0]):
                    continue
                setup.remove(line)
                changed = True
        used |= {n for a in map(_assignment, setup) if a is not None for n in re.findall(r"\b[rc]\d+\b", a[1])}
    names = {a[0] for a in map(_assignment, setup) if a is not None}
    roots = tuple(r for r in prog.roots if r.split(".")[0] in names)  # `M0.t`: an attribute of a kept name
    return dataclasses.replace(prog, setup=tuple(setup), roots=roots)


def shrink(
    prog: Program, target: Outcome | None, budget: int = 400,
    still_fails: Callable[[Program], bool] | None = None,
) -> Program:
    """Greedy one-at-a-time reduction while eager still runs and `check_program` fails the same way
    as `target` (or while `still_fails(program)`, if given)."""
    if still_fails is None:
        assert target is not None

        def still_fails(p: Program) -> bool:
            return check_program(p).same_failure(target)

    steps = 0
    improved = True
    while improved and steps < budget:
        improved = False
        for cand in _candidates(prog):
            steps += 1
            if steps > budget:
                break
            if still_fails(cand):
                prog = cand
                improved = True
                break
    cleaned = _clean(prog)
    if cleaned != prog and still_fails(cleaned):
        prog = cleaned
    return prog
