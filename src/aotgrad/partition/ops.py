"""What each aten op costs and whether it may be recomputed: `checkpoint_name` tags, tensor sizes in
bytes, op classes (view, matmul, random, never-recompute) and FLOP estimates, for the partitioners.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import torch
import torch.fx
from torch.fx import Node

NAME_KEY = "aotgrad_checkpoint_names"


LARGE_REDUCTION_RATIO = 8


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Name the value `x` for name-based policies; returns `x` itself (an identity in eager).

    While aotgrad (or any `make_fx`-based tracer) traces the program, the name is recorded on the
    graph node that computes `x` (`node.meta["aotgrad_checkpoint_names"]`); nothing is added to the
    graph, so gradients are those of eager by construction.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"checkpoint_name expects a tensor, got {type(x).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name expects a str name, got {type(name).__name__}")
    node = _traced_node(x)
    if node is not None:
        names = node.meta.get(NAME_KEY, ())
        if name not in names:
            node.meta[NAME_KEY] = (*names, name)
    return x


def _traced_node(x: torch.Tensor) -> Node | None:
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return None
    inner = x
    if isinstance(inner, FunctionalTensor):
        torch._sync(inner)
        inner = torch._from_functional_tensor(inner.elem)
    slot = get_proxy_slot(inner, mode.tracer, default=None)
    proxy = getattr(slot, "proxy", None)
    return getattr(proxy, "node", None)


def checkpoint_names(node: Node) -> tuple[str, ...]:
    """The names `checkpoint_name` gave the value of `node` (empty if none)."""
    return tuple(node.meta.get(NAME_KEY, ()))


def _hint(n: Any, fallback: int = 4096) -> int:
    if isinstance(n, int):
        return n
    if isinstance(n, torch.SymInt):
        from ..torch_compat import optimization_hint

        try:
            return int(optimization_hint(n, fallback=fallback))
        except Exception:
            return fallback
    return int(n)


def _numel(t: torch.Tensor) -> int:
    return math.prod(_hint(s) for s in t.shape)


def tensor_nbytes(val: Any) -> int:
    """Bytes of a node value: shape x itemsize for tensors (summed over tuples), 8 for a symbolic int."""
    if isinstance(val, torch.Tensor):
        return _numel(val) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_nbytes(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return 8
    return 0


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _tensor_args(node: Node) -> list[torch.Tensor]:
    return [v for v in (_val(a) for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]


def _out_tensors(node: Node) -> list[torch.Tensor]:
    v = _val(node)
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_MATMUL = {
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear",
    "_int_mm", "_scaled_mm", "einsum", "tensordot", "_weight_int8pack_mm", "_weight_int4pack_mm",
}
_CONV = {
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "cudnn_convolution", "cudnn_convolution_transpose", "mkldnn_convolution",
    "miopen_convolution", "_slow_conv2d_forward", "slow_conv3d_forward", "thnn_conv2d",
    "convolution_overrideable", "_nnpack_spatial_convolution",
    # the backward's library kernels: they read their input and weight from memory, as a matmul
    # does, so a value they read is materialized (a recomputation of it is a kernel of its own)
    "convolution_backward", "convolution_backward_overrideable",
}
_EXPENSIVE = frozenset({"matmul", "conv", "attention", "reduction"})
_NEVER = frozenset({"input", "random", "fixed"})


def _packet_name(target: Any) -> str:
    return getattr(getattr(target, "overloadpacket", None), "__name__", getattr(target, "__name__", ""))


def _is_view_op(target: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


@functools.cache
def _target_class(target: torch._ops.OpOverload) -> str:
    tags = set(target.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return "fixed"
    if target._schema.is_mutable:
        return "fixed"
    if _is_view_op(target):
        return "view"
    name = _packet_name(target)
    if name in _MATMUL:
        return "matmul"
    if name in _CONV:
        return "conv"
    if "attention" in name:
        return "attention"
    if torch.Tag.pointwise in tags:
        return "pointwise"
    return "other"


def _no_dropout(node: Node) -> bool:
    """True for a seeded op whose only randomness is a `dropout_p` argument that is 0: attention
    kernels are tagged `nondeterministic_seeded` for their dropout, yet without it they are
    deterministic and may be recomputed (activation checkpointing recomputes them, as eager does)."""
    schema = node.target._schema
    for k, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                value = node.kwargs[arg.name]
            elif k < len(node.args):
                value = node.args[k]
            else:
                value = arg.default_value
            return isinstance(value, (int, float)) and value == 0
    return False


@functools.cache
def _deterministic_class(target: torch._ops.OpOverload) -> str:
    name = _packet_name(target)
    return "attention" if "attention" in name else "other"


def op_class(node: Node) -> str:
    """'input', 'view', 'free', 'pointwise', 'cheap', 'matmul', 'conv', 'attention', 'reduction',
    'random' or 'fixed' (see the module docstring)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "free"
    if node.op != "call_function":
        return "fixed"
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return "view" if isinstance(parent, Node) and op_class(parent) == "view" else "free"
    val = _val(node)
    number = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))
    if not isinstance(target, torch._ops.OpOverload):
        return "free" if number else "fixed"  # symbolic arithmetic, or an unknown callable
    cls = _target_class(target)
    if cls == "random" and _no_dropout(node):
        cls = _deterministic_class(target)
    if cls in ("random", "fixed", "view"):
        return cls
    if number:
        return "free"  # sym_size, sym_numel...
    if val is None:
        return "fixed"  # no output: an op run for its effect
    if cls != "other":
        return cls
    ins, outs = _tensor_args(node), _out_tensors(node)
    if not ins:
        return "free"  # a factory: zeros, full, arange, scalar_tensor...
    read = sum(_numel(t) for t in ins)
    written = sum(_numel(t) for t in outs)
    if read > LARGE_REDUCTION_RATIO * max(written, 1):
        return "reduction"
    return "cheap"


def is_matmul_like(node: Node) -> bool:
    """A matmul, convolution or attention op (what `save_matmuls` saves)."""
    return node.op == "call_function" and op_class(node) in ("matmul", "conv", "attention")


def estimate_flops(node: Node) -> int:
    """A rough FLOP count for computing `node` once (see the module docstring)."""
    cls = op_class(node)
    if cls in ("input", "view", "free"):
        return 0
    ins, outs = _tensor_args(node), _out_tensors(node)
    out_numel = sum(_numel(t) for t in outs)
    name = _packet_name(node.target)
    try:
        if cls == "matmul":
            args = [_val(a) for a in node.args if isinstance(a, Node)]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name in ("addmm", "baddbmm", "addbmm", "addmv"):
                tensors = tensors[1:]
            if name in ("dot", "vdot"):
                return 2 * _numel(tensors[0])
            k = _hint(tensors[0].shape[-1]) if tensors and tensors[0].dim() else 1
            return 2 * out_numel * k
        if cls == "conv":
            x, w = _val(node.args[0]), _val(node.args[1])
            per_out = _numel(w) // max(_hint(w.shape[0]), 1)
            transposed = name.startswith("conv_transpose") or (
                name in ("convolution", "_convolution") and len(node.args) > 6 and bool(node.args[6])
            )
            return 2 * (_numel(x) if transposed else out_numel) * per_out
        if cls == "attention":
            q, k, v = (_val(a) for a in node.args[:3])
            lq, s = _hint(q.shape[-2]), _hint(k.shape[-2])
            batch = _numel(q) // max(lq * _hint(q.shape[-1]), 1)
            return 2 * batch * lq * s * (_hint(q.shape[-1]) + _hint(v.shape[-1]))
    except (AttributeError, IndexError, TypeError):
        pass
    return max(sum(_numel(t) for t in ins), out_numel)
