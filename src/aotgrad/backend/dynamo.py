"""A `torch.compile` backend: Dynamo's graph -> aotgrad (capture, partition) -> Inductor.

    torch.compile(model, backend="aotgrad")          # Inductor compiles aotgrad's graphs
    torch.compile(model, backend="aotgrad_eager")    # nop compilers (debugging)
    torch.compile(model, backend=aotgrad.backend(fw_compiler=..., partition_fn=..., memory_budget=0.5))

The names are registered through the `torch_dynamo_backends` entry-point group (pyproject.toml), so
they resolve after `pip install` without importing aotgrad first.

What Dynamo hands a backend, and what we do with it:

- a `GraphModule` over flat inputs (parameters and buffers lifted to inputs, user tensors, and
  `SymInt` sizes when shapes are dynamic), real example tensors, and the placeholders'
  `example_value` fakes in Dynamo's `FakeTensorMode` (with its `ShapeEnv` when shapes are dynamic).
  We trace those fakes: aotgrad's capture reuses their fake mode, so symbolic sizes flow into the
  joint graph, and guards the trace adds land in Dynamo's `ShapeEnv`, which Dynamo turns into guards.
- Dynamo guards every property aotgrad's own signature keys on (shapes or their symbolic guards,
  strides, dtypes, devices, `requires_grad`, grad mode, input aliasing), so the backend compiles one
  signature up front and calls the generated run-time code directly, skipping aotgrad's signature
  cache and per-call guard.
- Shape-generic where that is safe: a new batch size reuses the compiled graphs. When the run-time
  plan itself would bake a symbolic size in (an output that is a view of an input or of an
  intermediate rebuilt with symbolic view arguments, a metadata mutation with symbolic sizes, or a
  `SymInt` input that no tensor size determines), the backend instead compiles per concrete shape
  through aotgrad's own signature cache (`CompiledFunction`): slower to warm up, never wrong.

Inductor is driven directly, one graph at a time, without upstream's AOT layer:
`torch._inductor.compile_fx.compile_fx_inner(graph, fake_inputs, ...)` for the forward, backward and
inference graphs, with Inductor's decomposition table given to aotgrad's capture, Inductor's joint-graph
passes run on aotgrad's joint graph before partitioning (and on inference graphs), and its pre-grad
passes on Dynamo's graph, all under the Inductor config that `torch.compile(mode=..., options=...)` asked
for. Inductor may pick different strides for the activations the forward saves;
we read them back (`TracingContext.report_output_strides`) and give the backward graph's placeholders
those strides before compiling it. Inputs mutated under `no_grad` (optimizer steps, BatchNorm stats)
stay in the inference graph as `copy_`s (`keep_inference_input_mutations=True`), so Inductor updates them
in place.

Errors: a graph aotgrad cannot compile raises `BackendCompileError` (an `AotgradError`) naming the
op and the line of the Dynamo graph being traced; with `aotgrad.config.fallback_to_eager = True` it
warns and runs that graph eagerly instead.

Modules: this one holds the Dynamo-facing backend; Inductor's side is inductor/compilers.py, symbolic
sizes and per-shape compiles backend/shapes.py, the compile context and errors inductor/context.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from .. import config
from ..cache import artifacts as cache_artifacts  # noqa: F401 (registers itself with torch's cache artifacts)
from ..cache import store as cache
from ..compile.compilers import AOTConfig, nop, wants_functional_graphs
from ..dynamic.shapes import caller_fakes as _fake_inputs
from ..dynamic.shapes import concrete_values
from ..dynamic.shapes import fake_state as _fake_state
from ..dynamic.shapes import is_symbolic as _is_symbolic
from ..dynamic.shapes import needs_concrete_sizes as _plan_needs_concrete_sizes
from ..dynamic.shapes import sizes_determined as _sizes_determined
from ..inductor import isa_probe
from ..inductor.compilers import (
    _fake_bw_inputs,
    _inductor_decompositions,
    _inductor_pre_grad_passes,
    _specialise_dynamic_floats,
    inductor_compilers,
    inductor_config_patches,
    wake_compile_workers,
)
from ..inductor.context import BackendCompileError, _compile_context, _describe_failure, _must_propagate
from ..inductor.cudagraphs import StaticInputs, static_leaf_positions
from ..runtime.input_checks import InputsChecked
from ..signature.inputs import alias_key, is_wrapper
from ..trace.interpreter_stack import on_roomy_stack
from . import precompile
from .distributed import on_rank
from .shapes import _anchor_positions, _Anchored, _fake_anchors, _ignoring_anchors, _PerShape

__all__ = [
    "BackendCompileError",
    "aotgrad_backend",
    "aotgrad_eager",
    "backend",
    "inductor_compilers",
    "inductor_config_patches",
]

log = logging.getLogger("aotgrad.backend")


# ----------------------------------------------------------------------------------------------
# Public constructors
# ----------------------------------------------------------------------------------------------


def backend(
    fw_compiler: Callable | None = None,
    bw_compiler: Callable | None = None,
    partition_fn: Callable | None = None,
    memory_budget: float | None = None,
    decompositions: dict | None = None,
    inference_compiler: Callable | None = None,
    keep_inference_input_mutations: bool = True,
) -> AotgradBackend:
    """Build a `torch.compile` backend running aotgrad with the given pieces.

    With no compiler given, Inductor compiles the forward, backward and inference graphs, and
    `decompositions` defaults to Inductor's table. `partition_fn` defaults to aotgrad's min-cut
    partitioner when the installed aotgrad has one (`min_cut_rematerialization_partition`), else
    `default_partition`; `memory_budget` (0..1) is passed to it and needs a partitioner that takes it.
    """
    use_inductor = fw_compiler is None and bw_compiler is None and inference_compiler is None
    return AotgradBackend(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=inference_compiler,
        partition_fn=partition_fn,
        memory_budget=memory_budget,
        decompositions=decompositions,
        keep_inference_input_mutations=keep_inference_input_mutations,
        use_inductor=use_inductor,
    )


class AotgradBackend:
    """A Dynamo backend: `backend_instance(gm, example_inputs) -> callable`."""

    def __init__(
        self,
        *,
        fw_compiler,
        bw_compiler,
        inference_compiler,
        partition_fn,
        memory_budget,
        decompositions,
        keep_inference_input_mutations,
        use_inductor,
    ):
        self.fw_compiler = fw_compiler
        self.bw_compiler = bw_compiler
        self.inference_compiler = inference_compiler
        self.partition_fn = partition_fn
        self.memory_budget = memory_budget
        self.decompositions = decompositions
        self.keep_inference_input_mutations = keep_inference_input_mutations
        self.use_inductor = use_inductor
        self.inductor_patches: dict = {}  # Inductor config from torch.compile(mode=, options=)
        self.forward_inductor_patches: dict = {}  # more of it, for forward and inference graphs only
        self.__name__ = "aotgrad" if use_inductor else "aotgrad_custom"
        if memory_budget is not None:
            if not 0.0 <= memory_budget <= 1.0:
                raise ValueError(f"aotgrad.backend: memory_budget must be in [0, 1], got {memory_budget}")
            if partition_fn is not None and not _takes(partition_fn, "memory_budget"):
                raise TypeError(
                    f"aotgrad.backend: partition_fn {getattr(partition_fn, '__name__', partition_fn)} does not "
                    "take a memory_budget argument; pass a partitioner that does (aotgrad's min-cut)."
                )

    def __repr__(self) -> str:
        return f"<aotgrad backend {self.__name__}>"

    # -- Dynamo entry point --------------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs) -> Callable:
        if precompile.requested():  # aot_compile: a SerializableCallable (precompile.py)
            return precompile.compile_graph(self, gm, list(example_inputs), **kwargs)
        chosen = self._with_compile_options(example_inputs, **kwargs)
        if config.explain_dir:  # one report per graph (explain/graphs.py); never fails the compile
            from ..explain.graphs import explain_graph

            explain_graph(gm, example_inputs, chosen, config.explain_dir)
        # Inductor's CPU kernels wait for its ISA probe: it runs while aotgrad traces or loads.
        if self.use_inductor and _cpu_graph(example_inputs) and isa_probe.start(chosen.inductor_patches):
            isa_probe.prefetch_imports()
        elif self.use_inductor:  # its Triton compile workers start while aotgrad traces
            wake_compile_workers(example_inputs)
        try:
            with chosen._inductor_patches():
                return on_roomy_stack(chosen._compile, gm, list(example_inputs))
        except Exception as e:
            if _must_propagate(e):
                raise
            err = on_rank(e if isinstance(e, BackendCompileError) else _describe_failure(e, gm))
            if config.fallback_to_eager:
                warnings.warn(f"{err} Running this graph eagerly (aotgrad.config.fallback_to_eager).", stacklevel=2)
                return _no_dynamo(gm.forward)
            raise err from e
        finally:
            isa_probe.wait()

    # -- pieces ---------------------------------------------------------------------------------

    def _with_compile_options(self, example_inputs: Sequence[Any], mode=None, options=None, **other) -> AotgradBackend:
        """`torch.compile(mode=..., options=...)` reach a backend as keyword arguments. With Inductor
        they become Inductor config patches for this graph's compiles (what backend="inductor" does
        with them); custom compilers cannot use them, so they are ignored with a warning."""
        if other:
            warnings.warn(f"aotgrad backend: ignoring unknown keyword arguments {sorted(other)}.", stacklevel=3)
        if (mode is None or mode == "default") and not options:
            return self
        if not self.use_inductor:
            warnings.warn(
                f"aotgrad backend {self.__name__}: torch.compile mode/options configure Inductor; this backend "
                "uses custom compilers, so they are ignored.",
                stacklevel=3,
            )
            return self
        patches = inductor_config_patches(mode, options)
        chosen = copy.copy(self)
        chosen.inductor_patches = patches
        return chosen

    def _inductor_patches(self):
        patches = self.inductor_patches
        if not patches:
            return contextlib.nullcontext()
        from torch._inductor import config as inductor_config

        return inductor_config.patch(patches)

    def _partition_fn(self) -> Callable:
        part = self.partition_fn or _default_partitioner()
        torch_budget = config.torch_activation_memory_budget()  # set by the user, as upstream honours it
        if self.memory_budget is None and torch_budget is not None and _takes(part, "memory_budget"):
            return functools.partial(part, memory_budget=torch_budget)
        if self.memory_budget is not None:
            if not _takes(part, "memory_budget"):
                raise TypeError(
                    "aotgrad.backend: memory_budget needs a partitioner that takes it (aotgrad's "
                    f"min_cut_rematerialization_partition); {getattr(part, '__name__', part)} does not."
                )
            part = functools.partial(part, memory_budget=self.memory_budget)
        return part

    def _without_forward_size_asserts(self) -> AotgradBackend:
        """This backend, compiling forward and inference graphs without Inductor's input asserts:
        for a graph whose caller checks the input sizes itself (`input_checks._SizesCheck`)."""
        chosen = copy.copy(self)
        chosen.forward_inductor_patches = {**self.forward_inductor_patches, "size_asserts": False}
        return chosen

    def _aot_config(self, symbolic: bool, static: StaticInputs | None = None) -> AOTConfig:
        """`static`: the parameters and buffers among the leaves (for CUDA graphs)."""
        partition = self._partition_fn()
        if self.use_inductor:
            compilers = inductor_compilers(self.inductor_patches, self.forward_inductor_patches, static)
            fw, bw, inf = compilers.forward, compilers.backward, compilers.inference
            partition = compilers.partition(partition)
            with self._inductor_patches():  # the table depends on a few Inductor options
                decomps = self.decompositions if self.decompositions is not None else _inductor_decompositions()
        else:
            fw = self.fw_compiler or self.bw_compiler or self.inference_compiler
            bw = _fake_bw_inputs(self.bw_compiler or fw)
            inf = self.inference_compiler or fw
            decomps = self.decompositions or {}
        bw = _no_dynamo_compiler(bw)
        if self.use_inductor:  # Inductor re-inplaces custom ops itself
            fw, bw, inf = (wants_functional_graphs(c) for c in (fw, bw, inf))
        return AOTConfig(
            fw_compiler=fw,
            bw_compiler=bw,
            inference_compiler=inf,
            partition_fn=partition,
            decompositions=dict(decomps),
            num_params_buffers=0,
            keep_inference_input_mutations=self.keep_inference_input_mutations,
            dynamic=symbolic,
        )

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # Imported here, not with this module: a cache or precompile load unpickles this class and
        # needs none of the tracer (api).
        from ..api import _functional_call, _named_state, _plan_depends_on_aliasing

        if any(isinstance(x, list) for x in example_inputs):
            return _taking_lists(self._compile, gm, example_inputs)
        if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
            raise BackendCompileError(
                "aotgrad backend: Dynamo passed nested (tuple/dict, or list of lists) graph inputs; only "
                "flat tensor, SymInt and scalar inputs, and lists of them, are supported."
            )
        # before passes change gm; while precompiling, the entry is kept for the saved file
        probe = precompile.probe(self) or cache.probe(self, gm, example_inputs, _named_state(gm)[1])
        fakes = _fake_inputs(gm, example_inputs)
        if self.use_inductor and config.inductor_graph_passes:
            gm = _inductor_pre_grad_passes(gm, fakes)
        names, state = _named_state(gm)
        fn = _functional_call(gm, names, len(state)) if state else gm
        leaves = _fake_state(state, fakes) + fakes
        static_at = static_leaf_positions(gm, len(state), example_inputs)
        # the fakes traced now, and the real tensors a per-shape compile traces later
        static = StaticInputs([leaves[i] for i in static_at] + list(state)
                              + [example_inputs[i - len(state)] for i in static_at if i >= len(state)])
        symbolic = any(_is_symbolic(x) for x in leaves)
        run = None
        sizes_checked = not symbolic and self._input_sizes_checkable_per_call(leaves)
        if not symbolic:
            compiler = self._without_forward_size_asserts() if sizes_checked else self
            run = compiler._compile_now(fn, leaves, symbolic=False, probe=probe, static=static)
        elif config.symbolic_shapes:
            # A SymInt input whose symbol no tensor size carries (an int argument Dynamo made
            # dynamic) gets an "anchor": a zero-stride tensor of that size, a free view at run time,
            # from which the compiled graphs read the value.
            anchored = _anchor_positions(leaves)
            sym_fn, sym_leaves = fn, leaves
            if anchored:
                sym_fn = _ignoring_anchors(fn, len(leaves))
                sym_leaves = leaves + _fake_anchors(leaves, anchored)
            if _sizes_determined(sym_leaves):
                try:
                    run = self._compile_now(sym_fn, sym_leaves, symbolic=True, static=static)
                except Exception as e:  # e.g. an aliasing output whose view chain needs concrete sizes
                    if _must_propagate(e):
                        raise
                    log.debug("aotgrad backend: symbolic compile failed (%s: %s); compiling per shape",
                              type(e).__name__, e)
                    run = None
                if run is not None and _plan_needs_concrete_sizes(run.plan):
                    log.debug("aotgrad backend: the run-time plan needs concrete sizes; compiling per shape")
                    run = None
                if run is not None and anchored:
                    plan = run.plan
                    run = _Anchored(run, anchored)
                    run.plan = plan
        if run is None:
            # Concrete shapes: compiled per signature through aotgrad's own cache and guards. The
            # current shapes are compiled now, so errors surface here, not at the first call.
            _specialise_dynamic_floats(gm)
            per_shape = _PerShape(fn, self._aot_config(False, static))
            per_shape.prepare(list(state) + concrete_values(example_inputs))
            run = per_shape
        elif sizes_checked or _plan_depends_on_aliasing(run.plan):
            # What Dynamo does not guard, checked per call (runtime/input_checks.py), with plans compiled
            # per signature for calls that fail: the sizes of inputs when the compiled forward does
            # not assert them, and, when the plan mutates inputs (or merged aliased inputs), that
            # the inputs alias each other as they did at compile time.
            run = InputsChecked(run, leaves, lambda: _PerShape(fn, self._aot_config(False, static)),
                                check_sizes=sizes_checked, check_aliasing=_plan_depends_on_aliasing(run.plan),
                                sizes_fixed=not symbolic and (sizes_checked or self._compiled_code_asserts_input_sizes()))
        return _no_dynamo(_bind_state(run, state))

    def _compiled_code_asserts_input_sizes(self) -> bool:
        """Whether Inductor's compiled graphs check their inputs' sizes and strides before computing
        (its input asserts, on by default, unless `options=` turned them off)."""
        if not self.use_inductor:
            return False
        from torch._inductor import config as inductor_config

        with self._inductor_patches():
            return bool(inductor_config.size_asserts)

    def _input_sizes_checkable_per_call(self, leaves: list) -> bool:
        """Whether to compile the forward without Inductor's input asserts (one Python call per
        input) and check the sizes in one C++ call per call instead (`input_checks._SizesCheck`):
        static shapes, each tensor input its own graph input (none aliased at compile time)."""
        from ..runtime.input_checks import tensor_guards_check_sizes

        return (
            self._compiled_code_asserts_input_sizes()
            and not alias_key(leaves)
            and all(x.layout is torch.strided and not is_wrapper(x) for x in leaves if isinstance(x, torch.Tensor))
            and tensor_guards_check_sizes()
        )

    def _compile_now(self, fn, leaves: list, *, symbolic: bool, probe: cache.Probe | None = None,
                     static: StaticInputs | None = None) -> Callable:
        from ..api import compile_signature

        spec = pytree.tree_flatten((tuple(leaves), {}))[1]
        with _compile_context(leaves):
            if probe is not None:  # the on-disk cache: load, or compile and store
                return probe.compile(self, compile_signature, fn, leaves, spec, self._aot_config(symbolic, static))
            return compile_signature(fn, leaves, spec, self._aot_config(symbolic, static))


def _taking_lists(compile_flat: Callable, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Compile a graph that takes lists of tensors (compiled autograd hands its graph the saved
    tensors as one list) as a graph over the flattened inputs, and flatten them per call. A list
    marked `steal_arg` is emptied once flattened, so its tensors can be freed as the graph goes."""
    graph = torch.fx.Graph()
    env: dict = {}
    items_of: dict = {}
    flat_examples: list = []
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, example in zip(placeholders, example_inputs):
        if isinstance(example, list):
            items = [graph.placeholder(f"{node.name}_{i}") for i in range(len(example))]
            for i, user in ((u.args[1], u) for u in node.users if _is_getitem_of(u, node)):
                items[i].meta = dict(user.meta)
            items_of[node] = env[node] = items
            flat_examples += example
        else:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            flat_examples.append(example)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_function" and node.args and node.args[0] in items_of and _is_getitem_of(node, node.args[0]):
            env[node] = items_of[node.args[0]][node.args[1]]
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    flat = compile_flat(torch.fx.GraphModule(gm, graph), flat_examples)

    is_list = [isinstance(x, list) for x in example_inputs]
    steal = [i for i, node in enumerate(placeholders) if is_list[i] and node.meta.get("steal_arg", False)]

    def forward(*args):
        leaves = []
        for arg, listed in zip(args, is_list):
            if listed:
                leaves += arg
            else:
                leaves.append(arg)
        for i in steal:
            args[i].clear()
        return flat(*leaves)

    return _no_dynamo(forward)


def _is_getitem_of(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    return node.target is operator.getitem and node.args[0] is source and isinstance(node.args[1], int)


def _make_default_backends() -> tuple[AotgradBackend, AotgradBackend]:
    default = backend()
    eager = backend(fw_compiler=nop, bw_compiler=nop, inference_compiler=nop)
    eager.__name__ = "aotgrad_eager"
    return default, eager


aotgrad_backend, aotgrad_eager = _make_default_backends()


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _no_dynamo(fn: Callable) -> Callable:
    """Dynamo must not trace into compiled graphs or the generated run time."""
    return torch._dynamo.disable(fn, reason="aotgrad: compiled graph")


def _cpu_graph(example_inputs: Sequence[Any]) -> bool:
    """Tensors, all on the CPU: Inductor will build C++ kernels. A GPU graph with CPU scalars (an
    optimizer's `lr`) usually needs none, and must not wait for a probe it would never run."""
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    return devices == {"cpu"}


def _no_dynamo_compiler(compiler: Callable) -> Callable:
    def wrapped(gm, example_inputs):
        compiled = torch._dynamo.disable(compiler, reason="aotgrad: backward compiler")(gm, example_inputs)
        boxed = getattr(compiled, "_boxed_call", False)
        out = _no_dynamo(compiled)
        out.aotgrad_compiled = compiled  # what the on-disk cache records (cache_serialize.inductor_artifact)
        if boxed:
            out._boxed_call = True
        return out

    return wrapped


def _bind_state(run: Callable, state: list) -> Callable:
    if not state:

        def forward(*args):
            return run(args)

    else:

        def forward(*args):
            return run([*state, *args])

    return forward






def _takes(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _default_partitioner() -> Callable:
    """aotgrad's min-cut partitioner when this aotgrad has one, else `default_partition`."""
    import aotgrad

    from ..partition import default as partition_module

    for where in (partition_module, aotgrad):
        fn = getattr(where, "min_cut_rematerialization_partition", None)
        if fn is not None:
            return fn
    return partition_module.default_partition


