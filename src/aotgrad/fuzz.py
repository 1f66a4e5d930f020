"""Differential random-program fuzzer: eager vs `aot_function(f, nop)`.

Generates small straight-line tensor programs (views, out-of-place ops, in-place ops on
intermediates / views / inputs, metadata mutations, `no_grad` blocks, `.detach()`, aliasing and
duplicate outputs) over 1-3 roots passed as leaves, non-leaf clones, duplicates or overlapping views,
runs each through `aotgrad.testing.check_against_eager`, and classifies the result:

* ``matched``    - compiled behaves like eager;
* ``refused``    - aotgrad raised an `AotgradError` (a deliberate refusal);
* ``crashed``    - any other exception from the compiled side (a bug);
* ``mismatched`` - a silent wrong result (the worst kind of bug).

Programs whose *eager* run (including the gradient and output-mutation checks of
`check_against_eager`) raises are skipped. Every program is a `Program` (a list of statements that
render to Python source) that is generated deterministically from ``(seed, index)``; it is executed
from its rendered source, so a failing program can be written out verbatim as a standalone
reproducer after being shrunk (statements, returned values and arguments dropped one at a time while
eager still runs and the failure stays the same).

    from aotgrad import fuzz
    summary = fuzz.run(200, seed=0)           # or: python scripts/fuzz.py --n 200 --seed 0
    print(summary.report())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import re
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import AotgradError
from .fuzz_closures import maybe_close_over

KINDS = ("matched", "refused", "crashed", "mismatched")

# ----------------------------------------------------------------------------------------------
# Program representation
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stmt:
    """One line of the function body, e.g. ``v3 = v1.t()`` or ``a0.add_(2)``."""

    code: str

    def render(self, indent: str) -> list[str]:
        return [indent + self.code]


@dataclass(frozen=True)
class NoGrad:
    """``with torch.no_grad():`` around some statements."""

    body: tuple[Stmt, ...]

    def render(self, indent: str) -> list[str]:
        lines = [indent + "with torch.no_grad():"]
        for s in self.body:
            lines += s.render(indent + "    ")
        return lines


@dataclass(frozen=True)
class Program:
    seed: int  # seed of the input values
    setup: tuple[str, ...]  # lines of make_inputs after the generator
    roots: tuple[str, ...]  # names (in setup) of the leaves whose grads are compared
    args: tuple[tuple[str, str], ...]  # (parameter name, expression in make_inputs)
    body: tuple[Stmt | NoGrad, ...]
    returns: tuple[str, ...]
    single: bool = False  # return the only value bare instead of a 1-tuple
    config: tuple[tuple[str, Any], ...] = ()  # extra aot_function kwargs

    @property
    def aot_kwargs(self) -> dict:
        return dict(self.config)

    def render_make_inputs(self) -> str:
        lines = ["def make_inputs():", f"    g = torch.Generator().manual_seed({self.seed})"]
        lines += ["    " + s for s in self.setup]
        lines.append(f"    return {_tuple(self.roots)}, {_tuple([e for _, e in self.args])}")
        return "\n".join(lines) + "\n"

    def render_f(self) -> str:
        lines = [f"def f({', '.join(p for p, _ in self.args)}):"]
        for s in self.body:
            lines += s.render("    ")
        if self.single and len(self.returns) == 1:
            lines.append(f"    return {self.returns[0]}")
        else:
            lines.append(f"    return {_tuple(self.returns)}")
        return "\n".join(lines) + "\n"

    def source(self) -> str:
        return self.render_make_inputs() + "\n\n" + self.render_f()

    def n_statements(self) -> int:
        return sum(len(s.body) if isinstance(s, NoGrad) else 1 for s in self.body)

    def reproducer(self, header: str = "", backend: str | None = None) -> str:
        kw = "".join(f", {k}={v!r}" for k, v in self.config)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        make = f"torch.compile(f, backend={backend!r})" if backend else f"aot_function(f, nop{kw})"
        return (
            f"{comment}import torch\n\nfrom aotgrad import aot_function, nop\n"
            "from aotgrad.testing import check_against_eager\n\n\n"
            f"{self.source()}\n\n"
            'if __name__ == "__main__":\n'
            f"    compiled = {make}\n"
            "    for _ in range(2):  # the second call takes the cached fast path\n"
            "        check_against_eager(f, make_inputs, compiled=compiled)\n"
            '    print("matches eager")\n'
        )


def _tuple(names) -> str:
    names = list(names)
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def materialize(prog: Program) -> tuple[Callable, Callable]:
    """Exec the rendered source; return `(f, make_inputs)`."""
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(prog.source(), "<aotgrad-fuzz>", "exec"), ns)
    return ns["f"], ns["make_inputs"]


# ----------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------

_DTYPES = [("float32", 0.80), ("float64", 0.06), ("int64", 0.05), ("bool", 0.03), ("complex64", 0.06)]
_FLOAT_SCALARS = ["2", "-1", "0.5", "1.5", "-0.25", "3"]
_INT_SCALARS = ["2", "-1", "3", "0"]


def _weighted(rng: random.Random, pairs):
    items, weights = zip(*pairs)
    return rng.choices(items, weights=weights)[0]


def _shape(rng: random.Random, max_ndim: int = 3) -> tuple[int, ...]:
    ndim = _weighted(rng, [(0, 0.1), (1, 0.3), (2, 0.4), (3, 0.2)][: max_ndim + 1])
    return tuple(rng.choice([1, 2, 2, 3, 3, 4]) for _ in range(ndim))


def _make_root(rng: random.Random, name: str) -> tuple[str, tuple[int, ...]]:
    shape = _shape(rng)
    dt = _weighted(rng, _DTYPES)
    if dt in ("float32", "float64", "complex64"):
        expr = f"torch.randn({shape!r}, generator=g, dtype=torch.{dt})"
        if rng.random() < 0.65:
            expr += ".requires_grad_()"
    elif dt == "int64":
        expr = f"torch.randint(-3, 4, {shape!r}, generator=g)"
    else:
        expr = f"torch.randint(0, 2, {shape!r}, generator=g).bool()"
    return f"{name} = {expr}", shape


def _scalar(rng: random.Random, t: torch.Tensor) -> str:
    if t.dtype.is_floating_point or t.is_complex():
        return rng.choice(_FLOAT_SCALARS)
    if t.dtype == torch.bool:
        return rng.choice(["True", "False"])
    return rng.choice(_INT_SCALARS)


def _dim(rng: random.Random, ndim: int, extra: int = 0) -> int:
    """A valid dim for a tensor of `ndim` dims (+`extra` for unsqueeze), sometimes negative."""
    n = max(ndim + extra, 1)
    d = rng.randrange(n)
    return d - n if rng.random() < 0.25 else d


def _reshape_target(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, ...]:
    n = math.prod(shape)
    opts: list[tuple[int, ...]] = [(-1,), (n,)]
    if n == 1:
        opts.append(())
    for i in range(len(shape) - 1):
        opts.append(shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :])
    for i, s in enumerate(shape):
        for a in range(2, s):
            if s % a == 0:
                opts.append(shape[:i] + (a, s // a) + shape[i + 1 :])
    i = rng.randrange(len(shape) + 1)
    opts.append(shape[:i] + (1,) + shape[i:])
    if len(shape) >= 2:
        opts.append((shape[0], -1))
    return rng.choice(opts)


def _shape_src(shape) -> str:
    return repr(tuple(shape))


def _slice_src(rng: random.Random, size: int) -> str:
    if size == 0:
        return ":"
    start = rng.randrange(size)
    stop = rng.randrange(start + 1, size + 1)
    step = rng.choice([1, 1, 1, 2])
    s_start = str(start - size) if rng.random() < 0.2 else (str(start) if start else "")
    s_stop = "" if stop == size and rng.random() < 0.5 else str(stop)
    return f"{s_start}:{s_stop}" + (f":{step}" if step != 1 else "")


def view_expr(rng: random.Random, x: str, t: torch.Tensor) -> str:
    """A random view of the value named `x` whose current value is `t`."""
    nd, shape = t.dim(), tuple(t.shape)
    kinds = [("reshape", 2), ("view", 3), ("unsqueeze", 1.5), ("expand", 1), ("alias", 0.5)]
    if nd >= 1:
        kinds += [("slice", 3), ("select", 2.5), ("unbind", 1), ("split", 1), ("squeeze", 1), ("narrow", 1)]
    if nd >= 2:
        kinds += [("transpose", 2.5), ("diagonal", 1), ("permute", 1)]
    if nd <= 2:
        kinds += [("t", 1.5)]
    if t.is_contiguous() and t.numel() > 0:
        kinds += [("as_strided", 1.5)]
    if t.is_complex():
        kinds += [("real", 1), ("imag", 0.5), ("view_as_real", 1)]
    kind = _weighted(rng, kinds)
    if kind == "reshape":
        return f"{x}.reshape({_shape_src(_reshape_target(rng, shape))})"
    if kind == "view":
        return f"{x}.view({_shape_src(_reshape_target(rng, shape))})"
    if kind == "unsqueeze":
        return f"{x}.unsqueeze({_dim(rng, nd, 1)})"
    if kind == "expand":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if ones and rng.random() < 0.6:
            tgt = list(shape)
            tgt[rng.choice(ones)] = rng.choice([2, 3])
            return f"{x}.expand({_shape_src(tgt)})"
        lead = rng.choice([1, 2, 3])
        return f"{x}.expand({_shape_src((lead,) + shape)})"
    if kind == "alias":
        return rng.choice([f"{x}.view_as({x})", f"{x}[...]", f"{x}.view({_shape_src(shape)})"])
    if kind == "slice":
        d = rng.randrange(nd)
        return f"{x}[{':, ' * d}{_slice_src(rng, shape[d])}]"
    if kind == "narrow":
        d = rng.randrange(nd)
        start = rng.randrange(shape[d]) if shape[d] else 0
        length = rng.randrange(0, shape[d] - start + 1) if shape[d] else 0
        return f"{x}.narrow({d}, {start}, {length})"
    if kind == "select":
        d = rng.randrange(nd)
        if shape[d] == 0:
            return f"{x}[...]"
        i = rng.randrange(shape[d])
        if rng.random() < 0.2:
            i -= shape[d]
        if rng.random() < 0.5:
            return f"{x}[{':, ' * d}{i}]"
        return f"{x}.select({d}, {i})"
    if kind == "unbind":
        d = rng.randrange(nd)
        return f"{x}.unbind({d})[{rng.randrange(max(shape[d], 1))}]"
    if kind == "split":
        d = rng.randrange(nd)
        sz = rng.randrange(1, max(shape[d], 1) + 1)
        n_chunks = max(-(-shape[d] // sz), 1)
        if rng.random() < 0.3:
            return f"{x}.chunk({rng.choice([1, 2, 3])}, {d})[0]"
        return f"{x}.split({sz}, {d})[{rng.randrange(n_chunks)}]"
    if kind == "squeeze":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if ones and rng.random() < 0.7:
            return f"{x}.squeeze({rng.choice(ones)})"
        return f"{x}.squeeze()"
    if kind == "transpose":
        return f"{x}.transpose({_dim(rng, nd)}, {_dim(rng, nd)})"
    if kind == "permute":
        perm = list(range(nd))
        rng.shuffle(perm)
        return f"{x}.permute({', '.join(map(str, perm))})"
    if kind == "diagonal":
        d0, d1 = rng.sample(range(nd), 2)
        return f"{x}.diagonal({rng.choice([0, 0, 1, -1])}, {d0}, {d1})"
    if kind == "t":
        return f"{x}.t()"
    if kind == "as_strided":
        n = t.numel()
        for _ in range(10):
            size = [rng.randint(1, 3) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
            stride = [rng.choice([0, 1, 1, 2, 3, 4]) for _ in size]
            span = sum((s - 1) * st for s, st in zip(size, stride))
            if span <= n - 1:
                off = t.storage_offset() + rng.randint(0, n - 1 - span)
                return f"{x}.as_strided({_shape_src(size)}, {_shape_src(stride)}, {off})"
        return f"{x}.as_strided({_shape_src(shape)}, {_shape_src(t.stride())}, {t.storage_offset()})"
    if kind == "real":
        return f"{x}.real"
    if kind == "imag":
        return f"{x}.imag"
    if kind == "view_as_real":
        return f"torch.view_as_real({x})"
    raise AssertionError(kind)


def _partially_overlaps(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """`dst.op_(src)` reads memory it writes through a different layout (eager's result would depend
    on the order of its loop; functional semantics read everything first)."""
    if src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr() or src.numel() == 0:
        return False
    same = src.shape == dst.shape and src.stride() == dst.stride() and src.storage_offset() == dst.storage_offset()
    return not same


class _Gen:
    """Builds one program, executing every statement eagerly as it goes (so shapes, dtypes and
    eager-validity are known); a statement that raises in eager is dropped and the state replayed."""

    def __init__(self, rng: random.Random, prog: Program):
        self.rng = rng
        self.prog = prog
        self.body: list[Stmt | NoGrad] = []
        self.n_vars = 0
        self._replay()

    # --- state -------------------------------------------------------------------------------
    def _replay(self) -> None:
        f, make_inputs = materialize(self.prog)
        _, args = make_inputs()
        self.ns: dict[str, Any] = {"torch": torch}
        for (p, _), a in zip(self.prog.args, args):
            self.ns[p] = a
        self.live: list[str] = [p for p, _ in self.prog.args]
        for s in self.body:
            self._exec(s)

    def _replay_or_trim(self) -> None:
        """Replay the body; where eager's replay of it raises (eager's view/no_grad checks depend on
        more state than the statements record, e.g. seed 27 program 615), drop trailing statements
        until it replays: the program stays eager-valid instead of crashing the generator."""
        while True:
            try:
                self._replay()
                return
            except Exception:
                if not self.body:
                    raise
                self.body.pop()

    def _exec(self, s: Stmt | NoGrad) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if isinstance(s, NoGrad):
                with torch.no_grad():
                    for b in s.body:
                        exec(b.code, self.ns)
            else:
                exec(s.code, self.ns)
        for name, v in self.ns.items():
            if isinstance(v, torch.Tensor) and name not in self.live:
                self.live.append(name)

    def try_add(self, s: Stmt | NoGrad) -> bool:
        try:
            self._exec(s)
        except Exception:
            self._replay_or_trim()
            return False
        if not torch.is_grad_enabled():  # pragma: no cover - defensive
            torch.set_grad_enabled(True)
        self.body.append(s)
        return True

    # --- picking values ----------------------------------------------------------------------
    def new_var(self) -> str:
        self.n_vars += 1
        return f"v{self.n_vars - 1}"

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True, input_bias: float = 0.25) -> str | None:
        cands = [n for n in self.live if pred(self.ns[n])]
        if not cands:
            return None
        inputs = [n for n in cands if n.startswith("a")]
        if inputs and self.rng.random() < input_bias:
            return self.rng.choice(inputs)
        weights = [1.0 + i for i in range(len(cands))]  # prefer recent values
        return self.rng.choices(cands, weights=weights)[0]

    def t(self, name: str) -> torch.Tensor:
        return self.ns[name]

    # --- statements ----------------------------------------------------------------------------
    def stmt(self, allow_block: bool = True) -> Stmt | NoGrad:
        kinds = [("view", 30), ("outofplace", 25), ("inplace", 25), ("meta", 6), ("detach", 4)]
        if allow_block:
            kinds.append(("nograd", 8))
        kind = _weighted(self.rng, kinds)
        if kind == "nograd":
            return NoGrad(tuple(self.stmt(False) for _ in range(self.rng.randint(1, 3))))
        return Stmt(getattr(self, "_" + kind)())

    def _view(self) -> str:
        x = self.pick()
        return f"{self.new_var()} = {view_expr(self.rng, x, self.t(x))}"

    def _detach(self) -> str:
        x = self.pick()
        if self.rng.random() < 0.15:
            return f"{x}.detach_()"
        return f"{self.new_var()} = {x}.detach()"

    def _other(self, t: torch.Tensor, inplace: bool) -> str | None:
        def fits(o: torch.Tensor) -> bool:
            try:
                b = torch.broadcast_shapes(t.shape, o.shape)
            except RuntimeError:
                return False
            return b == t.shape if inplace else True

        return self.pick(fits, input_bias=0.15)

    def _outofplace(self) -> str:
        rng = self.rng
        x = self.pick()
        t = self.t(x)
        kind = _weighted(rng, [("binary", 5), ("unary", 5), ("sum", 2), ("matmul", 1.5), ("clone", 2),
                               ("convert", 1), ("cat", 0.7)])
        out = self.new_var()
        if kind == "binary":
            op = rng.choice(["+", "*", "-"])
            y = self._other(t, False) if rng.random() < 0.7 else None
            rhs = y if y is not None else _scalar(rng, t)
            if rng.random() < 0.2:
                return f"{out} = torch.add({x}, {rhs}, alpha=2)"
            return f"{out} = {x} {op} {rhs}"
        if kind == "unary":
            fn = rng.choice(["sin", "exp", "cos", "neg", "tanh", "abs"])
            return f"{out} = {x}.{fn}()"
        if kind == "sum":
            if t.dim() == 0 or rng.random() < 0.25:
                return f"{out} = {x}.sum()"
            keep = ", keepdim=True" if rng.random() < 0.3 else ""
            return f"{out} = {x}.sum({_dim(rng, t.dim())}{keep})"
        if kind == "matmul":
            def fits(o: torch.Tensor) -> bool:
                if t.dim() == 0 or o.dim() == 0 or o.dtype != t.dtype:
                    return False
                return t.shape[-1] == (o.shape[0] if o.dim() == 1 else o.shape[-2])

            y = self.pick(fits)
            if y is not None:
                return f"{out} = {x} @ {y}"
            return f"{out} = {x} * {x}"
        if kind == "clone":
            return f"{out} = " + rng.choice([f"{x}.clone()", f"{x}.clone()", f"{x}.contiguous()"])
        if kind == "convert":  # returns self when nothing changes: an alias
            return f"{out} = " + rng.choice([f"{x}.float()", f"{x}.to(torch.float32)", f"{x}.double()"])
        if kind == "cat":
            y = self.pick(lambda o: o.dim() == t.dim() and o.dim() >= 1 and o.shape[1:] == t.shape[1:]
                          and o.dtype == t.dtype)
            return f"{out} = torch.cat([{x}, {y or x}])"
        raise AssertionError(kind)

    def _inplace(self) -> str:
        rng = self.rng
        x = self.pick(input_bias=0.3)
        t = self.t(x)
        target = x
        if rng.random() < 0.25:
            target = view_expr(rng, x, t)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = eval(target, self.ns)
            except Exception:
                target, t = x, self.t(x)
        kind = _weighted(rng, [("add_", 4), ("mul_", 3), ("zero_", 1.5), ("copy_", 2), ("fill_", 1),
                               ("clamp_", 1), ("sin_", 0.7), ("sub_", 0.7)])
        if kind in ("add_", "mul_", "sub_", "copy_"):
            y = self._other(t, True) if (kind == "copy_" or rng.random() < 0.5) else None
            if y is not None and _partially_overlaps(self.t(y), t):
                y = None  # eager's result then depends on its loop order: not a well-defined program
            if kind == "copy_" and y is None:
                kind = "fill_"
            else:
                call = f"{target}.{kind}({y if y is not None else _scalar(rng, t)})"
                return self._maybe_assign(call)
        if kind == "zero_":
            return self._maybe_assign(f"{target}.zero_()")
        if kind == "fill_":
            return self._maybe_assign(f"{target}.fill_({_scalar(rng, t)})")
        if kind == "clamp_":
            return self._maybe_assign(f"{target}.clamp_({rng.choice(['-1', '-0.5', '0'])}, {rng.choice(['0.5', '1'])})")
        return self._maybe_assign(f"{target}.{kind}()")

    def _maybe_assign(self, call: str) -> str:
        if self.rng.random() < 0.15:
            return f"{self.new_var()} = {call}"
        return call

    def _meta(self) -> str:
        rng = self.rng
        x = self.pick(input_bias=0.35)
        t = self.t(x)
        nd = t.dim()
        opts = ["unsqueeze_"]
        if nd <= 2:
            opts.append("t_")
        if nd >= 2:
            opts.append("transpose_")
        if nd >= 1:
            opts.append("squeeze_")
        kind = rng.choice(opts)
        if kind == "t_":
            return f"{x}.t_()"
        if kind == "transpose_":
            return f"{x}.transpose_({_dim(rng, nd)}, {_dim(rng, nd)})"
        if kind == "unsqueeze_":
            return f"{x}.unsqueeze_({_dim(rng, nd, 1)})"
        ones = [i for i, s in enumerate(t.shape) if s == 1]
        if ones and rng.random() < 0.7:
            return f"{x}.squeeze_({rng.choice(ones)})"
        return f"{x}.squeeze_()"

    # --- returns -----------------------------------------------------------------------------
    def returns(self) -> tuple[tuple[str, ...], bool]:
        rng = self.rng
        k = _weighted(rng, [(1, 3), (2, 3), (3, 2), (4, 1)])
        outs: list[str] = []
        for _ in range(k):
            if outs and rng.random() < 0.12:
                outs.append(rng.choice(outs))  # the same value twice
            else:
                outs.append(self.pick(input_bias=0.2))
        return tuple(outs), k == 1 and rng.random() < 0.5


def _inputs(rng: random.Random, seed: int) -> Program:
    setup: list[str] = []
    roots: list[str] = []
    args: list[tuple[str, str]] = []
    n_roots = _weighted(rng, [(1, 4), (2, 4), (3, 2)])
    for i in range(n_roots):
        r = f"r{i}"
        line, shape = _make_root(rng, r)
        setup.append(line)
        roots.append(r)
        mode = _weighted(rng, [("leaf", 3), ("clone", 4), ("views", 1.5), ("dup", 1), ("leafview", 0.5)])
        if mode in ("views", "leafview") and not shape:
            mode = "clone"
        if mode == "leaf":
            args.append((f"a{len(args)}", r))
        elif mode == "clone":
            c = f"c{i}"
            setup.append(f"{c} = {r}.clone()")
            args.append((f"a{len(args)}", c))
        elif mode == "dup":
            base = r if rng.random() < 0.4 else f"c{i}"
            if base != r:
                setup.append(f"{base} = {r}.clone()")
            args.append((f"a{len(args)}", base))
            args.append((f"a{len(args)}", base))
        else:
            base = r
            if mode == "views":
                base = f"c{i}"
                setup.append(f"{base} = {r}.clone()")
            ev_ns: dict[str, Any] = {"torch": torch, "g": torch.Generator().manual_seed(seed)}
            exec("\n".join(setup), ev_ns)
            n_views = 2 if mode == "views" else 1
            for j in range(n_views):
                if rng.random() < 0.2 and mode == "views":
                    args.append((f"a{len(args)}", base))  # the base itself next to a view of it
                    continue
                for _ in range(10):
                    e = view_expr(rng, base, ev_ns[base])
                    try:
                        eval(e, ev_ns)
                        break
                    except Exception:
                        e = base
                name = f"x{i}_{j}"
                setup.append(f"{name} = {e}")
                args.append((f"a{len(args)}", name))
    if len(args) > 1 and rng.random() < 0.3:
        rng.shuffle(args)
        args = [(f"a{k}", e) for k, (_, e) in enumerate(args)]
    return Program(seed=seed, setup=tuple(setup), roots=tuple(roots), args=tuple(args), body=(), returns=())


def generate(seed: int, index: int = 0) -> Program:
    """The program number `index` of run `seed` (deterministic)."""
    pseed = seed * 1_000_003 + index
    rng = random.Random(pseed)
    prog = _inputs(rng, pseed % 2**31)
    gen = _Gen(rng, prog)
    n = _weighted(rng, [(rng.randint(1, 4), 3), (rng.randint(5, 9), 4), (rng.randint(10, 14), 2)])
    tries = 0
    while len(gen.body) < n and tries < 4 * n + 10:
        tries += 1
        n_vars = gen.n_vars
        if not gen.try_add(gen.stmt()):
            gen.n_vars = n_vars
    returns, single = gen.returns()
    config: tuple = ()
    if rng.random() < 0.3:
        config = (("keep_inference_input_mutations", True),)
    prog = dataclasses.replace(prog, body=tuple(gen.body), returns=returns, single=single, config=config)
    return maybe_close_over(pseed, prog, Stmt)


# ----------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------


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
    frames = traceback.extract_tb(tb)
    if not frames:
        return False
    last = frames[-1].filename.replace(os.sep, "/")
    return last.endswith("aotgrad/testing.py") or "/torch/testing/" in last


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
    prog: Program, *, eager_checked: bool = False, explain_mismatch: bool = True, backend: str | None = None
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


# ----------------------------------------------------------------------------------------------
# Shrinker
# ----------------------------------------------------------------------------------------------


def _candidates(prog: Program):
    """Smaller variants of `prog`, biggest cuts first."""
    body = list(prog.body)
    for i in range(len(body)):  # drop a statement / a whole block
        yield dataclasses.replace(prog, body=tuple(body[:i] + body[i + 1 :]))
    for i, s in enumerate(body):
        if isinstance(s, NoGrad):
            yield dataclasses.replace(prog, body=tuple(body[:i] + list(s.body) + body[i + 1 :]))  # unwrap
            for j in range(len(s.body)):
                inner = s.body[:j] + s.body[j + 1 :]
                if inner:
                    yield dataclasses.replace(prog, body=tuple(body[:i] + [NoGrad(inner)] + body[i + 1 :]))
    for i in range(len(prog.returns)):
        if len(prog.returns) > 1:
            yield dataclasses.replace(prog, returns=prog.returns[:i] + prog.returns[i + 1 :])
    if len(prog.returns) == 1 and prog.single:
        yield dataclasses.replace(prog, single=False)
    if prog.config:
        yield dataclasses.replace(prog, config=())
    for i in range(len(prog.args)):  # drop an argument
        if len(prog.args) > 1:
            yield dataclasses.replace(prog, args=prog.args[:i] + prog.args[i + 1 :])
    for i, line in enumerate(prog.setup):  # simpler inputs
        if ".requires_grad_()" in line:
            yield dataclasses.replace(prog, setup=_replace(prog.setup, i, line.replace(".requires_grad_()", "")))
        if "dtype=torch.float64" in line or "dtype=torch.complex64" in line:
            yield dataclasses.replace(
                prog, setup=_replace(prog.setup, i, re.sub(r"torch\.(float64|complex64)", "torch.float32", line))
            )
    for i, (p, e) in enumerate(prog.args):  # pass the clone / the root instead of a view
        for alt in _arg_alternatives(prog, e):
            yield dataclasses.replace(prog, args=prog.args[:i] + ((p, alt),) + prog.args[i + 1 :])


def _arg_alternatives(prog: Program, e: str) -> list[str]:
    defs = {line.split(" = ", 1)[0]: line.split(" = ", 1)[1] for line in prog.setup}
    rhs = defs.get(e, "")
    m = re.match(r"([rc]\d+)\b", rhs)
    return [m.group(1)] if m and m.group(1) != e else []


def _replace(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def _clean(prog: Program) -> Program:
    """Drop setup lines and roots no argument needs (does not change behaviour)."""
    used = {e for _, e in prog.args}
    setup = list(prog.setup)
    changed = True
    while changed:
        changed = False
        for line in list(setup):
            name, rhs = line.split(" = ", 1)
            if name not in used:
                if any(re.search(rf"\b{name}\b", other.split(" = ", 1)[1]) for other in setup if other is not line):
                    continue
                setup.remove(line)
                changed = True
        used |= {n for line in setup for n in re.findall(r"\b[rc]\d+\b", line.split(" = ", 1)[1])}
    names = {line.split(" = ", 1)[0] for line in setup}
    roots = tuple(r for r in prog.roots if r in names)
    return dataclasses.replace(prog, setup=tuple(setup), roots=roots)


def shrink(
    prog: Program, target: Outcome | None, budget: int = 400,
    still_fails: Callable[[Program], bool] | None = None,
) -> Program:
    """Greedy one-at-a-time reduction while eager still runs and `check_program` fails the same way
    as `target` (or while `still_fails(program)`, if given)."""
    if still_fails is None:
        assert target is not None

        def still_fails(p: Program) -> bool:
            return check_program(p).same_failure(target)

    steps = 0
    improved = True
    while improved and steps < budget:
        improved = False
        for cand in _candidates(prog):
            steps += 1
            if steps > budget:
                break
            if still_fails(cand):
                prog = cand
                improved = True
                break
    cleaned = _clean(prog)
    if cleaned != prog and still_fails(cleaned):
        prog = cleaned
    return prog


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


@dataclass
class Failure:
    index: int
    outcome: Outcome
    program: Program
    shrunk: Program | None = None
    shrunk_outcome: Outcome | None = None  # the failure as the shrunk program shows it
    path: str | None = None


@dataclass
class Summary:
    seed: int
    n: int = 0
    skipped: int = 0
    counts: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    crashed: Counter = field(default_factory=Counter)
    mismatched: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    def add(self, index: int, prog: Program, out: Outcome) -> Failure | None:
        self.n += 1
        if out.kind == "skipped":
            self.skipped += 1
            return None
        self.counts[out.kind] += 1
        if out.kind == "refused":
            self.refused[out.key] += 1
        elif out.kind in ("crashed", "mismatched"):
            getattr(self, out.kind)[out.key] += 1
            fail = Failure(index, out, prog)
            self.failures.append(fail)
            return fail
        return None

    def report(self, top: int = 10) -> str:
        checked = sum(self.counts.values())
        lines = [
            f"programs: {self.n} (seed {self.seed}); eager raised, skipped: {self.skipped}; checked: {checked}",
            "  " + "  ".join(f"{k}: {self.counts[k]}" for k in KINDS),
        ]
        for kind, groups in (("refused", self.refused), ("crashed", self.crashed), ("mismatched", self.mismatched)):
            if groups:
                lines.append(f"{kind} (top {top} of {len(groups)} messages):")
                for key, c in groups.most_common(top if kind == "refused" else None):
                    lines.append(f"  {c:6d}  {key}")
        if self.failures:
            lines.append("reproducers:")
            seen = set()
            for fl in self.failures:
                if fl.path and (fl.outcome.kind, fl.outcome.key) not in seen:
                    seen.add((fl.outcome.kind, fl.outcome.key))
                    lines.append(f"  {fl.path}  ({fl.outcome.kind}: {fl.outcome.key[:90]})")
        return "\n".join(lines)


def write_reproducer(fail: Failure, seed: int, out_dir: str, backend: str | None = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    prog = fail.shrunk or fail.program
    out = fail.shrunk_outcome if fail.shrunk_outcome is not None else fail.outcome
    kind = "crash" if fail.outcome.kind == "crashed" else "mismatch"
    path = os.path.join(out_dir, f"{kind}_{seed}_{fail.index}.py")
    header = (
        f"aotgrad fuzz reproducer: {fail.outcome.kind}, seed {seed}, program {fail.index}"
        f" ({'shrunk' if fail.shrunk else 'not shrunk'}; regenerate with aotgrad.fuzz.generate({seed}, {fail.index}))\n"
        f"key: {fail.outcome.key}\n"
        + "\n".join(out.message.splitlines()[:12])
        + "".join(f"\nat {w}" for w in _where(out.detail))
    )
    with open(path, "w") as fh:
        fh.write(prog.reproducer(header, backend))
    return path


def _where(tb_text: str, n: int = 3) -> list[str]:
    """The innermost `n` frames of a formatted traceback, one line each."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb_text or "")
    return [f"{os.path.basename(f)}:{line} {fn}" for f, line, fn in frames[-n:]]


class Progress:
    """A one-line progress bar on a terminal (plain periodic lines otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.last_line = -1

    def update(self, done: int, summary: Summary) -> None:
        c = summary.counts
        stats = (f"matched {c['matched']} refused {c['refused']} crashed {c['crashed']} "
                 f"mismatched {c['mismatched']} skipped {summary.skipped}")
        if self.tty:
            fill = int(self.width * done / max(self.total, 1))
            bar = "#" * fill + "." * (self.width - fill)
            self.stream.write(f"\r[{bar}] {done}/{self.total} {stats}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            pct = int(10 * done / max(self.total, 1))
            if pct != self.last_line or done == self.total:
                self.last_line = pct
                self.stream.write(f"{done}/{self.total} {stats}\n")
                self.stream.flush()


def run(
    n: int,
    seed: int = 0,
    *,
    shrink_failures: bool = True,
    shrink_per_key: int = 3,
    out_dir: str | None = "fuzz-repros",
    progress: Progress | None = None,
    start: int = 0,
    backend: str | None = None,
) -> Summary:
    """Generate and check programs `start .. start+n-1` of run `seed` (through `torch.compile` with
    `backend`, if given).

    Crashes and mismatches are shrunk (at most `shrink_per_key` per distinct failure message; the
    others are written as generated) and written to `out_dir` (None: keep them in the summary only).
    """
    summary = Summary(seed)
    shrunk_keys: Counter = Counter()
    check = functools.partial(check_program, backend=backend)
    for k, i in enumerate(range(start, start + n)):
        prog = generate(seed, i)
        out = check(prog)
        fail = summary.add(i, prog, out)
        if fail is not None:
            key = (out.kind, out.key)
            if shrink_failures and shrunk_keys[key] < shrink_per_key:
                shrunk_keys[key] += 1
                fail.shrunk = shrink(prog, out, still_fails=lambda p, out=out: check(p).same_failure(out))
                fail.shrunk_outcome = check(fail.shrunk)
            if out_dir is not None:
                fail.path = write_reproducer(fail, seed, out_dir, backend)
        if progress is not None:
            progress.update(k + 1, summary)
    return summary
