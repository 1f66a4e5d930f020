"""Shared helpers for the benchmarks: the two implementations side by side, timing, checks, tables."""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Impl:
    name: str
    aot_function: Callable
    aot_module: Callable
    nop: Callable


def implementations() -> tuple[Impl, Impl]:
    """(aotgrad, upstream functorch.compile), in that order."""
    import functorch.compile as upstream

    import aotgrad

    return (
        Impl("aotgrad", aotgrad.aot_function, aotgrad.aot_module, aotgrad.nop),
        Impl("upstream", upstream.aot_function, upstream.aot_module, upstream.nop),
    )


class Timer:
    """A `perf_counter` stopwatch with the garbage collector off (as `timeit` does)."""

    def __enter__(self) -> Timer:
        gc.collect()
        self._gc = gc.isenabled()
        gc.disable()
        self.start = time.perf_counter()
        return self

    def lap(self) -> float:
        return time.perf_counter() - self.start

    def __exit__(self, *exc) -> None:
        if self._gc:
            gc.enable()


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def error_text(e: BaseException, limit: int = 160) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"ERROR: {type(e).__name__}: {msg}"


def sum_outputs(out: Any) -> torch.Tensor:
    """A scalar to call `.backward()` on: the sum of every differentiable tensor output."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def state_of(mod: nn.Module, inputs: tuple) -> dict[str, torch.Tensor | None]:
    """Everything a training step leaves behind: parameter grads, buffers, input grads."""
    state: dict[str, torch.Tensor | None] = {}
    for n, p in mod.named_parameters():
        state[f"grad:{n}"] = p.grad
    for n, b in mod.named_buffers():
        state[f"buffer:{n}"] = b
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            state[f"input_grad:{i}"] = x.grad
    return state


def compare(ref: Any, got: Any, rtol: float = 1e-4, atol: float = 1e-5) -> str | None:
    """None if `got` matches `ref` (same pytree, close tensors), else a short description."""
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if ref_spec != got_spec:
        return f"structure differs: {ref_spec} vs {got_spec}"
    keys = list(ref.keys()) if isinstance(ref, dict) else list(range(len(ref_leaves)))
    for key, r, g in zip(keys, ref_leaves, got_leaves):
        if isinstance(r, torch.Tensor) != isinstance(g, torch.Tensor):
            return f"{key}: {type(r).__name__} vs {type(g).__name__}"
        if not isinstance(r, torch.Tensor):
            if r != g:
                return f"{key}: {r!r} vs {g!r}"
            continue
        if r.shape != g.shape or r.dtype != g.dtype:
            return f"{key}: {tuple(r.shape)}/{r.dtype} vs {tuple(g.shape)}/{g.dtype}"
        if not torch.allclose(r, g, rtol=rtol, atol=atol):
            err = (r.double() - g.double()).abs().max().item()
            return f"{key}: max abs err {err:.3g}"
    return None


def clone_inputs(inputs: tuple) -> tuple:
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def fresh(mod: nn.Module, inputs: tuple) -> tuple[nn.Module, tuple]:
    return copy.deepcopy(mod), clone_inputs(inputs)


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A plain-text table; `align` is one char per column, 'l' or 'r' (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = []
        for c, w, a in zip(cells, widths, align):
            out.append(c.ljust(w) if a == "l" else c.rjust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])
