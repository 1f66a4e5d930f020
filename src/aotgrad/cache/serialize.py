"""What a cache entry holds, and how it is made from a freshly compiled signature.

An entry is the `Plan`, per compiled graph a `GraphRecord` (Inductor's FX-graph cache key for its
compiled code, and the graph exactly as aotgrad handed it to the compiler), the few facts the run
time reads off the graphs (`GraphFacts`), and those `CompiledForward` reads off graphs that are not
stored (the joint graph's value flow, the number of saved values). On a hit (cache/load.py) a graph
with an Inductor key comes back as Inductor's compiled code, loaded by that key: no trace, no
partitioning, no graph unpickled and no graph hashed again. Graphs are written with torch.fx's
`GraphPickler` (each node's fake value kept, re-created in the loading compile's fake mode); they are
unpickled only for graphs without an Inductor key (custom compilers, `aotgrad_eager`) or when
something needs the graph itself (compiled autograd, a backward under autocast). A training entry
also holds the pristine graphs of the differentiable backward (cache/higher.py), unpickled when a
`create_graph=True` or None-gradient backward first runs.
"""

from __future__ import annotations

import functools
import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from .higher import HigherOrderRecord, record
from .key import Uncacheable


@dataclass(frozen=True)
class GraphRecord:
    """One compiled graph: the graph as its compiler got it (None when not serializable), and
    where Inductor keeps its compiled code (`inductor_key`; None: compile `graph` again on a hit)."""

    graph: bytes | None
    inductor_key: str | None = None
    guards_expr: str | None = None
    donated: tuple[int, ...] = ()  # inputs the compiled code writes into (inductor/donation.py)


@dataclass(frozen=True)
class TensorKind:
    """A traced tensor's dtype, device and shape (None when symbolic): what the run time reads off
    a backward placeholder."""

    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GraphFacts:
    """What the run-time generator reads off the graphs (runtime/runner.py), so a hit needs no graph:
    forward inputs an `as_strided_scatter` writes into, which forward outputs are tensors, and the
    differentiable outputs' tangents as the backward graph traced them."""

    scattered: frozenset
    outputs_are_tensors: tuple
    tangents: tuple


@dataclass
class Entry:
    plan: Any
    training: bool
    forward: GraphRecord  # the forward/inference graph
    backward: GraphRecord | None
    num_fw_outputs: int
    num_saved_tensors: int
    num_saved_other: int
    written_in_place: frozenset
    computed_from: tuple
    gradient_from: tuple
    facts: GraphFacts
    fw_meta: dict  # the forward module's meta the backward compiler reads (Inductor's output strides)
    # The pristine graphs of a differentiable / None-gradient backward (cache/higher.py), or None.
    higher_order: HigherOrderRecord | None = None


class Recorder:
    """Wraps a signature's graph compilers to keep the graph each one is handed, before the
    compiler (which may rewrite it in place) sees it, and where Inductor keeps what it compiled."""

    def __init__(self):
        self.forward: bytes | None = None
        self.forward_artifact: tuple[str, str | None, tuple[int, ...]] | None = None
        self.failure: str | None = None
        # Set once the entry is made: the compiled functions of a later differentiable backward
        # (higher_order/backward.py), built with the same compilers, are not this signature's forward.
        self.closed = False

    def wrap(self, compiler: Callable) -> Callable:
        def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            if self.closed:
                return compiler(gm, example_inputs)
            try:
                self.forward = dump_graph(gm)
            except Exception as e:  # noqa: BLE001 - any pickling failure means "do not cache"
                self.failure = f"the forward graph cannot be serialized ({type(e).__name__}: {e})"
            compiled = compiler(gm, example_inputs)
            self.forward_artifact = inductor_artifact(compiled)
            return compiled

        return _like(recording, compiler)


def on_compiled(compiler: Callable, callback: Callable) -> Callable:
    """`compiler`, calling `callback(gm, inductor_artifact(result))` after each compile (the lazy
    backward's record is added to its entry once it is compiled)."""

    def compile_and_report(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = compiler(gm, example_inputs)
        callback(gm, inductor_artifact(compiled))
        return compiled

    return _like(compile_and_report, compiler)


def _like(wrapper: Callable, compiler: Callable) -> Callable:
    for attr in ("aotgrad_functional_graphs", "_boxed_call"):
        if hasattr(compiler, attr):
            setattr(wrapper, attr, getattr(compiler, attr))
    return wrapper


def inductor_artifact(compiled: Any) -> tuple[str, str | None, tuple[int, ...]] | None:
    """(FX-graph cache key, guards, donated inputs) of what Inductor compiled, when its FX-graph
    cache holds it (not for a bypassed or no-op graph, or one whose constants live outside the
    artifact)."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraph

    donated: tuple[int, ...] = ()
    # The backend's and donation's wrappers (the backend's may be the function itself).
    while getattr(compiled, "aotgrad_compiled", compiled) is not compiled:
        donated = getattr(compiled, "aotgrad_donated", donated)
        compiled = compiled.aotgrad_compiled
    if not isinstance(compiled, CompiledFxGraph) or getattr(compiled, "frozen_param_names", None):
        return None
    key = getattr(compiled, "_fx_graph_cache_key", None)
    if not isinstance(key, str) or not os.path.isdir(FxGraphCache._get_tmp_dir_for_key(key)):
        return None
    return key, compiled.guards_expr, donated


def dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """`gm` (nodes, fake values, meta) as bytes. Left out, and restored on `gm` after: meta entries
    that do not pickle and the `shape_env` attribute
    (a load gets the loading compile's). Inductor's FX-graph cache keys on the module's class name,
    attributes and meta, so they come back as they were."""
    dropped = {k: v for k, v in gm.meta.items() if not _picklable(v)}
    shape_env = gm.__dict__.pop("shape_env", _MISSING)
    for k in dropped:
        del gm.meta[k]
    # Autograd's sequence numbers (node_meta.py) count up through the process: an entry would differ
    # from one compile to the next. They only pair backward nodes with forward ones; not stored.
    seq_nrs = {n: n.meta.pop("seq_nr") for n in gm.graph.nodes if "seq_nr" in n.meta}
    env = "absent" if shape_env is _MISSING else "none" if shape_env is None else "mode"
    try:
        from torch.fx._graph_pickler import Options

        return _pickler().dumps((type(gm).__name__, env, gm), Options(ops_filter=None))
    finally:
        for n, seq in seq_nrs.items():
            n.meta["seq_nr"] = seq
        gm.meta.update(dropped)
        if shape_env is not _MISSING:
            gm.shape_env = shape_env


_MISSING = object()


def _picklable(v: Any) -> bool:
    if isinstance(v, torch.fx.GraphModule):
        return False
    try:
        pickle.dumps(v)
    except Exception:  # noqa: BLE001
        return False
    return True


def load_graph(data: bytes, fake_mode) -> torch.fx.GraphModule:
    # Dynamo records `addcmul_`/`addcdiv_` with a value as Inductor's `prims.fma`, an op that exists
    # once its module is imported: a precompile load (no Dynamo trace) may not have imported it yet.
    import torch._inductor.inductor_prims  # noqa: F401
    from torch.fx._graph_pickler import GraphPickler

    class_name, env, gm = GraphPickler.loads(data, fake_mode)
    type(gm).__name__ = class_name
    if env == "none":
        gm.shape_env = None
    elif env == "mode":
        gm.shape_env = getattr(fake_mode, "shape_env", None)
    gm.recompile()
    return gm


@functools.lru_cache(maxsize=1)
def _pickler() -> type:
    """torch.fx's GraphPickler, also for fake values that are views (their base's description
    keeps the fake mode, which cannot be pickled; the unpickler sets the loading mode on it) or have
    a `.grad` (left out)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._graph_pickler import GraphPickler

    class Pickler(GraphPickler):
        def reducer_override(self, obj):
            out = super().reducer_override(obj)
            if isinstance(obj, FakeTensor) and out is not NotImplemented:
                data = out[1][0]
                base = getattr(data.metadata, "base", None)
                if base is not None and base.fake_mode is not None:
                    data.metadata = dataclasses.replace(data.metadata, base=dataclasses.replace(base, fake_mode=None))
                if getattr(data.metadata, "grad", None) is not None:  # a parameter's .grad: no compiler reads it
                    data.metadata = dataclasses.replace(data.metadata, grad=None)
            return out

    return Pickler


def make_entry(run: Any, recorder: Recorder) -> Entry:
    """The entry for a freshly compiled signature (`api.compile_signature`'s result). The backward
    is compiled later (on the first `.backward()`); its Inductor key is added then (`with_backward`)."""
    compiled = run.compiled
    recorder.closed = True
    if recorder.failure:
        raise Uncacheable(recorder.failure)
    if recorder.forward is None:
        raise Uncacheable("the forward graph was not handed to a compiler")
    training = compiled.bw_module is not None
    backward = None
    if training:
        if compiled._backward is not None:
            raise Uncacheable("the backward was compiled ahead of time (symbolic sizes)")
        try:
            backward = GraphRecord(dump_graph(compiled.bw_module))
        except Exception as e:  # noqa: BLE001
            raise Uncacheable(f"the backward graph cannot be serialized ({type(e).__name__}: {e})") from e
    try:
        loads(dumps(run.plan))
    except Exception as e:  # noqa: BLE001
        raise Uncacheable(f"the plan cannot be pickled ({type(e).__name__}: {e})") from e
    key, guards, _ = recorder.forward_artifact or (None, None, ())
    fw_meta = {k: v for k, v in compiled.fw_module.meta.items() if k.startswith("aotgrad_") and _picklable(v)}
    return Entry(
        plan=run.plan,
        training=training,
        forward=GraphRecord(recorder.forward, key, guards),
        backward=backward,
        num_fw_outputs=compiled.num_fw_outputs,
        num_saved_tensors=compiled.num_saved_tensors,
        num_saved_other=compiled.num_saved_other,
        written_in_place=frozenset(compiled.written_in_place),
        computed_from=tuple(compiled.computed_from),
        gradient_from=tuple(compiled.gradient_from),
        facts=graph_facts(run.plan, compiled),
        fw_meta=fw_meta,
        higher_order=record(compiled, dump_graph) if training else None,
    )


def with_backward(entry: Entry, artifact: tuple[str, str | None, tuple[int, ...]] | None) -> Entry | None:
    """`entry` with its backward's Inductor key, once the backward is compiled (None: no change)."""
    if artifact is None or entry.backward is None or entry.backward.inductor_key == artifact[0]:
        return None
    key, guards, donated = artifact
    return replace(entry, backward=replace(entry.backward, inductor_key=key, guards_expr=guards, donated=donated))


def graph_facts(plan: Any, compiled: Any) -> GraphFacts:
    """What the run time read off `compiled`'s graphs when it was built (runtime/runner.py)."""
    from ..compile.compile import placeholder_values
    from ..runtime.runner import _output_values, _scattered_into

    tangents: tuple = ()
    if compiled.bw_module is not None:
        diff = [o for o in plan.fw_outputs if o.differentiable]
        traced = placeholder_values(compiled.bw_module)[-len(diff):] if diff else []
        tangents = tuple(TensorKind(v.dtype, v.device, _static_shape(v)) if isinstance(v, torch.Tensor) else None
                         for v in traced)
    return GraphFacts(
        scattered=frozenset(_scattered_into(compiled.fw_module)),
        outputs_are_tensors=tuple(isinstance(v, torch.Tensor) for v in _output_values(compiled.fw_module)),
        tangents=tangents,
    )


def _static_shape(v: torch.Tensor) -> tuple[int, ...] | None:
    return tuple(v.shape) if all(type(d) is int for d in v.shape) else None


class _Pickler(pickle.Pickler):
    """pickle, with aten ops (the plan's view steps) written by name."""

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name, None)
        return NotImplemented


def _op(qualified: str, overload: str | None):
    namespace, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload or "default")


def dumps(obj: Any) -> bytes:
    import io

    with io.BytesIO() as f:
        _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return f.getvalue()


def loads(data: bytes) -> Any:
    with warnings.catch_warnings():  # unpickling a TreeSpec warns about LeafSpec (torch's own code)
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        return pickle.loads(data)
