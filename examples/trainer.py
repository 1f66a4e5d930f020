"""Shared training harness for the examples: train one model three ways and compare.

The same steps (same seed, same initial weights, same batches) run:

- ``eager``: plain PyTorch;
- ``aotgrad``: ``torch.compile(..., backend="aotgrad")`` (aotgrad captures and partitions, Inductor
  compiles the forward, backward and optimizer graphs);
- ``inductor``: upstream ``torch.compile(..., backend="inductor")``.

Each compiled variant compiles the loss function (model + cross-entropy) and AdamW's ``step()``
(``--no-compile-optimizer`` to keep the optimizer eager). The harness prints a progress bar (step,
loss, step time), checks that aotgrad's losses track eager's, and ends with a table: compile time
(first step minus the median step: Dynamo + AOT + Inductor for the forward, backward and optimizer
graphs), median step time, activation bytes saved for the backward, final loss.

Losses "track" when aotgrad's loss is within --tolerance (1e-3) of eager's at each of the first
--early-steps (50) steps and its mean over the last 10% of steps is within --final-tolerance (5%) of
eager's: compiled kernels reassociate float32 sums, and training amplifies those last-bit differences
over hundreds of steps (upstream Inductor drifts the same way; its numbers are printed for scale).
Each variant runs in a fresh Python process (`--same-process` to run them in this one): a compile
in a process that has already compiled another model measured up to 25% slower or faster than the
same compile in a fresh one, depending on which variant went first. The processes take turns, one
step each (the others wait on a pipe, idle), another variant first each step, so a machine that
speeds up or slows down over the run, or a step's after-effects, hit every variant alike (run one
after the other, variants minutes apart measured step-time ratios 8% off the interleaved ones; with
a fixed turn order, the variant stepping right after eager measured up to 15% slower). Compile times
are measured after an untimed warm-up compile (one-time process costs); each compiled variant starts
from an empty Inductor cache (a fresh cache directory, caches off), so no variant reuses kernels
another compiled; --warm-caches keeps them.

Saved activation bytes are counted the same way for all three: `saved_tensors_hooks` during one
forward, counting each distinct storage once and leaving out parameters and the input batch (eager:
every tensor autograd nodes save; compiled: what the compiled forward hands its backward).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tiny_text.txt")
VARIANTS = ("eager", "aotgrad", "inductor")


# ----------------------------------------------------------------------------------------------
# Data: byte-level tokens of a small public-domain text


def load_tokens(path: str = DATA) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read()
    return torch.tensor(list(data), dtype=torch.long)


def make_batches(tokens: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list:
    """`steps` (x, y) pairs of random windows, the same for every variant."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[s : s + seq] for s in starts])
        y = torch.stack([tokens[s + 1 : s + seq + 1] for s in starts])
        out.append((x, y))
    return out


# ----------------------------------------------------------------------------------------------
# Progress bar (no dependency)


class ProgressBar:
    """One line, redrawn in place on a terminal; every ~10% on a log file."""

    def __init__(self, total: int, label: str, width: int = 24, stream=sys.stdout):
        self.total, self.label, self.width, self.stream = total, label, width, stream
        self.tty = stream.isatty()
        self.last_pct = -1

    def update(self, step: int, detail: str) -> None:
        done = step + 1
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label:>9} [{bar}] step {done:>4}/{self.total}  {detail}"
        if self.tty:
            self.stream.write("\r" + line)
            if done == self.total:
                self.stream.write("\n")
        else:
            pct = (10 * done) // self.total
            if pct != self.last_pct or done == self.total:
                self.last_pct = pct
                self.stream.write(line + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------------------------
# One training run


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    saved_bytes: int | None = None
    error: str | None = None

    @property
    def median_step(self) -> float:
        xs = self.step_times[3:] if len(self.step_times) > 6 else self.step_times[1:] or self.step_times
        return statistics.median(xs)

    @property
    def compile_time(self) -> float:
        return max(self.step_times[0] - self.median_step, 0.0) if self.step_times else float("nan")


class LossModule(nn.Module):
    """model(x) -> logits; the loss is part of the compiled graph."""

    def __init__(self, model: nn.Module, logits_of: Callable):
        super().__init__()
        self.model = model
        self.logits_of = logits_of

    def forward(self, x, y):
        logits = self.logits_of(self.model, x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _backend_for(name: str):
    return {"aotgrad": "aotgrad", "inductor": "inductor"}[name]


def count_saved_bytes(loss_fn: Callable, x, y, exclude: list[torch.Tensor]) -> int:
    """Bytes of distinct storages saved for the backward during one forward (parameters, sharded
    or not, and `exclude` left out; a DTensor counts its local shard)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.device.type != "meta":
            t = t.to_local() if hasattr(t, "to_local") else t
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(x, y)
    del loss
    return sum(seen.values())


def step_detail(loss: float, step_s: float) -> str:
    return f"loss {loss:7.4f}  step {step_s * 1e3:8.1f} ms"


class Turns:
    """A variant's side of the rotation (see `run_in_turns`): say "ready" once set up; before each
    step, and before the work after the last one, wait for the parent's go byte; after each step,
    send back the loss and the step time."""

    def __init__(self, fds: str):
        go, done = (int(x) for x in fds.split(","))
        self.go = os.fdopen(go, "rb", buffering=0)
        self.done = os.fdopen(done, "w", buffering=1)
        self.ready = False

    def wait(self) -> None:
        if not self.ready:
            self.done.write("ready\n")
            self.ready = True
        if not self.go.read(1):
            raise SystemExit("trainer: the parent process went away")

    def report(self, loss: float, step_s: float) -> None:
        self.done.write(f"{loss!r} {step_s!r}\n")


def train(
    name: str,
    make_model: Callable[[], nn.Module],
    logits_of: Callable,
    batches: list,
    *,
    lr: float,
    compile_optimizer: bool,
    warmup: int = 0,
    turns: Turns | None = None,
) -> RunResult:
    torch.manual_seed(0)
    model = make_model()
    loss_mod = LossModule(model, logits_of)
    # The learning rate is a tensor updated in place (linear warm-up), so the compiled step()
    # reads it as an input instead of recompiling for every new value.
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr), weight_decay=0.1, betas=(0.9, 0.95))
    lr_t = opt.param_groups[0]["lr"]
    if name == "eager":
        loss_fn = loss_mod
        opt_step = opt.step
    else:
        backend = _backend_for(name)
        loss_fn = torch.compile(loss_mod, backend=backend)
        opt_step = torch.compile(opt.step, backend=backend) if compile_optimizer else opt.step

    result = RunResult(name)
    bar = ProgressBar(len(batches), name) if turns is None else None  # in turns, the parent draws it
    for i, (x, y) in enumerate(batches):
        if turns is not None:
            turns.wait()
        t0 = time.perf_counter()
        lr_t.fill_(lr * min(1.0, (i + 1) / warmup) if warmup > 0 else lr)
        loss = loss_fn(x, y)
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        value = loss.item()
        result.losses.append(value)
        result.step_times.append(dt)
        if turns is not None:
            turns.report(value, dt)
        else:
            bar.update(i, step_detail(value, dt))
    if turns is not None:  # the counting below runs alone too
        turns.wait()
    x, y = batches[0]
    params = list(model.parameters()) + list(model.buffers())
    result.saved_bytes = count_saved_bytes(loss_fn, x, y, params + [x, y])
    return result


# ----------------------------------------------------------------------------------------------
# Report


def fmt_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))


def tracking(a: list[float], ref: list[float], early_steps: int) -> tuple[float, float]:
    """(max |a - ref| over the first `early_steps` steps, relative gap of the last-10%-of-steps means)."""
    early = max_abs_diff(a[:early_steps], ref[:early_steps])
    k = max(1, len(ref) // 10)
    ma, mr = statistics.fmean(a[-k:]), statistics.fmean(ref[-k:])
    return early, abs(ma - mr) / abs(mr)


def report(results: dict[str, RunResult], tolerance: float, final_tolerance: float, early_steps: int) -> bool:
    eager = results.get("eager")
    headers = ["variant", "compile s", "median step ms", "vs eager", "saved act MB", "final loss",
               f"max |loss - eager| (first {early_steps})", "last-10% mean vs eager"]
    rows = []
    for name, r in results.items():
        if r.error:
            rows.append([name, "-", "-", "-", "-", "-", r.error[:60], "-"])
            continue
        ratio = f"{r.median_step / eager.median_step:.2f}x" if eager and not eager.error else "-"
        early, final = (0.0, 0.0)
        if eager and not eager.error and name != "eager":
            early, final = tracking(r.losses, eager.losses, early_steps)
        rows.append([
            name,
            "-" if name == "eager" else f"{r.compile_time:.1f}",
            f"{r.median_step * 1e3:.1f}",
            ratio,
            f"{r.saved_bytes / 2**20:.2f}" if r.saved_bytes is not None else "-",
            f"{r.losses[-1]:.4f}",
            f"{early:.2e}",
            f"{100 * final:.2f}%",
        ])
    print()
    print(fmt_table(headers, rows))
    ok = True
    a = results.get("aotgrad")
    if eager and a and not eager.error and not a.error:
        early, final = tracking(a.losses, eager.losses, early_steps)
        ok = early <= tolerance and final <= final_tolerance and all(math.isfinite(v) for v in a.losses)
        print(f"\naotgrad losses track eager: max |loss_aotgrad - loss_eager| over the first {min(early_steps, len(a.losses))} "
              f"steps = {early:.2e} (tolerance {tolerance:g}); mean loss over the last 10% of steps within "
              f"{100 * final:.2f}% of eager's (tolerance {100 * final_tolerance:g}%): {'PASS' if ok else 'FAIL'}")
        print("   (float32 sums are reassociated by compiled kernels, so runs drift apart slowly and training "
              "amplifies it: hence a tight bound early and a loose one on the final mean)")
        i = results.get("inductor")
        if i and not i.error:
            ie, if_ = tracking(i.losses, eager.losses, early_steps)
            print(f"   upstream inductor vs eager, for scale: {ie:.2e} early, {100 * if_:.2f}% final; "
                  f"aotgrad/inductor: median step time {a.median_step / i.median_step:.2f}x, compile time "
                  f"{a.compile_time / max(i.compile_time, 1e-9):.2f}x")
    elif a and a.error:
        ok = False
    return ok


def plot(results: dict[str, RunResult], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install 'aotgrad[plot]'); not writing {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"eager": "-", "aotgrad": "--", "inductor": ":"}
    for name, r in results.items():
        if r.losses:
            ax.plot(range(1, len(r.losses) + 1), r.losses, styles.get(name, "-"), label=name, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# CLI shared by the examples


def parser(description: str, *, steps: int, batch: int, seq: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help=f"training steps per variant (default {steps})")
    p.add_argument("--batch-size", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=seq)
    p.add_argument("--lr", type=float, default=lr, help=f"AdamW learning rate after warm-up (default {lr})")
    p.add_argument("--warmup", type=int, default=25, help="linear learning-rate warm-up steps (default 25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of eager,aotgrad,inductor (default: all three)")
    p.add_argument("--no-compile-optimizer", dest="compile_optimizer", action="store_false",
                   help="keep AdamW.step() eager in the compiled variants")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="max |loss_aotgrad - loss_eager| over the first --early-steps steps (default 1e-3)")
    p.add_argument("--early-steps", type=int, default=50)
    p.add_argument("--final-tolerance", type=float, default=0.05,
                   help="relative gap allowed between the mean losses of the last 10%% of steps (default 0.05)")
    p.add_argument("--warm-caches", dest="cold", action="store_false",
                   help="keep Inductor's caches between variants (default: each compiled variant starts "
                        "from an empty cache, so neither reuses kernels the other compiled)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw the loss curves (needs matplotlib)")
    p.add_argument("--same-process", dest="isolate", action="store_false",
                   help="run all variants in this process, one after the other (default: each in a fresh "
                        "one, so compile times do not depend on which variant went first, taking turns "
                        "step by step)")
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # set for a variant's own process
    p.add_argument("--turn-fds", default=None, help=argparse.SUPPRESS)  # its pipes to the parent, "go,done"
    return p


def warm_up(backends: list[str]) -> None:
    """Compile a tiny function with each backend first (untimed): one-time process costs (imports,
    Inductor's C++ toolchain and worker pool start-up) must not count against whichever variant
    happens to compile first."""

    def tiny(x, w):
        return F.gelu(x @ w).sum()

    for b in backends:
        torch._dynamo.reset()
        w = torch.randn(4, 4, requires_grad=True)
        torch.compile(tiny, backend=_backend_for(b))(torch.randn(2, 4), w).backward()
    torch._dynamo.reset()
    if backends:
        wait_for_compile_workers()


def wait_for_compile_workers() -> None:
    """Inductor starts its pool of compile worker processes in the background on the first compile;
    each imports torch, seconds of CPU. Wait for them: a compile timed while they start (this
    process's or, with the variants taking turns, another's) pays for it."""
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wait_pool_ready()


def _child_args(args) -> list[str]:
    out = [f"--steps={args.steps}", f"--batch-size={args.batch_size}", f"--seq-len={args.seq_len}",
           f"--lr={args.lr}", f"--warmup={args.warmup}", f"--seed={args.seed}"]
    out += [] if args.compile_optimizer else ["--no-compile-optimizer"]
    return out + ([] if args.cold else ["--warm-caches"])


@dataclass
class _Child:
    """The parent's handle on one variant's process."""

    variant: str
    proc: subprocess.Popen
    go: Any  # write one byte: take a step
    done: Any  # one line back per step: "loss step_s"
    result_path: str
    last: str = "waiting"


def _start_child(variant: str, args, tmp: str) -> _Child:
    """Run this script again for one variant (same arguments, so the same seed, weights and batches),
    stepping only when told to."""
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    path = os.path.join(tmp, f"{variant}.json")
    cmd = [sys.executable, sys.modules["__main__"].__file__, *_child_args(args), "--variants", variant,
           "--result-json", path, "--turn-fds", f"{go_r},{done_w}"]
    proc = subprocess.Popen(cmd, pass_fds=(go_r, done_w), stdout=sys.stdout, stderr=sys.stderr)
    os.close(go_r)
    os.close(done_w)
    return _Child(variant, proc, os.fdopen(go_w, "wb", buffering=0), os.fdopen(done_r, "r"), path)


def _go(child: _Child) -> bool:
    try:
        child.go.write(b"g")
        return True
    except OSError:  # the process is gone
        return False


def _take_step(child: _Child) -> bool:
    """One step of one variant; False once its process has stopped stepping (finished or failed)."""
    if not _go(child):
        return False
    line = child.done.readline()
    if not line:
        return False
    loss, step_s = (float(x) for x in line.split())
    child.last = f"{child.variant} loss {loss:.4f} {step_s * 1e3:5.0f} ms"
    return True


def run_in_turns(variants: list[str], args) -> dict[str, RunResult]:
    """Each variant in its own fresh process; the processes take turns, one training step each, so
    all of them see the same machine (its speed drifts over minutes) and only one runs at a time."""
    results: dict[str, RunResult] = {}
    with tempfile.TemporaryDirectory() as tmp:
        children = [_start_child(v, args, tmp) for v in variants]
        # All set up (imports, warm-up compile) before the first step: no start-up runs beside one.
        live = [c for c in children if c.done.readline().strip() == "ready"]
        bar = ProgressBar(args.steps, "step")
        for i in range(args.steps if live else 0):
            # Each step another variant goes first: what a step leaves behind (threads still spinning,
            # memory being handed back) falls on every variant equally often.
            k = i % len(live)
            stepped = [c for c in live[k:] + live[:k] if _take_step(c)]
            live = [c for c in live if c in stepped]
            if not live:
                break
            bar.update(i, " | ".join(c.last for c in children))
        for c in children:  # one at a time: the work after the last step, then exit
            _go(c)
            c.go.close()
            code = c.proc.wait()
            c.done.close()
            if code != 0 or not os.path.exists(c.result_path):
                print(f"\n{c.variant}: FAILED: its process exited with code {code}")
                results[c.variant] = RunResult(c.variant, error=f"process exited with code {code}")
                continue
            with open(c.result_path) as fh:
                results[c.variant] = RunResult(**json.load(fh)[c.variant])
    return results


def _cache_for(cold: bool):
    if not cold:
        return contextlib.nullcontext()
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


class _DropNotices(logging.Filter):
    """torch's notices about choices this script makes on purpose (its cold runs turn the caches off,
    so Dynamo's PGO says so per variant; transformers' record_function calls are ignored in graphs):
    nothing a user of the demo can act on."""

    NOTICES = ("Profiler record function",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


def _quiet_torch_notices() -> None:
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled by")  # a warnings.warn
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_DropNotices())


def main_with(args, title: str, make_model: Callable[[], nn.Module], logits_of: Callable) -> int:
    import aotgrad  # noqa: F401  (not needed for backend="aotgrad"; keeps the version printable)

    _quiet_torch_notices()

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {VARIANTS}")
    if args.cold:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    tokens = load_tokens()
    batches = make_batches(tokens, args.steps, args.batch_size, args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    pristine = make_model()
    n_params = sum(p.numel() for p in pristine.parameters())
    if args.result_json is None:  # a variant's own process leaves the header to its parent
        print(f"{title}: {n_params / 1e6:.2f}M parameters; {len(tokens)} bytes of text; {args.steps} steps of "
              f"{args.batch_size}x{args.seq_len} tokens; AdamW lr {args.lr} ({args.warmup} warm-up steps); "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads"
              + ("; each variant in its own process, the processes taking turns step by step"
                 if args.isolate else ""))

    def fresh():
        return copy.deepcopy(pristine)

    if args.isolate and args.result_json is None:
        results = run_in_turns(variants, args)
    else:
        warm_up([v for v in variants if v != "eager"])
        turns = Turns(args.turn_fds) if args.turn_fds else None
        results = {}
        for v in variants:
            torch._dynamo.reset()
            try:
                with _cache_for(args.cold):
                    results[v] = train(v, fresh, logits_of, batches, lr=args.lr, warmup=args.warmup,
                                       compile_optimizer=args.compile_optimizer, turns=turns)
            except Exception as e:  # report and go on with the other variants
                print(f"\n{v}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                results[v] = RunResult(v, error=f"{type(e).__name__}: {e}")
        if args.result_json is not None:  # a variant's own process: hand the result back, no report
            with open(args.result_json, "w") as fh:
                json.dump({v: asdict(r) for v, r in results.items()}, fh)
            return 0
    ok = report(results, args.tolerance, args.final_tolerance, args.early_steps)
    if args.plot:
        plot(results, args.plot, title)
    return 0 if ok else 1
