"""The public entry points, with the names and signatures of upstream's AOT API.

`aot_function(fn, fw_compiler, ...)` returns a callable that, per distinct input signature
(inputs.signature), runs the pipeline once and then only the generated run-time code:

    inputs.layout_for -> capture.capture -> partition_fn -> compile.compile_* -> runtime.build_runner
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import inputs as inputs_stage
from .capture import capture
from .capture_state import NeedsSyntheticBase
from .compile import compile_inference, compile_training
from .interpreter_stack import on_roomy_stack
from .partition import default_partition
from .plan import symbols_in
from .runtime import build_runner


@dataclass(frozen=True)
class AOTConfig:
    fw_compiler: Callable
    bw_compiler: Callable
    inference_compiler: Callable
    partition_fn: Callable
    decompositions: dict
    num_params_buffers: int
    keep_inference_input_mutations: bool
    dynamic: bool


def compile_signature(fn: Callable, leaves: list, spec: pytree.TreeSpec, config: AOTConfig) -> Callable:
    """Run the whole pipeline for one input signature; return the generated `run(leaves)`.

    It runs on a roomy interpreter stack (interpreter_stack.py): compile time then does not depend
    on how deep the caller's stack is."""
    return on_roomy_stack(_compile_signature, fn, leaves, spec, config)


def _compile_signature(fn: Callable, leaves: list, spec: pytree.TreeSpec, config: AOTConfig) -> Callable:
    inputs_stage.check_supported(leaves)
    training = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
    )
    groups = inputs_stage.storage_groups(leaves)
    layout = inputs_stage.layout_for(leaves, spec)
    try:
        captured = _capture(fn, layout, leaves, training, config, groups)
    except NeedsSyntheticBase as merge:
        layout = inputs_stage.layout_for(leaves, spec, merge_groups=merge.groups)
        captured = _capture(fn, layout, leaves, training, config, ())
    primals = inputs_stage.primal_values(layout, leaves)
    if training:
        compiled = compile_training(
            captured, config.partition_fn, config.fw_compiler, config.bw_compiler, primals,
            keep_input_mutations=config.keep_inference_input_mutations,
            make_compiled=lambda f: CompiledFunction(f, replace(config, num_params_buffers=0)),
        )
    else:
        compiled = compile_inference(captured, config.inference_compiler, primals)
    plan = captured.plan
    symbols = symbols_in(plan)
    if symbols:  # dynamic sizes in view arguments or restrides: read them off the inputs per call
        plan = replace(plan, symbol_sources=inputs_stage.symbol_sources(leaves, symbols))
    run = build_runner(plan, compiled)
    run.plan = plan
    run.compiled = compiled
    return run


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
    """What `aot_function` returns: a cache from input signature to generated run-time code."""

    def __init__(self, fn: Callable, config: AOTConfig):
        self.fn = fn
        self.config = config
        self.cache: dict[tuple, Callable] = {}
        self.fast: list[tuple[Callable, Callable]] = []  # (guard, run) for flat positional calls
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        if not kwargs:
            for guard, run in self.fast:
                if guard(args):
                    return run(args)
        return self._call_slow(args, kwargs)

    def _call_slow(self, args: tuple, kwargs: dict):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = inputs_stage.signature(leaves, spec)
        run = self.cache.get(key)
        if run is None:
            run = compile_signature(self.fn, leaves, spec, self.config)
            self.cache[key] = run
            guard = inputs_stage.make_guard(leaves, spec, _plan_depends_on_aliasing(run.plan))
            if guard is not None:
                self.fast.insert(0, (guard, run))
        return run(leaves)


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
) -> CompiledFunction:
    """Trace `fn`'s forward and backward ahead of time and run them through the given compilers.

    Compiles on the first call for each input signature (shapes, strides, dtypes, requires_grad,
    aliasing, non-tensor values, grad mode); later calls with the same signature only run the
    generated run-time code. `dynamic` is accepted for compatibility: shapes are specialized and a new
    shape recompiles (never reuses a graph that does not fit).
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
    )
    return CompiledFunction(fn, config)


compiled_function = aot_function


def _functional_call(mod: nn.Module, names: list[str], num: int):
    def call(*flat_and_args, **kwargs):
        state = dict(zip(names, flat_and_args[:num]))
        return torch.func.functional_call(mod, state, flat_and_args[num:], kwargs, tie_weights=False, strict=False)

    return call


class AOTModule(nn.Module):
    """What `aot_module` returns: calls the compiled function with the module's parameters and buffers."""

    def __init__(self, mod: nn.Module, compiled: CompiledFunction, state: list[torch.Tensor]):
        super().__init__()
        self.orig_module = mod
        self._compiled = compiled
        self._state = state

    def forward(self, *args, **kwargs):
        return self._compiled(*self._state, *args, **kwargs)


def _named_state(mod: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    named = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
    return [n for n, _ in named], [t for _, t in named]


def aot_module(mod: nn.Module, *args, **kwargs) -> nn.Module:
    """`aot_function` for modules: parameters and buffers become graph inputs, so gradients land in
    `param.grad` and buffer updates (e.g. BatchNorm running stats) in the module's buffers."""
    names, state = _named_state(mod)
    kwargs["num_params_buffers"] = len(state)
    compiled = aot_function(_functional_call(mod, names, len(state)), *args, **kwargs)
    return AOTModule(mod, compiled, state)


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
    **_ignored,
) -> Callable:
    """The form `torch.compile` backends use: parameters and buffers lifted to graph inputs; the
    returned callable takes only the user inputs (flat list semantics, like the FX graph)."""
    names, state = _named_state(mod)
    compiled = aot_function(
        _functional_call(mod, names, len(state)),
        fw_compiler,
        bw_compiler,
        partition_fn,
        decompositions,
        num_params_buffers=len(state),
        keep_inference_input_mutations=keep_inference_input_mutations,
        inference_compiler=inference_compiler,
    )

    def forward(*runtime_args):
        return compiled(*state, *runtime_args)

    forward.zero_grad = mod.zero_grad
    forward.named_parameters = mod.named_parameters
    forward.named_buffers = mod.named_buffers
    forward._boxed_call = False
    return forward
