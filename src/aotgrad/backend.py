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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import linecache
import logging
import operator
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import config
from .api import (
    AOTConfig,
    CompiledFunction,
    _functional_call,
    _named_state,
    _plan_depends_on_aliasing,
    compile_signature,
)
from .compile import placeholder_values
from .compilers import nop, wants_functional_graphs
from .errors import AotgradError
from .input_checks import InputsChecked
from .inputs import alias_key, is_wrapper
from .interpreter_stack import on_roomy_stack
from .partition import default_partition
from .plan import symbols_in

__all__ = [
    "BackendCompileError",
    "aotgrad_backend",
    "aotgrad_eager",
    "backend",
    "inductor_compilers",
    "inductor_config_patches",
]

_graph_ids = itertools.count()
log = logging.getLogger(__name__)


class BackendCompileError(AotgradError):
    """aotgrad could not compile a graph Dynamo handed it (see the message for the op and line)."""


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
        chosen = self._with_compile_options(example_inputs, **kwargs)
        try:
            with chosen._inductor_patches():
                return on_roomy_stack(chosen._compile, gm, list(example_inputs))
        except Exception as e:
            if _must_propagate(e):
                raise
            err = e if isinstance(e, BackendCompileError) else _describe_failure(e, gm)
            if config.fallback_to_eager:
                warnings.warn(f"{err} Running this graph eagerly (aotgrad.config.fallback_to_eager).", stacklevel=2)
                return _no_dynamo(gm.forward)
            raise err from e

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
        if patches.get("triton.cudagraphs") and any(
            isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs
        ):
            warnings.warn(
                "aotgrad backend: CUDA graphs (mode='reduce-overhead' / 'max-autotune', or "
                "triton.cudagraphs) are not captured by aotgrad; compiling without them.",
                stacklevel=3,
            )
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

    def _aot_config(self, symbolic: bool) -> AOTConfig:
        partition = self._partition_fn()
        if self.use_inductor:
            compilers = inductor_compilers(self.inductor_patches, self.forward_inductor_patches)
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
        if any(isinstance(x, list) for x in example_inputs):
            return _taking_lists(self._compile, gm, example_inputs)
        if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
            raise BackendCompileError(
                "aotgrad backend: Dynamo passed nested (tuple/dict, or list of lists) graph inputs; only "
                "flat tensor, SymInt and scalar inputs, and lists of them, are supported."
            )
        fakes = _fake_inputs(gm, example_inputs)
        if self.use_inductor and config.inductor_graph_passes:
            gm = _inductor_pre_grad_passes(gm, fakes)
        names, state = _named_state(gm)
        fn = _functional_call(gm, names, len(state)) if state else gm
        leaves = _fake_state(state, fakes) + fakes
        symbolic = any(_is_symbolic(x) for x in leaves)
        run = None
        sizes_checked = not symbolic and self._input_sizes_checkable_per_call(leaves)
        if not symbolic:
            compiler = self._without_forward_size_asserts() if sizes_checked else self
            run = compiler._compile_now(fn, leaves, symbolic=False)
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
                    run = self._compile_now(sym_fn, sym_leaves, symbolic=True)
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
            per_shape = _PerShape(fn, self._aot_config(False))
            per_shape.prepare(list(state) + _concrete(example_inputs))
            run = per_shape
        elif sizes_checked or _plan_depends_on_aliasing(run.plan):
            # What Dynamo does not guard, checked per call (input_checks.py), with plans compiled
            # per signature for calls that fail: the sizes of inputs when the compiled forward does
            # not assert them, and, when the plan mutates inputs (or merged aliased inputs), that
            # the inputs alias each other as they did at compile time.
            run = InputsChecked(run, leaves, lambda: _PerShape(fn, self._aot_config(False)),
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
        from .input_checks import tensor_guards_check_sizes

        return (
            self._compiled_code_asserts_input_sizes()
            and not alias_key(leaves)
            and all(x.layout is torch.strided and not is_wrapper(x) for x in leaves if isinstance(x, torch.Tensor))
            and tensor_guards_check_sizes()
        )

    def _compile_now(self, fn, leaves: list, *, symbolic: bool) -> Callable:
        spec = pytree.tree_flatten((tuple(leaves), {}))[1]
        with _compile_context(leaves):
            return compile_signature(fn, leaves, spec, self._aot_config(symbolic))


class _PerShape:
    """aotgrad's own per-signature cache (exact shapes, generated guards) for graphs the backend
    cannot compile shape-generically. A signature that fails to compile raises a
    `BackendCompileError`, or with `config.fallback_to_eager` warns once and runs eagerly."""

    def __init__(self, fn: Callable, aot_config: AOTConfig):
        self.inner = CompiledFunction(fn, aot_config)

    def prepare(self, leaves: list) -> Callable:
        from . import inputs as inputs_stage

        inner = self.inner
        spec = pytree.tree_flatten((tuple(leaves), {}))[1]
        key = inputs_stage.signature(leaves, spec)
        run = inner.cache.get(key)
        if run is not None:
            return run
        try:
            run = compile_signature(inner.fn, leaves, spec, inner.config)
            guard = inputs_stage.make_guard(leaves, spec, _plan_depends_on_aliasing(run.plan))
        except Exception as e:
            if _must_propagate(e):
                raise
            err = _describe_failure(e, inner.fn if isinstance(inner.fn, torch.fx.GraphModule) else None)
            if not config.fallback_to_eager:
                raise err from e
            warnings.warn(f"{err} Running this graph eagerly for these shapes "
                          "(aotgrad.config.fallback_to_eager).", stacklevel=2)
            fn = inner.fn

            def run(leaves):
                return fn(*leaves)

            guard = None
        inner.cache[key] = run
        if guard is not None:
            inner.fast.insert(0, (guard, run))
        return run

    def __call__(self, leaves) -> Any:
        for guard, run in self.inner.fast:
            if guard(leaves):
                return run(leaves)
        return self.prepare(list(leaves))(leaves)


class _Anchored:
    """Append a zero-stride anchor tensor for each free SymInt argument (see `_anchor_positions`)."""

    _ANCHOR = torch.empty(())

    def __init__(self, run: Callable, positions: list[int]):
        self.run, self.positions = run, positions

    def __call__(self, leaves) -> Any:
        anchor = self._ANCHOR
        return self.run([*leaves, *(anchor.expand(leaves[i]) for i in self.positions)])


def _anchor_positions(leaves: list) -> list[int]:
    """Positions of SymInt arguments that are a bare symbol no tensor argument's size carries."""
    import sympy

    known: set = set()
    for x in leaves:
        if isinstance(x, torch.Tensor):
            for v in (*x.shape, *x.stride(), x.storage_offset()):
                known |= _free_symbols(v)
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol) and x.node.expr not in known:
            known.add(x.node.expr)
            out.append(i)
    return out


def _fake_anchors(leaves: list, positions: list[int]) -> list:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([x for x in leaves if isinstance(x, torch.Tensor)]) or _context_fake_mode()
    with mode if mode is not None else contextlib.nullcontext():
        base = torch.empty(())
        return [base.expand(leaves[i]) for i in positions]


def _ignoring_anchors(fn: Callable, n: int) -> Callable:
    def call(*args):
        return fn(*args[:n])

    return call


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


def _concrete(example_inputs: list) -> list:
    """Real example values: SymInt examples replaced by their hints."""
    out = []
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            hint = x.node.hint
            x = int(hint) if hint is not None else x
        out.append(x)
    return out


def inductor_compilers(patches: dict | None = None, forward_patches: dict | None = None) -> _InductorCompilers:
    """Forward / backward / inference compilers (and a partition wrapper) that hand aotgrad's graphs
    to Inductor's `compile_fx_inner`, under the Inductor config `patches`; one set per Dynamo graph.
    `forward_patches` add to them for the forward and inference graphs only (the backward's inputs
    are aotgrad's own, so e.g. it keeps its input asserts where the forward's are left out)."""
    return _InductorCompilers(patches or {}, forward_patches or {})


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """Inductor config for `torch.compile(mode=..., options=...)`, checked as backend="inductor"
    checks it: a known mode, known option names, values of the option's type."""
    from typing import get_origin

    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    patches: dict = {}
    if mode is not None and mode != "default":
        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as e:
            raise BackendCompileError(f"aotgrad backend: {e}") from None
    known = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise BackendCompileError(
                f"aotgrad backend: torch.compile option {key!r} is not an Inductor config option "
                "(see torch._inductor.list_options())."
            )
        expected = inductor_config.get_type(name)
        if get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
            raise BackendCompileError(
                f"aotgrad backend: torch.compile option {key!r} takes a {expected.__name__}, got "
                f"{type(value).__name__}."
            )
        patches[name] = value
    return patches


def _make_default_backends() -> tuple[AotgradBackend, AotgradBackend]:
    default = backend()
    eager = backend(fw_compiler=nop, bw_compiler=nop, inference_compiler=nop)
    eager.__name__ = "aotgrad_eager"
    return default, eager


aotgrad_backend, aotgrad_eager = _make_default_backends()


# ----------------------------------------------------------------------------------------------
# Inductor
# ----------------------------------------------------------------------------------------------


def _inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _inductor_pre_grad_passes(gm: torch.fx.GraphModule, fakes: list) -> torch.fx.GraphModule:
    from torch._inductor.compile_fx import run_pre_grad_passes

    with _compile_context(fakes):
        return run_pre_grad_passes(gm, fakes)


_FWD_OF_BWD = "aotgrad_forward_module"
_NUM_FWD = "aotgrad_num_fwd_outputs"
_OUT_STRIDES = "aotgrad_output_strides"


class _InductorCompilers:
    """Compile aotgrad's graphs with `compile_fx_inner`: fake example inputs from the graph's own
    placeholders, the TracingContext/fake mode Inductor reads, the boxed convention (Inductor's
    compiled graphs take one list), and forward output strides handed to the backward."""

    def __init__(self, patches: dict, forward_patches: dict):
        from torch._guards import TracingContext

        self.patches = patches  # applied here too: the backward may compile after the backend returned
        self.forward_patches = {**patches, **forward_patches}
        self.graph_id = next(_graph_ids)
        self.context = TracingContext.try_get()  # Dynamo's; re-entered for the lazy backward

    def partition(self, partition_fn: Callable) -> Callable:
        def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
            _tensorify_scalars(joint_module)
            _views_alias_their_base(joint_module)
            if config.inductor_graph_passes:
                from torch._inductor.compile_fx import _recursive_joint_graph_passes

                with self._context(placeholder_values(joint_module)):
                    joint_module = _recursive_joint_graph_passes(joint_module)
            fw, bw = partition_fn(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            fw.meta[_NUM_FWD] = num_fwd_outputs
            bw.meta[_FWD_OF_BWD] = fw
            return fw, bw

        partition.__name__ = f"inductor_joint_passes({getattr(partition_fn, '__name__', 'partition')})"
        return partition

    def forward(self, gm: torch.fx.GraphModule, _example_inputs) -> Callable:
        n = gm.meta.get(_NUM_FWD)
        return self._compile(gm, visible=n, is_inference=False, is_backward=False)

    def inference(self, gm: torch.fx.GraphModule, _example_inputs) -> Callable:
        example = placeholder_values(gm)
        _tensorify_scalars(gm)
        _views_alias_their_base(gm)
        if config.inductor_graph_passes:
            from torch._inductor.compile_fx import _recursive_joint_graph_passes

            with self._context(example):
                gm = _recursive_joint_graph_passes(gm)
        return self._compile(gm, visible=None, is_inference=True, is_backward=False)

    def backward(self, gm: torch.fx.GraphModule, _example_inputs) -> Callable:
        fw = gm.meta.get(_FWD_OF_BWD)
        if fw is not None:
            _restride_saved(gm, fw)
        return self._compile(gm, visible=None, is_inference=False, is_backward=True)

    @contextlib.contextmanager
    def _context(self, example: list, patches: dict | None = None):
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.virtualized import V
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

        # The graph's own fake mode (detect_fake_mode would prefer the active TracingContext's,
        # which is Dynamo's even when aotgrad traced real inputs in a fresh mode).
        fake_mode = _mode_of(example) or FakeTensorMode(allow_non_fake_inputs=True)
        ctx = TracingContext.try_get() or self.context
        if ctx is None or ctx.fake_mode is not fake_mode:
            ctx = TracingContext(fake_mode)
        patches = self.patches if patches is None else patches
        patched = inductor_config.patch(patches) if patches else contextlib.nullcontext()
        with patched, V.set_fake_mode(fake_mode), tracing(ctx), enable_python_dispatcher():
            yield ctx

    def _compile(self, gm, *, visible, is_inference, is_backward) -> Callable:
        from torch._guards import TracingContext
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.utils import BoxedBool

        example = placeholder_values(gm)
        out = gm.graph.output_node()
        outs = list(out.args[0])
        n = len(outs) if visible is None else visible
        # Outputs the run time hands to the user (or rebuilds views from) keep eager's strides.
        out.meta["user_visible_output_idxs"] = [i for i in range(n) if isinstance(outs[i], torch.fx.Node)]
        with self._context(example, self.patches if is_backward else self.forward_patches):
            with TracingContext.report_output_strides() as strides:
                compiled = compile_fx_inner(
                    gm,
                    example,
                    cudagraphs=BoxedBool(False),
                    graph_id=self.graph_id,
                    is_inference=is_inference,
                    is_backward=is_backward,
                )
            if not is_inference and not is_backward and strides is not None:
                # Concrete strides (size hints); the expressions they came from, for symbolic sizes.
                gm.meta[_OUT_STRIDES] = list(zip(strides, getattr(compiled, "output_strides", None) or strides))
        return compiled


def _views_alias_their_base(gm: torch.fx.GraphModule) -> None:
    """Give each view node a value that is a view of its input's value.

    The trace computes views as copies (functionalization without reapplied views), so a view
    node's value had a storage of its own. Inductor reads aliasing off node values: its no-op
    removal then dropped `clone(permute(x))`'s clone, returning a view of input x as a fresh output,
    and its re-inplacing would misjudge which buffers a write can reuse."""
    from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

    from .analysis import is_view_op

    fake_mode = _mode_of(placeholder_values(gm))
    if fake_mode is None:
        return
    with fake_mode, enable_python_dispatcher():
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not is_view_op(target):
                continue
            if not node.args or not isinstance(node.args[0], torch.fx.Node):
                continue
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                value = target(*args, **kwargs)
            except Exception:  # keep the traced value
                continue
            node.meta["val"] = value
            if isinstance(value, (tuple, list)):
                for user in node.users:
                    if user.target is operator.getitem and isinstance(user.args[1], int):
                        user.meta["val"] = value[user.args[1]]


def _tensorify_scalars(gm: torch.fx.GraphModule) -> None:
    """Turn arithmetic on floats that Dynamo made dynamic back into tensor arithmetic.

    Dynamo passes such a float (a module's `eps`, `norm_type`...) as a 0-d tensor and calls `.item()`
    on it; Inductor cannot lower an `.item()` whose answer the shape environment already knows.
    torch.fx's pass rewrites those uses into tensor ops, or asks Dynamo to restart with the float
    specialised (an exception that reaches Dynamo unchanged)."""
    from torch.fx.passes._tensorify_python_scalars import tensorify_python_scalars

    fake_mode = _mode_of(placeholder_values(gm))
    if fake_mode is None or fake_mode.shape_env is None:
        return
    if any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes):
        tensorify_python_scalars(gm, fake_mode.shape_env, fake_mode)


def _specialise_dynamic_floats(gm: torch.fx.GraphModule) -> None:
    """A graph compiled per concrete shape is traced on the real inputs, where `.item()` of a float
    Dynamo made dynamic (passed as a 0-d tensor) has no symbol to answer with: ask Dynamo to restart
    with those floats specialised (baked in and guarded), as tensorify_python_scalars does."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._subclasses.fake_tensor import FakeTensor

    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        memo = value.item_memo if isinstance(value, FakeTensor) else None
        symbol = getattr(memo.node, "_expr", None) if isinstance(memo, torch.SymFloat) else None
        if symbol is not None and hasattr(symbol, "name"):  # unreplaced, as Dynamo looks it up
            names.append(symbol.name)
    if names:
        for name in names:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


def _restride_saved(bw: torch.fx.GraphModule, fw: torch.fx.GraphModule) -> None:
    """Give the backward's saved-value placeholders the strides Inductor chose for them.

    A symbolic stride is compared by its size hint, never with `==` on the symbol: that would add a
    guard pinning the size (a recompile for every new length). Where the hint differs, the
    stride expression Inductor recorded becomes the new symbolic stride."""
    from torch.fx.experimental.symbolic_shapes import free_symbols, optimization_hint

    strides = fw.meta.get(_OUT_STRIDES)
    n_fwd = fw.meta.get(_NUM_FWD)
    if not strides or n_fwd is None:
        return
    placeholders = [p for p in bw.graph.nodes if p.op == "placeholder"]
    for p, (stride, expressions) in zip(placeholders, strides[n_fwd:]):
        val = p.meta.get("val")
        if stride is None or not isinstance(val, torch.Tensor):
            continue
        fake_mode = getattr(val, "fake_mode", None)
        if free_symbols(val):
            if [optimization_hint(s, fallback=-1) for s in val.stride()] == [int(s) for s in stride]:
                continue
            shape_env = getattr(fake_mode, "shape_env", None)
            if shape_env is None or not all(isinstance(e, str) for e in expressions):
                continue
            stride = tuple(shape_env.deserialize_symexpr(e) for e in expressions)
        elif tuple(val.stride()) == tuple(stride):
            continue
        ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
        with ctx:
            p.meta["val"] = torch.empty_strided(val.shape, tuple(stride), dtype=val.dtype, device=val.device)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _mode_of(values: list):
    from torch._subclasses.fake_tensor import FakeTensor

    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _fake_bw_inputs(compiler: Callable) -> Callable:
    """Backward compilers get fake example inputs (the placeholders' values), as with upstream."""

    def bw_compiler(gm, _example_inputs):
        vals = placeholder_values(gm)
        return compiler(gm, vals if all(v is not None for v in vals) else list(_example_inputs))

    return bw_compiler


def _no_dynamo(fn: Callable) -> Callable:
    """Dynamo must not trace into compiled graphs or the generated run time."""
    return torch._dynamo.disable(fn, reason="aotgrad: compiled graph")


def _no_dynamo_compiler(compiler: Callable) -> Callable:
    def wrapped(gm, example_inputs):
        compiled = torch._dynamo.disable(compiler, reason="aotgrad: backward compiler")(gm, example_inputs)
        boxed = getattr(compiled, "_boxed_call", False)
        out = _no_dynamo(compiled)
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


def _fake_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> list:
    """Fake inputs in the backend's fake mode (TracingContext.fake_mode), with the symbolic sizes
    Dynamo decided on (its per-tensor symbolic context); real examples when there is no context."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor

    ctx = TracingContext.try_get()
    mode = ctx.fake_mode if ctx is not None else None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, x in enumerate(example_inputs):
        ev = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        if mode is None or not isinstance(x, torch.Tensor):
            # A SymInt input: keep the symbol Dynamo traced with (guards refer to it).
            out.append(ev if isinstance(ev, torch.SymInt) and not isinstance(x, torch.SymInt) else x)
            continue
        if isinstance(x, FakeTensor):
            out.append(x if x.fake_mode is mode else mode.from_tensor(x))
            continue
        sym_ctx = ctx.tensor_to_context.get(x) if hasattr(ctx.tensor_to_context, "get") else None
        if sym_ctx is not None:
            out.append(mode.from_tensor(x, symbolic_context=sym_ctx, source=sym_ctx.tensor_source, trace=False))
        else:
            out.append(mode.from_tensor(x, static_shapes=True))
    return out


def _fake_state(state: list, fakes: list) -> list:
    """Parameters/buffers still attached to Dynamo's graph (not lifted), as static fakes."""
    if not state:
        return []
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([x for x in fakes if isinstance(x, torch.Tensor)]) or _context_fake_mode()
    if mode is None:
        return list(state)
    return [mode.from_tensor(t, static_shapes=True) for t in state]


def _context_fake_mode():
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    return ctx.fake_mode if ctx is not None else None


@contextlib.contextmanager
def _compile_context(leaves: list):
    """Dynamo's tracing context (or a new one for our fake mode) and the python dispatcher, which
    symbolic-shape decompositions need."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

    ctx = TracingContext.try_get()
    stack = contextlib.ExitStack()
    with stack:
        if ctx is None:
            mode = detect_fake_mode([x for x in leaves if isinstance(x, torch.Tensor)])
            if mode is not None:
                stack.enter_context(tracing(TracingContext(mode)))
        stack.enter_context(enable_python_dispatcher())
        yield


def _is_symbolic(x: Any) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(x, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride(), x.storage_offset()))
    return False


def _free_symbols(x) -> set:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(x.node.expr.free_symbols)
    return set()


def _sizes_determined(leaves: list) -> bool:
    """Every symbol of a SymInt input appears in some tensor input's sizes/strides/offset (so the
    compiled graphs can read it off the tensors; Dynamo passes such SymInts alongside)."""
    known: set = set()
    for x in leaves:
        if isinstance(x, torch.Tensor):
            for s in (*x.shape, *x.stride(), x.storage_offset()):
                known |= _free_symbols(s)
    need: set = set()
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            need |= _free_symbols(x)
    return need <= known


def _plan_needs_concrete_sizes(plan) -> bool:
    """Would the generated run time bake in a symbolic value (a view argument, a restride) that it
    cannot read off the inputs per call (`Plan.symbol_sources`)?"""
    bound = {s.name for s in plan.symbol_sources}
    return any(str(s) not in bound for s in symbols_in(plan))


def _takes(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _default_partitioner() -> Callable:
    """aotgrad's min-cut partitioner when this aotgrad has one, else `default_partition`."""
    import aotgrad

    from . import partition as partition_module

    for where in (partition_module, aotgrad):
        fn = getattr(where, "min_cut_rematerialization_partition", None)
        if fn is not None:
            return fn
    return default_partition


def _must_propagate(e: BaseException) -> bool:
    """Dynamo control flow (restart analysis, skip frame) must reach Dynamo unchanged."""
    try:
        from torch._dynamo import exc as dexc
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (dexc.RestartAnalysis, dexc.SkipFrame))


def _describe_failure(e: BaseException, gm: torch.fx.GraphModule | None) -> BackendCompileError:
    """A `BackendCompileError` naming the failing op, the input involved and the Dynamo graph line."""
    op = _failing_op(e)
    line = _graph_line(e, gm) if gm is not None else None
    first = (str(e).strip().splitlines() or [""])[0][:400].rstrip(". ")
    parts = [f"aotgrad could not compile a graph Dynamo handed it: {type(e).__name__}: {first}"]
    if op is not None and op not in first:
        parts.append(f"op: {op}")
    named = _input_names(first, gm) if gm is not None else None
    if named:
        parts.append(named)
    if line is not None:
        parts.append(f"while tracing: `{line}`")
    if not config.fallback_to_eager:
        parts.append("set aotgrad.config.fallback_to_eager = True to run such graphs eagerly")
    return BackendCompileError(". ".join(parts) + ".")


def _input_names(message: str, gm: torch.fx.GraphModule) -> str | None:
    """'input 3' in an aotgrad message, as the Dynamo graph's placeholder (and its source) name."""
    import re

    m = re.search(r"\binputs? \[?(\d+)", message)
    if not m:
        return None
    names, _ = _named_state(gm)
    i = int(m.group(1)) - len(names)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not 0 <= i < len(placeholders):
        return None
    node = placeholders[i]
    source = getattr(node.meta.get("grapharg"), "source", None)
    where = f" ({source.name})" if source is not None and hasattr(source, "name") else ""
    return f"input {m.group(1)} is the graph input `{node.name}`{where}"


def _failing_op(e: BaseException) -> str | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        func = getattr(e, "func", None) or getattr(e, "target", None)
        if func is not None:
            return str(func)
        e = e.__cause__ or e.__context__ or getattr(e, "inner_exception", None)
    return None


def _graph_line(e: BaseException, gm: torch.fx.GraphModule) -> str | None:
    code = getattr(gm.forward, "__code__", None)
    filename = code.co_filename if code is not None else None
    seen = set()
    found = None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            if filename is not None and frame.filename == filename:
                found = (linecache.getline(frame.filename, frame.lineno) or frame.line or "").strip()
        e = e.__cause__ or e.__context__
    if found:
        return found.split(";")[0].strip()
    return None
