"""Test fixtures shared by several test files."""

from __future__ import annotations

import torch


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
