"""DTensor gradients in eager's placements (issue 38 item 5): where eager's gradient of a Replicate
DTensor argument is Partial(sum) (a matmul whose other operand is sharded on the batch), aotgrad
returns it Partial too, not redistributed to Replicate (on a real mesh, an all-reduce in the backward
the caller did not ask for). One-rank gloo mesh; three calls with new values between them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_subclass_dtensor import TIMEOUT, _free_port

from aotgrad import aot_function, aot_module, nop

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            timeout=TIMEOUT)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _same_as_eager(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.placements == want.placements, what
    torch.testing.assert_close(got.full_tensor(), want.full_tensor(), msg=what)


class MatMul(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("path", ["aot_function", "aot_module"])
def test_partial_gradient_of_replicate_argument_stays_partial(mesh, path):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    def weight():
        torch.manual_seed(0)
        return distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])

    if path == "aot_function":
        we, wc = weight().requires_grad_(), weight().requires_grad_()
        eager, compiled = (lambda x: x @ we), aot_function(lambda w, x: x @ w, nop)

        def call(x):
            return compiled(wc, x)
    else:
        me, mc = MatMul(weight()), MatMul(weight())
        we, wc, eager, call = me.w, mc.w, me, aot_module(mc, nop)
    for i in range(3):
        torch.manual_seed(10 + i)
        x = distribute_tensor(torch.randn(2 + i, 4), mesh, [Shard(0)])
        out_e, out_c = eager(x), call(x)
        _same_as_eager(out_c, out_e, f"call {i}: output")
        out_e.sum().backward()
        out_c.sum().backward()
        assert we.grad.placements == (Partial("sum"),)
        _same_as_eager(wc.grad, we.grad, f"call {i}: gradient")
        with torch.no_grad():  # an SGD step: the next call reads the new values
            we -= 0.1 * we.grad.redistribute(placements=[Replicate()])
            wc -= 0.1 * wc.grad.redistribute(placements=[Replicate()])
        we.grad = wc.grad = None
