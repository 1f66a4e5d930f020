"""Capture, backward: tangents and `torch.autograd.grad` traced in the same session as the forward,
refusing stale saved values and checking what the backward mutates.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, track_tensor_tree

from .. import node_meta
from ..errors import AotgradError, BackwardMutationError, UnsupportedMutationError
from ..signature import ambient
from . import analysis
from .higher_order_marks import tag_saved_unpacks
from .state import BACKWARD_MUTATION, _Forward, _last_node, _recorder
from .tracer import LeanTracer

# Autograd errors a backward eager never ran (the caller took no gradient) can hit in the trace.
_BACKWARD_LIMITS = (
    "invalid gradient at index",
    "is a view and its base or another view of its base has been modified inplace",
)


def _without_compiled_autograd():
    """With compiled autograd on (`torch._dynamo.config.compiled_autograd`, or its context manager),
    autograd.grad would hand our traced backward to Dynamo instead of running it under our modes."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca._disable() if ca is not None and ca.compiled_autograd_enabled else contextlib.nullcontext()


def _trace_backward(fw: _Forward, primals, funs, bases, mode):
    """Add tangent placeholders for the differentiable forward values, then trace autograd.grad."""
    diff = [i for i, o in enumerate(fw.fw_outputs) if o.differentiable]
    tangents_fun = []
    for n, i in enumerate(diff):
        tangent = _new_placeholder(f"tangents_{n + 1}", fw.fw_values[i])
        with mode:
            tangents_fun.append(FunctionalTensor.to_functional(tangent))
    wrt = [k for k, (p, f) in enumerate(zip(primals, funs)) if _wants_grad(p, f)]
    counts = [analysis.mutation_count(b) for b in bases]
    metas = [analysis.meta_of(analysis.unwrap(b)) for b in bases]
    grads_wrt: Sequence = ()
    last_forward = _last_node()
    if diff and wrt:
        # Traced with autocast off: eager's backward is cast by the state in force when it runs,
        # which the run time checks (signature/ambient.py).
        with mode, _refuse_stale_saved_values(), _without_compiled_autograd(), ambient.no_autocast(), \
                node_meta.backward_phase(_recorded_graph()):
            try:
                grads_wrt = torch.autograd.grad(
                    [fw.fw_functional[i] for i in diff],
                    [funs[k] for k in wrt],
                    tangents_fun,
                    allow_unused=True,
                )
            except RuntimeError as e:
                if getattr(mode, "aliased_metadata_op", None) or not any(s in str(e) for s in _BACKWARD_LIMITS):
                    raise  # capture names the in-place metadata op on an aliased tensor
                raise UnsupportedMutationError(
                    f"aotgrad: the backward, which aotgrad traces ahead of time (even if the caller never runs "
                    f"it), fails: {str(e).splitlines()[0]} Typical causes: an in-place metadata op (squeeze_, t_) "
                    "under no_grad on a tensor autograd differentiates through; an in-place op on a view from "
                    "a multi-output op (chunk, split) or after detach_(). Use out-of-place ops there."
                ) from e
    _check_backward_mutations(fw, primals, bases, counts, metas, tangents_fun)
    tag_saved_unpacks(last_forward.graph, last_forward)  # for higher-order gradients (higher_order/backward.py)
    grads: list = [None] * len(funs)
    for k, g in zip(wrt, grads_wrt):
        grads[k] = analysis.unwrap(g) if g is not None else None
    return grads, len(diff)


@contextlib.contextmanager
def _refuse_stale_saved_values():
    """A value autograd saved for the backward was later modified in place or detach_()ed: eager's
    forward runs, but its backward raises (the caller's program often never calls it, e.g. after
    detach_()). aotgrad traces the backward ahead of time, so it refuses the program instead."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, AotgradError) or not any(sign in str(e) for sign in _STALE_SAVED_VALUE):
            raise
        raise UnsupportedMutationError(
            "aotgrad: the program modifies in place (or detach_()es) a value autograd saved for the "
            f"backward ({_saved_value_name(e)}); eager's backward through it fails, and aotgrad traces "
            "the backward ahead of time. Modify (or detach) a .clone() of that value instead."
        ) from e


_STALE_SAVED_VALUE = ("modified by an inplace operation", "saved tensor that has been detached in-place")


def _saved_value_name(e: RuntimeError) -> str:
    """'[torch.FloatTensor [1, 3]], which is output 0 of Tanh' out of autograd's version-check message."""
    first = str(e).splitlines()[0]
    if "inplace operation: " not in first:
        return "a tensor detached in place"
    return first.split("inplace operation: ", 1)[-1].split(", is at version")[0]


def _wants_grad(primal, fun) -> bool:
    """Gradients flow to a primal that required grad, or that the program made a leaf requiring grad."""
    return primal.requires_grad or (fun.requires_grad and fun.is_leaf)


def _recorded_graph() -> torch.fx.Graph | None:
    mode = _recorder()
    if isinstance(mode, LeanTracer):
        return mode.graph
    return getattr(getattr(mode, "tracer", None), "graph", None)


def _new_placeholder(name: str, like: torch.Tensor) -> torch.Tensor:
    """A new graph input created mid-trace (tangents are only known once the forward has run)."""
    mode = _recorder()
    with disable_proxy_modes_tracing():
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if isinstance(mode, LeanTracer):
        mode.placeholder(name, value)
        return value
    tracer = mode.tracer
    proxy = tracer.create_proxy("placeholder", name, (), {}, name=name)
    proxy.node.meta["val"] = value
    track_tensor_tree(value, proxy, constant=None, tracer=tracer)
    return value


def _check_backward_mutations(fw, primals, bases, counts, metas, tangents_fun) -> None:
    for k, b in enumerate(bases):
        if analysis.meta_of(analysis.unwrap(b)) != metas[k]:
            raise BackwardMutationError(
                f"aotgrad: the backward pass changes the metadata (shape/strides/storage) of graph input {k}; "
                "only data mutations of inputs are supported in the backward."
            )
        if analysis.mutation_count(b) == counts[k]:
            continue
        # An input that requires grad may be written by the backward too (eager: under the engine's
        # no_grad): the copy_ in the backward graph writes the caller's tensor, as eager's does.
        forward = fw.mutations[k]
        if forward.any and (forward.metadata or forward.storage or b.requires_grad or primals[k].requires_grad):
            raise BackwardMutationError(
                f"aotgrad: graph input {k} is mutated in both the forward and the backward, and the forward "
                "changes its metadata or it requires grad; only a data mutation of an input that does not "
                "require grad may happen in both."
            )
        with torch.no_grad():  # as eager's engine runs the backward
            torch.ops.aten.copy_.default(primals[k], analysis.unwrap(b))
        _last_node().meta[BACKWARD_MUTATION] = True
        # Mutated in the forward too: the forward graph writes its new value into the input itself
        # (trace/backward_mutations.py), so the backward's copy_ finds the caller's tensor.
        fw.mutations[k] = replace(forward, in_backward=True)
    for n, t in enumerate(tangents_fun):
        torch._sync(t)
        # A data mutation of an incoming gradient stays functional: what the backward reads after it
        # is the new value (as in eager); the caller's gradient tensor itself is not written (as
        # upstream). A metadata mutation is refused.
        if torch._functionalize_has_metadata_mutation(t.elem):
            raise BackwardMutationError(
                f"aotgrad: the backward pass changes the metadata (shape/strides) of the incoming gradient of "
                f"forward output {n} (e.g. grad_output.t_() in a custom autograd.Function); use an "
                "out-of-place op."
            )
