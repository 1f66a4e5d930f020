"""What a cache entry holds, and how a compiled signature is rebuilt from one.

An entry is the `Plan`, the forward (or inference) graph exactly as aotgrad handed it to the graph
compiler, the backward graph as the partitioner returned it, and the few facts `CompiledForward`
reads off graphs that are not stored (the joint graph's value flow, the number of saved values).
Graphs are written with torch.fx's `GraphPickler`, which keeps each node's fake value (`meta["val"]`)
and re-creates it in the fake mode of the compile that loads it. On a hit the compilers run again on
those graphs (Inductor's compiled code then comes from Inductor's own FX-graph cache): no trace, no
analysis, no partitioning.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .cache_key import Uncacheable


@dataclass
class Entry:
    plan: Any
    training: bool
    forward: bytes  # the forward/inference graph as its compiler got it
    backward: bytes | None
    num_fw_outputs: int
    num_saved_tensors: int
    num_saved_other: int
    written_in_place: frozenset
    computed_from: tuple
    gradient_from: tuple


class Recorder:
    """Wraps a signature's graph compilers to keep the graph each one is handed, before the
    compiler (which may rewrite it in place) sees it."""

    def __init__(self):
        self.forward: bytes | None = None
        self.failure: str | None = None

    def wrap(self, compiler: Callable) -> Callable:
        def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            try:
                self.forward = dump_graph(gm)
            except Exception as e:  # noqa: BLE001 - any pickling failure means "do not cache"
                self.failure = f"the forward graph cannot be serialized ({type(e).__name__}: {e})"
            return compiler(gm, example_inputs)

        for attr in ("aotgrad_functional_graphs", "_boxed_call"):
            if hasattr(compiler, attr):
                setattr(recording, attr, getattr(compiler, attr))
        return recording


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
    """The entry for a freshly compiled signature (`api.compile_signature`'s result)."""
    compiled = run.compiled
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
            backward = dump_graph(compiled.bw_module)
        except Exception as e:  # noqa: BLE001
            raise Uncacheable(f"the backward graph cannot be serialized ({type(e).__name__}: {e})") from e
    try:
        loads(dumps(run.plan))
    except Exception as e:  # noqa: BLE001
        raise Uncacheable(f"the plan cannot be pickled ({type(e).__name__}: {e})") from e
    return Entry(
        plan=run.plan,
        training=training,
        forward=recorder.forward,
        backward=backward,
        num_fw_outputs=compiled.num_fw_outputs,
        num_saved_tensors=compiled.num_saved_tensors,
        num_saved_other=compiled.num_saved_other,
        written_in_place=frozenset(compiled.written_in_place),
        computed_from=tuple(compiled.computed_from),
        gradient_from=tuple(compiled.gradient_from),
    )


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


def rebuild(entry: Entry, leaves: list, config: Any) -> Callable:
    """The generated `run(leaves)` for a cached signature: the stored graphs through this
    compile's compilers, the stored plan through the run-time generator."""
    from torch._guards import detect_fake_mode

    from .backend_context import _context_fake_mode
    from .backend_inductor import link_backward
    from .compile import CompiledForward, _aot_ids
    from .compilers import boxed, naming
    from .inputs import primal_values
    from .runtime import build_runner

    plan = entry.plan
    fake_mode = detect_fake_mode([x for x in leaves if isinstance(x, torch.Tensor)]) or _context_fake_mode()
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    primals = primal_values(plan.layout, leaves)
    fw = load_graph(entry.forward, fake_mode)
    aot_id = next(_aot_ids)
    if entry.training:
        bw = load_graph(entry.backward, fake_mode)
        link_backward(bw, fw)
        with naming("forward", aot_id):
            forward = boxed(config.fw_compiler(fw, list(primals)))
        compiled = CompiledForward(
            forward, fw, entry.num_fw_outputs,
            num_saved_tensors=entry.num_saved_tensors,
            num_saved_other=entry.num_saved_other,
            written_in_place=entry.written_in_place,
            computed_from=entry.computed_from,
            gradient_from=entry.gradient_from,
            bw_module=bw,
            bw_compiler=config.bw_compiler,
            aot_id=aot_id,
        )
    else:
        with naming("inference", aot_id):
            forward = boxed(config.inference_compiler(fw, list(primals)))
        compiled = CompiledForward(forward, fw, entry.num_fw_outputs, written_in_place=entry.written_in_place,
                                   aot_id=aot_id)
    run = build_runner(plan, compiled)
    run.plan = plan
    run.compiled = compiled
    return run
