"""OpInfo sweep: run torch's `op_db` ops eagerly and through an AOT `aot_function(f, nop)`.

Shared by tests/test_opinfo.py and benchmarks/opinfo_report.py.

For each OpInfo (CPU, float32) the first `max_samples` sample inputs are turned into a function
`f(*tensors)` that calls `op(sample.input, *sample.args, **sample.kwargs)`: every tensor found in the
sample (also inside lists / tuples / dicts) becomes a flat input of `f`; everything else is closed over.
`f` is run eagerly and through `aot_function(f, nop)` on separate, identical copies of the inputs
(storage, offset, sizes and strides are reproduced exactly), and compared:

* outputs: same nesting, every tensor with `torch.testing.assert_close(equal_nan=True)` (dtype and shape
  checked, values within OUT_TOL), non-tensor leaves with `==`;
* gradients: if the op supports autograd and some output is a differentiable floating tensor, the
  loss `sum_i (w_i * out_i).sum()` with fixed pseudo-random weights `w_i` (the same for both runs) is
  back-propagated with `torch.autograd.grad` into every input that requires grad, and the gradients
  are compared within GRAD_TOL (a `None` gradient is treated as zeros).

Result per op: "pass", "fail" (a mismatch), "error" (an exception while compiling or running the
compiled function, recorded as `ExcType: first line`), or "skip" (nondeterministic op, float32 not
supported on CPU, no sample, or eager itself raised for every sample). An op's result is the worst
over its samples (error > fail > pass; samples on which eager raises are dropped).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

OUT_TOL = {"rtol": 1e-4, "atol": 1e-4}
GRAD_TOL = {"rtol": 5e-4, "atol": 5e-4}
DEFAULT_MAX_SAMPLES = 2
DEFAULT_TIMEOUT_S = 120

# Ops whose outputs are random or uninitialized memory, so eager and compiled cannot be compared.
# (multi_head_attention_forward: its samples use dropout_p=0.5 with training=True.) Other random ops
# are caught by name (_RANDOM_NAME_PARTS) or at run time (two eager runs that differ).
NONDETERMINISTIC_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "multinomial", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.gumbel_softmax", "nn.functional.multi_head_attention_forward", "svd_lowrank",
    "pca_lowrank", "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
    "new_empty_strided", "resize_", "resize_as_",
}
_RANDOM_NAME_PARTS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "empty")


def op_id(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


# Deterministic despite a random-looking name.
DETERMINISTIC_OPS = {"nn.functional.feature_alpha_dropout.without_train", "native_dropout_backward"}


def nondeterministic_reason(op) -> str | None:
    name = op_id(op)
    if name in DETERMINISTIC_OPS:
        return None
    if name in NONDETERMINISTIC_OPS or op.name in NONDETERMINISTIC_OPS:
        return f"nondeterministic op ({name} in skip list)"
    # "normalize", "layer_norm" etc. contain "norm" but not "normal"; "nn.functional.normalize" does
    # contain "normal", so match random name parts on whole dotted components' prefixes only.
    for part in name.split("."):
        for word in _RANDOM_NAME_PARTS:
            if part == word or part.startswith(word + "_") or part.endswith("_" + word):
                return f"nondeterministic op (name matches {word!r})"
    return None


def get_op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def ops_by_id() -> dict:
    return {op_id(op): op for op in get_op_db()}


# ----------------------------------------------------------------------------------------------
# Building f(*tensors) from a SampleInput


def _split_tensors(tree):
    """Replace every tensor in a nested list/tuple/dict structure by a slot; return (template, tensors)."""
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and type(x) is tuple:
            return tuple(walk(v) for v in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(tree), tensors


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _fill(template, tensors):
    if isinstance(template, _Slot):
        return tensors[template.i]
    if isinstance(template, list):
        return [_fill(v, tensors) for v in template]
    if isinstance(template, tuple):
        return tuple(_fill(v, tensors) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def make_function(op, sample) -> tuple[Callable, list[torch.Tensor]]:
    template, tensors = _split_tensors((sample.input, tuple(sample.args), dict(sample.kwargs)))

    def f(*flat):
        inp, args, kwargs = _fill(template, flat)
        return op(inp, *args, **kwargs)

    return f, tensors


def copy_tensor(x: torch.Tensor) -> torch.Tensor:
    """A fresh leaf with x's values, dtype, storage offset, sizes, strides and requires_grad."""
    with torch.no_grad():
        if x.layout != torch.strided or x.is_conj() or x.is_neg():
            y = x.detach().clone()
        else:
            storage = x.untyped_storage()
            new = torch.empty(0, dtype=x.dtype, device=x.device)
            new.set_(storage.clone(), x.storage_offset(), x.size(), x.stride())
            y = new
    return y.requires_grad_(x.requires_grad)


# ----------------------------------------------------------------------------------------------
# Comparison


def _flatten_out(out) -> tuple[list, list]:
    """(structure description, leaves) for outputs: tuples/lists/structseqs/dicts recursed."""
    leaves: list = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return "T"
        if isinstance(x, (list, tuple)):  # list vs tuple vs structseq is not compared (as assert_close)
            return ("seq", [walk(v) for v in x])
        if isinstance(x, dict):
            return ("dict", [(k, walk(v)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))])
        leaves.append(x)
        return "L"

    return walk(out), leaves


def _weights_for(t: torch.Tensor, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + index)
    return torch.rand(t.shape, generator=g, dtype=t.dtype) + 0.5


def _differentiable_outputs(out) -> list[torch.Tensor]:
    _, leaves = _flatten_out(out)
    return [
        x for x in leaves
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.requires_grad
    ]


class Mismatch(AssertionError):
    pass


def _compare_leaf(a, b, what: str, tol: dict) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise Mismatch(f"{what}: eager {type(a).__name__} vs compiled {type(b).__name__}")
        if a.layout != torch.strided or b.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        try:
            torch.testing.assert_close(b.detach(), a.detach(), equal_nan=True, **tol)
        except AssertionError as e:
            raise Mismatch(f"{what}: {str(e).strip().splitlines()[0]}") from None
        return
    same = a == b
    if isinstance(same, bool) and not same and not (isinstance(a, float) and a != a and b != b):
        raise Mismatch(f"{what}: eager {a!r} vs compiled {b!r}")


def compare_outputs(eager, compiled) -> None:
    s1, l1 = _flatten_out(eager)
    s2, l2 = _flatten_out(compiled)
    if s1 != s2:
        raise Mismatch(f"output structure: eager {s1} vs compiled {s2}")
    for i, (a, b) in enumerate(zip(l1, l2)):
        _compare_leaf(a, b, f"output {i}", OUT_TOL)


def compare_grads(eager, compiled) -> None:
    if len(eager) != len(compiled):
        raise Mismatch(f"number of grads: eager {len(eager)} vs compiled {len(compiled)}")
    for i, (a, b) in enumerate(zip(eager, compiled)):
        _compare_leaf(a, b, f"grad of input {i}", GRAD_TOL)


# ----------------------------------------------------------------------------------------------
# Running one sample


@dataclass
class RunResult:
    out: object
    grads: list | None  # None: backward not checked


def _run(fn: Callable, tensors: list[torch.Tensor], backward: bool, process_fn: Callable | None) -> RunResult:
    inputs = [copy_tensor(t) for t in tensors]
    out = fn(*inputs)
    if not backward:
        return RunResult(out, None)
    diff_in = [x for x in inputs if x.requires_grad]
    loss_out = process_fn(out) if process_fn is not None else out
    diff_out = _differentiable_outputs(loss_out)
    if not diff_in or not diff_out:
        return RunResult(out, None)
    loss = sum((o * _weights_for(o, i)).sum() for i, o in enumerate(diff_out))
    grads = torch.autograd.grad(loss, diff_in, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(diff_in, grads)]
    return RunResult(out, grads)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """SIGALRM-based limit (main thread, Unix only); a no-op elsewhere."""
    import threading

    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def exc_summary(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _samples_equal(a: RunResult, b: RunResult) -> bool:
    try:
        compare_outputs(a.out, b.out)
        return True
    except Mismatch:
        return False


@dataclass
class OpResult:
    name: str
    status: str  # pass | fail | error | skip
    detail: str = ""
    samples: int = 0
    seconds: float = 0.0
    where: str = ""  # for fail/error: "forward", "backward", "compile+forward", ...
    per_sample: list = field(default_factory=list)


_RANK = {"pass": 0, "skip": -1, "fail": 1, "error": 2}


def check_op(
    op,
    compile_fn: Callable[[Callable], Callable],
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    verbose_errors: bool = False,
) -> OpResult:
    """Run up to `max_samples` samples of `op` eagerly and through `compile_fn(f)`; classify."""
    name = op_id(op)
    start = time.perf_counter()
    reason = nondeterministic_reason(op)
    if reason:
        return OpResult(name, "skip", reason)
    try:
        supported = torch.float32 in op.supported_dtypes("cpu")
    except Exception as e:  # pragma: no cover - defensive
        return OpResult(name, "skip", f"supported_dtypes raised {exc_summary(e)}")
    if not supported:
        return OpResult(name, "skip", "float32 not supported on CPU")

    # Ops without autograd support are sampled without requires_grad (their inference path is tested).
    backward = bool(op.supports_autograd)
    per_sample: list[tuple[str, str, str]] = []
    with warnings.catch_warnings(), time_limit(timeout_s):
        warnings.simplefilter("ignore")
        try:
            torch.manual_seed(0)
            samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=backward), max_samples))
        except Exception as e:
            return OpResult(name, "skip", f"sample_inputs raised {exc_summary(e)}", seconds=time.perf_counter() - start)
        if not samples:
            return OpResult(name, "skip", "no sample inputs", seconds=time.perf_counter() - start)
        for sample in samples:
            try:
                per_sample.append(_check_sample(op, sample, compile_fn, backward, verbose_errors))
            except _Timeout as e:
                per_sample.append(("error", f"Timeout: {e}", "sweep"))
                break
            except Exception as e:  # the harness itself (comparison of odd outputs, ...)
                per_sample.append(("error", f"sweep harness: {exc_summary(e)}", "harness"))

    seconds = time.perf_counter() - start
    worst = max(per_sample, key=lambda r: _RANK[r[0]])
    counted = sum(1 for r in per_sample if r[0] != "skip")
    if worst[0] == "skip":
        return OpResult(name, "skip", worst[1], 0, seconds, per_sample=per_sample)
    return OpResult(name, worst[0], worst[1], counted, seconds, worst[2], per_sample)


def _check_sample(op, sample, compile_fn, backward, verbose_errors) -> tuple[str, str, str]:
    fn, tensors = make_function(op, sample)
    process_fn = getattr(sample, "output_process_fn_grad", None)
    # Eager, twice: an exception is a skip; different results mean the op is nondeterministic.
    try:
        eager = _run(fn, tensors, backward, process_fn)
        eager2 = _run(fn, tensors, False, None)
    except _Timeout:
        raise
    except Exception as e:
        return ("skip", f"eager raised {exc_summary(e)}", "eager")
    if not _samples_equal(eager, eager2):
        return ("skip", "nondeterministic (two eager runs differ)", "eager")

    where = "compile"
    try:
        compiled_fn = compile_fn(fn)
        where = "compiled forward/backward"
        compiled = _run(compiled_fn, tensors, backward and eager.grads is not None, process_fn)
    except _Timeout:
        raise
    except Exception as e:
        if verbose_errors:
            traceback.print_exc()
        return ("error", exc_summary(e), where)
    try:
        compare_outputs(eager.out, compiled.out)
    except Mismatch as e:
        return ("fail", f"forward mismatch: {e}", "forward")
    if eager.grads is not None:
        if compiled.grads is None:
            return ("fail", "compiled outputs are not differentiable", "backward")
        try:
            compare_grads(eager.grads, compiled.grads)
        except Mismatch as e:
            return ("fail", f"backward mismatch: {e}", "backward")
    return ("pass", "", "")


# ----------------------------------------------------------------------------------------------
# Compilers under test


def aotgrad_compile(fn: Callable) -> Callable:
    import aotgrad

    return aotgrad.aot_function(fn, aotgrad.nop)


def upstream_compile(fn: Callable) -> Callable:
    from functorch.compile import aot_function, nop

    return aot_function(fn, nop)


COMPILERS = {"aotgrad": aotgrad_compile, "upstream": upstream_compile}


# ----------------------------------------------------------------------------------------------
# Full sweep and report


def sweep(
    ops: Iterable,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, OpResult]]:
    """{op id: {"aotgrad": OpResult, "upstream": OpResult}} for every op."""
    results: dict[str, dict[str, OpResult]] = {}
    for op in ops:
        row = {}
        for label, compile_fn in COMPILERS.items():
            try:
                row[label] = check_op(op, compile_fn, max_samples=max_samples, timeout_s=timeout_s)
            except BaseException as e:  # never let one op stop the sweep (KeyboardInterrupt excepted)
                if isinstance(e, KeyboardInterrupt):
                    raise
                row[label] = OpResult(op_id(op), "error", f"sweep harness: {exc_summary(e)}")
        results[op_id(op)] = row
        if progress:
            a, u = row["aotgrad"], row["upstream"]
            progress(f"{op_id(op):55s} aotgrad={a.status:5s} upstream={u.status:5s} "
                     f"({a.seconds + u.seconds:.1f}s) {a.detail if a.status in ('fail', 'error') else ''}")
    return results


@dataclass
class Summary:
    total: int
    tested: dict  # label -> number of non-skipped ops
    passed: dict  # label -> pass count
    regressions: list  # [(op, OpResult aotgrad)] where aotgrad fails/errors and upstream passes
    improvements: list  # [(op, OpResult upstream)] where upstream fails/errors and aotgrad passes

    def rate(self, label: str) -> float:
        return self.passed[label] / max(self.tested[label], 1)


def summarize(results: dict[str, dict[str, OpResult]]) -> Summary:
    labels = list(COMPILERS)
    tested = {k: sum(1 for r in results.values() if r[k].status != "skip") for k in labels}
    passed = {k: sum(1 for r in results.values() if r[k].status == "pass") for k in labels}
    regressions = [
        (name, r["aotgrad"]) for name, r in results.items()
        if r["aotgrad"].status in ("fail", "error") and r["upstream"].status == "pass"
    ]
    improvements = [
        (name, r["upstream"]) for name, r in results.items()
        if r["upstream"].status in ("fail", "error") and r["aotgrad"].status == "pass"
    ]
    return Summary(len(results), tested, passed, regressions, improvements)


def upstream_passes_aotgrad_does_not(results: dict[str, dict[str, OpResult]]) -> dict[str, OpResult]:
    """Op by op: the ops upstream passes and aotgrad fails, errors on or skips (aotgrad's result)."""
    return {name: r["aotgrad"] for name, r in results.items()
            if r["upstream"].status == "pass" and r["aotgrad"].status != "pass"}


def _group(items: list) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, res in items:
        groups.setdefault(f"[{res.status}] {res.detail}", []).append(name)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def format_report(results: dict[str, dict[str, OpResult]], summary: Summary | None = None) -> str:
    s = summary or summarize(results)
    lines = [f"OpInfo sweep: {s.total} ops (CPU float32)"]
    for label in COMPILERS:
        counts = {st: sum(1 for r in results.values() if r[label].status == st) for st in ("pass", "fail", "error", "skip")}
        lines.append(
            f"  {label:9s} pass {s.passed[label]}/{s.tested[label]} of tested ops ({100 * s.rate(label):.1f}%)"
            f"  [pass={counts['pass']} fail={counts['fail']} error={counts['error']} skip={counts['skip']}]"
        )
    lines.append(f"\nOps where aotgrad fails/errors and upstream passes ({len(s.regressions)}), grouped by message:")
    for msg, names in _group(s.regressions).items():
        lines.append(f"  ({len(names)}) {msg}")
        lines.append("      " + ", ".join(names))
    lines.append(f"\nOps where upstream fails/errors and aotgrad passes ({len(s.improvements)}):")
    for msg, names in _group(s.improvements).items():
        lines.append(f"  ({len(names)}) {msg}")
        lines.append("      " + ", ".join(names))
    both = [(n, r) for n, r in results.items()
            if r["aotgrad"].status in ("fail", "error") and r["upstream"].status in ("fail", "error")]
    lines.append(f"\nOps failing under both ({len(both)}), grouped by aotgrad's message:")
    for msg, names in _group([(n, r["aotgrad"]) for n, r in both]).items():
        lines.append(f"  ({len(names)}) aotgrad {msg}")
        lines.append("      " + ", ".join(names))
        upstream_msgs = {f"[{results[n]['upstream'].status}] {results[n]['upstream'].detail}" for n in names}
        for um in sorted(upstream_msgs - {msg}):
            lines.append(f"      upstream: {um}")
    return "\n".join(lines)
