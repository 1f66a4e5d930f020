"""Decomposition tables aotgrad users commonly pass as `decompositions=`."""

from __future__ import annotations

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

# Ops whose backward formulas are easier for graph compilers to fuse once decomposed
# (in the spirit of upstream's default decompositions).
_DEFAULT_OPS = [
    aten.detach,
    aten.gelu_backward,
    aten.leaky_relu_backward,
    aten.sigmoid_backward,
    aten.threshold_backward,
    aten.hardtanh_backward,
    aten.hardsigmoid_backward,
    aten.hardswish_backward,
    aten.tanh_backward,
    aten.silu_backward,
    aten.elu_backward,
    aten.cudnn_batch_norm,
    aten.cudnn_batch_norm_backward,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.elu,
    aten.leaky_relu,
    aten.hardtanh,
    aten.hardswish,
    aten.hardsigmoid,
    aten.conj_physical,
    aten.is_same_size,
]

default_decompositions = get_decompositions(_DEFAULT_OPS)
