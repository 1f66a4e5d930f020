"""The fuzzer's programs and their generator: `Stmt`/`NoGrad`/`Program` (straight-line statements that
render to Python source) and `generate(seed, index)`, deterministic per `(seed, index)`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .closures import maybe_close_over


@dataclass(frozen=True)
class Stmt:
    """One line of the function body, e.g. ``v3 = v1.t()`` or ``a0.add_(2)``."""

    code: str

    def render(self, indent: str) -> list[str]:
        return [indent + self.code]


@dataclass(frozen=True)
class NoGrad:
    """``with torch.no_grad():`` around some statements, or another context (`REGIONS`): a grad-mode
    or autocast region, whose state the compiled code must reproduce op by op."""

    body: tuple[Stmt | NoGrad, ...]
    context: str = "torch.no_grad()"

    def render(self, indent: str) -> list[str]:
        lines = [indent + f"with {self.context}:"]
        for s in self.body:
            lines += s.render(indent + "    ")
        return lines


# Contexts of a block, weighted: grad mode off (most mutations-under-no_grad bugs live there), and the
# autocast states a program switches between (the CPU's lower precision, and a float32 region).
REGIONS = [
    ("torch.no_grad()", 8),
    ('torch.autocast("cpu", dtype=torch.bfloat16)', 3),
    ('torch.autocast("cpu", enabled=False)', 1),
]


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
        return sum(_count(s) for s in self.body)

    def reproducer(self, header: str = "", backend: str | None = None, *, subclass: bool = False,
                   order: int = 1, autocast: bool = False) -> str:
        """A standalone script that runs this program as the fuzzer checked it: the same compile
        (`aot_function` options, or `torch.compile` with `backend`), the same input wrapping
        (`subclass`: every floating tensor `make_inputs` creates a TwoTensor, fuzz_subclass.py), the
        same caller state (`autocast`: fuzz/autocast.py) and the same check (`order` 2: first and
        second gradients, fuzz_order2.py); it prints "matches eager" only if that check passes."""
        kw = "".join(f", {k}={v!r}" for k, v in self.config)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        make = f"torch.compile(f, backend={backend!r})" if backend else f"aot_function(f, nop{kw})"
        imports = "from aotgrad import aot_function, nop\n"
        if order == 2:
            imports += "from aotgrad.testing.fuzz.order2 import check_second_order\n"
            check = "check_second_order(f, make_inputs, compiled)"
        else:
            imports += "from aotgrad.testing import check_against_eager\n"
            check = "check_against_eager(f, make_inputs, compiled=compiled)"
        wrap = ""
        if subclass:
            imports += "from aotgrad.testing.fuzz.subclass import with_two_tensor_inputs\n"
            wrap = "    make_inputs = with_two_tensor_inputs(make_inputs)  # floating inputs are TwoTensors, as in the run\n"
        indent = "        "
        caller = ""
        if autocast:
            imports += "from aotgrad.testing.fuzz.autocast import callers_autocast\n"
            caller = "        with callers_autocast():  # called and differentiated under bfloat16 autocast, as in the run\n"
            indent += "    "
        return (
            f"{comment}import torch\n\n{imports}\n\n"
            f"{self.source()}\n\n"
            'if __name__ == "__main__":\n'
            f"{wrap}"
            f"    compiled = {make}\n"
            "    for _ in range(2):  # the second call takes the cached fast path\n"
            f"{caller}{indent}{check}\n"
            '    print("matches eager")\n'
        )


def _count(s: Stmt | NoGrad) -> int:
    return sum(_count(b) for b in s.body) if isinstance(s, NoGrad) else 1


def _tuple(names) -> str:
    names = list(names)
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def materialize(prog: Program) -> tuple[Callable, Callable]:
    """Exec the rendered source; return `(f, make_inputs)`."""
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(prog.source(), "<aotgrad-fuzz>", "exec"), ns)
    return ns["f"], ns["make_inputs"]


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
            exec("\n".join(s.render("")), self.ns)
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
    def stmt(self, allow_block: bool = True, in_no_grad: bool = False) -> Stmt | NoGrad:
        kinds = [("view", 30), ("outofplace", 25), ("inplace", 25), ("meta", 6), ("detach", 4),
                 ("requires_grad", 0.7)]
        if allow_block:
            kinds.append(("block", 12))
        if in_no_grad:
            kinds.append(("enable_grad", 3))
        kind = _weighted(self.rng, kinds)
        if kind in ("block", "enable_grad"):
            context = _weighted(self.rng, REGIONS) if kind == "block" else "torch.enable_grad()"
            nested = context == "torch.no_grad()"
            body = tuple(self.stmt(False, in_no_grad=nested) for _ in range(self.rng.randint(1, 3)))
            return NoGrad(body, context)
        return Stmt(getattr(self, "_" + kind)())

    def _requires_grad(self) -> str:
        """A value the program turns into an autograd leaf (eager allows it on leaves only)."""
        def fresh_leaf(t: torch.Tensor) -> bool:
            try:  # reading autograd metadata of a no_grad view whose base changed since raises
                return t.is_floating_point() and t.is_leaf and not t.requires_grad
            except RuntimeError:
                return False

        x = self.pick(fresh_leaf)
        if x is None:
            return self._outofplace()
        return f"{x}.requires_grad_()"

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
