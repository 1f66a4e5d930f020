"""Partitioner benchmark: what the forward saves for the backward, and what the backward recomputes.

On the benchmark models (models.py) it compares, in one process:

    eager                     PyTorch autograd
    aotgrad default           aotgrad.aot_module / aot_function, partition_fn=aotgrad.default_partition
    aotgrad min-cut           ... partition_fn=aotgrad.min_cut_rematerialization_partition
    upstream default          functorch.compile.aot_module / aot_function, partition_fn=default_partition
    upstream min-cut          ... partition_fn=functorch.compile.min_cut_rematerialization_partition

"saved" is measured the same way for all five: the unique storages packed by
`torch.autograd.graph.saved_tensors_hooks` during one training forward (compiled programs hand their
residuals to `ctx.save_for_backward`, eager autograd saves per op). "recomputed" counts the ops of
the backward graph that the forward graph also computes (views and getitems are listed apart, they
are free); "mm/conv" are the matmul, convolution and attention ops among them. Every compiled run is
checked against eager (outputs, parameter/input gradients, buffers) after one training step.

Then a memory-budget sweep of aotgrad's min-cut (1.0, 0.75, 0.5, 0.25, 0.0): saved bytes, where they
land between budget 0's and budget 1's ("achieved", all three the bytes saved at run time; the
request is the budget itself: B0 + budget x (B1 - B0) bytes), recomputed mm/conv, and how many
interior points (budgets 0.75, 0.5, 0.25, of models whose budgets 0 and 1 save different bytes)
land within 5% of the range from the request. For a point that does not, the nearest plans the partitioner found around the request are
printed, next to what an exhaustive search (every subset of the expensive nodes unlocked, with or
without one cheap value saved on top) finds. Checks (printed PASS/FAIL):

  1. aotgrad min-cut saved bytes <= upstream min-cut on every model, with no more recomputed mm/conv;
  2. the sweep is monotone: saved bytes never grow as the budget falls;
  3. the measured live peak (one forward + backward, op by op, as `aotgrad.explain`'s timeline; the
     backward graphs free each saved value at its last use, as compiled code does) of aotgrad's
     min-cut is at most upstream min-cut's at the same budget (`activation_memory_budget`) and eager's.

Every model is measured twice: on the aten graph as traced (no decompositions), and with Inductor's
decomposition table (`torch._inductor.decomposition.select_decomp_table()`, what
`torch.compile(backend="aotgrad")` traces with) handed to both aotgrad and upstream; the second set
of rows is labelled "<model>+inductor". The sweep also reports, per model, the largest distance
|achieved - budget| from a requested point.

Usage: python benchmarks/partition_bench.py [--only mlp,cnn_bn] [--decompositions none,inductor] [--json PATH]
From run_all.py: `import partition_bench; ok, lines, results = partition_bench.run(log=log)` prints both
tables and returns the two summary lines; `partition_bench.to_json(results)` gives the raw data.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from harness import clone_inputs, compare, error_text, state_of, sum_outputs, table  # noqa: E402
from models import BENCH_MODELS, BenchModel  # noqa: E402

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


@dataclass
class Measure:
    saved_bytes: int | None = None  # unique storages handed to the backward, measured at run time
    saved_count: int | None = None
    graph_bytes: int | None = None  # shape x itemsize over the forward graph's saved outputs
    recomputed: int | None = None  # non-free ops computed by both graphs
    recomputed_free: int | None = None  # views / getitems recomputed (no work)
    recomputed_mm: int | None = None  # matmul / conv / attention among `recomputed`
    partition_ms: float | None = None
    achieved: float | None = None  # budget sweep: (saved - bytes at 0) / (bytes at 1 - bytes at 0)
    on_target: bool | None = None  # budget sweep: within 5% of the range from the requested point
    nearest: tuple | None = None  # budget sweep: fractions of the explored plans nearest the request (below, above)
    dominated: bool | None = None  # budget sweep: another explored plan saves less for no more FLOPs
    exhaustive: str | None = None  # budget sweep, off-target points: what an exhaustive search finds
    live_peak: int | None = None  # measured live activation bytes, forward + backward (explain's timeline)
    mismatch: str | None = None
    error: str | None = None


@dataclass
class ModelResult:
    model: str
    sides: dict[str, Measure] = field(default_factory=dict)
    sweep: dict[float, Measure] = field(default_factory=dict)
    upstream_sweep: dict[float, Measure] = field(default_factory=dict)  # upstream min-cut at the same budgets


class _SavedCounter:
    def __init__(self):
        self.storages: dict[tuple[int, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes():
            self.storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _live_peak(mod: torch.nn.Module, call: Callable, inputs: tuple) -> int:
    """The live peak of one forward + backward (gradients of ones), measured op by op as
    `aotgrad.explain`'s timeline does; parameters, buffers and inputs are not counted, and gradients
    start as None."""
    from aotgrad.explain.memory import measure_timeline

    fresh = clone_inputs(inputs)
    mod.zero_grad(set_to_none=True)
    held = (fresh, list(mod.parameters()), list(mod.buffers()))
    return measure_timeline("", lambda: call(*fresh), held).peak


def _step(model: torch.nn.Module, call: Callable, inputs: tuple) -> tuple[object, dict]:
    out = call(*inputs)
    sum_outputs(out).backward()
    return out, state_of(model, inputs)


def _eager(bm: BenchModel) -> tuple[Measure, tuple]:
    mod, inputs = bm.factory()
    ref_mod, ref_inputs = copy.deepcopy(mod), clone_inputs(inputs)
    reference = _step(ref_mod, ref_mod, ref_inputs)
    counter = _SavedCounter()
    with counter.hooks():
        mod(*clone_inputs(inputs))
    m = Measure(saved_bytes=sum(counter.storages.values()), saved_count=len(counter.storages),
                recomputed=0, recomputed_free=0, recomputed_mm=0)
    m.live_peak = _live_peak(mod, mod, inputs)
    return m, reference


def _compiled(bm: BenchModel, aot_function: Callable, aot_module: Callable, partition_fn: Callable,
              reference, decompositions: dict | None = None) -> Measure:
    from aotgrad.partition.mincut import INFO_KEY
    from aotgrad.partition.ops import op_class, tensor_nbytes
    from aotgrad.partition.order import REMADE_FROM

    m = Measure()
    mod, inputs = bm.factory()
    inputs = clone_inputs(inputs)
    seen: dict = {"ms": 0.0}

    def part(joint, joint_inputs, *, num_fwd_outputs, **kw):
        start = time.perf_counter()
        fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        seen["ms"] += (time.perf_counter() - start) * 1e3
        seen["n"] = num_fwd_outputs
        seen["joint"] = joint
        return fw, bw

    def fw_compiler(gm, _example):
        seen["fw"] = gm
        return gm

    def bw_compiler(gm, example):
        from aotgrad.explain.freeing import freeing_nop

        seen["bw"] = gm
        return freeing_nop(gm, example)  # frees each saved value at its last use, as compiled code does

    try:
        if bm.is_function:
            compiled = aot_function(bm.function, fw_compiler, bw_compiler, partition_fn=part,
                                    decompositions=decompositions)
        else:
            compiled = aot_module(mod, fw_compiler, bw_compiler, partition_fn=part, decompositions=decompositions)
        out, state = _step(mod, compiled, inputs)
        m.mismatch = compare(reference[0], out) or compare(reference[1], state)
        counter = _SavedCounter()
        with counter.hooks():
            compiled(*inputs)
        m.live_peak = _live_peak(mod, compiled, inputs)
    except Exception as e:  # a benchmark reports, it does not stop
        m.error = error_text(e)
        return m
    m.saved_bytes, m.saved_count = sum(counter.storages.values()), len(counter.storages)
    fw, bw = seen["fw"], seen["bw"]
    m.graph_bytes = sum(tensor_nbytes(n.meta.get("val")) for n in list(fw.graph.output_node().args[0])[seen["n"]:])
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    # A value the backward remakes for its late users (partition/order.py) counts once per copy.
    again = [n for n in bw.graph.nodes if n.op == "call_function"
             and (n.name in fw_ops or n.meta.get(REMADE_FROM) in fw_ops)]
    classes = [op_class(n) for n in again]
    m.recomputed_free = sum(c in ("view", "free") for c in classes)
    m.recomputed = len(again) - m.recomputed_free
    m.recomputed_mm = sum(c in ("matmul", "conv", "attention") for c in classes)
    m.partition_ms = seen["ms"]
    info = fw.meta.get(INFO_KEY)
    if info is not None and info.memory_budget is not None:
        m.achieved = info.achieved_fraction
        m.on_target = info.on_target
        m.dominated = info.dominated
        span = info.bytes_at_budget_1 - info.bytes_at_budget_0
        if span > 0:
            m.nearest = tuple(None if b is None else (b - info.bytes_at_budget_0) / span for b in info.nearest_plans)
        if info.on_target is False:
            m.exhaustive = _exhaustive(seen["joint"], seen["n"], info.requested_bytes)
    return m


def _exhaustive(joint, num_fwd_outputs: int, requested: int, max_items: int = 6) -> str:
    """For a point the partitioner misses: search every plan of a family wider than its menu -
    each subset of the expensive nodes unlocked, with or without one cheap value saved on top - and
    say how near the request the best of them lands (skipped above `max_items` expensive nodes)."""
    from aotgrad.partition.graph import _candidate, _Joint

    j = _Joint(joint, num_fwd_outputs, None)
    items = list(j.items)
    if len(items) > max_items:
        return f"not searched ({len(items)} expensive nodes)"
    top, bottom = _candidate(j, ()), _candidate(j, items, tie="source")
    span = top.bytes - bottom.bytes
    cheap = [n for n in j.region if j.forceable(n)]
    found = set()
    for mask in range(1 << len(items)):
        unlocked = [n for i, n in enumerate(items) if mask >> i & 1]
        for extra in [None, *cheap]:
            found.add(_candidate(j, unlocked, forced=[extra] if extra else []).bytes)
    below = max((b for b in found if b <= requested), default=None)
    above = min((b for b in found if b > requested), default=None)
    frac = [("-" if b is None else f"{(b - bottom.bytes) / span:.2f}") for b in (below, above)]
    return f"{len(found)} distinct sizes over {1 << len(items)}x{len(cheap) + 1} plans: nearest {frac[0]} / {frac[1]}"


DECOMPOSITIONS = ("none", "inductor")


def _decomposition_table(name: str) -> dict | None:
    if name == "none":
        return None
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def measure_model(bm: BenchModel, budgets=BUDGETS, decompositions: str = "none") -> ModelResult:
    import functorch.compile as upstream

    import aotgrad

    decomps = _decomposition_table(decompositions)
    res = ModelResult(bm.name if decompositions == "none" else f"{bm.name}+{decompositions}")
    res.sides["eager"], reference = _eager(bm)
    sides = {
        "aotgrad default": (aotgrad, aotgrad.default_partition),
        "aotgrad min-cut": (aotgrad, aotgrad.min_cut_rematerialization_partition),
        "upstream default": (upstream, upstream.default_partition),
        "upstream min-cut": (upstream, upstream.min_cut_rematerialization_partition),
    }
    for name, (impl, pf) in sides.items():
        res.sides[name] = _compiled(bm, impl.aot_function, impl.aot_module, pf, reference, decomps)
    for b in budgets:
        res.sweep[b] = _compiled(bm, aotgrad.aot_function, aotgrad.aot_module, aotgrad.mincut_partitioner(b), reference,
                                 decomps)
        from torch._functorch import config as functorch_config

        with functorch_config.patch(activation_memory_budget=b):
            res.upstream_sweep[b] = _compiled(bm, upstream.aot_function, upstream.aot_module,
                                              upstream.min_cut_rematerialization_partition, reference, decomps)
    return res


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.1f}"


def _num(n) -> str:
    return "-" if n is None else str(n)


def report_sides(results: list[ModelResult]) -> tuple[bool, str]:
    print()
    print("== 1. Saved for the backward (KiB of unique storages, measured at run time) and recomputed ops ==")
    names = ["eager", "aotgrad default", "aotgrad min-cut", "upstream default", "upstream min-cut"]
    headers = ["model", "side", "saved KiB", "tensors", "graph KiB", "recomputed", "free", "mm/conv", "partition ms", "check"]
    rows = []
    ok = True
    worst: list[str] = []
    for r in results:
        for name in names:
            m = r.sides[name]
            note = m.error or (f"MISMATCH vs eager: {m.mismatch}" if m.mismatch else "ok")
            rows.append([r.model, name, _kib(m.saved_bytes), _num(m.saved_count), _kib(m.graph_bytes),
                         _num(m.recomputed), _num(m.recomputed_free), _num(m.recomputed_mm),
                         "-" if m.partition_ms is None else f"{m.partition_ms:.1f}", note])
        a, u = r.sides["aotgrad min-cut"], r.sides["upstream min-cut"]
        if a.error or a.mismatch or a.saved_bytes is None:
            ok = False
            worst.append(f"{r.model}: aotgrad min-cut failed")
        elif u.saved_bytes is not None:
            if a.saved_bytes > u.saved_bytes or a.recomputed_mm > u.recomputed_mm:
                ok = False
                worst.append(f"{r.model}: {a.saved_bytes} B / {a.recomputed_mm} mm vs upstream {u.saved_bytes} B / {u.recomputed_mm} mm")
    print(table(headers, rows, "llrrrrrrrl"))
    ratios = []
    for r in results:
        a, u = r.sides["aotgrad min-cut"], r.sides["upstream min-cut"]
        if a.saved_bytes is not None and u.saved_bytes:
            ratios.append(f"{r.model} {a.saved_bytes / u.saved_bytes:.2f}")
    line = (f"aotgrad min-cut saved bytes <= upstream min-cut on every model, no more recomputed mm/conv: "
            f"{'PASS' if ok else 'FAIL'} | aotgrad/upstream saved bytes: {', '.join(ratios)}")
    if worst:
        line += " | " + "; ".join(worst)
    return ok, line


def _runtime_fraction(r: ModelResult, b: float) -> float | None:
    """Where the bytes saved at run time at budget `b` land between budget 0's (0.0) and budget 1's
    (1.0), both measured at run time; None where those two save the same (nothing to place)."""
    s0, s1, s = r.sweep[0.0].saved_bytes, r.sweep[1.0].saved_bytes, r.sweep[b].saved_bytes
    if None in (s0, s1, s) or s1 == s0:
        return None
    return (s - s0) / (s1 - s0)


def report_sweep(results: list[ModelResult]) -> tuple[bool, str]:
    """The sweep table. Accuracy is judged on interior budgets only (0 and 1 are on target by
    construction) of models whose budgets 0 and 1 save different bytes, on the bytes saved at run
    time (`_SavedCounter`: unique storages handed to the backward), not the plan's own figure."""
    print()
    print("== 2. Memory budget sweep, aotgrad min-cut (saved KiB at run time; achieved = where those bytes land "
          "between budget 0's (0.00) and budget 1's (1.00), measured at run time) ==")
    budgets = list(results[0].sweep) if results else list(BUDGETS)
    interior = [b for b in budgets if 0.0 < b < 1.0]
    headers = ["model"] + [f"b={b:g}" for b in budgets] + ["monotone", "interior within 5%", "max |ach-b|"]
    rows = []
    ok = True
    off_target = []
    distances: list[str] = []
    total_within = total_points = 0
    for r in results:
        cells = [r.model]
        bytes_seq = []
        within = points = 0
        distance = None
        errors = any(r.sweep[b].error or r.sweep[b].mismatch for b in budgets)
        for b in budgets:
            m = r.sweep[b]
            if m.error or m.mismatch:
                cells.append("ERR")
                ok = False
                continue
            bytes_seq.append(m.saved_bytes)
            ach = None if errors else _runtime_fraction(r, b)
            if b in interior and ach is not None:
                points += 1
                within += abs(ach - b) <= 0.05
                distance = max(distance or 0.0, abs(ach - b))
            if m.on_target is False:
                off_target.append((r.model, b, m))
            text = "-" if errors else ("=" if ach is None else f"{ach:.2f}")
            star = "*" if m.dominated else ""
            cells.append(f"{_kib(m.saved_bytes)} ({text}, {m.recomputed_mm}mm){star}")
        mono = all(x >= y for x, y in zip(bytes_seq, bytes_seq[1:]))
        ok &= mono
        cells += ["yes" if mono else "NO", f"{within}/{points}" if points else "- (no span)",
                  "-" if distance is None else f"{distance:.2f}"]
        distances.append(f"{r.model} {'-' if distance is None else f'{distance:.2f}'}")
        total_within += within
        total_points += points
        rows.append(cells)
    print(table(headers, rows, "l" + "r" * (len(headers) - 1)))
    print("   cell = saved KiB at run time (achieved fraction at run time, recomputed mm/conv); '=' where budget 0 and")
    print("   budget 1 save the same (no span: not counted); '*' where another plan found saves fewer bytes for no more")
    print("   FLOPs (taken only to land nearer the request). 'interior within 5%': budgets strictly between 0 and 1.")
    if off_target:
        print("   Off by more than 5% by the plan's own count (the nearest plan found is taken; nearest = plans found")
        print("   just below / above the request; exhaustive = every subset of expensive nodes unlocked, with or")
        print("   without one cheap value saved on top):")
        for model, b, m in off_target:
            near = " / ".join("-" if f is None else f"{f:.2f}" for f in (m.nearest or (None, None)))
            print(f"     {model}@{b:g}: got {m.achieved:.2f}; nearest {near}; exhaustive: {m.exhaustive}")
    line = f"budget sweep monotone (saved bytes never grow as the budget falls): {'PASS' if ok else 'FAIL'}"
    line += (f" | interior budgets ({', '.join(f'{b:g}' for b in interior)}) within 5% of the request, "
             f"on run-time saved bytes: {total_within}/{total_points} points (models where budgets 0 and 1 differ)")
    line += " | largest |achieved - budget|: " + ", ".join(distances)
    if off_target:
        line += " | off by the plan's count: " + ", ".join(f"{mdl}@{b:g}->{m.achieved:.2f}" for mdl, b, m in off_target)
    return ok, line


def report_live_peak(results: list[ModelResult]) -> tuple[bool, str]:
    print()
    print("== 3. Live peak (KiB alive at the highest point of one forward + backward, measured op by op as "
          "aotgrad.explain's timeline does), min-cut at each budget: aotgrad / upstream, and eager ==")
    budgets = list(results[0].sweep) if results else list(BUDGETS)
    headers = ["model", "eager"] + [f"b={b:g} aot/up" for b in budgets] + ["aotgrad <= both"]
    rows, above_eager, above_upstream, failed = [], [], [], []
    for r in results:
        eager = r.sides["eager"].live_peak
        cells = [r.model, _kib(eager)]
        good = True
        for b in budgets:
            a, u = r.sweep[b], r.upstream_sweep.get(b, Measure())
            cells.append(f"{_kib(a.live_peak)} / {_kib(u.live_peak)}")
            if a.live_peak is None:
                good = False
                failed.append(f"{r.model}@{b:g}")
                continue
            if eager is not None and a.live_peak > eager:
                good = False
                above_eager.append(f"{r.model}@{b:g}")
            if u.live_peak is not None and a.live_peak > u.live_peak:
                good = False
                above_upstream.append(f"{r.model}@{b:g}")
        cells.append("yes" if good else "NO")
        rows.append(cells)
    print(table(headers, rows, "l" + "r" * (len(headers) - 1)))
    print("   Rows '+inductor' run Inductor's decompositions op by op, unfused (nop compilers), on both compiled sides;")
    print("   eager runs its own kernels: there the compiled sides hold decompositions' intermediates eager never makes.")
    ok = not (above_eager or above_upstream or failed)
    line = f"live peak: aotgrad min-cut <= upstream min-cut and <= eager at every budget: {'PASS' if ok else 'FAIL'}"
    for what, where in (("above eager at", above_eager), ("above upstream at", above_upstream),
                        ("not measured at", failed)):
        if where:
            line += f" | {what} " + ", ".join(where)
    return ok, line


def run(only: list[str] | None = None, log: Callable[[str], None] | None = None,
        decompositions: tuple[str, ...] = DECOMPOSITIONS) -> tuple[bool, list[str], list[ModelResult]]:
    """Measure, print both tables; return (all checks pass, summary lines, raw results)."""
    warnings.filterwarnings("ignore")
    results = []
    for decomps in decompositions:
        for bm in BENCH_MODELS:
            if only and bm.name not in only:
                continue
            if log:
                log(f"partition_bench: {bm.name} (decompositions: {decomps})")
            results.append(measure_model(bm, decompositions=decomps))
    ok1, line1 = report_sides(results)
    ok2, line2 = report_sweep(results)
    ok3, line3 = report_live_peak(results)
    return ok1 and ok2 and ok3, [line1, line2, line3], results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None)
    p.add_argument("--decompositions", type=lambda s: tuple(x for x in s.split(",") if x), default=DECOMPOSITIONS,
                   help="none (aten graph as traced), inductor (Inductor's table), or both (default)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    print(f"partitioners: aotgrad vs upstream functorch.compile | torch {torch.__version__}")
    _ok, lines, results = run(args.only, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                              decompositions=args.decompositions)
    print()
    print("== Summary ==")
    for i, line in enumerate(lines, 1):
        print(f"{i}. {line}")
    print(f"(total {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(to_json(results), fh, indent=1, default=str)
    return 0


def to_json(results: list[ModelResult]) -> list[dict]:
    """Raw results as plain data (for --json, or run_all.py's raw dump)."""
    return [{"model": r.model, "sides": {k: asdict(v) for k, v in r.sides.items()},
             "sweep": {str(b): asdict(v) for b, v in r.sweep.items()},
             "upstream_sweep": {str(b): asdict(v) for b, v in r.upstream_sweep.items()}} for r in results]


if __name__ == "__main__":
    sys.exit(main())
