"""The tensor metadata part of a generated guard (inputs.make_guard) as one C++ call.

Read from Python, each of a tensor's `requires_grad`, `shape`, `stride()`, `dtype`, `device` costs
0.1-0.2 us, and 0.4 us on a subclass (each read checks for `__torch_function__`): a TwoTensor
argument's outer tensor and two inner ones made most of the subclass guard's ~4.5 us. Dynamo's
`TensorGuards` compares exactly these (plus the Python type and dispatch keys) for many tensors in
one call. Its dispatch-key check is stricter than the signature (conjugate/negative bits, functorch
wrappers, inference tensors): such a call only misses the fast path and is looked up by its full
signature (api.CompiledFunction._call_slow), never accepted wrongly. Where `TensorGuards` cannot be
built or does not accept the examples, the guard keeps its Python conditions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("aotgrad.guard_tensors")


@dataclass(frozen=True)
class Metadata:
    """A tensor's metadata conditions in a guard's list: `conds` (Python) unless one C++ check
    (`tensor_check`) covers every such tensor of the guard."""

    expr: str
    tensor: torch.Tensor
    conds: tuple[str, ...]


def metadata(t: torch.Tensor, v: str, shape: str, stride: str, dtype: str, device: str) -> Metadata:
    """`v`'s requires_grad, shape, stride, dtype, device as `t`'s (scope names of `t`'s values)."""
    return Metadata(v, t, (
        f"{v}.requires_grad is {t.requires_grad}", f"{v}.shape == {shape}", f"{v}.stride() == {stride}",
        f"{v}.dtype is {dtype}", f"{v}.device == {device}",
    ))


def resolve(conds: Sequence[str | Metadata], scope: dict) -> list[str]:
    """The guard's conditions: the Metadata entries become one `TensorGuards` check at the end (after
    every type check, so each expression can be read), or their Python conditions in place."""
    entries = [c for c in conds if isinstance(c, Metadata)]
    check = tensor_check([e.tensor for e in entries]) if entries else None
    if check is None:
        return [s for c in conds for s in ((c,) if isinstance(c, str) else c.conds)]
    scope["_tensor_check"] = check
    return [c for c in conds if isinstance(c, str)] + [f"_tensor_check({', '.join(e.expr for e in entries)})"]


def tensor_check(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """`TensorGuards(...).check` for these tensors' static metadata, or None where it cannot serve."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        sizes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        if not all(type(n) is int for dims in (*sizes, *strides) for n in dims):  # symbolic: left to Python
            return None
        guards = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        if guards.check(*tensors):
            return guards.check
    except (ImportError, TypeError, RuntimeError, SystemError, ValueError) as e:
        log.debug("aotgrad: tensor guard in Python (TensorGuards unavailable: %s)", e)
    return None
