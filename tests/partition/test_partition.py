"""Partitioners (issue 4): min-cut rematerialization, memory budget, policies, residual report.

Every partitioner must give eager's outputs and gradients on the core behaviours; then hand-checkable
cases pin down what the min-cut saves, the budget sweep, the policies (JAX-style names, checkpoint_name,
torch.utils.checkpoint selective-checkpoint tags), and that the report lists exactly what the forward
hands to the backward.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import BwMutatesBuffer
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import aotgrad
from aotgrad import (
    aot_function,
    aot_module,
    checkpoint_name,
    default_partition,
    min_cut_rematerialization_partition,
    mincut_partitioner,
    nop,
)
from aotgrad.partition.mincut import INFO_KEY
from aotgrad.partition.ops import op_class
from aotgrad.testing import check_against_eager

PARTITIONERS = {
    "default": default_partition,
    "mincut": min_cut_rematerialization_partition,
    "budget_0.75": mincut_partitioner(0.75),
    "budget_0.5": functools.partial(min_cut_rematerialization_partition, memory_budget=0.5),
    "budget_0": mincut_partitioner(0.0),
    "save_everything": mincut_partitioner(policy="save_everything"),
    "save_nothing": mincut_partitioner(policy="save_nothing"),
    "save_matmuls": mincut_partitioner(policy=aotgrad.save_matmuls),
}
EVERY = pytest.mark.parametrize("pf", list(PARTITIONERS.values()), ids=list(PARTITIONERS))


def leaf_inputs(*shapes, requires_grad=True, seed=0):
    def make():
        g = torch.Generator().manual_seed(seed)
        roots = tuple(torch.randn(*s, generator=g).requires_grad_(requires_grad) for s in shapes)
        return roots, tuple(r.clone() for r in roots)

    return make


def plain(*shapes, requires_grad=(True,), seed=0):
    def make():
        g = torch.Generator().manual_seed(seed)
        rg = list(requires_grad) + [requires_grad[-1]] * (len(shapes) - len(requires_grad))
        args = tuple(torch.randn(*s, generator=g).requires_grad_(r) for s, r in zip(shapes, rg))
        return args, args

    return make


class Graphs:
    """A forward compiler that keeps the forward module (and the partition info on it)."""

    def __init__(self):
        self.fw = None

    def __call__(self, gm, _inputs):
        self.fw = gm
        return gm.forward

    @property
    def info(self):
        return self.fw.meta[INFO_KEY]

    def saved_nodes(self, num_fwd_outputs: int):
        return list(self.fw.graph.output_node().args[0])[num_fwd_outputs:]


def compile_and_run(f, pf, *args):
    g = Graphs()
    out = aot_function(f, g, nop, partition_fn=pf)(*args)
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    return g


# --- 1. eager equivalence under every partitioner -----------------------------------------------


@EVERY
def test_matmul_pointwise_mix(pf):
    def f(x, w1, w2):
        h = torch.tanh(x @ w1) * 2 + 1
        return (h @ w2).sin(), h.sum()

    check_against_eager(f, leaf_inputs((4, 5), (5, 6), (6, 3)), compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_input_mutation(pf):
    def f(a, b):
        a.mul_(2)
        return (a @ b).cos()

    check_against_eager(f, leaf_inputs((3, 3), (3, 3)), compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_mutated_input_read_by_backward_keeps_old_value(pf):
    def f(w, x):
        y = ((x + 1) * w).sin().sum()
        x.mul_(2)
        return y

    def make():
        w = torch.linspace(-1, 2, 3).requires_grad_(True)
        return (w,), (w, torch.linspace(0, 1, 3))

    check_against_eager(f, make, compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_mutation_under_no_grad(pf):
    def f(a):
        with torch.no_grad():
            a.mul_(2)
        return a.exp() * 3

    check_against_eager(f, leaf_inputs((4,)), compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_aliasing_outputs(pf):
    def f(a):
        out = (a * 3).sin()
        return out.view(-1), out, out.t(), a[1:], out[0].detach()

    check_against_eager(f, leaf_inputs((3, 3)), compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_batch_norm_train_functional(pf):
    # Not check_against_eager: running statistics are written back with copy_, which bumps their
    # version counter where eager's kernel does not (a documented gap of the core, ARCHITECTURE.md).
    def f(x, w, b, rm, rv):
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)
        return F.relu(y).square()

    def run(fn):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, 5, 5, generator=g, requires_grad=True)
        w = torch.rand(3, generator=g).requires_grad_(True)
        b = torch.randn(3, generator=g, requires_grad=True)
        rm, rv = torch.zeros(3), torch.ones(3)
        out = fn(x, w, b, rm, rv)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        return out, x.grad, w.grad, b.grad, rm, rv

    compiled = aot_function(f, nop, partition_fn=pf)
    for a, b in zip(run(f), run(compiled)):
        torch.testing.assert_close(b, a)


@EVERY
def test_modules_train_steps(pf):
    torch.manual_seed(0)
    models = [
        (nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3)), torch.randn(5, 6)),
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 1)),
         torch.randn(2, 3, 8, 8)),
    ]
    _train_like_eager(models, pf)


@EVERY
def test_backward_mutation_stays_in_backward(pf):
    def f(x, buf):
        return BwMutatesBuffer.apply(x, buf).sin()

    def run(fn):
        x = torch.linspace(-1, 1, 4).requires_grad_(True)
        buf = torch.full((4,), 2.0)
        out = fn(x, buf)
        before = buf.clone()
        out.sum().backward()
        return before, buf, x.grad

    ref, got = run(f), run(aot_function(f, nop, partition_fn=pf))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a)


@EVERY
def test_tensor_constant_in_program(pf):
    def f(x):
        return (x * torch.tensor([1.0, 2.0, 3.0])).sin()

    check_against_eager(f, leaf_inputs((3,)), compiled=aot_function(f, nop, partition_fn=pf))


@EVERY
def test_dropout_same_seed_same_rng_stream(pf):
    def f(x, w):
        h = F.dropout((x @ w).relu(), p=0.5, training=True)
        return (h * 2).sin()

    def run(fn):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(6, 5, generator=g, requires_grad=True)
        w = torch.randn(5, 7, generator=g, requires_grad=True)
        torch.manual_seed(1234)
        out = fn(x, w)
        out.sum().backward()
        return out.detach(), x.grad, w.grad, torch.get_rng_state()

    graphs = Graphs()
    compiled = aot_function(f, graphs, nop, partition_fn=pf)
    ref, got = run(f), run(compiled)
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])
    assert torch.equal(got[3], ref[3]), "the compiled program consumed the random stream differently"
    bw = compiled.cache[next(iter(compiled.cache))].compiled.bw_module
    random_in_bw = [n for n in bw.graph.nodes if n.op == "call_function" and op_class(n) == "random"]
    assert not random_in_bw, random_in_bw


# --- 2. hand-checkable cuts ---------------------------------------------------------------------


def _chain(x, w):
    return (x @ w).sin().cos().mul(2).tanh().add(1)


def _chain_inputs():
    return torch.randn(4, 5, requires_grad=True), torch.randn(5, 6, requires_grad=True)


def test_pointwise_chain_after_matmul_saves_only_the_matmul_output():
    g = compile_and_run(_chain, min_cut_rematerialization_partition, *_chain_inputs())
    saved = g.saved_nodes(1)
    assert [n.op for n in saved[:2]] == ["placeholder", "placeholder"]  # x and w (matmul grads)
    assert [n.target for n in saved[2:]] == [torch.ops.aten.mm.default]
    assert g.info.recomputed_matmuls == 0
    # the default partition saves the chain's intermediates too
    d = Graphs()
    aot_function(_chain, d, nop)(*_chain_inputs()).sum().backward()
    assert len(d.saved_nodes(1)) > len(saved)


def test_budget_zero_saves_only_inputs():
    g = compile_and_run(_chain, mincut_partitioner(0.0), *_chain_inputs())
    assert all(n.op == "placeholder" for n in g.saved_nodes(1))
    assert g.info.recomputed_matmuls == 1
    assert g.info.saved_bytes == g.info.bytes_at_budget_0 < g.info.bytes_at_budget_1


def _deep(x, *ws):
    for w in ws:
        x = torch.tanh(x @ w)
    return x


def _deep_inputs(layers=20):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    return (x, *[(torch.randn(16, 16, generator=g) / 4).requires_grad_(True) for _ in range(layers)])


def test_budget_sweep_monotone_and_on_target():
    budgets = [1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.25, 0.1, 0.0]
    infos = [compile_and_run(_deep, mincut_partitioner(b), *_deep_inputs()).info for b in budgets]
    saved = [i.saved_bytes for i in infos]
    assert saved == sorted(saved, reverse=True), saved
    assert infos[0].saved_bytes == infos[0].bytes_at_budget_1 > infos[-1].saved_bytes == infos[0].bytes_at_budget_0 > 0
    for b, info in zip(budgets, infos):
        assert abs(info.achieved_fraction - b) <= 0.05, (b, info.achieved_fraction)
    assert [i.recomputed_matmuls for i in infos] == sorted(i.recomputed_matmuls for i in infos)


def _ln_mlp(x, *params):
    """Linear + GELU + LayerNorm blocks: every hidden activation has the same size, so the budget
    range comes in whole steps and only a cheap value saved on top lands between them."""
    for w, b in zip(params[0::2], params[1::2]):
        x = F.layer_norm(F.gelu(F.linear(x, w, b)), (w.shape[0],))
    return x


def _ln_mlp_make(layers=4, width=32):
    def make():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 16, generator=g)
        params, d = [], 16
        for _ in range(layers):
            params += [(torch.randn(width, d, generator=g) / 4).requires_grad_(True),
                       torch.randn(width, generator=g).requires_grad_(True)]
            d = width
        args = (x, *params)
        return args, args

    return make


def _run_ln_mlp(budget):
    args, _ = _ln_mlp_make()()
    return compile_and_run(_ln_mlp, mincut_partitioner(budget), *args).info


def test_budget_sweep_in_whole_steps_is_monotone_and_reports_the_nearest_plan():
    budgets = [round(1 - i / 20, 2) for i in range(21)]
    infos = [_run_ln_mlp(b) for b in budgets]
    saved = [i.saved_bytes for i in infos]
    assert saved == sorted(saved, reverse=True), saved
    assert saved[0] == infos[0].bytes_at_budget_1 and saved[-1] == infos[0].bytes_at_budget_0
    for info in infos[1:-1]:
        lo, hi = info.nearest_plans
        assert lo is None or lo <= info.requested_bytes
        assert hi is None or hi > info.requested_bytes
        if not info.on_target:  # nothing explored in between: the nearer of the two is taken
            assert info.saved_bytes in (lo, hi)
            nearer = min((b for b in (lo, hi) if b is not None), key=lambda b: abs(b - info.requested_bytes))
            assert abs(info.saved_bytes - info.requested_bytes) == abs(nearer - info.requested_bytes)
    assert sum(i.on_target for i in infos) > len(infos) // 2


def test_budget_saves_a_cheap_intermediate_to_land_between_whole_steps():
    # Unlocking one matmul moves 1/3 of the range; 0.75 is reached by also saving a cheap 1/3-size value.
    info = _run_ln_mlp(0.75)
    assert info.on_target and info.forced, (info.achieved_fraction, info.forced)
    pf = mincut_partitioner(0.75)
    check_against_eager(_ln_mlp, _ln_mlp_make(), compiled=aot_function(_ln_mlp, nop, partition_fn=pf))


_LN_DECOMPOSED = torch._decomp.get_decompositions([
    torch.ops.aten.native_layer_norm, torch.ops.aten.native_layer_norm_backward,
    torch.ops.aten.gelu, torch.ops.aten.gelu_backward,
])


@pytest.mark.parametrize("budget,policy", [(None, None), (0.5, None), (None, "save_nothing")])
def test_normalised_value_read_by_a_backward_matmul_is_saved_at_budget_one(budget, policy):
    # LayerNorm decomposed as Inductor sees it (var_mean, a large reduction): its output feeds the
    # next linear, whose weight gradient reads it again. At budget 1 it is saved (recomputing it
    # would cost the backward one more kernel); a lower budget or a policy may recompute it; GELU's
    # output, a pointwise function of a saved matmul, is always recomputed.
    pf = mincut_partitioner(budget, policy=policy)
    make = _ln_mlp_make()
    g = Graphs()
    compiled = aot_function(_ln_mlp, g, nop, partition_fn=pf, decompositions=_LN_DECOMPOSED)
    check_against_eager(_ln_mlp, make, compiled=compiled)

    @functools.cache
    def from_var_mean(n):
        return any(getattr(a.target, "overloadpacket", None) is torch.ops.aten.var_mean or from_var_mean(a)
                   for a in n.all_input_nodes)

    def feeds_matmul(n):
        return any(op_class(u) == "matmul" or (op_class(u) == "view" and feeds_matmul(u)) for u in n.users)

    saved = g.saved_nodes(1)
    normalised = [n for n in saved if n.target is torch.ops.aten.mul.Tensor and from_var_mean(n)]
    assert len(normalised) == (3 if budget is None and policy is None else 0), [n.name for n in saved]
    assert all(feeds_matmul(n) for n in normalised)
    assert "erf" in [name for name, _ in g.info.recomputed] and not any(
        n.target is torch.ops.aten.erf.default for n in saved
    )


_BN_DECOMPOSED = torch._decomp.get_decompositions([
    torch.ops.aten._native_batch_norm_legit_functional, torch.ops.aten.native_batch_norm_backward,
])


def _bn_relu_conv(x, w1, w2, bn_w, bn_b):
    h = F.conv2d(x, w1)
    mean, var = h.mean((0, 2, 3), keepdim=True), h.var((0, 2, 3), keepdim=True, correction=0)
    h = torch.relu((h - mean) * torch.rsqrt(var + 1e-5) * bn_w.view(1, -1, 1, 1) + bn_b.view(1, -1, 1, 1))
    return F.conv2d(h, w2)


@pytest.mark.parametrize("budget", [None, 0.0])
def test_normalised_value_read_by_a_backward_convolution_is_saved_at_budget_one(budget):
    # ResNet's BatchNorm -> ReLU -> Conv: the second convolution's backward reads the ReLU output.
    # Recomputed, it costs the backward a kernel per layer (the convolution backward reads it from
    # memory: ResNet-50 on the pretend H100, 619 kernels a step against Inductor's 578); saved, 584.
    # A lower budget may still recompute it.
    g = Graphs()
    make = plain((2, 3, 8, 8), (4, 3, 3, 3), (4, 4, 3, 3), (4,), (4,))
    compiled = aot_function(_bn_relu_conv, g, nop, partition_fn=mincut_partitioner(budget))
    check_against_eager(_bn_relu_conv, make, compiled=compiled)
    saved = g.saved_nodes(1)
    relus = [n for n in saved if n.target is torch.ops.aten.relu.default]
    assert len(relus) == (1 if budget is None else 0), [n.name for n in saved]
    assert op_class(next(n for n in g.fw.graph.nodes if n.target is torch.ops.aten.convolution.default)) == "conv"


def _masked_attention(q, k, v):
    n = q.shape[-2]
    causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    mask = torch.where(causal, 0.0, float("-inf")).expand(q.shape[0], 1, n, n)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(a, k, v, attn_mask=mask)


def test_mask_made_from_factories_is_saved_for_the_backward_attention():
    # GPT-2's causal mask: made from arange alone, read by every layer's attention and by its
    # backward. Unsaved, the forward returns nothing of it, so Inductor writes it out once per
    # attention kernel, and the backward again (GPT-2 on the pretend H100: 12 forward kernels where
    # upstream, which saves it, has one).
    g = Graphs()
    make = plain((2, 2, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8))
    compiled = aot_function(_masked_attention, g, nop, partition_fn=mincut_partitioner())
    check_against_eager(_masked_attention, make, compiled=compiled)
    saved = g.saved_nodes(1)
    assert any(n.target is torch.ops.aten.where.self for n in saved), [n.name for n in saved]
    recomputed = [name for name, _ in g.info.recomputed]
    assert not any(name.startswith(("where", "arange", "iota")) for name in recomputed), recomputed


def test_budget_split_lands_on_target_between_whole_steps():
    # _ln_mlp: 8 rows, hidden activations of 8 x 32 floats = 1 KiB, budget range 2688 B. No whole plan
    # lies between 0.38 and 0.67 of the range; 0.5 asks for 320 B more than the plan at 0.38: the
    # first 2 (320 / 128, rounded) rows of one recomputed activation are saved, the other 6 recomputed.
    g = Graphs()
    aot_function(_ln_mlp, g, nop, partition_fn=mincut_partitioner(0.5))(*_ln_mlp_make()()[0])
    info = g.info
    assert info.bytes_at_budget_1 - info.bytes_at_budget_0 == 2688
    lo, hi = info.nearest_plans
    assert (lo - info.bytes_at_budget_0, hi - info.bytes_at_budget_0) == (1024, 1792)  # 0.38 and 0.67
    assert info.split == {"value": "addmm_1", "rows_saved": 2, "rows": 8}
    assert info.saved_bytes == lo + 2 * 128 and info.on_target
    # The head is saved as its own 2-row tensor (not a view of the whole activation), once.
    heads = [n for n in g.saved_nodes(1) if n.op != "placeholder" and n.meta["val"].shape[0] == 2]
    assert len(heads) == 1 and op_class(heads[0]) == "matmul"
    assert all(op_class(n) != "view" for n in g.saved_nodes(1))


@pytest.mark.parametrize("budget", [0.9, 0.5, 0.25, 0.1])
def test_budget_split_grads_equal_eager(budget):
    pf = mincut_partitioner(budget)
    assert _run_ln_mlp(budget).split is not None
    check_against_eager(_ln_mlp, _ln_mlp_make(), compiled=aot_function(_ln_mlp, nop, partition_fn=pf))


@pytest.mark.parametrize("budget", [1.0, 0.75, 0.5, 0.25, 0.0])
def test_budget_split_modules_train_like_eager(budget):
    # Linear/GELU/LayerNorm and Conv/BatchNorm(train)/ReLU: batch norm is never split (its statistics
    # mix the rows); the convolutions and ReLUs may be.
    torch.manual_seed(0)
    models = [
        (nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                       nn.LayerNorm(32), nn.Linear(32, 4)), torch.randn(8, 16)),
        (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                       nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4)), torch.randn(4, 3, 8, 8)),
    ]
    _train_like_eager(models, mincut_partitioner(budget))


def test_budget_sweep_with_splitting_is_monotone_and_on_target():
    budgets = [round(1 - i / 20, 2) for i in range(21)]
    infos = [_run_ln_mlp(b) for b in budgets]
    saved = [i.saved_bytes for i in infos]
    assert saved == sorted(saved, reverse=True), saved
    assert all(i.on_target for i in infos), [(b, i.achieved_fraction) for b, i in zip(budgets, infos)]
    assert sum(i.split is not None for i in infos) >= 5


def _softmax_rows(x, *ws):
    for w in ws:
        x = torch.softmax(x @ w, dim=0)  # each output row depends on every input row
    return x


def _softmax_rows_make():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    args = (x, *[(torch.randn(16, 16, generator=g) / 4).requires_grad_(True) for _ in range(3)])
    return args, args


def test_budget_does_not_split_a_value_that_is_not_row_separable():
    # The backward reads the softmax outputs (along dim 0) and nothing row-separable: no split, the
    # nearest whole plan is taken as before.
    for budget in (0.75, 0.25):
        info = compile_and_run(_softmax_rows, mincut_partitioner(budget), *_softmax_rows_make()[0]).info
        assert info.split is None and not info.on_target
        assert info.saved_bytes in info.nearest_plans
    check_against_eager(_softmax_rows, _softmax_rows_make,
                        compiled=aot_function(_softmax_rows, nop, partition_fn=mincut_partitioner(0.25)))


def test_row_split_positions():
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotgrad.partition.split import row_split_positions

    def f(x, w, b, v, s):
        return (torch.addmm(b, x, w), x.mm(w), x * v, x + s, torch.softmax(x, 0), x.cumsum(0), x.sum(0, keepdim=True),
                torch.softmax(x, 1), x.t().contiguous())

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), torch.randn(4),
                                         torch.randn(4, 4))
    got = {n.target.overloadpacket.__name__: row_split_positions(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert got["addmm"] == (1,) and got["mm"] == (0,)
    assert got["mul"] == (0,)  # v broadcasts along the rows: passed whole
    assert got["add"] == (0, 1)  # s has the rows: sliced too
    for name in ("_softmax", "cumsum", "sum", "t"):  # a view (t) is never split; its base may be
        assert got.get(name) is None, name


def test_budget_near_one_recomputes_no_matmul():
    info = _run_ln_mlp(0.99)
    assert info.recomputed_matmuls == 0 and info.saved_bytes == info.bytes_at_budget_1


def test_budget_pick_is_monotone_for_any_menu():
    from aotgrad.partition.budget import _Menu
    from aotgrad.partition.graph import _Candidate

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        menu = object.__new__(_Menu)
        sizes = torch.randint(0, 1000, (12,), generator=g).tolist()
        flops = torch.randint(0, 50, (12,), generator=g).tolist()
        plans = [_Candidate((), [], b, f) for b, f in zip(sizes + [0, 1000], flops + [99, 0])]
        menu.top, menu.bottom, menu.span, menu._offered = plans[-1], plans[-2], 1000, None
        menu.plans = {i: c for i, c in enumerate(plans)}
        picked = [menu.pick(t).bytes for t in range(1000, -1, -5)]
        assert picked == sorted(picked, reverse=True)


def test_budget_validation():
    with pytest.raises(ValueError):
        mincut_partitioner(1.5)
    with pytest.raises(ValueError):
        mincut_partitioner(policy="no_such_policy")


# --- 3. policies --------------------------------------------------------------------------------


def _mlp(x, w1, w2):
    h = torch.tanh(x @ w1)
    return (h @ w2).sin()


def _mlp_inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, requires_grad=True) for s in [(4, 5), (5, 6), (6, 3)])


def _non_input_saved(g, n=1):
    return [node for node in g.saved_nodes(n) if node.op != "placeholder"]


def test_policy_save_everything_recomputes_nothing():
    g = compile_and_run(_mlp, mincut_partitioner(policy="save_everything"), *_mlp_inputs())
    assert all(cls in ("view", "free") for _, cls in g.info.recomputed), g.info.recomputed
    assert {n.target for n in _non_input_saved(g)} >= {torch.ops.aten.tanh.default, torch.ops.aten.mm.default}


def test_policy_save_nothing_saves_inputs():
    g = compile_and_run(_mlp, mincut_partitioner(policy="save_nothing"), *_mlp_inputs())
    assert _non_input_saved(g) == []
    assert g.info.recomputed_matmuls == 2


def test_policy_save_matmuls():
    g = compile_and_run(_mlp, mincut_partitioner(policy="save_matmuls"), *_mlp_inputs())
    assert {n.target for n in _non_input_saved(g)} == {torch.ops.aten.mm.default}
    assert g.info.recomputed_matmuls == 0


def _named(x, w1, w2):
    a = checkpoint_name(x @ w1, "proj")
    h = checkpoint_name(torch.tanh(a), "act")
    return (h @ w2).sin()


def test_checkpoint_name_is_identity_in_eager_and_matches_eager_grads():
    x = torch.randn(3, requires_grad=True)
    assert checkpoint_name(x, "x") is x
    for pf in [min_cut_rematerialization_partition, mincut_partitioner(policy=aotgrad.save_only_these_names("act"))]:
        check_against_eager(_named, leaf_inputs((4, 5), (5, 6), (6, 3)), compiled=aot_function(_named, nop, partition_fn=pf))
    ref = _mlp_inputs()
    test = _mlp_inputs()
    _named(*ref).sum().backward()
    aot_function(_named, nop, partition_fn=min_cut_rematerialization_partition)(*test).sum().backward()
    for a, b in zip(ref, test):
        assert torch.equal(a.grad, b.grad)


def test_save_only_these_names():
    g = compile_and_run(_named, mincut_partitioner(policy=aotgrad.save_only_these_names("act")), *_mlp_inputs())
    assert [n.target for n in _non_input_saved(g)] == [torch.ops.aten.tanh.default]
    g = compile_and_run(_named, mincut_partitioner(policy=aotgrad.save_only_these_names("proj")), *_mlp_inputs())
    assert [n.target for n in _non_input_saved(g)] == [torch.ops.aten.mm.default]


def test_save_and_recompute_names():
    g = compile_and_run(_named, mincut_partitioner(policy=aotgrad.recompute_names("proj")), *_mlp_inputs())
    recomputed = dict(g.info.recomputed)
    assert recomputed.get("mm") == "matmul"  # x @ w1 is recomputed although it is a matmul
    g = compile_and_run(_named, mincut_partitioner(policy=aotgrad.save_names("act")), *_mlp_inputs())
    assert torch.ops.aten.tanh.default in {n.target for n in _non_input_saved(g)}


def _sac(policy_fn):
    def inner(x, w):
        return torch.mm(x, w).sin().cos()

    def f(x, w, w2):
        ctx = functools.partial(create_selective_checkpoint_contexts, policy_fn)
        y = checkpoint(inner, x, w, use_reentrant=False, context_fn=ctx)
        return (y @ w2).relu()

    return f


def test_selective_checkpoint_tags_are_honoured():
    def save_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    f = _sac(save_mm)
    check_against_eager(f, leaf_inputs((4, 4), (4, 4), (4, 4)),
                        compiled=aot_function(f, nop, partition_fn=min_cut_rematerialization_partition))
    g = compile_and_run(f, min_cut_rematerialization_partition, *_mlp_inputs()[:1], torch.randn(5, 5, requires_grad=True),
                        torch.randn(5, 3, requires_grad=True))
    assert g.info.recomputed_matmuls == 0
    # vanilla checkpointing (everything PREFER_RECOMPUTE): the region's matmul is recomputed
    f = _sac(recompute_all)
    check_against_eager(f, leaf_inputs((4, 4), (4, 4), (4, 4)),
                        compiled=aot_function(f, nop, partition_fn=min_cut_rematerialization_partition))
    g = compile_and_run(f, min_cut_rematerialization_partition, torch.randn(4, 5, requires_grad=True),
                        torch.randn(5, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True))
    assert g.info.recomputed_matmuls == 1


def test_selective_checkpoint_tags_do_not_outlive_the_trace():
    """torch's selective-checkpoint mode writes its tags into torch.fx.traceback's global
    `current_meta` while the program is traced. Left there, every node of a later trace carried
    them and upstream Inductor's partitioner failed on the next `torch.compile(backend="inductor")`
    in the process (TypeError comparing ac_graph_ids)."""
    import torch.fx.traceback as fx_traceback

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    before = dict(fx_traceback.current_meta)
    compile_and_run(_sac(recompute_all), min_cut_rematerialization_partition, *leaf_inputs((4, 4), (4, 4), (4, 4))()[0])
    assert dict(fx_traceback.current_meta) == before


def _checkpointed_attention(dropout_p):
    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def inner(x, w):
        q, k, v = (x @ w).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)

    def f(x, w):
        ctx = functools.partial(create_selective_checkpoint_contexts, recompute_all)
        return checkpoint(inner, x, w, use_reentrant=False, context_fn=ctx).sum()

    return f


def test_checkpointed_attention_without_dropout_is_recomputed_like_eager():
    """Attention kernels are tagged nondeterministic_seeded for their dropout; with dropout_p=0
    they are deterministic, so a checkpointed region recomputes them and saves only its inputs,
    as eager does (it used to save the attention output and its logsumexp)."""
    shapes = (2, 2, 8, 12), (12, 12)
    f = _checkpointed_attention(0.0)
    check_against_eager(f, leaf_inputs(*shapes),
                        compiled=aot_function(f, nop, partition_fn=min_cut_rematerialization_partition))
    g = compile_and_run(f, min_cut_rematerialization_partition, *leaf_inputs(*shapes)()[0])
    assert "flash_attention" in g.fw.code  # the fused kernel, tagged nondeterministic_seeded
    assert [n.op for n in g.saved_nodes(1)] == ["placeholder", "placeholder"]
    # with dropout the kernel draws random numbers: never recomputed, its outputs are saved
    g = compile_and_run(_checkpointed_attention(0.5), min_cut_rematerialization_partition, *leaf_inputs(*shapes)()[0])
    assert any(n.op == "call_function" for n in g.saved_nodes(1))


# --- 4. what is saved: never twice, never a view ------------------------------------------------


def test_no_view_and_no_duplicate_is_saved():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))
    for pf in [min_cut_rematerialization_partition, mincut_partitioner(0.5), mincut_partitioner(policy="save_everything")]:
        g = Graphs()
        out = aot_module(copy.deepcopy(mod), g, nop, partition_fn=pf)(torch.randn(3, 8))
        saved = g.saved_nodes(1)
        assert len(saved) == len(set(saved))
        assert not [n for n in saved if n.op == "call_function" and op_class(n) == "view"]
        out.sum().backward()


# --- 5. the residual report ---------------------------------------------------------------------


def test_report_lists_exactly_what_the_forward_hands_over():
    x, w1, w2 = _mlp_inputs()
    rep = aotgrad.saved_residuals(_named, x, w1, w2, partition_fn=min_cut_rematerialization_partition)
    fw = rep.fw_module
    saved = [n.name for n in list(fw.graph.output_node().args[0])[1:]]
    assert [r.name for r in rep.residuals] == saved
    assert rep.runtime_count == len(rep.saved_tensors) and rep.runtime_bytes == rep.saved_bytes
    assert [r.source for r in rep.residuals if r.op == "input"] == ["x", "w1", "w2"]
    made = {r.op: r for r in rep.residuals if r.op != "input"}
    assert set(made) == {"aten.tanh", "aten.mm"}  # tanh's output (for tanh' and w2's grad), h @ w2 (for sin')
    assert "test_partition.py" in made["aten.tanh"].source and "torch.tanh(a)" in made["aten.tanh"].source
    assert "(h @ w2).sin()" in made["aten.mm"].source
    assert made["aten.tanh"].nbytes == 4 * 6 * 4 and made["aten.tanh"].shape == (4, 6)
    assert made["aten.mm"].dtype == torch.float32 and made["aten.mm"].nbytes == 4 * 3 * 4
    assert [r.op for r in rep.recomputed if not r.free] == []
    # eager: x, w1, w2, mm's output... counted as unique storages by saved_tensors_hooks
    seen = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t, lambda t: t):
        _named(*[t.detach().clone().requires_grad_() for t in (x, w1, w2)])
    assert rep.eager_bytes == sum(seen.values()) and rep.eager_count == len(seen)
    text = str(rep)
    assert "aten.mm" in text and "eager" in text and "recomputed in the backward" in text
    # the caller's tensors are untouched
    assert x.grad is None and w1.grad is None


def test_report_for_a_module_and_default_partition():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    rep = aotgrad.saved_residuals_module(mod, torch.randn(4, 6))
    assert rep.partitioner == "default_partition"
    assert {r.source for r in rep.residuals if r.op == "input"} == {"input"}  # Sequential.forward(input)
    assert {(r.op, r.module) for r in rep.residuals if r.op != "input"} == {("aten.relu", "1 (ReLU)"), ("aten.t", "2 (Linear)")}
    rep = aotgrad.saved_residuals_module(mod, torch.randn(4, 6), partition_fn=min_cut_rematerialization_partition)
    assert {r.source for r in rep.residuals if r.op == "input"} == {"input", "2.weight"}  # the base, not its view
    assert rep.runtime_count == len(rep.saved_tensors) == 3
    assert mod[0].weight.grad is None


def _train_like_eager(models, partition_fn) -> None:
    """Two training steps of each (module, input) through aot_module: outputs, grads and buffers
    (BatchNorm's running stats) equal eager's."""
    for eager, x in models:
        test = copy.deepcopy(eager)
        compiled = aot_module(test, nop, partition_fn=partition_fn)
        for _ in range(2):
            ref, out = eager(x), compiled(x)
            torch.testing.assert_close(out, ref)
            ref.square().sum().backward()
            out.square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), test.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        for (name, b), c in zip(eager.named_buffers(), test.buffers()):
            torch.testing.assert_close(c, b, msg=name)
