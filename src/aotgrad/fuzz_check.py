"""The fuzzer's runner: one program through `check_against_eager`, classified as matched, refused,
crashed or mismatched (`check_program`), and a readable account of a mismatch (`explain`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import AotgradError
from .fuzz_programs import Program, materialize

KINDS = ("matched", "refused", "crashed", "mismatched")


@dataclass
class Outcome:
    kind: str  # "skipped" (eager raised) or one of KINDS
    key: str = ""  # grouping key: exception type and normalized message
    message: str = ""
    detail: str = ""  # traceback, for crashes

    def same_failure(self, other: Outcome) -> bool:
        return self.kind == other.kind and self.key == other.key


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else ""


def normalize(msg: str, limit: int = 110) -> str:
    """Group messages that differ only in numbers, shapes, op names or names of values."""
    msg = re.sub(r"\b(?:[avcrx]\d+(?:_\d+)?)\b", "V", msg)
    msg = re.sub(r"torch\.Size\(\[[^\]]*\]\)", "SIZE", msg)
    msg = re.sub(r"\[torch\.\w+ \[[^\]]*\]\]", "[TENSOR]", msg)
    msg = re.sub(r"Function [\w:]+ returned", "Function F returned", msg)
    msg = re.sub(r"\bOutput \d+ of \w+ is", "Output N of OP is", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", msg)
    msg = re.sub(r"\[N(, N)*\]", "[..]", msg)
    msg = re.sub(r"\(N(, N)*,?\)", "(..)", msg)
    return msg[:limit]


def _raised_by_checker(tb) -> bool:
    """Whether the AssertionError was raised by the comparison itself (aotgrad.testing, or torch's
    assert_close): a mismatch. An AssertionError raised anywhere else (a subclass's own checks in
    torch/testing/_internal/two_tensor.py, an assert inside aotgrad) is a crash."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return False
    last = frames[-1].filename.replace(os.sep, "/")
    return last.endswith("aotgrad/testing.py") or last.endswith("/torch/testing/_comparison.py")


def _eager_ok(f: Callable, make_inputs: Callable, backend: str | None = None) -> bool:
    """Eager runs the program and agrees with itself (or, with `backend`, Dynamo with that backend
    agrees with eager)."""
    from .testing import check_against_eager

    try:
        if backend is not None:
            torch._dynamo.reset()
        check_against_eager(f, make_inputs, compiled=f if backend is None else torch.compile(f, backend=backend))
    except Exception:
        return False
    finally:
        torch.set_grad_enabled(True)
    return True


def _compile(f: Callable, prog: Program, backend: str | None) -> Callable:
    from .api import aot_function
    from .compilers import nop

    if backend is None:
        return aot_function(f, nop, **prog.aot_kwargs)
    torch._dynamo.reset()
    return torch.compile(f, backend=backend)


def _refusal_in(e: BaseException) -> AotgradError | None:
    """The AotgradError behind `e` (Dynamo wraps a backend's error in its own), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, AotgradError):
            return e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__
    return None


@contextlib.contextmanager
def _quiet():
    """No warnings, and no tracebacks logged by fake tensors for ops that fail on purpose."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def check_program(
    prog: Program, *, eager_checked: bool = False, explain_mismatch: bool = True, backend: str | None = None,
    wrap_inputs: Callable | None = None,
) -> Outcome:
    """Run `prog` eagerly and compiled (twice: the second call takes the cached path); classify.

    Compiled with `aot_function(f, nop)`, or with `torch.compile(f, backend=backend)`: Dynamo then
    splits programs at graph breaks and hands aotgrad graphs whose inputs are earlier graphs' values.
    A program Dynamo alone (backend="eager") gets wrong or cannot run is skipped there.
    A mismatch is keyed by the first difference `explain` finds (which says e.g. which output lost
    its aliasing), falling back to `check_against_eager`'s message."""
    from .testing import check_against_eager

    with _quiet():
        try:
            f, make_inputs = materialize(prog)
            if wrap_inputs is not None:  # e.g. TwoTensor inputs (fuzz_subclass.py)
                make_inputs = wrap_inputs(make_inputs)
        except Exception as e:
            return Outcome("skipped", "source", repr(e))
        if not eager_checked and not _eager_ok(f, make_inputs):
            return Outcome("skipped", "eager")
        if backend is not None and not _eager_ok(f, make_inputs, backend="eager"):
            return Outcome("skipped", "dynamo")
        call = 0
        try:
            compiled = _compile(f, prog, backend)
            for call in range(2):  # noqa: B007 - `call` is read in the handlers
                check_against_eager(f, make_inputs, compiled=compiled)
                if not torch.is_grad_enabled():
                    raise RuntimeError("grad mode left disabled after the compiled call")
        except Exception as e:
            refusal = _refusal_in(e)
            if refusal is not None:
                return Outcome("refused", f"{type(refusal).__name__}: {normalize(_first_line(refusal))}", str(refusal))
            where = "" if call == 0 else "[2nd call] "
            if isinstance(e, AssertionError) and _raised_by_checker(e.__traceback__):
                msg = _first_line(e)
                diffs = explain(prog, calls=call + 1) if explain_mismatch and backend is None else []
                key = where + (diffs[0][0] if diffs else normalize(msg))
                message = where + msg + "".join(f"\n  differs: {d}" for _, d in diffs) + "\n" + str(e)
                return Outcome("mismatched", key, message)
            return Outcome(
                "crashed", where + f"{type(e).__name__}: {normalize(_first_line(e))}",
                where + f"{type(e).__name__}: {e}", traceback.format_exc(),
            )
        finally:
            torch.set_grad_enabled(True)
    return Outcome("matched")


def _describe(fn: Callable, make_inputs: Callable, calls: int) -> dict[str, Any]:
    """Observable facts about one call of `fn` (the last of `calls` calls), keyed by what they are
    about, most severe first."""
    facts: dict[str, Any] = {}
    for _ in range(calls):
        roots, args = make_inputs()
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [a._version for a in ins]
        meta = [(tuple(a.shape), _stride(a), a.requires_grad, a.is_leaf) for a in ins]
        out = fn(*args)
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    outs = [(i, o) for i, o in enumerate(flat) if isinstance(o, torch.Tensor)]

    def storage(t):
        return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else None

    def idx(pred, pool):
        return [j for j, p in pool if pred(p)]

    ins_e = list(enumerate(ins))
    for i, o in outs:
        facts[f"output {i} value"] = _values(o)
    for j, a in ins_e:
        facts[f"input {j} value after the call"] = _values(a)
    for i, o in outs:
        p = f"output {i}"
        others = [(k, q) for k, q in outs if k != i]
        facts[p + " is the same object as input"] = idx(lambda x, o=o: x is o, ins_e)
        facts[p + " is the same object as output"] = idx(lambda x, o=o: x is o, others)
        base = o._base
        facts[p + " ._base"] = (
            "None" if base is None else
            f"input {idx(lambda x, b=base: x is b, ins_e)}" if idx(lambda x, b=base: x is b, ins_e) else
            f"the ._base of input {idx(lambda x, b=base: x._base is b, ins_e)}"
            if idx(lambda x, b=base: x._base is b, ins_e) else
            f"output {idx(lambda x, b=base: x is b, others)}" if idx(lambda x, b=base: x is b, others) else
            f"the ._base of output {idx(lambda x, b=base: x._base is b, others)}"
            if idx(lambda x, b=base: x._base is b, others) else
            "an intermediate"
        )
        st = storage(o)
        facts[p + " shares storage with input"] = idx(lambda x, st=st: st is not None and storage(x) == st, ins_e)
        facts[p + " shares storage with output"] = idx(lambda x, st=st: st is not None and storage(x) == st, others)
        facts[p + " stride"] = _stride(o)
        facts[p + " requires_grad"] = o.requires_grad
        facts[p + " is_leaf"] = o.is_leaf
    for j, (a, v, m) in enumerate(zip(ins, versions, meta)):
        p = f"input {j}"
        facts[p + " shape after the call"] = f"{m[0]} -> {tuple(a.shape)}"
        facts[p + " stride after the call"] = f"{m[1]} -> {_stride(a)}"
        facts[p + " requires_grad after the call"] = f"{m[2]} -> {a.requires_grad}"
        facts[p + " is_leaf after the call"] = f"{m[3]} -> {a.is_leaf}"
        facts[p + " has a grad_fn after the call"] = a.grad_fn is not None
        facts[p + " version bumped"] = a._version != v
    for i, o in outs:
        if o.dtype.is_floating_point:
            try:
                o.add_(2)
                facts[f"output {i} .add_(2) afterwards"] = "ok"
                facts[f"inputs after output {i} .add_(2)"] = [_values(a) for a in ins]
            except RuntimeError as e:
                facts[f"output {i} .add_(2) afterwards"] = f"{type(e).__name__}: {_first_line(e)[:100]}"
    return facts


def _stride(t: torch.Tensor) -> tuple:
    """Strides that matter: those of dims of size 1 do not."""
    return tuple(st if n != 1 else None for n, st in zip(t.shape, t.stride()))


def _values(t: torch.Tensor) -> str:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    vals = [round(v, 3) if isinstance(v, float) else v for v in t.flatten().tolist()[:8]]
    return f"{t.dtype}{tuple(t.shape)} {vals}" + (" ..." if t.numel() > 8 else "")


_COARSE = ("value", "value after the call", "stride", "shape after the call", "stride after the call")


def _diff_key(name: str, ref: Any, got: Any) -> str:
    """A grouping key for one difference: which fact, and (for small domains) how it differs."""
    generic = re.sub(r"\d+", "N", name)
    if name.startswith("inputs after output"):
        return "inputs after an in-place op on an output differ"
    if any(name.endswith(" " + c) for c in _COARSE):
        shape = lambda v: str(v).split(" ")[0]  # noqa: E731
        if "value" in name and shape(ref) != shape(got):
            return generic + ": shape differs"
        return generic + " differs"
    if isinstance(ref, list) or isinstance(got, list):
        return f"{generic}: eager {'some' if ref else 'none'} vs compiled {'some' if got else 'none'}"
    return normalize(f"{generic}: eager {ref} vs compiled {got}")


def explain(prog: Program, calls: int = 1) -> list[tuple[str, str]]:
    """What differs, observably, between eager and compiled on `prog`: (grouping key, description)
    pairs, most severe first (best effort: [] if either side raises)."""
    from .api import aot_function
    from .compilers import nop

    with _quiet():
        try:
            f, make_inputs = materialize(prog)
            ref = _describe(f, make_inputs, 1)
            got = _describe(aot_function(f, nop, **prog.aot_kwargs), make_inputs, calls)
        except Exception:
            return []
        finally:
            torch.set_grad_enabled(True)
    return [
        (_diff_key(k, v, got.get(k)), f"{k}: eager {v} vs compiled {got.get(k)}")
        for k, v in ref.items() if got.get(k) != v
    ]
