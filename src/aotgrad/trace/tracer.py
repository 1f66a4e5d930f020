"""A lean recorder of aten calls into an FX graph — the part of `make_fx` aotgrad needs.

trace/capture.py runs the program on fake tensors under functionalization; this mode sits between
functionalization and the fake mode (where `make_fx`'s proxy mode would sit) and appends one FX node
per aten call, with `meta["val"]` set to the fake result. It skips what `make_fx` does per op that
aotgrad never reads (proxy objects, torch-function metadata, tensor-meta snapshots), which makes the
trace about twice as fast.

It handles static shapes only. Symbolic shapes, and higher-order operators other than
`with_effects` and the auto-functionalization ones (custom ops that mutate their arguments), raise
`UseMakeFx`; capture then traces with `make_fx` instead.

    graph, placeholders = new_graph(fake_primals)
    with LeanTracer(graph, placeholders, decompositions) as tracer:
        outs = body(fake_primals)          # may call tracer.placeholder(name, value) mid-trace
    gm = tracer.finish(outs)
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._higher_order_ops.effects import with_effects
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._python_dispatch import TorchDispatchMode

from .. import node_meta


class UseMakeFx(Exception):
    """The program needs something this recorder does not do; trace it with make_fx."""


class LeanTracer(TorchDispatchMode):
    """Records aten calls on tensors into `self.graph`; every recorded tensor maps to its node."""

    # An infra mode in the proxy slot: below functionalization, above the fake mode.
    _mode_key = torch._C._TorchDispatchModeKey.PROXY

    def __init__(self, primals: list[torch.Tensor], decompositions: dict | None = None):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.decompositions = decompositions or {}
        self.nodes: dict[int, torch.fx.Node] = {}
        self.keep_alive: list[Any] = []  # ids stay unique while the trace runs
        self.num_constants = 0
        self.first_op: torch.fx.Node | None = None
        # The op the program called, while its decomposition runs: Inductor names kernels after it
        # (`meta["original_aten"]`, as make_fx records it), so profiles read `cpp_fused_gelu_...`.
        self.original_op: Callable | None = None
        for i, p in enumerate(primals):
            self._bind(p, self.graph.placeholder(f"primals_{i + 1}"))
        # FunctionalTensorMode looks up `mode.tracer.tensor_tracker[t].proxy.node` on the mode in the
        # proxy slot (to annotate replayed views); answer it from our map.
        self.tracer = SimpleNamespace(tensor_tracker=_NodeLookup(self.nodes))

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    # -- the graph ---------------------------------------------------------------------------------

    def _bind(self, value: Any, node: torch.fx.Node) -> None:
        node.meta["val"] = value
        if isinstance(value, torch.Tensor):
            self.nodes[id(value)] = node
            self.keep_alive.append(value)

    def node_of(self, t: torch.Tensor) -> torch.fx.Node:
        return self.nodes[id(t)]

    def placeholder(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        """A graph input created mid-trace (tangents); placed after the existing inputs."""
        if self.first_op is None:
            node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_before(self.first_op):
                node = self.graph.placeholder(name)
        self._bind(value, node)
        return node

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            node = self.nodes.get(id(a))
            return node if node is not None else self._constant(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UseMakeFx("symbolic shapes")
        return a

    def _constant(self, t: torch.Tensor) -> torch.fx.Node:
        if isinstance(t, torch._subclasses.FakeTensor):
            raise UseMakeFx("a fake tensor from outside the trace")
        name = f"_tensor_constant{self.num_constants}"
        self.num_constants += 1
        setattr(self.root, name, t)
        with self.graph.inserting_before(self.first_op):
            node = self.graph.get_attr(name)
        node.meta["val"] = t
        return node

    def record(self, target: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        name = getattr(target, "_opname", None)  # aten.sin.default -> "sin", as make_fx names nodes
        node = self.graph.create_node(
            "call_function", target, self._arg(args), {k: self._arg(v) for k, v in kwargs.items()}, name
        )
        if self.first_op is None:
            self.first_op = node
        if not torch.is_grad_enabled():  # under no_grad, or in a custom Function's forward (higher_order/backward.py)
            node.meta[NO_GRAD] = True
        elif target is torch.ops.aten.detach.default and torch._C._current_autograd_node() is not None:
            node.meta[ENGINE_UNPACK] = True  # the program's autograd.grad(create_graph=True) unpacked a saved output
        node.meta["val"] = out
        node.meta["original_aten"] = self.original_op or target
        node_meta.annotate(node)
        if isinstance(out, torch.Tensor):
            if id(out) not in self.nodes:  # an in-place op returns its (already recorded) input
                self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor) and id(item) not in self.nodes:
                    self._bind(item, self.graph.call_function(operator.getitem, (node, i)))
                elif isinstance(item, (torch.SymInt, torch.SymFloat)):
                    raise UseMakeFx("symbolic outputs")
        elif isinstance(out, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UseMakeFx("symbolic outputs")
        return out

    # -- dispatch ----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = self.decompositions.get(func)
        if decomposition is not None:
            out = self._decompose(func, decomposition, args, kwargs)
            if out is not NotImplemented:
                return out
        if func in _METADATA_OPS:
            return func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:
            # `torch.tensor(8)` in the program: the constant stays a module attribute and the program
            # gets its own copy (make_fx's rule). A graph that returned the attribute itself would hand
            # the compiler a constant as an output, which Inductor cannot lower.
            func = torch.ops.aten.lift_fresh_copy.default
        # A composite op reaches the trace when a decomposition calls one (`x.to(dtype)` in the
        # batch-norm decompositions), as autograd's key, which would have split it, is behind us:
        # split it here (make_fx's rule), or the compiler gets an op it can only call as a
        # fallback kernel (Inductor: `aten.to.dtype`, unfused, in every batch norm under autocast).
        if _composite(func):
            out = self._decompose(func, func.decompose, args, kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        return self.record(func, args, kwargs, out)

    def _decompose(self, func, decomposition, args, kwargs):
        outermost = self.original_op is None
        if outermost:
            self.original_op = func
        try:
            with self:
                return decomposition(*args, **kwargs)
        finally:
            if outermost:
                self.original_op = None

    def finish(self, outputs: list) -> torch.fx.GraphModule:
        self.graph.output([self._arg(o) if isinstance(o, torch.Tensor) else o for o in outputs])
        node_meta.copy_forward_traces(self.graph)
        # Lazy: a joint graph is only read by the partitioner; its Python code is written on demand.
        gm = _LazyGraphModule(self.root, self.graph)
        gm.meta[GRAD_MODE_RECORDED] = True
        return gm


@functools.cache
def _composite(func: torch._ops.OpOverload) -> bool:
    """Whether the op has a CompositeImplicitAutograd kernel (asked once per op, not per call)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


class _NodeLookup:
    def __init__(self, nodes: dict[int, torch.fx.Node]):
        self.nodes = nodes

    def __getitem__(self, t: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(proxy=SimpleNamespace(node=self.nodes[id(t)]))


# Meta keys: a node recorded with grad mode off; a graph whose nodes carry that key.
NO_GRAD = "aotgrad_no_grad"
# A `detach` autograd's engine recorded while the program's own `autograd.grad(create_graph=True)`
# ran: unpacking a saved output, which autograd gives the output's history (higher_order/backward.py).
ENGINE_UNPACK = "aotgrad_engine_unpack"
GRAD_MODE_RECORDED = "aotgrad_grad_mode_recorded"

_METADATA_OPS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.prim.device.default,
    torch.ops.prim.layout.default,
}


def _record_higher_order(hop):
    """Run `hop` on the modes below ours (fake), then record it as one node, like an aten call."""

    def run_and_record(mode: LeanTracer, *args, **kwargs):
        if torch._C._get_dispatch_mode(mode._mode_key) is mode:  # some callers leave us active
            with torch.utils._python_dispatch._pop_mode_temporarily(mode._mode_key):
                out = hop(*args, **kwargs)
        else:
            out = hop(*args, **kwargs)
        return mode.record(hop, args, kwargs, out)

    hop.py_impl(LeanTracer)(run_and_record)


for _hop in (with_effects, auto_functionalized, auto_functionalized_v2):
    _record_higher_order(_hop)
