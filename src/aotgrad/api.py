"""The public entry points, with the names and signatures of upstream's AOT API.

`aot_function(fn, fw_compiler, ...)` returns a callable that, per distinct input signature
(inputs.signature), runs the pipeline once and then only the generated run-time code:

    inputs.layout_for -> capture.capture -> partition_fn -> compile.compile_* -> runtime.build_runner
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from . import config as config_module
from . import observe
from .compile.compile import compile_inference, compile_training
from .compile.compilers import AOTConfig
from .dynamic import shapes as dynamic_shapes
from .errors import AotgradError, DataDependentError
from .partition.default import default_partition
from .plan import symbols_in
from .runtime.runner import build_runner
from .signature import ambient, guards, lifting
from .signature import inputs as inputs_stage
from .signature.module_state import ModuleState
from .signature.subclass_layout import NeedsSubclassBoundary
from .subclass import wrap as subclass_wrap
from .trace.capture import capture
from .trace.interpreter_stack import on_roomy_stack
from .trace.refusal_source import translated_torch_error, with_user_line
from .trace.state import NeedsSyntheticBase, NeedsTraining

log = logging.getLogger("aotgrad.api")


def compile_signature(fn: Callable, leaves: list, spec: pytree.TreeSpec, config: AOTConfig) -> Callable:
    """Run the whole pipeline for one input signature; return the generated `run(leaves)`.

    It runs on a roomy interpreter stack (trace/interpreter_stack.py): compile time then does not depend
    on how deep the caller's stack is."""
    return on_roomy_stack(_compile_signature, fn, leaves, spec, config)


def _compile_signature(fn: Callable, leaves: list, spec: pytree.TreeSpec, config: AOTConfig) -> Callable:
    if subclass_wrap.any_subclass(leaves):  # flattened at the boundary, plain inside (subclass/wrap.py)
        return subclass_wrap.compile_signature(fn, leaves, spec, config, _compile_signature)
    try:
        return _compile_plain_signature(fn, leaves, spec, config)
    except NeedsSubclassBoundary:  # the program returns a subclass it built
        return subclass_wrap.compile_signature(fn, leaves, spec, config, _compile_plain_signature)


def _compile_plain_signature(fn: Callable, leaves: list, spec: pytree.TreeSpec, config: AOTConfig) -> Callable:
    inputs_stage.check_supported(leaves)
    training = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
    )
    with observe.stage("capture", getattr(fn, "__qualname__", "")):
        try:
            layout, captured = _capture_merging_aliases(fn, leaves, spec, training, config)
        except NeedsTraining:  # called under no_grad, but the program turned grad mode on
            training = True
            layout, captured = _capture_merging_aliases(fn, leaves, spec, training, config)
        else:
            if training and _nothing_differentiable(captured, inputs_stage.primal_values(layout, leaves)):
                layout, captured, training = _as_inference(fn, leaves, spec, config, layout, captured)
    if training:  # an inference graph is logged as it goes to its compiler
        observe.log_graph("joint", captured.graph)
    primals = inputs_stage.primal_values(layout, leaves)
    # The graphs hold the casts of the autocast state they were traced under and run with autocast
    # off: a partitioner or compiler that re-runs their ops under the caller's autocast would see
    # other dtypes than they compute (observe.call_compiler covers backwards compiled later).
    with ambient.no_autocast():
        if training:
            compiled = compile_training(
                captured, config.partition_fn, config.fw_compiler, config.bw_compiler, primals,
                keep_input_mutations=config.keep_inference_input_mutations,
                make_compiled=lambda f: CompiledFunction(f, replace(config, num_params_buffers=0)),
                keep_inplace=config.disable_functionalization,
                decompositions=config.decompositions,
            )
        else:
            compiled = compile_inference(captured, config.inference_compiler, primals,
                                         keep_inplace=config.disable_functionalization)
    plan = captured.plan
    # The caller's non-tensor arguments were needed for the trace only; the signature holds what it
    # read off them (signature/guards.py), so the cache must not keep them alive.
    plan = replace(plan, layout=replace(plan.layout, constants=dict.fromkeys(plan.layout.constants)))
    symbols = symbols_in(plan)
    if symbols:  # dynamic sizes in view arguments or restrides: read them off the inputs per call
        plan = replace(plan, symbol_sources=inputs_stage.symbol_sources(leaves, symbols))
    run = build_runner(plan, compiled)
    run.plan = plan
    run.compiled = compiled
    return run


def _nothing_differentiable(captured, primals: list) -> bool:
    """No output requires grad and no input requiring grad is changed: the joint graph would have no
    tangent and an empty backward. Upstream compiles such a program as an inference graph (its
    `inference_compiler`), so do we."""
    return captured.num_tangents == 0 and not any(
        m.any and isinstance(p, torch.Tensor) and p.requires_grad for m, p in zip(captured.plan.mutations, primals))


def _as_inference(fn, leaves, spec, config, layout, captured):
    """Trace again without autograd; the graph then runs under no_grad (`Plan.inference_under_grad`).
    Kept as training where the inference trace disagrees (NeedsTraining)."""
    try:
        layout_i, captured_i = _capture_merging_aliases(fn, leaves, spec, False, config)
    except NeedsTraining:
        return layout, captured, True
    captured_i.plan = replace(captured_i.plan, inference_under_grad=True)
    return layout_i, captured_i, False


def _capture_merging_aliases(fn, leaves, spec, training, config):
    """Capture; when inputs sharing a storage turn out to be mutated, again with them as one base."""
    groups = inputs_stage.storage_groups(leaves)
    layout = inputs_stage.layout_for(leaves, spec)
    try:
        return layout, _capture(fn, layout, leaves, training, config, groups)
    except NeedsSyntheticBase as merge:
        layout = inputs_stage.layout_for(leaves, spec, merge_groups=merge.groups)
        return layout, _capture(fn, layout, leaves, training, config, ())


def _capture(fn, layout, leaves, training, config, groups):
    primals = inputs_stage.primal_values(layout, leaves)
    return capture(
        fn, layout, leaves, primals,
        training=training,
        decompositions=config.decompositions,
        keep_inference_input_mutations=config.keep_inference_input_mutations,
        storage_groups=groups,
    )


class CompiledFunction:
    """What `aot_function` returns: a cache from input signature to generated run-time code.

    Tensors the function reaches without being passed them are lifted (signature/lifting.py): found during a
    trace, they become leading arguments of every later call, so their current values are read,
    their mutations applied once and their gradients computed. Each entry's one generated guard
    checks the arguments and then the closed-over state (lifting.with_state): a rebound tensor or a
    closed-over module's changed state (flags, hooks, parameters) fails it, and the slow path runs
    `_state_ok` to see why; compiled entries are kept per module state (`_buckets`). Past
    `config.recompile_limit` signatures it warns once, naming what keeps changing; past
    `config.recompile_hard_limit` new signatures run eagerly."""

    def __init__(self, fn: Callable, config: AOTConfig):
        self.fn = fn
        self.config = config
        self.cache: dict[tuple, Callable] = {}
        self.fast: list[tuple[Callable, Callable]] = []  # (guard, run) for flat positional calls
        self.lifted: tuple[torch.Tensor, ...] = ()  # closed-over tensors, passed first
        self._slots: list = []  # where each lifted tensor is read from (lifting.Place or None)
        self._reach: lifting.Reach | None = None  # what fn reaches, found on its first compile
        self._modules: list[nn.Module] = []  # closed-over modules guarded here
        self._module_key: tuple = ()
        self._buckets: dict[tuple, tuple] = {}  # other module states' (cache, fast, symbolic)
        self._state_ok: Callable[[], bool] | None = None  # closed-over state (folded into self.fast's guards)
        self.recompiles: list[str] = []  # why each signature after the first was compiled
        self.symbolic: list[tuple] = []  # (spec, guard, run) per entry serving many shapes (dynamic/shapes.py)
        self._warned: set[str] = set()
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        if not kwargs:  # one generated guard per entry: the arguments, then any closed-over state
            full = (*self.lifted, *args) if self.lifted else args
            for guard, run in self.fast:
                if guard(full):
                    return run(full)
        return self._call_slow(args, kwargs)

    def prepare(self, *args, **kwargs) -> None:
        """Compile for these arguments now, without running anything: a refusal (an AotgradError)
        surfaces here, and the first call with the same signature finds the compiled entry."""
        if self._state_ok is not None and not self._state_ok():
            self._state_changed()
        args = (*self.lifted, *args)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not inputs_stage.being_traced(leaves) and any(map(dynamic_shapes.is_symbolic_number, leaves)):
            leaves = dynamic_shapes.hints(leaves)  # Dynamo's SymInt examples beside real tensors
            args, kwargs = pytree.tree_unflatten(leaves, spec)
        try:
            if inputs_stage.being_traced(leaves):
                fakes = dynamic_shapes.traceable_fakes(leaves)
                if fakes is not None:  # a caller's fakes (Dynamo's): compile from them, guards into its ShapeEnv
                    self._compile_symbolic(leaves, spec, fakes, propagate=(lifting.NeedsLifting, AotgradError))
                return
            key = inputs_stage.signature(leaves, spec)
            if key in self.cache or len(self.cache) >= max(1, config_module.recompile_hard_limit):
                return
            self._compile(leaves, spec, key, args, kwargs)
        except lifting.NeedsLifting as found:
            before = len(self.lifted)
            self._lift(found.tensors)
            self.prepare(*args[before:], **kwargs)

    def _call_slow(self, args: tuple, kwargs: dict):
        """`args` without the lifted tensors: the state check may change which tensors those are."""
        if self._state_ok is not None and not self._state_ok():
            self._state_changed()  # a rebound tensor, a module's mode, hooks or parameters
            if not kwargs:  # the entries' guards now check the new state
                full = (*self.lifted, *args)
                for guard, run in self.fast:
                    if guard(full):
                        return run(full)
        args = (*self.lifted, *args)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if inputs_stage.being_traced(leaves):
            # Called inside another trace (an outer aot_function): the outer graph records our ops
            # (and lifts our closed-over tensors itself).
            return self.fn(*args[len(self.lifted):], **kwargs)
        key = inputs_stage.signature(leaves, spec)
        run = self.cache.get(key)
        if run is None and self.symbolic:
            run = dynamic_shapes.find(self.symbolic, leaves, spec)
        if run is None:
            if len(self.cache) >= max(1, config_module.recompile_hard_limit):
                return self._run_eagerly(args, kwargs)
            try:
                run = self._compile(leaves, spec, key, args, kwargs)
            except lifting.NeedsLifting as found:
                before = len(self.lifted)
                self._lift(found.tensors)
                return self(*args[before:], **kwargs)
        return run(leaves)

    def _compile(self, leaves: list, spec, key: tuple, args: tuple, kwargs: dict) -> Callable:
        previous = next(reversed(self.cache), None)
        self._find_reach()
        fn = lifting.with_lifted(self.fn, self.lifted)
        before = lifting.snapshot(self._reach)
        with observe.graph_logging(self.config.enable_log):
            try:
                run = None
                if self.config.dynamic:  # one entry for many shapes, guarded by its ShapeEnv
                    fakes = dynamic_shapes.symbolic_fakes(leaves, self.config.num_params_buffers)
                    run = self._compile_symbolic(leaves, spec, fakes, own=True) if fakes is not None else None
                if run is None:
                    run = compile_signature(fn, leaves, spec, self.config)
            except DATA_DEPENDENT as e:
                raise with_user_line(_data_dependent_error(e), e) from e
            except lifting.NeedsLifting:
                raise
            except AotgradError as e:
                lifting.rename_inputs(e, lifting.names_of(self.lifted, self._slots))
                with_user_line(e)
                raise
            except RuntimeError as e:
                refusal = translated_torch_error(e)
                if refusal is None:
                    raise
                raise with_user_line(refusal, e) from e
            finally:
                rebound = lifting.restore_rebound(before, self.fn)
        if rebound:
            raise lifting.rebound_error(rebound)
        if previous is not None:
            self._note_recompile(previous, key, args, kwargs)
        self.cache[key] = run
        guard = None
        if getattr(run, "symbolic_guard", None) is None:  # a symbolic entry's guard is in self.fast
            guard = inputs_stage.make_guard(leaves, spec, _plan_depends_on_aliasing(run.plan))
        if guard is not None:
            self.fast.insert(0, (lifting.with_state(guard, self._state_ok), run))
        for ref in guards.weak_parts(key):  # forget the entry when the object it was keyed on dies
            weakref.finalize(ref(), _forget, weakref.ref(self), key)
        return run

    def _compile_symbolic(self, leaves: list, spec, fakes: list, propagate=(lifting.NeedsLifting,), own=False):
        """Compile from fakes with symbolic sizes and keep the entry with its own guard (the
        ShapeEnv's); None when symbolic sizes cannot serve this program (compiled per shape)."""
        fn = lifting.with_lifted(self.fn, self.lifted)
        run = dynamic_shapes.compile_symbolic(compile_signature, fn, fakes, spec, self.config, propagate=propagate,
                                              own_shape_env=own)
        if run is None:
            return None
        run.symbolic_guard = dynamic_shapes.call_guard(fakes, leaves, _plan_depends_on_aliasing(run.plan))
        self.symbolic.insert(0, (spec, run.symbolic_guard, run))
        if dynamic_shapes.flat_positional(leaves, spec):
            self.fast.insert(0, (lifting.with_state(run.symbolic_guard, self._state_ok), run))
        return run

    def _find_reach(self) -> None:
        """What fn reaches (lifting.find_places), once: the modules it closes over are guarded here
        unless the caller guards them (aot_module marks its own module)."""
        if self._reach is not None:
            return
        self._reach = lifting.find_places(self.fn)
        guarded = getattr(self.fn, "__aotgrad_guarded__", ())
        self._modules = [m for _, m in self._reach.modules if not any(m is g for g in guarded)]
        self._module_key = lifting.module_key(self._modules)
        self._rebuild_state_guard()

    def _rebuild_state_guard(self) -> None:
        """A new state check (new lifted tensors, places or modules): every entry of the current
        module state gets its guard folded again with it (another module state's entries are, when
        `_state_changed` switches to them)."""
        self._slots = lifting.slots_of(self.lifted, self._reach)
        self._state_ok = lifting.make_state_guard(self.lifted, self._slots, self._modules)
        self.fast = [(lifting.with_state(guard, self._state_ok), run) for guard, run in self.fast]

    def _lift(self, tensors: list[torch.Tensor]) -> None:
        self._find_reach()
        guarded = getattr(self.fn, "__aotgrad_guarded__", ())
        known = {id(t) for t in self.lifted}
        tensors = [t for t in lifting.expand(tensors, self._reach, guarded) if id(t) not in known]
        log.debug("aotgrad: lifting closed-over tensors to inputs of %s: %s",
                  getattr(self.fn, "__qualname__", self.fn), lifting.describe(tensors))
        self.lifted = (*self.lifted, *tensors)
        self._clear_entries()  # earlier entries take fewer leading arguments
        self._rebuild_state_guard()

    def _clear_entries(self) -> None:
        self.cache, self.fast, self.symbolic = {}, [], []
        self._buckets.clear()

    def _state_changed(self) -> None:
        """Closed-over state changed since the last call: switch to the compiled entries of the
        modules' new state (flags, hooks, names), and pass the tensors now found where the lifted
        ones were read (by place name: a replaced submodule's parameter is found). When one is gone
        or no longer a tensor, forget the lifting (the next trace finds what to lift again)."""
        guarded = getattr(self.fn, "__aotgrad_guarded__", ())
        self._reach = lifting.find_places(self.fn)
        self._modules = [m for _, m in self._reach.modules if not any(m is g for g in guarded)]
        key = lifting.module_key(self._modules)
        if key != self._module_key:
            observe.log_recompile(self.fn, "a closed-over module's training flag, hooks or state names changed")
            self._buckets[self._module_key] = (self.cache, self.fast, self.symbolic)
            self.cache, self.fast, self.symbolic = self._buckets.pop(key, ({}, [], []))
            self._module_key = key
        current = lifting.read_again(self.lifted, self._slots, self._reach)
        if current is None:
            self.lifted = ()
            self._clear_entries()
        else:
            self.lifted = tuple(current)  # same signature parts: compiled entries stay valid
        self._rebuild_state_guard()

    def _note_recompile(self, previous: tuple, key: tuple, args: tuple, kwargs: dict) -> None:
        names = guards.leaf_names(args, kwargs, len(self.lifted))
        reason = guards.recompile_reason(previous, key, names)
        self.recompiles.append(reason)
        observe.log_recompile(self.fn, reason)
        limit = config_module.recompile_limit
        if len(self.cache) + 1 > limit and "limit" not in self._warned:
            self._warned.add("limit")
            parts = Counter(p for r in self.recompiles for p in guards.part_names(r))
            common = ", ".join(f"{p} ({n}x)" for p, n in parts.most_common(3))
            warnings.warn(
                f"aotgrad: {getattr(self.fn, '__qualname__', self.fn)} has been compiled for {len(self.cache) + 1} "
                f"input signatures (aotgrad.config.recompile_limit = {limit}); what keeps changing: {common}. "
                f"Latest: {reason}. Keep it fixed (pass a changing number as a tensor), or raise the limit.",
                stacklevel=4,
            )

    def _run_eagerly(self, args: tuple, kwargs: dict):
        if "hard" not in self._warned:
            self._warned.add("hard")
            warnings.warn(
                f"aotgrad: {getattr(self.fn, '__qualname__', self.fn)} reached "
                f"aotgrad.config.recompile_hard_limit = {config_module.recompile_hard_limit} signatures; "
                "new signatures now run eagerly (compiled ones keep running compiled).",
                stacklevel=4,
            )
        return self.fn(*args[len(self.lifted):], **kwargs)


def _forget(ref: weakref.ref, key: tuple) -> None:
    compiled = ref()
    if compiled is None:
        return
    for cache, _, _ in compiled._buckets.values():
        cache.pop(key, None)
    run = compiled.cache.pop(key, None)
    compiled.fast = [(g, r) for g, r in compiled.fast if r is not run]
    compiled.symbolic = [e for e in compiled.symbolic if e[2] is not run]


DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
_OP_NAMES = {"aten._local_scalar_dense.default": ".item() (or int()/float()/bool() of a tensor)"}


def _data_dependent_error(e: Exception) -> DataDependentError:
    op = str(getattr(e, "func", "") or "") or str(e).splitlines()[0]
    shown = _OP_NAMES.get(op, op)
    return DataDependentError(
        f"aotgrad: the program calls {shown}, whose result depends on the values of a tensor; aot_function "
        "traces one graph with sizes and Python values known ahead of time. Use torch.compile(fn, "
        "backend=\"aotgrad\"), which splits the graph at such ops, or move the op out of the compiled function."
    )


def _plan_depends_on_aliasing(plan) -> bool:
    return bool(plan.layout.leaf_views) or any(m.any or m.in_backward for m in plan.mutations)


def aot_function(
    fn: Callable,
    fw_compiler: Callable,
    bw_compiler: Callable | None = None,
    partition_fn: Callable = default_partition,
    decompositions: dict | None = None,
    num_params_buffers: int = 0,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Callable | None = None,
    *,
    dynamic: bool = False,
    enable_log: bool = True,
    disable_functionalization: bool = False,
) -> CompiledFunction:
    """Trace `fn`'s forward and backward ahead of time and run them through the given compilers.

    Compiles on the first call for each input signature (shapes, strides, dtypes, requires_grad,
    aliasing, non-tensor values, grad mode); later calls with the same signature only run the
    generated run-time code. With `dynamic`, sizes are traced as symbols (dynamic/shapes.py): one
    entry serves every shape its ShapeEnv's guards accept; others compile again. With `disable_functionalization`,
    compilers get graphs whose out-of-place ops are made in place again where safe (upstream's
    non-functional graphs); the trace itself stays functional, so results are the same.
    """
    config = AOTConfig(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler or fw_compiler,
        inference_compiler=inference_compiler or fw_compiler,
        partition_fn=partition_fn,
        decompositions=dict(decompositions or {}),
        num_params_buffers=num_params_buffers,
        keep_inference_input_mutations=keep_inference_input_mutations,
        dynamic=dynamic,
        enable_log=enable_log,
        disable_functionalization=disable_functionalization,
    )
    return CompiledFunction(fn, config)


compiled_function = aot_function


def _functional_call(mod: nn.Module, names: list[str], num: int):
    def call(*flat_and_args, **kwargs):
        state = dict(zip(names, flat_and_args[:num]))
        return torch.func.functional_call(mod, state, flat_and_args[num:], kwargs, tie_weights=False, strict=False)

    call.__aotgrad_guarded__ = (mod,)  # ModuleState guards it (lifting.find_places still reads it)
    return call


class AOTModule(nn.Module):
    """What `aot_module` returns: calls the compiled function with the module's parameters and buffers
    (read again, and recompiled for, when the module's state changes: signature/module_state.py)."""

    def __init__(self, mod: nn.Module, state: ModuleState):
        super().__init__()
        self.orig_module = mod
        self._module_state = state

    @property
    def _compiled(self) -> CompiledFunction:
        return self._module_state.current()[0]

    def forward(self, *args, **kwargs):
        compiled, state = self._module_state.current()
        return compiled(*state, *args, **kwargs)


def _named_state(mod: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    named = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
    return [n for n, _ in named], [t for _, t in named]


def aot_module(mod: nn.Module, *args, **kwargs) -> nn.Module:
    """`aot_function` for modules: parameters and buffers become graph inputs, so gradients land in
    `param.grad` and buffer updates (e.g. BatchNorm running stats) in the module's buffers."""

    def make(names: list[str]) -> CompiledFunction:
        return aot_function(_functional_call(mod, names, len(names)), *args,
                            **{**kwargs, "num_params_buffers": len(names)})

    return AOTModule(mod, ModuleState(mod, _named_state, make))


compiled_module = aot_module


def aot_module_simplified(
    mod: nn.Module,
    args: list,
    fw_compiler: Callable,
    bw_compiler: Callable | None = None,
    partition_fn: Callable = default_partition,
    decompositions: dict | None = None,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Callable | None = None,
    cudagraphs: Any = None,
    boxed_forward_device_index: Any = None,
    ignore_shape_env: bool = False,
    disable_functionalization: bool = False,
    **_ignored,
) -> Callable:
    """The form `torch.compile` backends use: parameters and buffers lifted to graph inputs; the
    returned callable takes only the user inputs (flat list semantics, like the FX graph).

    Compiles for `args` before returning, as upstream does, so a refusal is raised here (with its
    AotgradError type) rather than at the first call."""

    def make(names: list[str]) -> CompiledFunction:
        return aot_function(
            _functional_call(mod, names, len(names)),
            fw_compiler,
            bw_compiler,
            partition_fn,
            decompositions,
            num_params_buffers=len(names),
            keep_inference_input_mutations=keep_inference_input_mutations,
            inference_compiler=inference_compiler,
            disable_functionalization=disable_functionalization,
        )

    module_state = ModuleState(mod, _named_state, make)
    # Compiled now from the example inputs, as upstream does: what aotgrad refuses is raised here.
    compiled, state = module_state.current()
    if not ignore_shape_env and isinstance(mod, torch.fx.GraphModule) and dynamic_shapes.context_fake_mode():
        compiled.prepare(*state, *dynamic_shapes.caller_fakes(mod, list(args)))  # Dynamo's fakes and ShapeEnv
    if not compiled.symbolic:  # no symbolic entry (none asked for, or it cannot serve): these shapes
        compiled.prepare(*state, *args)

    def forward(*runtime_args):
        compiled, state = module_state.current()
        return compiled(*state, *runtime_args)

    forward.zero_grad = mod.zero_grad
    forward.named_parameters = mod.named_parameters
    forward.named_buffers = mod.named_buffers
    forward._boxed_call = False
    return forward
