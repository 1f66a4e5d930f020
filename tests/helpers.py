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
