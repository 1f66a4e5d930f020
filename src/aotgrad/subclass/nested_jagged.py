"""Jagged NestedTensors (torch.nested, layout=torch.jagged) at the subclass boundary.

A jagged NestedTensor is a traceable wrapper subclass over `values` (every component's rows,
concatenated) and `offsets` (plus cached min/max sequence lengths); its ragged size is a *nested
int* tied to its offsets tensor. The subclass stage flattens it like any other subclass
(subclass/wrap.py). What is particular to it, and where it lives:

- its offsets are integer metadata: passed as they are, never detached, so an output sharing its
  argument's offsets, and its gradient, have the argument's nested int as in eager
  (`subclass_sizes.metadata_tensors`, used by `_Unwrap`);
- in a trace its ragged size is a real nested int, given to the offsets' fake
  (`subclass_sizes.tie_ragged`), which records nothing; at run time it rebuilds its nested int
  from its offsets and ignores the outer size (`subclass_symbolic.specialize` writes -1 there);
- `flatten_context`'s `requires_grad` is autograd state, not structure (`subclass_layout._ctx_key`).

Supported: under `torch.compile(backend="aotgrad" | "aotgrad_eager")`, where Dynamo hands the
ragged size over as a symbol, with static dense sizes. Refused here, naming the input: a call on
real NestedTensors (`aot_function`, or the backend's per-shape fallback), whose fakes would need a
ShapeEnv for the nested int; the error says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UnsupportedInputError


def is_jagged(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout is torch.jagged


def _has_real_nested_int(x: torch.Tensor) -> bool:
    from torch.nested._internal.nested_int import NestedIntNode

    v = x.shape[x._ragged_idx]
    return isinstance(v, torch.SymInt) and isinstance(v.node, NestedIntNode)


def refuse_static(leaves: Sequence[Any]) -> None:
    """Refuse jagged NestedTensor arguments whose ragged size is a real nested int (a call traced
    with static sizes), naming the input."""
    for i, x in enumerate(leaves):
        if is_jagged(x) and _has_real_nested_int(x):
            raise UnsupportedInputError(
                f"aotgrad: input {i} is a jagged NestedTensor with a concrete ragged size (a nested int); "
                "aotgrad compiles jagged NestedTensors only as torch.compile(backend='aotgrad' or "
                "'aotgrad_eager') hands them over: ragged size symbolic, dense sizes static. This call is "
                "aot_function's, or the backend's per-shape fallback after the symbolic compile failed "
                "(under dynamic=True, or an op the symbolic trace does not support: the aotgrad.backend "
                "debug log says which). Call it eagerly, or pass its values() and offsets() instead."
            )
