"""The few torch internals whose names moved between releases.

aotgrad pins torch 2.13; the GPU machines used for the CUDA checks (`scripts/cuda_check.py`) carry
an older torch, so the handful of helpers renamed since are looked up here, once."""

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
