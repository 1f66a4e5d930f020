"""GPU training suite (issue 41): aotgrad vs Inductor under torch.compile, model by model.

Per model (gpu_models.py: GPT-2, BERT, Llama, T5 from transformers configs; ResNet-50, ViT from timm
or plain-torch stand-ins; the small GPT-2 under mode="reduce-overhead"), in one process, from the same
random weights and the same batches:

    eager      the model as is
    aotgrad    torch.compile(model, backend="aotgrad")      (aotgrad's graphs, compiled by Inductor)
    inductor   torch.compile(model, backend="inductor")

each a training step under bf16 autocast (`--dtype`) with a fused AdamW run eagerly. It prints
pass/fail and aotgrad ÷ Inductor for

  * step time: median over `--steps` steps, the two compiled variants taking turns step by step
    (CUDA events on a GPU, perf_counter on CPU);
  * activation peak: `max_memory_allocated` during forward+backward above what was allocated before
    the step (on CPU, the same from the profiler's allocator events);
  * first step: compile + first step, fresh Inductor cache, Dynamo reset per model; which backend
    goes first alternates from model to model, after an untimed small-model step of each (the
    process's one-time imports and probes belong to no model);
  * loss: the largest |loss - eager's loss| over the first `--loss-steps` steps, for each.

A row passes when both compiled variants train (no error, finite losses) and aotgrad's loss is as
close to eager's as Inductor's (within 2× of its difference, or 1% of the loss).

GPU (one or two runs of < 8 minutes on an H100/H200; `--deadline` skips models past it):

    make bench-gpu                      # both groups below, one after the other
    python benchmarks/gpu_suite.py --models gpt2,gpt2_6l,bert,llama --json gpu1.json
    python benchmarks/gpu_suite.py --models t5,resnet50,vit,gpt2_small_ro --json gpu2.json

CPU dry run (tiny configs, stand-in models; what tests/test_gpu_suite.py runs):

    python benchmarks/gpu_suite.py --tiny --device cpu --steps 2 --compilers eager

CPU memory comparison (`--mid`: small layers, the real vocabularies; ~10 minutes on 2 cores):

    python benchmarks/gpu_suite.py --mid --device cpu --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from gpu_models import MODELS, SuiteModel  # noqa: E402

GROUPS = {"1": "gpt2,gpt2_6l,bert,llama", "2": "t5,resnet50,vit,gpt2_small_ro"}
# --compilers: "inductor" is what users run; "eager" swaps in the debugging backends (aotgrad_eager vs
# upstream aot_eager: the same capture and partitioning, no Inductor) so a CPU dry run takes seconds.
BACKENDS = {"inductor": {"aotgrad": "aotgrad", "inductor": "inductor"},
            "eager": {"aotgrad": "aotgrad_eager", "inductor": "aot_eager"}}
COMPILED = ("aotgrad", "inductor")


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _backend(name: str):
    """aotgrad's backends as objects: on a GPU machine the package may run from src/ without being
    installed, so its `torch_dynamo_backends` entry points are not there."""
    if name.startswith("aotgrad"):
        import importlib

        module = importlib.import_module("aotgrad.backend")  # the module, not aotgrad.backend()
        return {"aotgrad": module.aotgrad_backend, "aotgrad_eager": module.aotgrad_eager}[name]
    return name


@dataclass
class Variant:
    losses: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    step_ms: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    error: str | None = None
    trace: str | None = None  # the failure's traceback, for --json (what a GPU run brings back to diagnose)
    # graphs that ran without CUDA graphs under mode="reduce-overhead" (Inductor's counter, over the
    # first step, where graphs compile, and the warm-up, where cudagraph trees record)
    cudagraph_skips: int = 0
    # on the pretend GPU: the operations one forward+backward asked of the device (pretend_gpu.device_ops)
    device_ops: dict[str, int] | None = None

    def median_ms(self) -> float | None:
        if not self.step_ms:
            return None
        s = sorted(self.step_ms)
        n = len(s)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass
class Row:
    model: str
    source: str = ""
    shape: str = ""
    mode: str | None = None
    variants: dict[str, Variant] = field(default_factory=dict)
    first_order: tuple[str, ...] = ()
    error: str | None = None  # the model itself (eager) failed or was skipped
    # on the pretend GPU (scripts/pretend_gpu) no kernel computes: losses mean nothing, so a row passes
    # when both compiled variants train without error (and run_model keeps no step times)
    pretend: bool = False

    def loss_diff(self, name: str) -> float | None:
        if self.pretend:
            return None
        ref, got = self.variants.get("eager"), self.variants.get(name)
        if ref is None or got is None or got.error or not got.losses or len(got.losses) != len(ref.losses):
            return None
        return max(abs(a - b) for a, b in zip(ref.losses, got.losses))

    def ratio(self, what: str) -> float | None:
        a, b = self.variants.get("aotgrad"), self.variants.get("inductor")
        if a is None or b is None or a.error or b.error:
            return None
        x, y = {"step": (a.median_ms(), b.median_ms()), "peak": (a.peak_bytes, b.peak_bytes),
                "first": (a.first_step_s, b.first_step_s)}[what]
        return None if x is None or not y else x / y

    def passed(self) -> bool:
        if self.error:
            return False
        for name in COMPILED:
            v = self.variants.get(name)
            if v is None or v.error or (not self.pretend and not all(map(math.isfinite, v.losses))):
                return False
        if self.pretend:
            return True
        da, di = self.loss_diff("aotgrad"), self.loss_diff("inductor")
        if da is None or di is None:
            return False
        scale = max(abs(x) for x in self.variants["eager"].losses)
        return da <= max(2 * di, 0.01 * scale, 1e-6)


# ----------------------------------------------------------------------------------------------
# Timing and memory


class Clock:
    """Step times: CUDA events on a GPU (read after one synchronize at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Variant, object, object]] = []

    def time(self, variant: Variant, fn: Callable[[], None]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.pending.append((variant, start, end))
        else:
            t0 = time.perf_counter()
            fn()
            variant.step_ms.append(1e3 * (time.perf_counter() - t0))

    def collect(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for variant, start, end in self.pending:
                variant.step_ms.append(start.elapsed_time(end))
        self.pending.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _fresh_inductor_cache():
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), inductor_config.patch(force_disable_caches=True):
        yield
        try:
            from aotgrad.runtime import input_checks

            input_checks.wait_for_builds()  # aotgrad's background build, in the cache it started in
        except ImportError:
            pass


# ----------------------------------------------------------------------------------------------
# One model


class Trainer:
    """One variant: its copy of the model, its fused AdamW (run eagerly), its compiled callable."""

    def __init__(self, sm: SuiteModel, pristine: torch.nn.Module, backend: str | None, device: torch.device,
                 dtype: torch.dtype | None, mode: str | None):
        self.model = copy.deepcopy(pristine)
        fused = device.type in ("cuda", "cpu")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.device, self.dtype = device, dtype
        if backend is None:
            self.call = self.model
        else:
            kwargs = {"mode": mode} if mode else {}
            self.call = torch.compile(self.model, backend=_backend(backend), **kwargs)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward_backward(self, batch: tuple) -> torch.Tensor:
        with self.autocast():
            loss = self.call(*batch)
        loss.backward()
        return loss

    def step(self, batch: tuple) -> torch.Tensor:
        loss = self.forward_backward(batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def _error(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def warm_up_process(args, device: torch.device, dtype, log: Callable[[str], None]) -> None:
    """One untimed training step of a small model per compiled variant, before any model: the
    process's one-time costs (Inductor's and Triton's imports, the CPU's vector-ISA probe, aotgrad's
    own imports) would otherwise land on whichever variant compiles the first model first."""
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    mod = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    sm = SuiteModel("warm-up", "stand-in", _SumLoss(mod), [(torch.randn(8, 32, device=device),)], "8×32")
    for v in COMPILED:
        torch._dynamo.reset()
        with _fresh_inductor_cache():
            Trainer(sm, sm.module.to(device), BACKENDS[args.compilers][v], device, dtype, None).step(sm.batches[0])
    torch._dynamo.reset()
    log(f"process warm-up (untimed): {time.perf_counter() - t0:.1f} s")


class _SumLoss(torch.nn.Module):
    def __init__(self, mod: torch.nn.Module):
        super().__init__()
        self.mod = mod

    def forward(self, x):
        return self.mod(x).float().sum()


def _size(args) -> str:
    """The model sizes asked for: gpu_models' "full", "mid" or "tiny"."""
    return "tiny" if args.tiny else "mid" if args.mid else "full"


def run_model(name: str, index: int, args, device: torch.device, dtype, log: Callable[[str], None]) -> Row:
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    sm = MODELS[name](_size(args), device, max(args.loss_steps, 1), gen)
    row = Row(name, sm.source, sm.shape, sm.mode, pretend=is_pretend(device))
    pristine = sm.module.to(device).train()
    backends = BACKENDS[args.compilers]
    mode = sm.mode if args.compilers == "inductor" else None  # the debugging backends take no mode

    torch._dynamo.reset()
    trainers: dict[str, Trainer] = {"eager": Trainer(sm, pristine, None, device, dtype, None)}
    for v in COMPILED:
        trainers[v] = Trainer(sm, pristine, backends[v], device, dtype, mode)
        row.variants[v] = Variant()
    row.variants["eager"] = Variant()

    # Eager's losses over the first steps: the reference.
    try:
        for batch in sm.batches:
            row.variants["eager"].losses.append(float(trainers["eager"].step(batch)))
    except Exception as e:
        row.error = "eager: " + _error(e)
        return row
    del trainers["eager"]

    # First step of each compiled variant: fresh Inductor cache; who goes first alternates per model.
    order = COMPILED if index % 2 == 0 else COMPILED[::-1]
    row.first_order = order
    for v in order:
        variant = row.variants[v]
        try:
            with _fresh_inductor_cache():
                _sync(device)
                skips, t0 = _cudagraph_skips(), time.perf_counter()
                loss = trainers[v].step(sm.batches[0])
                _sync(device)
                variant.first_step_s = time.perf_counter() - t0
                variant.cudagraph_skips += _cudagraph_skips() - skips
            variant.losses.append(float(loss))
        except Exception as e:
            variant.error, variant.trace = _error(e), traceback.format_exc(limit=-12)
            if args.verbose:
                traceback.print_exc()
        log(f"  {name}: {v} first step {_f(variant.first_step_s, '.1f') + ' s' if variant.error is None else variant.error}")

    live = [v for v in COMPILED if row.variants[v].error is None]
    # The remaining loss steps, then the timed steps, the variants taking turns.
    clock = Clock(device)
    for i in range(1, len(sm.batches)):
        for v in list(live):
            try:
                row.variants[v].losses.append(float(trainers[v].step(sm.batches[i])))
            except Exception as e:
                row.variants[v].error, row.variants[v].trace = _error(e), traceback.format_exc(limit=-12)
                live.remove(v)
    for v in list(live):  # warm-up beyond the loss steps (CUDA graphs record on the first calls)
        try:
            skips = _cudagraph_skips()
            for _ in range(args.warmup):
                trainers[v].step(sm.batches[-1])
            _sync(device)
            row.variants[v].cudagraph_skips += _cudagraph_skips() - skips
        except Exception as e:
            row.variants[v].error = _error(e)
            live.remove(v)
    for _ in range(args.steps):
        for v in live:
            clock.time(row.variants[v], lambda v=v: trainers[v].step(sm.batches[-1]))
    clock.collect()
    if row.pretend:  # the pretend device's events read 1 ms whatever ran: no step time was measured
        for v in live:
            row.variants[v].step_ms.clear()

    # Activation peak: forward + backward, above what was allocated before the step.
    for v in live:
        gc.collect()
        ops = _device_ops() if row.pretend else None
        row.variants[v].peak_bytes = activation_peak(device, lambda v=v: trainers[v].forward_backward(sm.batches[-1]))
        if ops is not None:
            row.variants[v].device_ops = {k: n - ops[k] for k, n in _device_ops().items()}
        trainers[v].opt.zero_grad(set_to_none=True)
    return row


def _device_ops() -> dict[str, int]:
    """The pretend device's operation counts so far (scripts/pretend_gpu/pretend_gpu.py, loaded by its launcher)."""
    return sys.modules["pretend_gpu"].device_ops()


def activation_peak(device: torch.device, fn: Callable[[], object]) -> int | None:
    """Bytes allocated at the highest point of `fn` above what was allocated before it:
    `max_memory_allocated` on CUDA; on CPU the same sum over the profiler's allocator events (every
    allocation and free of the CPU allocator, Inductor's buffers included), so a CPU run shows the
    memory a GPU would hold for the same graphs, up to the kernels each device picks."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    if device.type != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------------------------
# Report


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _mib_cell(x: int | None) -> str:
    """MiB: whole on a GPU's model sizes, to 0.01 on the CPU dry run's tiny ones."""
    mib = _mib(x)
    return _f(mib, ".0f" if mib is None or mib >= 100 else ".2f")


def _mib(x: int | None) -> float | None:
    return None if x is None else x / 2**20


def report(rows: list[Row], device: torch.device) -> str:
    headers = ["model", "source", "batch", "pass", "step ÷ ind", "aot ms", "ind ms", "peak ÷ ind", "aot MiB",
               "ind MiB", "first ÷ ind", "aot s", "ind s", "|Δloss| aot", "|Δloss| ind", "note"]
    lines = []
    for r in rows:
        a, b = r.variants.get("aotgrad", Variant()), r.variants.get("inductor", Variant())
        notes = [f"{k}: {v.error}" for k, v in r.variants.items() if v.error] + ([r.error] if r.error else [])
        if r.mode:
            notes.insert(0, f"mode={r.mode}")
            notes += [f"{k}: {v.cudagraph_skips} CUDA-graph skips" for k, v in r.variants.items() if v.cudagraph_skips]
        if a.device_ops and b.device_ops:
            notes.append("device ops per fwd+bwd, aot/ind: " + ", ".join(
                f"{k} {a.device_ops[k]}/{b.device_ops[k]}" for k in a.device_ops))
        if r.first_order:
            notes.append("first: " + " then ".join(r.first_order))
        lines.append([r.model, r.source, r.shape, "PASS" if r.passed() else "FAIL",
                      _f(r.ratio("step"), ".2f"), _f(a.median_ms(), ".1f"), _f(b.median_ms(), ".1f"),
                      _f(r.ratio("peak"), ".2f"), _mib_cell(a.peak_bytes), _mib_cell(b.peak_bytes),
                      _f(r.ratio("first"), ".2f"), _f(a.first_step_s, ".1f"), _f(b.first_step_s, ".1f"),
                      _f(r.loss_diff("aotgrad"), ".2e"), _f(r.loss_diff("inductor"), ".2e"), "; ".join(notes)])
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + " |" for x in lines]
    ok = [r for r in rows if r.passed()]

    def geomean(what: str) -> float | None:
        xs = [r.ratio(what) for r in ok if r.ratio(what)]
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None

    if any(r.pretend for r in rows):
        out.append("pretend GPU (scripts/pretend_gpu): no kernel computes, so pass means both compiled variants "
                   "trained without error; step and loss not measured; first step is CPU compile time; device "
                   "ops count the kernels (with memsets and copies) and library calls one forward+backward asks for")
    out.append(f"{len(ok)}/{len(rows)} models pass; geometric mean aotgrad ÷ Inductor: step "
               f"{_f(geomean('step'), '.2f')}, activation peak {_f(geomean('peak'), '.2f')}, first step "
               f"{_f(geomean('first'), '.2f')} (targets: ≤ 0.97, ≤ 0.90, ≤ 1.00)")
    return "\n".join(out)


def is_pretend(device: torch.device) -> bool:
    """The pretend H100 of scripts/pretend_gpu (its device name says so), not a GPU."""
    return device.type == "cuda" and "(pretend)" in torch.cuda.get_device_name(device)


def environment(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = "-"
    return f"device {device} ({gpu}), torch {torch.__version__}, transformers {tv}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}; "
                   f"or --group")
    p.add_argument("--group", choices=sorted(GROUPS), help="a prepared half of the suite: " +
                   "; ".join(f"{k}: {v}" for k, v in GROUPS.items()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="autocast dtype")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny configs and stand-in models (the CPU dry run)")
    size.add_argument("--mid", action="store_true", help="CPU-sized layers with the real vocabularies and class "
                      "counts, stand-in vision models: activation peaks a CPU can compare")
    p.add_argument("--compilers", default="inductor", choices=sorted(BACKENDS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-process-warmup", action="store_true",
                   help="skip the untimed small-model step per variant before the first model")
    p.add_argument("--loss-steps", type=int, default=3, help="first steps whose losses are compared with eager's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=None, help="seconds: start no model after this")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    names = (GROUPS[args.group] if args.group else args.models).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {list(MODELS)}")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(environment(device))
    start = time.perf_counter()
    if not args.no_process_warmup:
        warm_up_process(args, device, dtype, log)
    rows: list[Row] = []
    for i, name in enumerate(names):
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            rows.append(Row(name, error=f"not reached (--deadline {args.deadline:.0f} s)"))
            continue
        t0 = time.perf_counter()
        try:
            rows.append(run_model(name, i, args, device, dtype, log))
        except Exception as e:
            if args.verbose:
                traceback.print_exc()
            rows.append(Row(name, error=_error(e)))
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"GPU training suite — {environment(device)}, autocast {args.dtype}, "
          f"compilers {args.compilers}{'' if _size(args) == 'full' else ', ' + _size(args)}, {args.steps} timed steps")
    print(report(rows, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(device), "args": vars(args),
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0 if all(r.passed() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
