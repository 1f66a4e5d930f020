"""torch's OpInfo checker `torch.testing._internal.optests.aot_autograd_check` with aotgrad in place
of `functorch.compile` (the checker imports `compiled_function`, the partitioners and `nop` by name).

`optests_sweep` runs it over op_db (CPU, float32, the first samples of each op), as upstream's
test_aotdispatch does, once per (backend, disable_functionalization) configuration.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import opinfo_sweep as sweep
import torch
import torch.testing._internal.optests.aot_autograd as optests_aot

import aotgrad
from aotgrad.partition.mincut import min_cut_rematerialization_partition

_NAMES = ("compiled_function", "min_cut_rematerialization_partition", "default_partition", "nop")


def _aotgrad_parts() -> dict:
    return dict(zip(_NAMES, (aotgrad.aot_function, min_cut_rematerialization_partition,
                             aotgrad.default_partition, aotgrad.nop)))


@contextlib.contextmanager
def swapped(backend: str):
    """Run the checker against `backend` ("aotgrad" or "upstream")."""
    saved = {name: getattr(optests_aot, name) for name in _NAMES}
    if backend == "aotgrad":
        for name, value in _aotgrad_parts().items():
            setattr(optests_aot, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(optests_aot, name, value)


def check_with_aotgrad(monkeypatch, func, args, kwargs, disable_functionalization: bool) -> None:
    for name, value in _aotgrad_parts().items():
        monkeypatch.setattr(optests_aot, name, value)
    optests_aot.aot_autograd_check(
        func, args, kwargs, dynamic=False, check_gradients="auto",
        disable_functionalization=disable_functionalization,
    )


def check_op(op, backend: str, disable_functionalization: bool, max_samples: int = 2) -> str:
    """"pass", "skip" or "fail: <why>" for the first `max_samples` samples of `op`."""
    if sweep.nondeterministic_reason(op) or torch.float32 not in op.supported_dtypes("cpu"):
        return "skip"
    with warnings.catch_warnings(), sweep.time_limit(sweep.DEFAULT_TIMEOUT_S), swapped(backend):
        warnings.simplefilter("ignore")
        try:
            torch.manual_seed(0)
            samples = list(itertools.islice(
                op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd), max_samples))
        except Exception:
            return "skip"
        checked = 0
        for s in samples:
            try:  # the checker assumes eager runs the sample
                op.op(s.input, *s.args, **s.kwargs)
            except Exception:
                continue
            try:
                optests_aot.aot_autograd_check(
                    op.op, (s.input, *s.args), s.kwargs, False, check_gradients="auto",
                    disable_functionalization=disable_functionalization,
                    skip_correctness_check=getattr(op, "skip_correctness_check_compile_vs_eager", False),
                )
            except Exception as e:  # any failure of the checker is this op's result
                return f"fail: {sweep.exc_summary(e)}"
            checked += 1
    return "pass" if checked else "skip"


CONFIGS = [(b, d) for b in ("aotgrad", "upstream") for d in (False, True)]


def optests_sweep(ops, progress=None) -> dict[str, dict[tuple[str, bool], str]]:
    results = {}
    for op in ops:
        row = {cfg: check_op(op, *cfg) for cfg in CONFIGS}
        results[sweep.op_id(op)] = row
        if progress:
            progress(f"{sweep.op_id(op):50s} " + " ".join(f"{b}/{'nofunc' if d else 'func'}={r[:4]}"
                                                        for (b, d), r in row.items()))
    return results


def summary(results) -> str:
    lines = [f"optests.aot_autograd_check over {len(results)} ops (CPU float32, 2 samples each)"]
    for cfg in CONFIGS:
        tested = [r[cfg] for r in results.values() if r[cfg] != "skip"]
        passed = sum(r == "pass" for r in tested)
        lines.append(f"  {cfg[0]:9s} disable_functionalization={cfg[1]!s:5s}: pass {passed}/{len(tested)}")
    for d in (False, True):
        worse = [n for n, r in results.items() if r[("aotgrad", d)].startswith("fail") and r[("upstream", d)] == "pass"]
        lines.append(f"  aotgrad fails, upstream passes (disable_functionalization={d}): {len(worse)}")
        lines += [f"    {n}: {results[n][('aotgrad', d)]}" for n in worse]
    return "\n".join(lines)
