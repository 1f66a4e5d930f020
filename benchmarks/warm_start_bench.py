"""Warm start: time to the first finished training step in a fresh process whose on-disk caches an
earlier process filled, aotgrad+Inductor vs upstream Inductor in the same run.

What a restarted job, a re-run notebook or every rank of a multi-process job pays. Per row and
backend: a private cache folder (`TORCHINDUCTOR_CACHE_DIR`; aotgrad's cache is its `aotgrad/`
subfolder, upstream's AOTAutograd and FX-graph caches are in it too); one fresh process compiles
with it empty (the cold number), then `--repeats` fresh processes run with it filled (warm). Each
child times from after its imports and model construction to the end of its first step (the
same work for both backends), and from the start of the process (imports included: torch, the
model's code, and aotgrad only in the aotgrad child, through `torch.compile`'s backend lookup), and
reports aotgrad's cache counters and the loss, which must equal the cold run's. Backends alternate
which goes first.

Rows: the demo's GPT-2 (its compiled loss forward + backward, then its compiled AdamW step, as the
demo's first step does), and the training step (forward + backward) of each model of models.py.

    python benchmarks/warm_start_bench.py [--repeats 3] [--rows gpt2,mlp,transformer,cnn_bn,pointwise200]

Target: warm aotgrad <= 0.8x upstream's warm time (medians), cold numbers beside it.

Precompile (`--precompile-rows`, default nanogpt: the demo's GPT-2 in plain torch, see `_make`; `--rows ''` runs only these): the model's loss forward is
`aot_compile`d and saved (`save_compiled_function`) by one fresh process per backend, then loaded
(`torch.compiler.load_compiled_function`) by `--repeats` fresh processes that run the first step. The
AdamW step is precompiled too, through `aotgrad.OptimizerStep` (the step's update as a plain function:
`opt.step` itself cannot be `aot_compile`d, its `_use_grad` breaks the graph), on both backends' sides;
`--adamw compile` compiles it as usual instead (`torch.compile(opt.step)`, Dynamo traces it in each
process, with the saving process's caches). Measured in the same run: (1) aotgrad's first step via
precompile against upstream's usual warm start (Inductor, its caches filled by a cold process),
from process start, target <= 0.8x; (2) aotgrad's precompile load against upstream Inductor's
(the `load_compiled_function` call, the same call on both sides: Dynamo's import, unpickling, the
backend's artifacts, Inductor's compiled modules for forward and backward), target <= 1.0x; beside
it, its CPU seconds and the load plus the first forward + backward. aotgrad's bytecode is written
first (`compile_bytecode`), as torch's is by its install.

    python benchmarks/warm_start_bench.py --rows '' --precompile-rows nanogpt --repeats 2
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before any import: the import-included clock starts here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

BACKENDS = ("aotgrad", "inductor")
ROWS = ("gpt2", "mlp", "transformer", "cnn_bn", "pointwise200")
TARGET = 0.8


def _make(row: str):
    """(model, inputs) of a row. `nanogpt`: the demo's GPT-2 shape (4 layers, width 256, 4 heads,
    256 tokens, 128 positions) in plain torch (examples/nanogpt.py), with the same loss and batch as
    the `gpt2` row: Dynamo can `aot_compile` it, while transformers' GPT-2 leaves an ID_MATCH guard
    that torch 2.13 cannot serialize (with either backend)."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import backend_bench as bb

    if row != "nanogpt":
        return bb.all_models()[row]()
    import nanogpt
    import torch

    torch.manual_seed(0)
    model = bb.NanoGPTLoss(nanogpt.make_nanogpt())
    g = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))


def child(backend: str, row: str) -> dict:
    """One first training step in this (fresh) process; seconds from after setup to its end."""
    import torch
    from harness import sum_outputs

    pristine, inputs = _make(row)
    opt = None
    if row in ("gpt2", "nanogpt"):
        opt = torch.optim.AdamW(pristine.parameters(), lr=torch.tensor(2e-3), weight_decay=0.1, betas=(0.9, 0.95))
    t0 = time.perf_counter()
    loss = sum_outputs(torch.compile(pristine, backend=backend)(*inputs))
    loss.backward()
    if opt is not None:
        torch.compile(opt.step, backend=backend)()
    end = time.perf_counter()
    from torch._dynamo.utils import counters

    check = float(loss.detach()) + (float(sum(p.detach().sum() for p in pristine.parameters())) if opt else 0.0)
    stats = {}
    if backend.startswith("aotgrad"):  # the inductor child never imports aotgrad
        import aotgrad

        stats = aotgrad.cache_stats()
    return {"seconds": end - t0, "process": end - PROCESS_START, "check": check, "aotgrad_cache": stats,
            "fx": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k}}


def precompile_child(mode: str, backend: str, row: str, folder: str, adamw: str = "precompile") -> dict:
    """`save`: aot_compile the model's forward, save it, run the first step. `load`: load it
    (timed alone too) and run the first step. The AdamW step: `adamw` (see `_adamw_step`)."""
    import torch
    from harness import sum_outputs

    pristine, inputs = _make(row)
    opt = None
    if row in ("gpt2", "nanogpt"):
        opt = torch.optim.AdamW(pristine.parameters(), lr=torch.tensor(2e-3), weight_decay=0.1, betas=(0.9, 0.95))
    path = os.path.join(folder, f"{row}.pt2c")
    t0 = time.perf_counter()
    load = load_cpu = first = None
    if mode == "save":
        step = torch.compile(pristine, fullgraph=True, backend=backend).forward.aot_compile((tuple(inputs), {}))
        step.save_compiled_function(path, external_data={"model": pristine})
    else:
        cpu0 = _cpu_seconds()
        with open(path, "rb") as f:
            step = torch.compiler.load_compiled_function(f, external_data={"model": pristine})
        load = time.perf_counter() - t0
        load_cpu = _cpu_seconds() - cpu0
    # Dynamo traces the module's `_wrapped_call_impl(self, *args)` or, for some modules, a wrapper taking
    # `*args`: the saved signature says whether the module is passed.
    if "self" in step._artifacts.signature.parameters:
        inputs = (pristine, *inputs)
    loss = sum_outputs(step(*inputs))
    loss.backward()
    if mode != "save":
        first = time.perf_counter() - t0
    if opt is not None:
        _adamw_step(opt, mode, backend, adamw, path + ".adamw")
    end = time.perf_counter()
    check = float(loss.detach()) + (float(sum(p.detach().sum() for p in pristine.parameters())) if opt else 0.0)
    return {"seconds": end - t0, "process": end - PROCESS_START, "load": load, "load_cpu": load_cpu, "first": first,
            "check": check}


def _adamw_step(opt, mode: str, backend: str, adamw: str, path: str) -> None:
    """`compile`: `torch.compile(opt.step)` (Dynamo traces it in every process). `precompile`: its
    update `aot_compile`d and saved (`save`) or loaded (`load`) through `aotgrad.OptimizerStep`."""
    import torch

    if adamw == "compile":
        torch.compile(opt.step, backend=backend)()
        return
    from aotgrad import OptimizerStep

    update = OptimizerStep(opt)
    if mode == "save":
        step = torch.compile(update.function, fullgraph=True, backend=backend).aot_compile((update.arguments(), {}))
        step.save_compiled_function(path)
    else:
        with open(path, "rb") as f:
            step = torch.compiler.load_compiled_function(f)
    step(*update.arguments())


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (Inductor's ISA probe runs
    compilers and Python in subprocesses): the load's work, less exposed to other processes on
    the machine than its wall-clock time."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_bytecode() -> None:
    """Write aotgrad's bytecode (`__pycache__`), as installing a package does (torch's is there):
    with PYTHONDONTWRITEBYTECODE set, or a read-only checkout, each child would otherwise compile
    aotgrad's ~90 modules from source, a cost upstream's side never pays."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("aotgrad")
    if spec is None or not spec.submodule_search_locations:
        return
    for folder in spec.submodule_search_locations:
        if not compileall.compile_dir(folder, quiet=1):
            print(f"note: could not write aotgrad's bytecode under {folder}: its children compile it from source")


def run_child(backend: str, row: str, cache_dir: str, precompile: tuple | None = None) -> dict | None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "AOTGRAD_CACHE": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, row]
    if precompile is not None:  # (mode, folder of the saved file, how the AdamW step is compiled)
        cmd += ["--precompile", *precompile]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    print(f"    {backend} {row}: failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-3:]}")
    return None


def measure(row: str, repeats: int) -> dict:
    folders = {b: tempfile.mkdtemp(prefix=f"warm-{b}-") for b in BACKENDS}
    out: dict = {b: {"cold": None, "warm": [], "process": [], "checks": [], "notes": ""} for b in BACKENDS}
    try:
        for rep in range(repeats + 1):
            for b in (BACKENDS if rep % 2 == 0 else BACKENDS[::-1]):
                got = run_child(b, row, folders[b])
                if got is None:
                    continue
                kind = "cold" if rep == 0 else "warm"
                print(f"  {row}: {b} {kind} {got['seconds']:.2f} s (process {got['process']:.2f} s)  "
                      f"aotgrad cache {got['aotgrad_cache']} "
                      f"fx {got['fx']} aot {got['aot']}", flush=True)
                if rep == 0:
                    out[b]["cold"] = got["seconds"]
                else:
                    out[b]["warm"].append(got["seconds"])
                    out[b]["process"].append(got["process"])
                out[b]["checks"].append(got["check"])
                if b == "aotgrad" and rep > 0 and got["aotgrad_cache"].get("misses"):
                    out[b]["notes"] = "aotgrad cache missed on a warm run"
                elif rep > 0 and got["fx"].get("fxgraph_cache_miss"):
                    out[b]["notes"] = f"Inductor's FX-graph cache missed on a warm {b} run"
    finally:
        for f in folders.values():
            shutil.rmtree(f, ignore_errors=True)
    return out


def measure_precompile(row: str, repeats: int, adamw: str) -> dict:
    """Per backend a cache folder: a `save` process, then `repeats` `load` processes; and upstream's
    usual warm start (a cold Inductor process, then `repeats` warm ones) in its own folder."""
    folders = {b: tempfile.mkdtemp(prefix=f"precompile-{b}-") for b in (*BACKENDS, "usual")}
    out: dict = {k: {"save": None, "runs": [], "checks": []} for k in (*BACKENDS, "usual")}
    try:
        for b in BACKENDS:
            got = run_child(b, row, folders[b], ("save", folders[b], adamw))
            if got is not None:
                out[b]["save"] = got["seconds"]
                out[b]["checks"].append(got["check"])
                print(f"  {row}: {b} aot_compile + save + first step {got['seconds']:.2f} s", flush=True)
        got = run_child("inductor", row, folders["usual"])
        if got is not None:
            out["usual"]["save"] = got["seconds"]
            out["usual"]["checks"].append(got["check"])
            print(f"  {row}: inductor usual cold {got['seconds']:.2f} s", flush=True)
        for rep in range(repeats):
            order = (*BACKENDS, "usual") if rep % 2 == 0 else ("usual", *BACKENDS[::-1])
            for k in order:
                if k == "usual":
                    got = run_child("inductor", row, folders["usual"])
                else:
                    got = run_child(k, row, folders[k], ("load", folders[k], adamw)) if out[k]["save"] is not None else None
                if got is None:
                    continue
                out[k]["runs"].append(got)
                out[k]["checks"].append(got["check"])
                load = (f", load {got['load']:.2f} s, CPU {got['load_cpu']:.2f} s, load + first forward/backward "
                        f"{got['first']:.2f} s") if got.get("load") is not None else ""
                print(f"  {row}: {k} {'usual warm start' if k == 'usual' else 'precompile load'} "
                      f"{got['seconds']:.2f} s (process {got['process']:.2f} s{load})", flush=True)
    finally:
        for f in folders.values():
            shutil.rmtree(f, ignore_errors=True)
    return out


def precompile_table(rows: list[str], repeats: int, adamw: str) -> bool:
    from harness import fmt_ratio, table

    table_rows, verdict = [], True
    for row in rows:
        res = measure_precompile(row, repeats, adamw)
        a, i, u = res["aotgrad"], res["inductor"], res["usual"]
        if not a["runs"] or not i["runs"] or not u["runs"]:
            table_rows.append([row] + ["-"] * 12 + ["failed"])
            verdict = False
            continue

        def med(side, what):
            return statistics.median(r[what] for r in side["runs"])

        pa, pu, pi = med(a, "process"), med(u, "process"), med(i, "process")
        la, li = med(a, "load"), med(i, "load")
        ca, ci = med(a, "load_cpu"), med(i, "load_cpu")
        fa, fi = med(a, "first"), med(i, "first")
        # per repeat, the two loads ran one after the other: the ratio of each pair, then their median
        pairs = statistics.median(x["load"] / y["load"] for x, y in zip(a["runs"], i["runs"]))
        same = all(abs(c - a["checks"][0]) <= 1e-6 * max(1.0, abs(c)) for c in a["checks"])
        # the precompiled step against the usual one (loss + parameters after AdamW): float rounding apart
        delta = abs(a["checks"][-1] - u["checks"][-1])
        verdict &= pa / pu <= TARGET and la / li <= 1.0 and same
        table_rows.append([row, f"{pa:.1f}", f"{pu:.1f}", fmt_ratio(pa / pu), f"{pi:.1f}", f"{la:.2f}", f"{li:.2f}",
                           fmt_ratio(la / li), fmt_ratio(pairs), fmt_ratio(ca / ci), fmt_ratio(fa / fi),
                           f"{a['save']:.1f}", f"{i['save']:.1f}",
                           (f"ok (vs usual {delta:.1e})" if same else "aotgrad loaded result differs from its cold run")])
    print()
    print(f"== precompile: first step in a fresh process that loads the aot_compiled model (median of {repeats}, s, "
          "from process start) vs upstream's usual warm start; load = load_compiled_function alone (wall clock; "
          "'pairs' = median of the per-repeat ratios; 'CPU' = its CPU seconds, subprocesses included); "
          "'+ call' = the load and the first forward + backward; "
          f"AdamW step: {'precompiled (OptimizerStep)' if adamw == 'precompile' else 'torch.compile(opt.step)'} ==")
    print(table(["row", "aotgrad precompile", "inductor usual warm", "ratio", "inductor precompile", "aotgrad load",
                 "inductor load", "load ratio", "pairs", "CPU", "+ call", "aotgrad save", "inductor save", "check"],
                table_rows, "lrrrrrrrrrrrrl"))
    print(f"targets: first step <= {TARGET}x upstream's usual warm start, load <= 1.0x Inductor's: "
          f"{'PASS' if verdict else 'FAIL'}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="warm fresh-process runs per backend and row (default 3)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--precompile-rows", default="nanogpt",
                   help="rows measured through aot_compile / load_compiled_function ('' for none; default nanogpt)")
    p.add_argument("--child", nargs=2, metavar=("BACKEND", "ROW"), help=argparse.SUPPRESS)
    p.add_argument("--adamw", choices=("precompile", "compile"), default="precompile",
                   help="precompile rows: the AdamW step precompiled through aotgrad.OptimizerStep (default), or "
                        "torch.compile(opt.step) as usual")
    p.add_argument("--precompile", nargs=3, metavar=("MODE", "FOLDER", "ADAMW"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        result = precompile_child(args.precompile[0], *args.child, *args.precompile[1:]) if args.precompile else \
            child(*args.child)
        print(json.dumps(result))
        return 0
    rows = [r for r in args.rows.split(",") if r]
    precompile_rows = [r for r in args.precompile_rows.split(",") if r]
    try:
        import transformers  # noqa: F401
    except ImportError:
        rows = [r for r in rows if r != "gpt2"]
        precompile_rows = [r for r in precompile_rows if r != "gpt2"]
    compile_bytecode()
    if precompile_rows:
        precompile_table(precompile_rows, args.repeats, args.adamw)
    if not rows:
        return 0
    from harness import fmt_ratio, table

    table_rows, verdict = [], True
    for row in rows:
        res = measure(row, args.repeats)
        a, u = res["aotgrad"], res["inductor"]
        if not a["warm"] or not u["warm"] or a["cold"] is None or u["cold"] is None:
            table_rows.append([row, "-", "-", "-", "-", "-", "-", "-", "-", "-", "failed"])
            verdict = False
            continue
        wa, wu = statistics.median(a["warm"]), statistics.median(u["warm"])
        pa, pu = statistics.median(a["process"]), statistics.median(u["process"])
        same = all(abs(c - a["checks"][0]) <= 1e-6 * max(1.0, abs(c)) for c in a["checks"])
        notes = "; ".join(n for n in (a["notes"], u["notes"], "" if same else "aotgrad warm result differs from cold")
                          if n)
        verdict &= pa / pu <= TARGET and same  # the number: a fresh process, imports included
        table_rows.append([row, f"{pa:.1f}", f"{pu:.1f}", fmt_ratio(pa / pu), f"{wa:.1f}", f"{wu:.1f}",
                           fmt_ratio(wa / wu), f"{a['cold']:.1f}", f"{u['cold']:.1f}", fmt_ratio(a["cold"] / u["cold"]),
                           notes or "ok"])
    print()
    print(f"== warm start: first training step in a fresh process, caches filled (median of {args.repeats}, s); "
          "'process' = from process start, imports included; 'step' = after imports and model construction ==")
    print(table(["row", "aotgrad process", "inductor process", "ratio", "aotgrad step", "inductor step", "ratio",
                 "aotgrad cold", "inductor cold", "cold ratio", "check"], table_rows, "lrrrrrrrrrl"))
    print(f"target warm ratio aotgrad/upstream (process, imports included) <= {TARGET}: {'PASS' if verdict else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
