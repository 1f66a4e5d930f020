"""Per-call run-time overhead over eager with tiny inputs (nop compiler).

`f = lambda x: x.sin()` on a 1-element tensor, three cases:
    fwd        x.requires_grad=True, time f(x)
    fwd+bwd    x.requires_grad=True, time f(x).backward()
    inference  x.requires_grad=False, time f(x)
    TwoTensor  x a TwoTensor (torch.testing._internal.two_tensor) requiring grad, time f(x): the
               subclass stage's prologue/epilogue (flatten, rebuild) against upstream's
Each case gets its own compiled object per implementation (upstream caches its first compiled
graph regardless of the input signature), compiled and warmed before timing. Timing is
timeit-style: `number` calls per sample with the GC off, `repeats` samples interleaved across
eager/aotgrad/upstream, best sample reported. Ratio, defined per case (`Case.ratio_kind`): the
overhead ratio (aotgrad - eager) / (upstream - eager), or for the TwoTensor case the time ratio
aotgrad / upstream (eager is slower than both there).
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from harness import Impl, compare, error_text


def sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@dataclass(frozen=True)
class Case:
    name: str
    requires_grad: bool
    stmt: str
    two_tensor: bool = False  # x is a TwoTensor of two 1-element tensors
    # How the case's ratio is defined, fixed per case (never chosen from the measured values):
    # "overhead" = (aotgrad - eager) / (upstream - eager); "time" = aotgrad / upstream (the TwoTensor
    # case: eager dispatches each op through the subclass's Python code and is slower than both
    # compiled runs, so there is no overhead over eager to compare).
    ratio_kind: str = "overhead"


CASES = [
    Case("fwd (requires_grad)", True, "f(x)"),
    Case("fwd+bwd", True, "f(x).backward()"),
    Case("inference (no grad)", False, "f(x)"),
    Case("fwd (one TwoTensor input, requires_grad)", True, "f(x)", two_tensor=True, ratio_kind="time"),
]


def _input(case: Case, base: torch.Tensor) -> torch.Tensor:
    if case.two_tensor:
        from torch.testing._internal.two_tensor import TwoTensor

        base = TwoTensor(base.clone(), base.clone() * 2)
    return base.requires_grad_(case.requires_grad)


def _components(t: torch.Tensor) -> tuple:
    return (t.a, t.b) if hasattr(t, "a") and hasattr(t, "b") else (t,)


@dataclass
class CaseResult:
    case: str
    ratio_kind: str = "overhead"  # Case.ratio_kind
    us: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def overhead(self, name: str) -> float | None:
        e, v = self.us.get("eager"), self.us.get(name)
        return None if e is None or v is None else v - e

    def ratio(self) -> float | None:
        """The case's ratio as its `ratio_kind` defines it; None where that is undefined (a missing
        time, or upstream no slower than eager for an overhead ratio)."""
        if self.ratio_kind == "time":
            a, u = self.us.get("aotgrad"), self.us.get("upstream")
            return a / u if a is not None and u else None
        a, u = self.overhead("aotgrad"), self.overhead("upstream")
        return a / u if a is not None and u is not None and u > 0 else None


def _check(case: Case, f: Callable) -> str | None:
    """Result (and grad) of `f` against eager on a fresh input."""
    torch.manual_seed(0)
    base = torch.randn(1)
    xr, xg = _input(case, base.clone()), _input(case, base.clone())
    ref, got = sin(xr), f(xg)
    if type(ref) is not type(got):
        return f"output type {type(got).__name__}, eager's {type(ref).__name__}"
    if case.requires_grad:
        ref.sum().backward()
        got.sum().backward()
        return compare((_components(ref), _components(xr.grad)), (_components(got), _components(xg.grad)))
    return compare(ref, got) or (None if got.requires_grad == ref.requires_grad else "requires_grad differs")


def bench_case(impls: tuple[Impl, ...], case: Case, number: int, repeats: int) -> CaseResult:
    result = CaseResult(case.name, case.ratio_kind)
    timers: dict[str, timeit.Timer] = {}
    candidates: list[tuple[str, Callable]] = [("eager", sin)]
    candidates += [(impl.name, impl.aot_function(sin, impl.nop)) for impl in impls]
    for name, f in candidates:
        x = _input(case, torch.randn(1))
        try:
            mismatch = _check(case, f)
            if mismatch:
                result.errors[name] = f"MISMATCH: {mismatch}"
            timer = timeit.Timer(case.stmt, globals={"f": f, "x": x})
            timer.timeit(max(number // 10, 50))  # warm-up (compiles on the first call)
        except Exception as e:  # reported in the table
            result.errors[name] = error_text(e)
            result.us[name] = None
            continue
        timers[name] = timer
        result.us[name] = float("inf")
    for _ in range(repeats):
        for name, timer in timers.items():
            try:
                t = timer.timeit(number) / number * 1e6
            except Exception as e:
                result.errors[name] = error_text(e)
                result.us[name] = None
                continue
            if result.us[name] is not None:
                result.us[name] = min(result.us[name], t)
    # `timers` is rebuilt per case; drop the graphs before the next one.
    timers.clear()
    return result


def run(impls: tuple[Impl, ...], number: int, repeats: int, log=print) -> list[CaseResult]:
    results = []
    for case in CASES:
        log(f"  overhead: {case.name} ...")
        results.append(bench_case(impls, case, number, repeats))
    return results
