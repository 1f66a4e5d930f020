"""A cache hit: the compiled signature rebuilt from an entry (cache_serialize.Entry).

A graph that Inductor compiled comes back as its compiled code, loaded from Inductor's FX-graph
cache by the key stored with the entry (as upstream's AOTAutograd cache loads its
`FxGraphCacheLoadable`s): the graph is neither unpickled nor hashed again. Other graphs (custom
compilers, `aotgrad_eager`, a graph Inductor did not cache) are unpickled and handed to this
compile's compilers. A backward without a key is compiled on the first `.backward()`, as in a cold
compile, and its key is then added to the entry. Graphs stay serialized until something needs
them (`LoadedForward`, and cache_higher's `LoadedHigherOrder` for a differentiable backward).
An artifact Inductor no longer has raises `ArtifactMissing`: the cache
counts a miss, logs why, and compiles the signature again.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..compile.compile import CompiledForward
from .higher import attach
from .serialize import Entry, GraphRecord, load_graph, on_compiled


class ArtifactMissing(Exception):
    """Inductor's cache no longer holds a graph's compiled code (cleared, evicted, other dir)."""


class LoadedForward(CompiledForward):
    """A `CompiledForward` whose graph modules are unpickled on first use only: the run time
    reads `facts` instead; compiled autograd, a backward under autocast, or a backward compiled
    from its graph read the modules."""

    def __init__(self, *args, load_fw: Callable | None = None, load_bw: Callable | None = None, **kwargs):
        self._loaders = {"fw": load_fw, "bw": load_bw}
        self._modules: dict = {}
        super().__init__(*args, **kwargs)

    def _module(self, which: str):
        if self._modules.get(which) is None and self._loaders.get(which) is not None:
            self._modules[which] = self._loaders[which]()
            self._loaders[which] = None
        return self._modules.get(which)

    @property
    def fw_module(self):
        return self._module("fw")

    @fw_module.setter
    def fw_module(self, value) -> None:
        self._modules["fw"] = value

    @property
    def bw_module(self):
        return self._module("bw")

    @bw_module.setter
    def bw_module(self, value) -> None:
        self._modules["bw"] = value


def rebuild(entry: Entry, leaves: list, config: Any, backend: Any, on_backward: Callable) -> Callable:
    """The generated `run(leaves)` for a cached signature. `on_backward(artifact)` is called when a
    backward without an Inductor key gets compiled (its key goes into the entry)."""
    from ..compile.compile import _aot_ids
    from ..compile.compilers import boxed, naming
    from ..inductor import cudagraphs, donation
    from ..inductor.compilers import inductor_compilers, link_backward
    from ..runtime.runner import build_runner
    from ..signature.ambient import no_autocast
    from ..signature.inputs import primal_values

    plan = entry.plan
    primals = list(primal_values(plan.layout, leaves))
    compilers = None
    if backend is not None and backend.use_inductor:
        compilers = inductor_compilers(backend.inductor_patches, backend.forward_inductor_patches)
    graphs = _Graphs(entry, leaves)
    pair = cudagraphs.Pair()  # the forward's CUDA-graph box and device, shared with its backward
    aot_id = next(_aot_ids)
    kind = "forward" if entry.training else "inference"
    with naming(kind, aot_id), no_autocast():  # as a cold compile (observe.call_compiler)
        if entry.forward.inductor_key is not None and compilers is not None:
            forward = load_inductor(compilers, entry.forward, kind, primals, pair)
        else:
            compiler = config.fw_compiler if entry.training else config.inference_compiler
            fw_module = graphs.forward()
            cudagraphs.link(fw_module, pair=pair)  # its backward, if compiled later, shares the box
            forward = compiler(fw_module, primals)
    forward = boxed(forward)
    common = dict(written_in_place=entry.written_in_place, aot_id=aot_id, facts=entry.facts, load_fw=graphs.forward)
    if not entry.training:
        compiled = LoadedForward(forward, None, entry.num_fw_outputs, **common)
    else:
        backward = None
        if entry.backward.inductor_key is not None and compilers is not None:
            with naming("backward", aot_id), no_autocast():
                loaded = load_inductor(compilers, entry.backward, "backward", primals, pair)
                backward = boxed(donation.guard(loaded, entry.backward.donated))

        def load_bw() -> torch.fx.GraphModule:
            bw = graphs.backward()
            # The backward compiler restrides saved values as Inductor chose for the forward.
            link_backward(bw, types.SimpleNamespace(meta=dict(entry.fw_meta)), pair)
            return bw

        def backward_compiled(gm, artifact) -> None:  # not a backward re-traced under autocast
            if gm is compiled._modules.get("bw"):
                on_backward(artifact)

        compiled = LoadedForward(
            forward, None, entry.num_fw_outputs,
            num_saved_tensors=entry.num_saved_tensors,
            num_saved_other=entry.num_saved_other,
            computed_from=entry.computed_from,
            gradient_from=entry.gradient_from,
            bw_module=None,
            bw_compiler=config.bw_compiler if backward is not None else on_compiled(config.bw_compiler, backward_compiled),
            _backward=backward,
            decompositions=config.decompositions,
            load_bw=load_bw,
            **common,
        )
        # The cold compile's differentiable backward (create_graph=True) and None-gradient
        # specialisation: their pristine graphs are unpickled when such a backward first runs.
        attach(compiled, entry.higher_order, graphs.load, lambda f: _compiled_function(f, config))
    run = build_runner(plan, compiled)
    run.plan = plan
    run.compiled = compiled
    return run


def _compiled_function(f: Callable, config: Any) -> Callable:
    from ..api import CompiledFunction  # the tracer: only when a differentiable backward first runs

    return CompiledFunction(f, replace(config, num_params_buffers=0))


class _Graphs:
    """The entry's graphs, unpickled when first asked for, in the loading compile's fake mode."""

    def __init__(self, entry: Entry, leaves: list):
        self.entry = entry
        self.leaves = leaves
        self._forward: torch.fx.GraphModule | None = None

    def _fake_mode(self):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..inductor.context import _context_fake_mode

        tensors = [x for x in self.leaves if isinstance(x, torch.Tensor)]
        return detect_fake_mode(tensors) or _context_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)

    def forward(self) -> torch.fx.GraphModule:
        if self._forward is None:
            self._forward = _load(self.entry.forward, "forward", self._fake_mode())
        return self._forward

    def backward(self) -> torch.fx.GraphModule:
        return _load(self.entry.backward, "backward", self._fake_mode())

    def load(self, data: bytes) -> torch.fx.GraphModule:
        return load_graph(data, self._fake_mode())


def _load(record: GraphRecord, what: str, fake_mode) -> torch.fx.GraphModule:
    if record.graph is None:
        raise ArtifactMissing(f"the {what} graph was not stored")
    return load_graph(record.graph, fake_mode)


def load_inductor(compilers: Any, record: GraphRecord, kind: str, primals: list, pair: Any = None) -> Callable:
    """Inductor's compiled code for one graph, loaded by its FX-graph cache key (the stored guards
    must match exactly), then Inductor's post-compile steps as `compile_fx_inner` runs them: CUDA
    graphs as a cold compile would choose them (a backward shares its forward's `pair`)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..inductor import cudagraphs, isa_probe
    from ..inductor.compilers import _mode_of

    fake_mode = _mode_of(primals)
    if fake_mode is None or fake_mode.shape_env is None:  # Inductor's lookup reads the context's ShapeEnv
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    patches = compilers.patches if kind == "backward" else compilers.forward_patches
    constants = CompiledFxGraphConstants()
    isa_probe.wait()
    with inductor_config.patch(patches), V.set_fake_mode(fake_mode), tracing(TracingContext(fake_mode)):
        graph, info = FxGraphCache.load_with_key(
            record.inductor_key, [], [], local=True, remote_cache=None, is_backward=kind == "backward",
            constants=constants, evaluate_guards=lambda expr, _hints: expr == record.guards_expr,
        )
        if graph is None:
            raise ArtifactMissing(
                f"Inductor's compiled code for the {kind} graph (FX-graph key {record.inductor_key[:16]}) is "
                f"not in its cache ({info.get('cache_status_detailed', 'no entry')})"
            )
        graph_kwargs = _cudagraph_kwargs(graph, kind, pair or cudagraphs.Pair())
        requested = graph_kwargs["cudagraphs"].value
        graph.post_compile([], constants, {
            "is_backward": kind == "backward", "is_inference": kind == "inference", "graph_id": compilers.graph_id,
            **graph_kwargs,
        })
        cudagraphs.report(kind, requested, graph, graph_kwargs)
    return graph


def _cudagraph_kwargs(graph: Any, kind: str, pair: Any) -> dict:
    """The cold compile's choice: the forward's box from the config in force, the backward's from
    its forward; the static inputs are the ones the graph was compiled (and cached) with."""
    from torch._inductor.utils import BoxedBool

    from ..inductor import cudagraphs

    if kind == "backward":
        box = pair.cudagraphs if pair.cudagraphs is not None else BoxedBool(False)
    else:
        box = BoxedBool(cudagraphs.wanted())
        if kind == "forward":
            pair.cudagraphs = box
    static = tuple((getattr(graph, "fx_kwargs", None) or {}).get("static_input_idxs") or ())
    return {"cudagraphs": box, "static_input_idxs": static, "boxed_forward_device_index": pair.device}
