"""The few torch internals whose names moved between releases.

Tested range: torch 2.13 (pyproject pins >=2.13,<2.14; CI runs every test on it). The GPU machines
used for the CUDA checks (`scripts/cuda_check.py`) and the GPU suite (`benchmarks/gpu_suite.py`) carry
torch 2.11 and run aotgrad from src/, so the handful of helpers renamed since are looked up here,
once. What `make test`'s files show on torch 2.11 (the cu130 wheel, run on CPU, session 25): 1,427
passed and 45 failed before the `is_out` fallback below (16 of them: custom ops with mutations); of the
rest, none is a wrong result of aotgrad's own:
  * precompile (`aot_compile`, 9 tests, its docs page) is a torch 2.13 feature (so is the saved and
    loaded `OptimizerStep` test, added later; its other tests pass on 2.11);
  * where aotgrad differs from eager, upstream on 2.11 does too: LSTM in eval with oneDNN returns
    `h_n` with an extra dimension (2.11's decomposition, the same shapes upstream); Inductor rounds
    an autocast bf16 head beyond the tests' 1e-4 (the same values upstream); its kernels that mix
    bf16 and fp16 miss eager's gradients of nested regions on both sides (max error 5.0 upstream,
    11.0 aotgrad; both 0 on 2.13);
  * 2.11's checkpoint tags and batch-norm decomposition make min-cut save what 2.13's let it recompute
    (three partition tests; still correct); a DTensor gradient placement and FSDP2's hook tracing
    differ; `torch.ops.higher_order.map` over a closure raises aotgrad's retry signal through Dynamo;
  * the fuzz gate refuses one program more (over its budget).
`benchmarks/gpu_suite.py --tiny --device cpu --compilers inductor` passes on every model (it crashed on
T5 and Llama until graphs were compiled with autocast off)."""

from __future__ import annotations

import contextlib
import inspect
import threading

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


__all__ = ["boxed_codegen", "compiling_session", "is_out", "load_scalar_cpp_binding", "optimization_hint"]


def is_out(op: torch._ops.OpOverload) -> bool:
    """An op with "out" semantics (its mutable arguments are written, never read). torch 2.13 tags
    it `out` and asks `torch._library.utils.is_out`; torch 2.11 tags a custom one `out_variant` and
    marks a native one's `out=` arguments in its schema."""
    asks = getattr(torch._library.utils, "is_out", None)
    if asks is not None:
        return asks(op)
    tag = getattr(torch.Tag, "out_variant", None)
    return (tag is not None and tag in op.tags) or any(getattr(a, "is_out", False) for a in op._schema.arguments)


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


def load_scalar_cpp_binding(argtypes: list[str], source: str):
    """A C++ function of plain scalar code, built and bound to Python by Inductor's toolchain
    (`CppPythonBindingsCodeCache`), without probing the CPU's vector instruction sets.

    Inductor's first C++ build in a process compiles a test program per instruction set (avx512,
    avx2: 8-12 s on 2 cores) to choose vector flags. Scalar code needs none of them, and on a GPU
    no other build asks for them, so that probe was the whole of it: 16 s of a ResNet-50's first
    step on the pretend H100, for aotgrad's overlap check. torch 2.13 takes `needs_vec_isa=False`;
    older ones pick the ISA for every build, so there the probe is answered "none" for this build
    alone, unless it has already run (then it costs nothing)."""
    from torch._inductor import codecache, cpu_vec_isa

    load = codecache.CppPythonBindingsCodeCache.load_pybinding_async
    if "needs_vec_isa" in inspect.signature(load).parameters:
        return load(argtypes, source, needs_vec_isa=False)()
    with _probe_lock:
        probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
        pick = codecache.pick_vec_isa
        if not probed:
            codecache.pick_vec_isa = lambda: cpu_vec_isa.invalid_vec_isa
        try:
            return load(argtypes, source)()
        finally:
            codecache.pick_vec_isa = pick


_probe_lock = threading.Lock()


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
