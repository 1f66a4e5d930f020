"""CUDA checks: aotgrad against eager on a GPU, one short run.

The CI machines have no GPU, so the CUDA paths are kept correct by design and checked here when a
GPU is at hand: `python scripts/cuda_check.py` prints one line per check and exits 1 if any check
disagrees with eager. Each check compares outputs, gradients, inputs after mutation and aliasing
with eager on the same device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn

import aotgrad

DEV = "cuda"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def close(a, b, what, atol=1e-5, rtol=1e-4):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} values"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{what}[{i}]", atol, rtol)
        return
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None"
        return
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    assert a.device == b.device, f"{what}: device {a.device} vs {b.device}"
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def leaves(*shapes, dtype=torch.float32, grad=True):
    torch.manual_seed(0)
    return [torch.randn(s, device=DEV, dtype=dtype, requires_grad=grad) for s in shapes]


def clone(ts):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


@check
def mlp_nop():
    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).tanh()

    a = leaves((64, 32), (32, 48), (48, 16))
    b = clone(a)
    out_e = f(*a)
    out_e.sum().backward()
    out_c = aotgrad.aot_function(f, aotgrad.nop)(*b)
    out_c.sum().backward()
    close(out_c, out_e, "out")
    close([t.grad for t in b], [t.grad for t in a], "grads")


@check
def mutation_and_alias():
    def f(x, y):
        x.mul_(2)
        return x.view(-1), y + x.sum()

    xe, ye = torch.randn(4, 5, device=DEV), torch.randn(3, device=DEV, requires_grad=True)
    xc, yc = xe.clone(), ye.detach().clone().requires_grad_()
    oe = f(xe, ye)
    oc = aotgrad.aot_function(f, aotgrad.nop)(xc, yc)
    close(oc, oe, "outputs")
    close(xc, xe, "mutated input")
    assert oc[0].data_ptr() == xc.data_ptr() and oc[0]._base is xc, "output 0 must be a view of x"
    oe[1].sum().backward()
    oc[1].sum().backward()
    close(yc.grad, ye.grad, "grad y")


@check
def batchnorm_module():
    torch.manual_seed(0)
    me = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).to(DEV)
    mc = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).to(DEV)
    mc.load_state_dict(me.state_dict())
    x = torch.randn(4, 3, 16, 16, device=DEV)
    cm = aotgrad.aot_module(mc, aotgrad.nop)
    for _ in range(2):
        me(x).square().mean().backward()
        cm(x).square().mean().backward()
    close([p.grad for p in mc.parameters()], [p.grad for p in me.parameters()], "param grads", atol=1e-4)
    close(list(mc.buffers()), list(me.buffers()), "buffers")


@check
def dropout_rng():
    def f(x):
        return torch.nn.functional.dropout(x, 0.3, training=True) * 2

    (xe,) = leaves((128, 64))
    xc = clone([xe])[0]
    torch.manual_seed(7)
    oe = f(xe)
    oe.sum().backward()
    g = aotgrad.aot_function(f, aotgrad.nop)
    torch.manual_seed(7)
    oc = g(xc)
    oc.sum().backward()
    close(oc, oe, "out")
    close(xc.grad, xe.grad, "grad")


class Block(nn.Module):
    def __init__(self, d=64, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def _compiled_block(backend, mode=None):
    torch.manual_seed(0)
    me = Block().to(DEV)
    mc = Block().to(DEV)
    mc.load_state_dict(me.state_dict())
    x = torch.randn(8, 32, 64, device=DEV)
    cm = torch.compile(mc, backend=backend, mode=mode)
    for _ in range(2):
        me(x).square().mean().backward()
        cm(x).square().mean().backward()
    close([p.grad for p in mc.parameters()], [p.grad for p in me.parameters()], "grads", atol=2e-4, rtol=2e-3)


@check
def inductor_block():
    torch._dynamo.reset()
    _compiled_block("aotgrad")


@check
def inductor_block_dynamic():
    torch._dynamo.reset()

    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    w = torch.randn(32, 16, device=DEV, requires_grad=True)
    cf = torch.compile(f, backend="aotgrad", dynamic=True)
    for n in (3, 5, 9):
        x = torch.randn(n, 32, device=DEV)
        we = w.detach().clone().requires_grad_()
        oe = f(x, we)
        oc = cf(x, w)
        close(oc, oe, f"out n={n}", atol=1e-4)
        oe.sum().backward()
        w.grad = None
        oc.sum().backward()
        close(w.grad, we.grad, f"grad n={n}", atol=1e-4)


def _recorded_graphs() -> int:
    """CUDA graphs recorded by Inductor's cudagraph trees on this device (every node of every tree)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [n for ns in manager.roots.values() for n in ns]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [c for cs in node.children.values() for c in cs]
    return count


@check
def reduce_overhead_train_step():
    """mode="reduce-overhead": train steps of a small MLP with BatchNorm (buffers written by the
    forward) and an inference call match eager; the forward and backward are recorded as CUDA graphs
    with no skip, and the parameters and buffers are static inputs (not among those copied in)."""
    import copy

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    me = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                       nn.Linear(64, 8)).to(DEV)
    mc = copy.deepcopy(me)
    cm = torch.compile(mc, backend="aotgrad", mode="reduce-overhead")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc)]
    for step in range(6):
        x = torch.randn(16, 32, device=DEV)
        losses = []
        for call, opt in ((me, opts[0]), (cm, opts[1])):
            loss = call(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        close(losses[1], losses[0], f"loss step {step}", atol=1e-4, rtol=1e-3)
    close(list(mc.parameters()), list(me.parameters()), "params", atol=1e-4, rtol=1e-3)
    close(list(mc.buffers()), list(me.buffers()), "buffers", atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        x = torch.randn(16, 32, device=DEV)
        for _ in range(3):
            close(cm(x).clone(), me(x), "inference", atol=1e-4, rtol=1e-3)
    if DEV == "cuda":
        skips = counters["inductor"]["cudagraph_skips"]
        assert skips == 0, f"{skips} CUDA-graph skips (see the 'skipping cudagraphs' / aotgrad.inductor.cudagraphs log)"
        recorded = _recorded_graphs()
        assert recorded >= 3, f"{recorded} CUDA graphs recorded; expected the forward, backward and inference"
        copied = counters["inductor"]["cudagraph_recorded_non_static_inputs"]
        n_state = len(list(mc.parameters())) + len(list(mc.buffers()))
        assert copied < n_state, f"{copied} inputs copied in per recording: parameters/buffers not static?"


@check
def autocast_region():
    torch._dynamo.reset()

    def f(a, b):
        y = a @ b
        with torch.autocast(DEV, enabled=False):
            z = a.float() @ b.float()
        return y, z

    a, b = leaves((32, 32), (32, 32))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        oe = f(a, b)
        oc = torch.compile(f, backend="aotgrad_eager")(a, b)
    assert oc[0].dtype == torch.bfloat16 and oc[1].dtype == torch.float32, [o.dtype for o in oc]
    close(oc, oe, "outputs", atol=1e-2, rtol=1e-2)


@check
def ceil_mode_avg_pool_backward():
    """HF EfficientNet's global pool: Inductor's lowering divides the overhanging window by the whole
    kernel (CPU, torch 2.13: 3e-5 of eager's gradient); aotgrad routes it to aten on every device."""
    torch._dynamo.reset()
    pool = nn.AvgPool2d(1280, ceil_mode=True)
    (x,) = leaves((2, 8, 7, 7))
    weights = torch.randn(2, 8, 1, 1, device=DEV)
    (pool(x) * weights).sum().backward()
    expected, x.grad = x.grad, None
    (torch.compile(pool, backend="aotgrad")(x) * weights).sum().backward()
    close(x.grad, expected, "input gradient")


@check
def mincut_budget():
    def f(x, w):
        for _ in range(3):
            x = torch.sin(x @ w).cos()
        return x.sum()

    a = leaves((64, 64), (64, 64))
    b = clone(a)
    f(*a).backward()
    g = aotgrad.aot_function(f, aotgrad.nop, partition_fn=aotgrad.min_cut_rematerialization_partition)
    g(*b).backward()
    close([t.grad for t in b], [t.grad for t in a], "grads", atol=1e-4)


@check
def second_order():
    def f(x, w):
        return (torch.tanh(x @ w) ** 2).sum()

    a = leaves((8, 6), (6, 4), dtype=torch.float64)
    b = clone(a)
    ge = torch.autograd.grad(f(*a), a[0], create_graph=True)[0]
    ge.square().sum().backward()
    gc = torch.autograd.grad(aotgrad.aot_function(f, aotgrad.nop)(*b), b[0], create_graph=True)[0]
    gc.square().sum().backward()
    close(gc, ge, "first grad")
    close([t.grad for t in b], [t.grad for t in a], "second-order grads")


@check
def cpu_scalar_with_cuda():
    def f(x, s):
        return x * s + 1

    (xe,) = leaves((5, 5))
    xc = clone([xe])[0]
    s = torch.tensor(3.0)
    oe = f(xe, s)
    oc = aotgrad.aot_function(f, aotgrad.nop)(xc, s)
    close(oc, oe, "out")
    oe.sum().backward()
    oc.sum().backward()
    close(xc.grad, xe.grad, "grad")


@check
def subclass_two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, y):
        return (x * y).sin() + 1

    def make():
        torch.manual_seed(0)
        a, b = torch.randn(4, 4, device=DEV), torch.randn(4, 4, device=DEV)
        return TwoTensor(a, b).requires_grad_(), torch.randn(4, 4, device=DEV, requires_grad=True)

    xe, ye = make()
    xc, yc = make()
    oe = f(xe, ye)
    oc = aotgrad.aot_function(f, aotgrad.nop)(xc, yc)
    assert type(oc) is type(oe), (type(oc), type(oe))
    close([oc.a, oc.b], [oe.a, oe.b], "out components")
    oe.sum().backward()
    oc.sum().backward()
    assert type(xc.grad) is type(xe.grad)
    close([xc.grad.a, xc.grad.b], [xe.grad.a, xe.grad.b], "grad x components")
    close(yc.grad, ye.grad, "grad y")


_CACHE_JOB = r"""
import torch, aotgrad, json, sys
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(sys.argv[1])
x = torch.randn(16, 32, device=sys.argv[1])
loss = torch.compile(m, backend="aotgrad")(x).square().mean()
loss.backward()
print(json.dumps({"loss": loss.item(), "g": m[0].weight.grad.sum().item(), **aotgrad.cache_stats()}))
"""


@check
def warm_start_cache():
    import json

    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=d, AOTGRAD_CACHE="1")
        runs = []
        for _ in range(2):
            p = subprocess.run([sys.executable, "-c", _CACHE_JOB, DEV], env=env, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr[-2000:]
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert warm["loss"] == cold["loss"] and warm["g"] == cold["g"], (cold, warm)
    hits = {k: v for k, v in warm.items() if "hit" in k}
    assert any(v for v in hits.values()), f"no cache hit in the second process: {warm}"


@check
def optimizer_step():
    """aotgrad.OptimizerStep compiled (what precompile saves) against torch.compile(opt.step) and
    eager AdamW: parameters after three steps, step counts on the parameters' device."""
    def run(how):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(2e-3), weight_decay=0.1)
        if how == "function":
            update = aotgrad.OptimizerStep(opt)
            compiled = torch.compile(update.function, fullgraph=True, backend="aotgrad")
            step = lambda: compiled(*update.arguments())  # noqa: E731
        else:
            step = torch.compile(opt.step, backend="aotgrad") if how == "compiled" else opt.step
        for i in range(3):
            x = torch.randn(8, 16, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
            model(x).pow(2).sum().backward()
            step()
            opt.zero_grad()
        return list(model.parameters()), [opt.state[p]["step"] for p in model.parameters()]

    (got, steps), (want, want_steps), (eager, _) = run("function"), run("compiled"), run("eager")
    close(got, want, "vs torch.compile(opt.step)")
    close(got, eager, "vs eager", atol=1e-5, rtol=1e-4)
    assert all(float(s) == 3 and s.device == w.device for s, w in zip(steps, want_steps)), (steps, want_steps)


@check
def donated_buffers():
    """The Inductor backward writes the logits gradient over the saved logits (inductor/donation.py):
    gradients equal eager's through three backwards of one graph (retain_graph=True keeps the saved
    values, which the backward must then leave alone), and on CUDA the peak is at most Inductor's."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(4096, 64), nn.Linear(64, 4096)

        def forward(self, tokens):
            return nn.functional.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), tokens.flatten())

    torch.manual_seed(0)
    tokens = torch.randint(0, 4096, (8, 128), device=DEV)
    base = Head().to(DEV)
    grads, peaks = {}, {}
    for backend in ("eager", "aotgrad", "inductor"):
        torch._dynamo.reset()
        model = Head().to(DEV)
        model.load_state_dict(base.state_dict())
        call = model if backend == "eager" else torch.compile(model, backend=backend)
        loss = call(tokens)
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()
        grads[backend] = [p.grad.clone() for p in model.parameters()]
        if DEV == "cuda" and backend != "eager":
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            call(tokens).backward()
            torch.cuda.synchronize()
            peaks[backend] = torch.cuda.max_memory_allocated() - before
    close(grads["aotgrad"], grads["eager"], "grads after three backwards", atol=1e-5, rtol=1e-4)
    if peaks:
        assert peaks["aotgrad"] <= peaks["inductor"] * 1.02, peaks


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-k", default="", help="run only checks whose name contains this")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    global DEV
    DEV = args.device
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"torch {torch.__version__}, {name}", flush=True)
    failed = 0
    for fn in CHECKS:
        if args.k not in fn.__name__:
            continue
        t0 = time.perf_counter()
        try:
            fn()
            status = "ok"
        except Exception as e:  # a report, not a library: every failure is printed and counted
            failed += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc(limit=4)
        print(f"{fn.__name__:28s} {time.perf_counter() - t0:6.1f}s  {status}", flush=True)
    print(f"{failed} failed of {len(CHECKS)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
