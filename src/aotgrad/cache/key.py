"""The on-disk cache's key: everything a compiled Dynamo graph depends on, or why none can be given.

A key is a SHA-256 over plain values (strings, ints, tuples): the Dynamo graph's code (and that of
its subgraphs), its inputs' metadata and how they alias, grad mode, autocast, the versions of
aotgrad (the hash of its source files), torch and Python, aotgrad's config, and the backend's
compilers, partitioner, memory budget, decompositions and Inductor config. Anything the key cannot
describe faithfully (a custom compiler without `aotgrad_cache_key`, a user function called in the
graph, a tensor subclass input, symbolic shapes) raises `Uncacheable` with the reason: the graph is
then compiled as usual and not cached, never looked up under a key that might not cover it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .. import config

FORMAT = 3  # bump when what an entry holds changes

# aotgrad options that do not change what the backend compiles (reports, the aot_function path).
_CONFIG_NOT_IN_KEY = frozenset({"cache", "explain_dir", "recompile_limit", "recompile_hard_limit"})


class Uncacheable(Exception):
    """The key cannot be computed; the message says why (logged with the miss)."""


def digest(parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def aotgrad_version() -> str:
    """aotgrad's version: a hash of its source files, so any edit to the package is a new version."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the aotgrad package
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                h.update(os.path.relpath(os.path.join(folder, name), root).encode())
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:32]


def torch_version() -> str:
    py = ".".join(map(str, sys.version_info[:3]))
    return f"torch {torch.__version__} ({torch.version.git_version}) python {py}"


def graph_key(backend: Any, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], state: list) -> tuple:
    """The parts of the key that come from the Dynamo graph and the global state (before any pass
    changes the graph); `state` are the parameters/buffers still attached to it."""
    return (
        ("format", FORMAT),
        ("aotgrad", aotgrad_version()),
        ("torch", torch_version()),
        ("graph", _graph_parts(gm, {id(t) for t in state})),
        ("inputs", _inputs_parts(list(state) + list(example_inputs))),
        ("dynamic", _symbolic_placeholders(gm)),
        ("global", _global_state()),
        ("config", tuple((n, getattr(config, n)) for n in config._NAMES if n not in _CONFIG_NOT_IN_KEY)),
    )


def backend_key(backend: Any) -> tuple:
    """The parts of the key that come from the backend that compiles the graph (after the backend
    picked its Inductor patches for this graph)."""
    parts: list = [
        ("use_inductor", backend.use_inductor),
        ("keep_inference_input_mutations", backend.keep_inference_input_mutations),
        ("memory_budget", backend.memory_budget),
        ("torch_memory_budget", _torch_memory_budget()),
        ("partition", _identity(backend.partition_fn, "partition_fn") if backend.partition_fn else "default"),
    ]
    if backend.use_inductor:
        from torch._inductor import config as inductor_config

        from ..inductor.compilers import _inductor_decompositions

        with backend._inductor_patches():
            parts.append(("inductor_config", inductor_config.get_hash().hex()))
            decomps = backend.decompositions if backend.decompositions is not None else _inductor_decompositions()
        parts.append(("inductor_patches", _sorted_items(backend.inductor_patches)))
        parts.append(("forward_patches", _sorted_items(backend.forward_inductor_patches)))
        for name in ("pre_grad_custom_pass", "joint_custom_pre_pass", "joint_custom_post_pass",
                     "post_grad_custom_pre_pass", "post_grad_custom_post_pass"):
            if getattr(inductor_config, name, None) is not None:
                raise Uncacheable(f"Inductor config {name} is set (a custom pass the key cannot describe)")
    else:
        for what in ("fw_compiler", "bw_compiler", "inference_compiler"):
            fn = getattr(backend, what)
            parts.append((what, _identity(fn, what) if fn is not None else None))
        decomps = backend.decompositions or {}
    parts.append(("decompositions", _decomps_digest(decomps)))
    return tuple(parts)


def _torch_memory_budget() -> float:
    """`torch._functorch.config.activation_memory_budget`: the backend's partitioner honours it."""
    import torch._functorch.config as functorch_config

    return float(functorch_config.activation_memory_budget)


# -- the Dynamo graph ---------------------------------------------------------------------------


_SAFE_MODULES = ("operator", "_operator", "builtins", "math")
_PUBLIC_TORCH_MODULES = ("torch.functional", "torch.nn.functional")


def _graph_parts(gm: torch.fx.GraphModule, state_ids: set[int]) -> tuple:
    parts = []
    for name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            raise Uncacheable(f"submodule {name!r} of the Dynamo graph is a {type(mod).__name__}, not a graph")
        for node in mod.graph.nodes:
            _check_node(node)
        parts.append((name, mod.code, _attributes(mod, state_ids)))
    return tuple(parts)


def _check_node(node: torch.fx.Node) -> None:
    if node.op == "call_function" and not _safe_target(node.target):
        name = f"{getattr(node.target, '__module__', '?')}.{getattr(node.target, '__qualname__', node.target)}"
        raise Uncacheable(f"the graph calls {name} (node {node.name}), a function the key cannot describe")
    if node.op == "call_method" and not isinstance(node.target, str):
        raise Uncacheable(f"call_method node {node.name} with a non-string target")
    if node.op not in ("placeholder", "output", "get_attr", "call_function", "call_method", "call_module"):
        raise Uncacheable(f"node {node.name}: op {node.op}")
    for arg in torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: a):
        _check_constant(arg, node)


_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format,
                   torch.fx.Node, type(Ellipsis))


def _check_constant(arg: Any, node: torch.fx.Node) -> None:
    if isinstance(arg, (tuple, list)):
        for a in arg:
            _check_constant(a, node)
    elif isinstance(arg, dict):
        for a in arg.values():
            _check_constant(a, node)
    elif isinstance(arg, slice):
        for a in (arg.start, arg.stop, arg.step):
            _check_constant(a, node)
    elif isinstance(arg, float) and not math.isfinite(arg):
        return
    elif not isinstance(arg, _CONSTANT_TYPES):
        raise Uncacheable(f"node {node.name} has an argument of type {type(arg).__name__} the key cannot describe")


def _safe_target(target: Callable) -> bool:
    """Functions whose behaviour is fixed by torch's version (upstream's AOTAutograd cache
    allows the same set): ops, cacheable higher-order ops, C builtins, public torch functions."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return bool(getattr(target, "cacheable", lambda: False)())
    if type(target).__name__ == "builtin_function_or_method":
        return True
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", "") or ""
    if module in _SAFE_MODULES or target in (operator.getitem,):
        return True
    if module in _PUBLIC_TORCH_MODULES and not name.startswith("_"):
        return True
    from torch._dynamo.trace_rules import torch_non_c_binding_in_graph_functions

    return f"{module}.{name}" in torch_non_c_binding_in_graph_functions


def _attributes(mod: torch.fx.GraphModule, state_ids: set[int]) -> tuple:
    """What get_attr nodes read: parameters/buffers are graph inputs (their metadata is in the
    inputs part); other tensors are baked into the graph, so their values are part of the key."""
    out = []
    for node in mod.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(mod)
        if isinstance(value, torch.fx.GraphModule) or id(value) in state_ids:
            continue
        if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise Uncacheable(f"attribute {node.target} is a {type(value).__name__} the key cannot describe")
        if value.device.type == "meta" or value.nbytes > (64 << 20):
            raise Uncacheable(f"tensor constant {node.target} cannot be hashed (meta or over 64 MiB)")
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        out.append((node.target, _tensor_meta(value), hashlib.sha256(data).hexdigest()))
    return tuple(out)


# -- inputs and global state ---------------------------------------------------------------------


def _inputs_parts(values: list) -> tuple:
    storages: dict[int, int] = {}
    positions = {id(v): i for i, v in enumerate(values) if isinstance(v, torch.Tensor)}
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(_tensor_part(v, storages, positions))
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Uncacheable("a symbolic int/float input (dynamic shapes are not cached)")
        elif isinstance(v, (int, float, bool, type(None))):
            out.append(("const", type(v).__name__, repr(v)))
        else:
            raise Uncacheable(f"an input of type {type(v).__name__}")
    return tuple(out)


def _tensor_part(t: torch.Tensor, storages: dict[int, int], positions: dict[int, int]) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensor

    from ..signature.inputs import is_wrapper

    if is_wrapper(t) or (type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, FakeTensor)):
        raise Uncacheable(f"a tensor input of type {type(t).__name__} (tensor subclasses are not cached)")
    if t.layout is not torch.strided:
        raise Uncacheable(f"a tensor input with layout {t.layout}")
    _no_symbols(t.shape, t.stride(), t.storage_offset())
    storage = t.untyped_storage()
    group = storages.setdefault(storage._cdata, len(storages))
    base = t._base
    return (
        _tensor_meta(t),
        type(t).__name__ if not isinstance(t, FakeTensor) else "Tensor",
        t.is_leaf,
        t._is_view(),
        positions.get(id(base)) if base is not None else None,
        _tensor_meta(base) + (int(base.untyped_storage().nbytes()),) if base is not None else None,
        group,
        int(storage.nbytes()),
        t.is_inference(),
    )


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (str(t.dtype), str(t.device), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad,
            t.is_conj(), t.is_neg())


def _no_symbols(*values: Any) -> None:
    for v in values:
        items = v if isinstance(v, (tuple, list, torch.Size)) else (v,)
        if any(isinstance(x, torch.SymInt) for x in items):
            raise Uncacheable("symbolic sizes (dynamic shapes are not cached)")


def _symbolic_placeholders(gm: torch.fx.GraphModule) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_symbols

    for node in gm.graph.find_nodes(op="placeholder"):
        ev = node.meta.get("example_value")
        if isinstance(ev, (torch.Tensor, torch.SymInt, torch.SymFloat)) and free_symbols(ev):
            raise Uncacheable("symbolic sizes (dynamic shapes are not cached)")
    return False


def _global_state() -> tuple:
    autocast = tuple(
        (d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")
    )
    return (
        ("grad", torch.is_grad_enabled()),
        ("autocast", autocast, torch.is_autocast_cache_enabled()),
        ("deterministic", torch.are_deterministic_algorithms_enabled()),
        ("default_dtype", str(torch.get_default_dtype())),
    )


# -- the backend ---------------------------------------------------------------------------------


def _identity(fn: Callable, what: str) -> Any:
    """A compiler's or partitioner's identity: aotgrad's own by name, a user's by the string it
    gives as `aotgrad_cache_key` (its opt-in); anything else cannot be keyed."""
    key = getattr(fn, "aotgrad_cache_key", None)
    if isinstance(key, str):
        return ("user", key)
    if isinstance(fn, functools.partial):
        kwargs = tuple(sorted((k, repr(v)) for k, v in fn.keywords.items()))
        if not all(isinstance(a, (int, float, bool, str, type(None))) for a in fn.args) or not all(
            isinstance(v, (int, float, bool, str, type(None))) for v in fn.keywords.values()
        ):
            raise Uncacheable(f"{what} is a functools.partial with arguments the key cannot describe")
        return ("partial", _identity(fn.func, what), tuple(map(repr, fn.args)), kwargs)
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", "") or ""
    if (module == "aotgrad" or module.startswith("aotgrad.")) and "<locals>" not in name:
        return f"{module}.{name}"
    raise Uncacheable(
        f"{what} {getattr(fn, '__name__', fn)!r} is unknown to the cache; give it an `aotgrad_cache_key` "
        "string attribute (changed whenever its behaviour changes) to opt in"
    )


def _decomps_digest(decomps: dict) -> str:
    return digest(sorted((str(op), _decomp_identity(fn, op)) for op, fn in decomps.items()))


def _decomp_identity(fn: Any, op: Any) -> Any:
    """torch's decompositions by name (torch's version is in the key); others by their code."""
    if isinstance(fn, functools.partial):
        args = repr(fn.args) + repr(sorted(fn.keywords.items()))
        if " at 0x" in args:
            raise Uncacheable(f"decomposition of {op} is a partial with arguments the key cannot describe")
        return ("partial", _decomp_identity(fn.func, op), args)
    module = getattr(fn, "__module__", None) or ""
    entry = f"{module}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"
    if module.startswith("torch"):
        return entry
    code = getattr(fn, "__code__", None)
    if code is None:
        raise Uncacheable(f"decomposition of {op} ({entry}) has no code to hash")
    return entry + hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:16]


def _sorted_items(d: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in d.items()))
