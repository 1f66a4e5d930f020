"""Per-call run-time overhead over eager with tiny inputs (nop compiler).

`f = lambda x: x.sin()` on a 1-element tensor (and a program of three view outputs), these cases:
    fwd        x.requires_grad=True, time f(x)
    fwd+bwd    x.requires_grad=True, time f(x).backward()
    inference  x.requires_grad=False, time f(x); also for a program returning three views of x, and
               for programs closing over a tensor (`x * w`) and over a module (`Scaled`,
               in eval mode, its parameter without grad): aotgrad lifts the closed-over tensors
               to inputs and checks per call, in the entry's one generated guard, that they and
               the module's state are unchanged; upstream's aot_function refuses a closed-over
               tensor under its own fake mode, and compiled under one that allows it
               (`_upstream_closure`) bakes it into the graph as a constant and guards nothing (a
               rebound tensor or a module's changed mode is not seen): its rows say "unguarded"
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


def views(x: torch.Tensor) -> tuple:
    """Three outputs that are views of the input: each rebuilt by the run time as eager's view."""
    return x.view(-1), x[:1], x.unsqueeze(0)


def _closure_over_tensor() -> Callable:
    """`x * w`: one op, as `sin` (each graph op is a `torch.ops` call, ~1 us over eager's method
    call on both sides; a second op would measure that, not the closure)."""
    w = torch.randn(1)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * w

    return scaled


class Scaled(torch.nn.Module):
    """`x * weight`: the tensor closure's program inside a module. A closed-over `nn.Linear` would
    add `view`/`t`/`addmm` graph ops that both sides run through `torch.ops`, and a rebuilt view
    output, hiding the guard's cost; eager pays `nn.Module.__call__` (~2 us), the compiled graphs
    do not, so this row's ratio is lower than the tensor closure's for the same guard."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _closure_over_module() -> Callable:
    scaled = Scaled().eval()

    def module(x: torch.Tensor) -> torch.Tensor:
        return scaled(x)

    return module


closed_over_tensor = _closure_over_tensor()
closed_over_module = _closure_over_module()


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
    fn: Callable = sin  # the program
    closes_over: bool = False  # the program reads tensors it is not passed (see `_upstream_closure`)


CASES = [
    Case("fwd (requires_grad)", True, "f(x)"),
    Case("fwd+bwd", True, "f(x).backward()"),
    Case("inference (no grad)", False, "f(x)"),
    Case("inference, three view outputs", False, "f(x)", fn=views),
    Case("inference, closed-over tensor (upstream: unguarded)", False, "f(x)", fn=closed_over_tensor,
         closes_over=True),
    Case("inference, closed-over module (upstream: unguarded)", False, "f(x)", fn=closed_over_module,
         closes_over=True),
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
    ref, got = case.fn(xr), f(xg)
    if isinstance(ref, tuple) and isinstance(got, list):  # upstream returns several outputs as a list
        got = tuple(got)
    if type(ref) is not type(got):
        return f"output type {type(got).__name__}, eager's {type(ref).__name__}"
    if case.requires_grad:
        ref.sum().backward()
        got.sum().backward()
        return compare((_components(ref), _components(xr.grad)), (_components(got), _components(xg.grad)))
    flat_ref, flat_got = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
    same_grad = all(a.requires_grad == b.requires_grad for a, b in zip(flat_ref, flat_got))
    return compare(ref, got) or (None if same_grad else "requires_grad differs")


def _upstream_closure(case: Case, f: Callable) -> None:
    """Compile upstream's `f` for a program closing over tensors. Its trace fakes the arguments and
    refuses a real tensor met in the program ("Please convert all Tensors to FakeTensors first"),
    unless the tracing context's fake mode allows them: the first call then bakes the closed-over
    tensors into the graph as constants (later calls never read them again, and nothing is
    guarded); upstream caches that graph for every later call."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True))):
        f(_input(case, torch.randn(1)))


def bench_case(impls: tuple[Impl, ...], case: Case, number: int, repeats: int) -> CaseResult:
    result = CaseResult(case.name, case.ratio_kind)
    timers: dict[str, timeit.Timer] = {}
    candidates: list[tuple[str, Callable]] = [("eager", case.fn)]
    candidates += [(impl.name, impl.aot_function(case.fn, impl.nop)) for impl in impls]
    for name, f in candidates:
        x = _input(case, torch.randn(1))
        try:
            if case.closes_over and name == "upstream":
                _upstream_closure(case, f)
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
