"""Test fixtures shared by several test files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch
import torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils import _pytree as pytree

import aotgrad
from aotgrad.compile.compilers import nop
from aotgrad.signature.subclass_layout import is_subclass, layout_of


class BwMutatesBuffer(torch.autograd.Function):
    """Like Float8 scaling: the backward updates a buffer that does not require grad."""

    @staticmethod
    def forward(ctx, x, buf):
        ctx.save_for_backward(buf)
        return x * buf

    @staticmethod
    def backward(ctx, g):
        (buf,) = ctx.saved_tensors
        buf.add_(1)
        return g * buf, None


class BackwardTransposesSaved(torch.autograd.Function):
    """Its backward transposes a saved input in place: a metadata mutation in the backward, which
    aotgrad refuses (BackwardMutationError)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(b)
        return a.clone(), b.clone()

    @staticmethod
    def backward(ctx, ga, gb):
        (b,) = ctx.saved_tensors
        b.transpose_(1, 0)
        return ga.clone(), gb.clone()


class GraphRecorder:
    """A nop compiler that keeps the graphs it was given."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, _example):
        self.graphs.append(gm)
        return gm.forward

    def targets(self, graph: int | None = None, among=None) -> list:
        """The call_function targets of graph `graph` (all graphs when None), only those in `among`."""
        graphs = self.graphs if graph is None else [self.graphs[graph]]
        return [n.target for g in graphs for n in g.graph.nodes
                if n.op == "call_function" and (among is None or n.target in among)]


class Energy(nn.Module):
    """A force-field energy: an MLP over the pairwise distances; forces = -dE/dpos inside the model
    (`autograd.grad(create_graph=True)`), so training it is a second-order gradient."""

    def __init__(self, h=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1))

    def forward(self, pos):
        diff = pos[:, None, :] - pos[None, :, :]
        d = diff.pow(2).sum(-1).add(1e-3).sqrt()
        e = self.net(d.reshape(-1, 1)).sum()
        (f,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -f


class Critic(nn.Module):
    """A small WGAN-GP critic (gradient-penalty tests)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.Softplus(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def eager_runs_and_shows(text: str, render: str = "source"):
    """A shrinker predicate: "the bug" is `text` in the program (`render`: "source" or "render_f")
    in a program eager still runs."""
    from aotgrad.testing import fuzz

    def still_fails(p) -> bool:
        if text not in getattr(p, render)():
            return False
        f, make_inputs = fuzz.materialize(p)
        try:
            f(*make_inputs()[1])
        except Exception:
            return False
        return True

    return still_fails


def run_source(compiled) -> str:
    """The generated run-time source of a compiled function's one fast-path signature."""
    (_, run), = compiled.fast
    return run.__aotgrad_source__


def is_fused_run(compiled) -> bool:
    """The subclass run is ONE autograd.Function (subclass_runtime.build_fused_run)."""
    src = run_source(compiled)
    return src.count("_apply") == 1 and "_unwrap" not in src and "_wrap" not in src


def counting_compiler(compiler=None):
    """A compiler that records each graph it gets (`.calls`) and hands it to `compiler` (nop)."""
    from aotgrad import nop

    compiler = compiler or nop
    calls = []

    def c(gm, example_inputs):
        calls.append(gm)
        return compiler(gm, example_inputs)

    c.calls = calls
    return c


# ---------------------------------------------------------------------------------------------
# Tensor subclasses: arguments cloned with their nesting, compared with eager component by component


def _clone(x):
    """A deep copy of an argument keeping type, nesting, requires_grad and leaf-ness."""
    if not isinstance(x, torch.Tensor):
        return x
    rg = x.requires_grad
    with torch.no_grad():
        if is_subclass(x):
            attrs, ctx = x.__tensor_flatten__()
            inner = {a: _clone(getattr(x, a)) for a in attrs}
            c = type(x).__tensor_unflatten__(inner, ctx, x.shape, x.stride())
        else:
            c = x.clone()
    return c.requires_grad_(rg) if rg else c


def assert_same(a, b, what="value"):
    assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    if not isinstance(a, torch.Tensor):
        assert a == b, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert a.requires_grad == b.requires_grad, f"{what}: requires_grad"
    assert (a.grad_fn is None) == (b.grad_fn is None), f"{what}: grad_fn {a.grad_fn} vs {b.grad_fn}"
    if is_subclass(a):
        la, lb = layout_of(a), layout_of(b)
        assert la.ctx_key == lb.ctx_key and la.attrs == lb.attrs, f"{what}: flatten context"
        for attr in la.attrs:
            assert_same(getattr(a, attr).detach(), getattr(b, attr).detach(), f"{what}.{attr}")
    else:
        torch.testing.assert_close(a.detach(), b.detach(), msg=what)


def run_both(fn, make_inputs, compiler=nop, backward=True, **aot_kwargs):
    """Run `fn` eagerly and through aot_function on equal inputs; compare everything."""
    eager_in = make_inputs()
    memo: dict = {}
    ours_in = [memo.setdefault(id(x), _clone(x)) for x in eager_in]  # keeps which arguments are one object
    compiled = aotgrad.aot_function(fn, compiler, **aot_kwargs)
    expected = fn(*eager_in)
    got = compiled(*ours_in)
    assert_same(got, expected, "output") if not isinstance(got, tuple) else [
        assert_same(g, e, f"output {i}") for i, (g, e) in enumerate(zip(got, expected))
    ]
    for i, (x, y) in enumerate(zip(ours_in, eager_in)):
        assert_same(x, y, f"input {i} after the call")
    if backward:
        def losses(outs):  # one backward per output: each gets a gradient of its own type
            return [o.sum() for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]

        le, lg = losses(expected), losses(got)
        if le:
            torch.autograd.backward(le)
            torch.autograd.backward(lg)
            for i, (x, y) in enumerate(zip(ours_in, eager_in)):
                if isinstance(y, torch.Tensor) and y.requires_grad and y.is_leaf:
                    assert y.grad is not None
                    assert_same(x.grad, y.grad, f"grad of input {i}")
    return compiled, got, ours_in


def check_nonleaf_subclass_argument(fn, *shape, calls=3):
    """`fn` over a TwoTensor computed from a leaf requiring grad (a non-leaf with history), eagerly
    and compiled, over `calls` calls of one compiled function: outputs, the argument after the call,
    its version and the leaf's gradient of every output and the argument itself."""
    compiled = aotgrad.aot_function(fn, nop)
    for seed in range(calls):
        results = []
        for run in (fn, compiled):
            torch.manual_seed(seed)
            root = two(*shape)
            arg = root * 2
            outs = pytree.tree_leaves(run(arg))
            loss = sum(o.exp().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
            results.append((outs, arg, arg._version, torch.autograd.grad(loss + arg.sum(), root)[0]))
        (eo, ea, ev, eg), (go, ga, gv, gg) = results
        for k, (g, e) in enumerate(zip(go, eo)):
            assert_same(g, e, f"output {k}")
        assert_same(ga, ea, "argument after the call")
        assert gv == ev, "version"
        assert_same(gg, eg, "gradient")


def two(*shape, requires_grad=True):
    t = TwoTensor(torch.randn(*shape), torch.randn(*shape))
    return t.requires_grad_() if requires_grad else t


def nested(*shape, requires_grad=True):
    t = TwoTensor(two(*shape, requires_grad=False), two(*shape, requires_grad=False))
    return t.requires_grad_() if requires_grad else t


class Counting:
    """A backend that counts the graphs Dynamo hands to aotgrad."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_test_module(folder: str, name: str):
    """Another folder's test module (tests/<folder>/<name>.py), imported as pytest imports it (by
    its bare name, with its folder on sys.path), so both share one module object."""
    import importlib
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def assert_grads_close(eager: nn.Module, compiled: nn.Module, *, rtol: float = 1e-3, rel_atol: float = 1e-4,
                       floor: float = 1e-6) -> None:
    """Every parameter's gradient against eager's, each at its own tolerance: `rtol`, and an absolute
    tolerance of `rel_atol` times that parameter's largest eager gradient, so a parameter with small
    gradients is held to its own scale, not the model's. The absolute tolerance never drops below
    `floor` times the model's largest gradient: a gradient that is zero in exact arithmetic (a conv
    bias before BatchNorm) is float32 rounding noise (about 1e-8 here) in eager and compiled alike.
    A gradient eager leaves None must be None."""
    named = list(eager.named_parameters())
    model_scale = max((p.grad.abs().max().item() for _, p in named if p.grad is not None), default=0.0)
    for (name, p), q in zip(named, compiled.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is None:
            continue
        atol = max(rel_atol * p.grad.abs().max().item(), floor * model_scale, 1e-12)
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def refusal_reason(key: str, width: int = 60) -> str:
    """A fuzz refusal's key (`Type: aotgrad: message`, numbers normalised) cut to its error type and
    the start of its reason: the unit a fuzz gate's refusal budget counts."""
    kind, _, msg = key.partition(": ")
    return f"{kind}: {msg.removeprefix('aotgrad: ')[:width]}"


def assert_fuzz_gate(summary, mode: str, budgets: dict[str, int], total: int | None = None) -> None:
    """A fuzz gate: no crash, no mismatch, and refusals within their budget, printed with the result.

    `budgets` maps each accepted refusal (refusal_reason: error type and the start of its reason) to
    the most programs it may refuse: the counts measured when the budget was set, so they can only
    fall. A refusal not in `budgets` fails the gate. `total` (runs too long to measure per reason):
    the most refusals in all, any reason."""
    seen: dict[str, int] = {}
    for key, count in summary.refused.items():
        seen[refusal_reason(key)] = seen.get(refusal_reason(key), 0) + count
    refused, checked = summary.counts["refused"], sum(summary.counts.values())
    over = {r: (c, budgets.get(r, 0)) for r, c in seen.items() if total is None and c > budgets.get(r, 0)}
    line = (f"fuzz gate [{mode}], seed {summary.seed}, {summary.n} programs: {checked} checked, "
            f"{summary.counts['matched']} matched, {refused} refused ({100 * refused / max(checked, 1):.1f}%), "
            f"budget {total if total is not None else sum(budgets.values())}; "
            f"crashed {summary.counts['crashed']}, mismatched {summary.counts['mismatched']}")
    print(line)
    print(summary.report())
    assert summary.counts["mismatched"] == 0 and summary.counts["crashed"] == 0, line + "\n" + summary.report()
    assert not over, line + "\nrefusals over their budget (seen, budget):\n" + "\n".join(
        f"  {c} > {b}  {r}" for r, (c, b) in sorted(over.items()))
    if total is not None:
        assert refused <= total, line


def assert_same_results(a, b, exact: bool, where: str = "") -> None:
    """Results of two runs (dicts, lists, tensors, plain values) equal, bitwise where `exact`."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_results(a[k], b[k], exact, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_results(x, y, exact, f"{where}[{k}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if exact:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"{where}: {m}")
    else:
        assert a == b, where


def run_job_script(script: str, mode: str, backend: str, folder, cache_dir) -> dict:
    """Run `python SCRIPT MODE BACKEND FOLDER` in a fresh process with its own Inductor cache folder
    and aotgrad's on-disk cache on (a save or a load of a precompile round trip); the results it
    saved to FOLDER/MODE.pt."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "AOTGRAD_CACHE": "1"}
    proc = subprocess.run([sys.executable, script, mode, backend, str(folder)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return torch.load(os.path.join(str(folder), f"{mode}.pt"), weights_only=False)
