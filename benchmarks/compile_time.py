"""Cold AOT compile time with the nop compiler, aotgrad vs upstream functorch.compile.

For each model and each implementation, one *cold* measurement is: deep-copy the pristine model
(untimed), then time
    compiled = aot_module(model, nop)        # or aot_function(fn, nop) for the pointwise chain
    out = compiled(*inputs)                  # -> "fw": first forward call (trace, partition, fw compile)
    out.sum().backward()                     # -> "fw+bw": ... plus the first backward (lazy bw compile)
with a new compiled object every time. The first measurement of each (model, implementation) is an
untimed warm-up (process-level caches, lazy imports) whose results are checked against eager; then
`repeats` timed measurements alternate between the implementations, and the median is reported
(the ratio of the minimums too: on a shared 2-core machine, load from other processes inflates
single samples several-fold, and noise only ever adds time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from harness import Impl, Timer, compare, error_text, fresh, median, state_of, sum_outputs
from models import BENCH_MODELS, BenchModel


@dataclass
class SideResult:
    fw: list[float] = field(default_factory=list)
    fwbw: list[float] = field(default_factory=list)
    error: str | None = None
    mismatch: str | None = None

    def ms(self, which: str, stat: str = "median") -> float | None:
        """`which` is "fw" or "fwbw"; `stat` is "median" or "min"."""
        xs = getattr(self, which)
        if not xs or self.error:
            return None
        return 1e3 * (median(xs) if stat == "median" else min(xs))


@dataclass
class ModelResult:
    model: str
    sides: dict[str, SideResult]

    def ratio(self, which: str, stat: str = "median") -> float | None:
        a = self.sides["aotgrad"].ms(which, stat)
        u = self.sides["upstream"].ms(which, stat)
        return a / u if a is not None and u is not None and u > 0 else None


def _compile(impl: Impl, bm: BenchModel, mod: torch.nn.Module):
    if bm.is_function:
        return impl.aot_function(bm.function, impl.nop)
    return impl.aot_module(mod, impl.nop)


def cold_run(impl: Impl, bm: BenchModel, pristine: torch.nn.Module, inputs: tuple):
    """One cold compile; returns (fw seconds, fw+bw seconds, output, module, inputs)."""
    mod, inp = fresh(pristine, inputs)
    with Timer() as t:
        compiled = _compile(impl, bm, mod)
        out = compiled(*inp)
        t_fw = t.lap()
        sum_outputs(out).backward()
        t_fwbw = t.lap()
    return t_fw, t_fwbw, out, mod, inp


def eager_reference(pristine: torch.nn.Module, inputs: tuple):
    mod, inp = fresh(pristine, inputs)
    out = mod(*inp)
    sum_outputs(out).backward()
    return out, state_of(mod, inp)


def bench_model(impls: tuple[Impl, ...], bm: BenchModel, repeats: int) -> ModelResult:
    pristine, inputs = bm.factory()
    ref_out, ref_state = eager_reference(pristine, inputs)
    sides = {impl.name: SideResult() for impl in impls}

    # Untimed warm-up run per implementation, doubling as the correctness check.
    for impl in impls:
        side = sides[impl.name]
        try:
            _, _, out, mod, inp = cold_run(impl, bm, pristine, inputs)
        except Exception as e:  # reported in the table
            side.error = error_text(e)
            continue
        side.mismatch = compare(ref_out, out) or compare(ref_state, state_of(mod, inp))

    for r in range(repeats):
        order = impls if r % 2 == 0 else tuple(reversed(impls))
        for impl in order:
            side = sides[impl.name]
            if side.error:
                continue
            try:
                t_fw, t_fwbw, *_ = cold_run(impl, bm, pristine, inputs)
            except Exception as e:
                side.error = error_text(e)
                continue
            side.fw.append(t_fw)
            side.fwbw.append(t_fwbw)
    return ModelResult(bm.name, sides)


def run(impls: tuple[Impl, ...], repeats: int, only: list[str] | None = None, log=print) -> list[ModelResult]:
    results = []
    for bm in BENCH_MODELS:
        if only and bm.name not in only:
            continue
        log(f"  compile-time: {bm.name} ...")
        results.append(bench_model(impls, bm, repeats))
    return results


def process_warmup(impls: tuple[Impl, ...]) -> None:
    """Compile one tiny function per implementation so lazy imports are not charged to a model."""

    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    for impl in impls:
        x = torch.randn(2, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        try:
            impl.aot_function(f, impl.nop)(x, w).sum().backward()
            impl.aot_function(f, impl.nop)(x.detach(), w.detach())
        except Exception:  # the model runs report errors
            pass
