"""The fuzzer's subclass mode (`make fuzz SUBCLASS=1`): every program's inputs are TwoTensors.

Each floating tensor `make_inputs` creates (with `torch.randn`, `torch.ones`, ...) is made a
`TwoTensor(t, t * 2 + 1)` (torch.testing._internal.two_tensor), so the roots, their clones and the
views the program takes of them are subclasses whose two components differ; the program then runs
through the subclass stage (subclass/wrap.py). Outcomes are classified as in testing/fuzz/check.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .check import Outcome
from .check import check_program as check_plain
from .programs import Program


class TwoTensorFactories(TorchDispatchMode):
    """Tensor factories return TwoTensors of two different floating tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._subclasses.fake_tensor._is_tensor_constructor(func) and out.is_floating_point():
            from torch.testing._internal.two_tensor import TwoTensor

            return TwoTensor(out, out * 2 + 1)
        return out


def with_two_tensor_inputs(make_inputs: Callable) -> Callable:
    def make():
        with TwoTensorFactories():
            return make_inputs()

    return make


def check_program(prog: Program, *, backend: str | None = None, **kwargs) -> Outcome:
    """`fuzz_check.check_program` with TwoTensor inputs (a mismatch is not explained fact by fact:
    `explain` re-runs the plain program)."""
    return check_plain(prog, backend=backend, wrap_inputs=with_two_tensor_inputs, explain_mismatch=False, **kwargs)
