"""Sums of zero-based select_scatters nested into one chain (partition/scatters.py), against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotgrad
from aotgrad.partition.scatters import nest_zero_scatters

aten = torch.ops.aten


def _adds(gm) -> int:
    return sum(n.target is aten.add.Tensor for n in gm.graph.nodes)


def _three_slices(a, b, c):
    z = torch.zeros(3, 4, 5)
    return torch.select_scatter(z, a, 0, 0) + torch.select_scatter(z, b, 0, 2) \
        + torch.select_scatter(torch.zeros(3, 4, 5), c, 0, -2)


def _slices_of_two_sums(a, b, c):
    x = torch.select_scatter(torch.zeros(4, 3, 5), a, 1, 0) + torch.select_scatter(torch.zeros(4, 3, 5), b, 1, 1)
    y = torch.select_scatter(torch.zeros(4, 3, 5), c, 1, 2)
    return y + x


def _inputs(shape=(4, 5)):
    torch.manual_seed(0)
    return [torch.randn(*shape) for _ in range(3)]


@pytest.mark.parametrize("fn, shape", [(_three_slices, (4, 5)), (_slices_of_two_sums, (4, 5))])
def test_distinct_slices_nest_into_one_chain(fn, shape):
    args = _inputs(shape)
    gm = make_fx(fn)(*args)
    assert _adds(gm) == 2
    nest_zero_scatters(gm)
    assert _adds(gm) == 0, gm.code
    # One zero buffer left, scattered into three times.
    assert sum(n.target is aten.zeros.default for n in gm.graph.nodes) == 1, gm.code
    torch.testing.assert_close(gm(*args), fn(*args), rtol=0, atol=0)


def _same_slice(a, b, c):
    z = torch.zeros(3, 4, 5)
    return torch.select_scatter(z, a, 0, 1) + torch.select_scatter(z, b, 0, -2) + c


def _other_dims(a, b, c):
    z = torch.zeros(4, 4, 5)
    return torch.select_scatter(z, a, 0, 1) + torch.select_scatter(z, b, 1, 2) + c


def _nonzero_base(a, b, c):
    z = torch.ones(3, 4, 5)
    return torch.select_scatter(z, a, 0, 0) + torch.select_scatter(torch.zeros(3, 4, 5), b, 0, 1) + c


def _scaled(a, b, c):
    z = torch.zeros(3, 4, 5)
    return torch.add(torch.select_scatter(z, a, 0, 0), torch.select_scatter(z, b, 0, 1), alpha=2) + c


def _promoted(a, b, c):
    z = torch.zeros(3, 4, 5)
    w = torch.zeros(3, 4, 5, dtype=torch.float64)
    return torch.select_scatter(z, a, 0, 0) + torch.select_scatter(w, b.double(), 0, 1) + c


@pytest.mark.parametrize("fn", [_same_slice, _other_dims, _nonzero_base, _scaled, _promoted])
def test_overlapping_or_unlike_scatters_left_alone(fn):
    """Where the sum is not the nested scatter (one slice written twice, another dim, a base that is
    not zero, a scaled or type-promoting add), the graph keeps its adds and its result."""
    args = [torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 4, 5) if fn is _other_dims else torch.randn(3, 4, 5)]
    gm = make_fx(fn)(*args)
    before = _adds(gm)
    nest_zero_scatters(gm)
    assert _adds(gm) == before, gm.code
    torch.testing.assert_close(gm(*args), fn(*args))


class _Heads(torch.nn.Module):
    """Attention's `qkv[0], qkv[1], qkv[2]`, each read differently (Inductor decomposes the select
    backward into a scatter onto zeros)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 24)

    def forward(self, x):
        qkv = self.lin(x).reshape(x.shape[0], 3, 8).permute(1, 0, 2)
        q, k, v = qkv[0], qkv[1], qkv[-1]
        return (q.sin() * k + v.exp()).sum(-1)


def test_gradients_through_nested_scatters_match_eager():
    from torch._inductor.decomposition import select_decomp_table

    torch.manual_seed(0)
    mod, x = _Heads(), torch.randn(6, 8, requires_grad=True)
    ref, xr = copy.deepcopy(mod), x.detach().clone().requires_grad_(True)
    graphs = []

    def bw_compiler(gm, _example):
        graphs.append(gm)
        return gm

    compiled = aotgrad.aot_module(mod, aotgrad.nop, bw_compiler, partition_fn=aotgrad.min_cut_rematerialization_partition,
                                  decompositions=dict(select_decomp_table()))
    out = compiled(x)
    out.sum().backward()
    ref_out = ref(xr)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x.grad, xr.grad)
    for a, b in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    (bw,) = graphs
    scatters = [n for n in bw.graph.nodes if n.target is aten.select_scatter.default]
    assert len(scatters) == 3, bw.code
    assert not any(u.target is aten.add.Tensor for s in scatters for u in s.users), bw.code
