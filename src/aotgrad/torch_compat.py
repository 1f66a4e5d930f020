"""The few torch internals whose names moved between releases.

Tested range: torch 2.13 (pyproject pins >=2.13,<2.14; CI runs every test on it). The GPU machines
used for the CUDA checks (`scripts/cuda_check.py`) and the GPU suite (`benchmarks/gpu_suite.py`) carry
torch 2.11 and run aotgrad from src/, so the handful of helpers renamed since are looked up here,
once. What the test files show on torch 2.11 (CPU wheel, this project's tests, session of issue 41):
test_core / test_partition / test_explain / test_backend / test_autocast pass except
  * `test_ops_with_ordered_side_effects_keep_their_checks` failed until the check op is registered as
    an ordered effect here, as torch 2.13 itself does (`_linalg_checks_are_ordered_effects`);
  * `test_selective_checkpoint_tags_are_honoured`, `test_checkpointed_attention_without_dropout_...`:
    2.11's checkpoint tags lead min-cut to save what 2.13's let it recompute (still correct);
  * `test_nested_regions[no-caller-aotgrad]`: Inductor's mixed float16/bfloat16 kernels round one
    gradient beyond the test's 1e-4 (a low-precision step, as the bf16 case the test already loosens);
and `benchmarks/gpu_suite.py --tiny --device cpu --compilers eager` passes on every model."""

from __future__ import annotations

import contextlib

import torch

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13: the same hint, without adding guards

    def optimization_hint(a: torch.SymInt | int, fallback: int | None = None) -> int:
        if isinstance(a, torch.SymInt):
            hint = a.node.hint
            if hint is not None:
                return int(hint)
            if fallback is None:
                raise ValueError(f"no size hint for {a}")
            return fallback
        return int(a)


__all__ = ["boxed_codegen", "compiling_session", "optimization_hint"]


def boxed_codegen():
    """FX's code generator for the boxed calling convention (the function takes one list and clears
    it on entry), or None where this torch has none. Private in torch: looked up here."""
    import torch.fx.graph

    cls = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    return cls() if cls is not None else None


@contextlib.contextmanager
def compiling_session():
    """`torch.compiler.is_compiling()` is True inside: aotgrad's trace looks like tracing to the
    libraries that ask (transformers' `is_tracing()` skips its `.item()` shortcuts), as Dynamo's
    compilation and non-strict export do. torch 2.13 names the setter; older ones set the flag."""
    import torch.compiler as compiler

    session = getattr(compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = old


def _linalg_checks_are_ordered_effects() -> None:
    """torch 2.13 registers `aten::_linalg_check_errors` (linalg.inv's "singular matrix" check and
    the like) as an ordered side effect, so a traced program keeps it; torch 2.11 does not, and the
    check, having no output, was dropped as dead code. Register it here as 2.13 does."""
    try:
        from torch._higher_order_ops import effects
    except ImportError:  # pragma: no cover
        return
    op = "aten::_linalg_check_errors"
    if effects._get_effect(op) is None:
        effects._register_effectful_op(op, effects._EffectType.ORDERED)


_linalg_checks_are_ordered_effects()
