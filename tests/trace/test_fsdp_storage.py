"""FSDP2's storage pattern inside compiled programs (issue 25 item 5, issue 29 item 3): an unsharded
parameter (a leaf that requires grad, its storage freed) gets memory again
(`inductor.resize_storage_bytes_`), its data swapped in with `set_` under `no_grad` (or filled with
`fsdp.copy_`), is used, and is freed again. The ops stay in the graph, in order, applied to the
graph input itself; outputs, gradients, the parameter's storage and aliasing match eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (fsdp.all_gather_copy_in)
import torch.distributed.fsdp._fully_shard._fsdp_param  # noqa: F401  (fsdp.copy_)
from helpers import GraphRecorder

import aotgrad
from aotgrad import aot_function
from aotgrad.errors import UnsupportedMutationError

RESIZE = torch.ops.inductor.resize_storage_bytes_.default
SET = torch.ops.aotgrad.set_.default
COPY = torch.ops.fsdp.copy_.default


class Recorder(GraphRecorder):
    def ops(self, i: int, among=(RESIZE, SET, COPY)) -> list:
        return self.targets(i, among)


def unshard_use_reshard(p, data, x):
    """FSDP2's unshard (resize, then set_ under no_grad), a use, and its reshard (free)."""
    torch.ops.inductor.resize_storage_bytes_(p, p.numel() * p.itemsize)
    with torch.no_grad():
        p.set_(data)
    out = x * p.sum(1)  # the backward needs x and a value read off p, not p itself
    torch.ops.inductor.resize_storage_bytes_(p, 0)
    return out


def unshard_use(p, data, x):
    """The same without the reshard: afterwards p shares data's memory, as in eager."""
    torch.ops.inductor.resize_storage_bytes_(p, p.numel() * p.itemsize)
    with torch.no_grad():
        p.set_(data)
    return (x @ p).tanh()


def make(shape=(3, 4)):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(shape))
    p.untyped_storage().resize_(0)
    return p, torch.randn(shape), torch.randn(2, shape[0], requires_grad=True)


def _check(fn, args, ref_args, out, ref):
    torch.testing.assert_close(out, ref)
    (out.sum() + 0).backward()
    (ref.sum() + 0).backward()
    (p, data, x), (rp, rdata, rx) = args, ref_args
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(p.grad, rp.grad)
    assert p.untyped_storage().nbytes() == rp.untyped_storage().nbytes()
    assert (p.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()) == (
        rp.untyped_storage().data_ptr() == rdata.untyped_storage().data_ptr())
    assert p.is_leaf and p.requires_grad and p.shape == rp.shape and p.stride() == rp.stride()
    if rp.untyped_storage().nbytes():
        torch.testing.assert_close(p.detach(), rp.detach())


@pytest.mark.parametrize("partition", ["default", "min_cut"])
@pytest.mark.parametrize("fn", [unshard_use_reshard, unshard_use])
def test_resize_then_set_under_no_grad_stays_in_graph_in_order(fn, partition):
    part = {"default": aotgrad.default_partition, "min_cut": aotgrad.min_cut_rematerialization_partition}[partition]
    ref_args = make((4, 4) if fn is unshard_use else (3, 4))
    ref = fn(*ref_args)
    rec = Recorder()
    args = make((4, 4) if fn is unshard_use else (3, 4))
    out = aot_function(fn, rec, partition_fn=part)(*args)
    _check(fn, args, ref_args, out, ref)
    expected = [RESIZE, SET, RESIZE] if fn is unshard_use_reshard else [RESIZE, SET]
    assert rec.ops(0) == expected  # the forward: in the program's order, once each
    assert rec.ops(1) == []  # the backward neither replays nor undoes them


@pytest.mark.parametrize("backend", ["aotgrad_eager", "aotgrad"])
def test_resize_then_set_through_torch_compile(backend):
    ref_args = make()
    ref = unshard_use_reshard(*ref_args)
    torch._dynamo.reset()
    args = make()
    out = torch.compile(unshard_use_reshard, backend=backend)(*args)
    _check(unshard_use_reshard, args, ref_args, out, ref)


def test_set_that_changes_the_layout_is_still_refused():
    def f(p, data, x):
        with torch.no_grad():
            p.set_(data.t())  # other strides: eager's gradient follows the old metadata
        return x * p.sum(1)

    p, data, x = make((4, 4))
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(UnsupportedMutationError, match="set_"):
        aot_function(f, Recorder())(p, data, x)


def test_set_with_grad_on_a_parameter_raises_as_eager_does():
    p, data, x = make()
    with pytest.raises(RuntimeError):
        p.set_(data)  # eager: a leaf that requires grad used in an in-place operation
    with pytest.raises(RuntimeError):
        aot_function(lambda p, d: p.set_(d) * 1, Recorder())(p, data)


def fsdp_unshard_with_real_ops(p, shard0, shard1, x):
    """One process standing in for 2 ranks: FSDP2's all_gather_copy_in packs this rank's shard into
    the all-gather buffer, the other rank's half arrives (the all-gather), and the unsharded parameter
    gets memory and is filled by fsdp.copy_ under no_grad; after its use, it is freed."""
    numel = shard0.numel()
    buf = torch.empty(2 * numel)
    ag_in, ag_out = torch.ops.fsdp.all_gather_copy_in([shard0.reshape(-1)], buf, [numel], numel, 0)
    ag_out[numel:].copy_(shard1.reshape(-1))  # what the other rank contributes
    torch.ops.inductor.resize_storage_bytes_(p, p.numel() * p.itemsize)
    with torch.no_grad():
        torch.ops.fsdp.copy_(p, ag_out.view(p.shape))
    y = (x @ p).relu() * p.sum()  # x needs no grad: the backward never reads the freed p
    torch.ops.inductor.resize_storage_bytes_(p, 0)
    return y


def test_fsdp2_real_ops_all_gather_copy_in_and_copy():
    def make_real():
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.empty(4, 3))
        p.untyped_storage().resize_(0)
        return p, torch.randn(2, 3), torch.randn(2, 3), torch.randn(5, 4)

    ref_args = make_real()
    ref = fsdp_unshard_with_real_ops(*ref_args)
    ref.sum().backward()
    for part in (aotgrad.default_partition, aotgrad.min_cut_rematerialization_partition):
        rec = Recorder()
        args = make_real()
        out = aot_function(fsdp_unshard_with_real_ops, rec, partition_fn=part)(*args)
        out.sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(args[0].grad, ref_args[0].grad)
        assert args[0].untyped_storage().nbytes() == 0
        assert rec.ops(0) == [RESIZE, COPY, RESIZE]
        assert rec.ops(1) == []


def test_fsdp2_real_ops_with_set():
    """The same with FSDP's set_ pattern (the all-gather output swapped in) instead of fsdp.copy_."""

    def f(p, shard0, shard1, x):
        numel = shard0.numel()
        _, ag_out = torch.ops.fsdp.all_gather_copy_in([shard0.reshape(-1)], torch.empty(2 * numel), [numel], numel, 0)
        ag_out[numel:].copy_(shard1.reshape(-1))
        torch.ops.inductor.resize_storage_bytes_(p, p.numel() * p.itemsize)
        with torch.no_grad():
            p.set_(ag_out.view(p.shape))
        return (x @ p).relu() * p.sum()

    def make_real():
        torch.manual_seed(2)
        p = torch.nn.Parameter(torch.empty(4, 3))
        p.untyped_storage().resize_(0)
        return p, torch.randn(2, 3), torch.randn(2, 3), torch.randn(5, 4, requires_grad=True)

    ref_args = make_real()
    ref = f(*ref_args)
    ref.sum().backward()
    rec = Recorder()
    args = make_real()
    out = aot_function(f, rec)(*args)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(args[3].grad, ref_args[3].grad)
    torch.testing.assert_close(args[0].grad, ref_args[0].grad)
    torch.testing.assert_close(args[0].detach(), ref_args[0].detach())
    assert rec.ops(0) == [RESIZE, SET]
