"""The fuzzer's own reports: a raw crash is counted as a crash (not a mismatch), and a reproducer runs
the program as the fuzzer ran it (the same TwoTensor wrapping, the same options, the same check).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
import aotgrad.api
from aotgrad import fuzz, fuzz_subclass
from aotgrad.fuzz import Program, Stmt


def _prog(config=()) -> Program:
    setup = ("r0 = torch.randn((3, 2), generator=g, dtype=torch.float32).requires_grad_()", "c0 = r0.clone()")
    return Program(seed=0, setup=setup, roots=("r0",), args=(("a0", "c0"),), body=(Stmt("v0 = a0 * 2"),),
                   returns=("v0",), config=tuple(config))


def _breaks_two_tensors(fn, *args, **kwargs):
    """An aot_function that raises inside TwoTensor's own constructor (its components' dtypes differ)
    on TwoTensor inputs, and runs `fn` otherwise: an AssertionError raised by torch/testing/_internal,
    not by a comparison."""
    def run(*a):
        for x in a:
            if isinstance(x, TwoTensor):
                TwoTensor(x.a.detach(), x.b.detach().double())
        return fn(*a)

    return run


def test_assertion_error_raised_outside_the_comparison_is_a_crash(monkeypatch):
    monkeypatch.setattr(aotgrad.api, "aot_function", _breaks_two_tensors)
    assert fuzz.check_program(_prog()).kind == "matched"
    out = fuzz_subclass.check_program(_prog())
    assert out.kind == "crashed", out
    assert out.key.startswith("AssertionError: Expected a and b to have same"), out.key


def test_a_wrong_value_is_still_a_mismatch(monkeypatch):
    monkeypatch.setattr(aotgrad.api, "aot_function", lambda fn, *a, **k: lambda *x: (fn(*x)[0] + 1,))
    assert fuzz_subclass.check_program(_prog()).kind == "mismatched"
    assert fuzz.check_program(_prog()).kind == "mismatched"


def _run_reproducer(source: str) -> str:
    """Run a reproducer's source as a script in this process (so a monkeypatched aotgrad is the one
    it imports); what it printed, or the exception's type and message."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<reproducer>", "exec"), {"__name__": "__main__"})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return out.getvalue().strip()


def test_subclass_reproducer_wraps_inputs_as_the_run_did(monkeypatch):
    monkeypatch.setattr(aotgrad.api, "aot_function", _breaks_two_tensors)
    monkeypatch.setattr(aotgrad, "aot_function", _breaks_two_tensors)
    prog = _prog()
    assert fuzz_subclass.check_program(prog).kind == "crashed"
    assert _run_reproducer(prog.reproducer()) == "matches eager"  # the plain program is fine
    assert _run_reproducer(prog.reproducer(subclass=True)).startswith("AssertionError: Expected a and b")


def test_reproducer_written_by_a_subclass_run_reproduces(monkeypatch, tmp_path):
    monkeypatch.setattr(aotgrad.api, "aot_function", _breaks_two_tensors)
    monkeypatch.setattr(aotgrad, "aot_function", _breaks_two_tensors)
    monkeypatch.setattr(fuzz, "generate", lambda seed, i: _prog())
    summary = fuzz.run(1, seed=5, out_dir=str(tmp_path), shrink_failures=False, check_fn=fuzz_subclass.check_program,
                       reproducer_options={"subclass": True})
    assert summary.counts["crashed"] == 1 and summary.counts["mismatched"] == 0, summary.report()
    (path,) = tmp_path.iterdir()
    assert path.name == "crash_5_0.py"
    assert _run_reproducer(path.read_text()).startswith("AssertionError: Expected a and b")


def test_reproducer_keeps_the_options_and_the_second_order_check():
    prog = _prog(config=(("keep_inference_input_mutations", True),))
    src = prog.reproducer(order=2, subclass=True)
    assert "aot_function(f, nop, keep_inference_input_mutations=True)" in src
    assert "check_second_order(f, make_inputs, compiled)" in src and "with_two_tensor_inputs" in src
    assert _run_reproducer(src) == "matches eager"
    assert "torch.compile(f, backend='aotgrad_eager')" in prog.reproducer(backend="aotgrad_eager")


@pytest.mark.parametrize("order", [1, 2])
def test_second_order_reproducer_fails_on_a_wrong_second_gradient(monkeypatch, order):
    def doubled_grad(fn, *args, **kwargs):
        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return g * 2 if torch.is_grad_enabled() else g  # only the create_graph backward is wrong

        return lambda a: fn(Twice.apply(a))

    monkeypatch.setattr(aotgrad, "aot_function", doubled_grad)
    result = _run_reproducer(_prog().reproducer(order=order))
    assert (result == "matches eager") == (order == 1), result


def test_repeated_plain_argument_whose_gradient_is_a_subclass():
    """`scripts/fuzz.py --subclass --seed 77`, program 1077 (shrunk): a plain argument passed twice,
    whose gradient is a TwoTensor (it meets a closed-over one), crashed in TwoTensor's constructor:
    the second copy's plain tensors were not counted (subclass_wrap.Boundary.of)."""
    from aotgrad.testing import check_against_eager

    g = torch.Generator().manual_seed(0)
    w = TwoTensor(torch.randn((), generator=g), torch.randn((), generator=g))

    def f(a0, a1):
        return (a1 * a0 * w,)

    def make_inputs():
        r0 = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        return (r0,), (r0, r0)

    compiled = aotgrad.aot_function(f, aotgrad.nop)
    for _ in range(2):
        check_against_eager(f, make_inputs, compiled=compiled)
