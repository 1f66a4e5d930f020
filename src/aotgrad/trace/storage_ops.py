"""FSDP2's storage pattern kept in the graph: `set_` of a parameter under `no_grad`.

FSDP2's unshard gives an unsharded parameter (a leaf that requires grad) memory again
(`inductor.resize_storage_bytes_`) and swaps the all-gathered data in with `set_` under `no_grad`;
its reshard frees the memory. Functionalized, that `set_` would become an epilogue action replayed
on the caller's parameter after the graph, onto a storage the graph itself resized meanwhile, and
autograd would have to follow a leaf's new metadata. So a `set_` that keeps the tensor's layout
(size, strides, offset, dtype) on a caller's leaf that requires grad, under `no_grad`, is recorded
as `aotgrad.set_`: its Functionalize kernel runs `set_` on the unwrapped tensors, as traceable
FSDP2's own `fsdp.set_` did, so the op stays in the graph, in order with the resizes, and mutates the
graph input itself (no epilogue; `partition.reads_of_mutated_in_graph` pins its readers). The leaf's
metadata does not change, so its gradient is eager's. Any other `set_` is functionalized as before.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("aotgrad", "FRAGMENT")
_LIB.define("set_(Tensor(a!) tensor, Tensor data) -> ()")


def _set(tensor: torch.Tensor, data: torch.Tensor) -> None:
    tensor.set_(data)


def _set_functionalize(tensor: torch.Tensor, data: torch.Tensor) -> None:
    torch._sync(tensor)
    torch._sync(data)
    inner, inner_data = torch._from_functional_tensor(tensor), torch._from_functional_tensor(data)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        torch.ops.aotgrad.set_.default(inner, inner_data)


for _key in ("CPU", "CUDA", "Meta"):
    _LIB.impl("set_", _set, _key)
_LIB.impl("set_", _set_functionalize, "Functionalize")
torch.fx.node.has_side_effect(torch.ops.aotgrad.set_.default)

IN_GRAPH_SET = torch.ops.aotgrad.set_.default


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def kept_in_graph(func, args, kwargs) -> bool:
    """Whether this call is a `set_` to record as `aotgrad.set_` (see the module docstring): a
    layout-preserving `set_(tensor)` under no_grad on a caller's leaf that requires grad and has no
    views (a view taken before would keep the old storage in eager)."""
    if func is not torch.ops.aten.set_.source_Tensor or kwargs or len(args) != 2:
        return False
    t, data = args
    if torch.is_grad_enabled() or not t.requires_grad or not getattr(t, "_aotgrad_caller_leaf", False):
        return False
    if t._is_view() or getattr(t, "_aotgrad_has_views", False) or not isinstance(data, torch.Tensor):
        return False
    return _layout(t) == _layout(data)


def all_gather_copy_in(all_gather_inputs, all_gather_output, inp_split_sizes, all_gather_input_numel, rank):
    """FSDP2's `fsdp.all_gather_copy_in`, as its kernel runs it. Its schema marks nothing as written
    and no output as an alias, but the kernel copies the inputs into `all_gather_output` and returns
    views of it: recorded as the op, it would be dead code, its writes lost. Traced as these aten ops
    instead, functionalization sees the writes and the aliases."""
    all_gather_input = all_gather_output.narrow(0, all_gather_input_numel * rank, all_gather_input_numel)
    with torch.no_grad():
        torch._foreach_copy_(torch.split(all_gather_input, inp_split_sizes), all_gather_inputs)
    return all_gather_input, all_gather_output


def decomposition(func):
    """The Python function to trace in place of `func`, for custom ops whose schema understates
    what they do; else None. (Names compared, not ops looked up: this runs on every traced op.)"""
    if getattr(func, "namespace", None) == "fsdp" and getattr(func, "_opname", None) == "all_gather_copy_in":
        return all_gather_copy_in
    return None
