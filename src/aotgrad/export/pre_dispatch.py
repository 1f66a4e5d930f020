"""`aot_export_module(..., pre_dispatch=True)`: the pre-dispatch aten graph, functional, with the
`GraphSignature` contract of export/export.py.

A pre-dispatch graph is recorded above autograd: ops keep their composite form (`aten.linear`,
`aten.dropout`), grad-mode changes stay in the graph as `torch._C._set_grad_enabled` calls, and
control flow stays as higher-order ops (`torch.ops.higher_order.cond`, `map_impl`) with their
branches as subgraphs. aotgrad's capture records below autograd (its whole point is the joint
graph), so this export traces separately: `make_fx(pre_dispatch=True)` over the program run under
a pre-dispatch `FunctionalTensorMode` (what upstream does), returning the new values of mutated
inputs first, then the user outputs. No backward is traced (upstream refuses `trace_joint` with
`pre_dispatch` too).

Refused, each with an `AotgradError`: `trace_joint=True`; metadata or storage (`set_`) mutations of
inputs; inputs sharing memory; ops with ordered side effects (upstream threads effect tokens
through the graph's signature, which aotgrad's `GraphSignature` does not carry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..dynamic.shapes import export_context
from ..errors import UnsupportedInputError, UnsupportedMutationError
from ..signature.inputs import alias_key, check_supported
from ..trace.capture import restoring_node_meta


def export(fn: Callable, leaves: list, in_spec, names: list[str], kinds: list[str],
           trace_joint: bool, decompositions: dict | None) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """The pre-dispatch graph of `fn` over flat `leaves` (parameters, buffers, then user inputs)
    and the fields of its `GraphSignature` (export.GraphSignature(**fields))."""
    if trace_joint:
        raise UnsupportedInputError(
            "aotgrad.aot_export_module: pre_dispatch=True exports the forward only (a pre-dispatch graph "
            "keeps autograd's ops instead of tracing the backward; upstream refuses this pair too). Pass "
            "trace_joint=False, or pre_dispatch=False for a joint graph.")
    check_supported(leaves)
    if alias_key(leaves):
        raise UnsupportedInputError("aotgrad.aot_export_module: inputs share memory (a tensor passed twice, "
                                    "or views of one tensor); pass independent tensors (.clone()).")
    fakes = _fakes(leaves)
    found: dict[str, Any] = {}
    traced = _functional_program(fn, in_spec, names, kinds, found)
    mode = fakes[0].fake_mode if fakes and isinstance(fakes[0], FakeTensor) else None
    with export_context(fakes), mode if mode is not None else _null(), restoring_node_meta():
        gm = make_fx(traced, decomposition_table=decompositions or {}, pre_dispatch=True,
                     record_stack_traces=True)(*fakes)
    return gm, _signature(gm, leaves, names, kinds, in_spec, found)


def _null():
    import contextlib

    return contextlib.nullcontext()


def _fakes(leaves: list) -> list:
    """The leaves as fakes of one mode: a caller's (symbolic) fakes, or static fakes of real tensors."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    mode = next((x.fake_mode for x in tensors if isinstance(x, FakeTensor)), None) or FakeTensorMode(
        allow_non_fake_inputs=True)
    return [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
            else x for x in leaves]


def _functional_program(fn: Callable, in_spec, names: list[str], kinds: list[str], found: dict) -> Callable:
    """`fn` over flat leaves under pre-dispatch functionalization, returning (*new values of mutated
    inputs, *user outputs); what it found goes into `found` (mutated positions, output spec)."""

    def traced(*flat):
        mode = FunctionalTensorMode(pre_dispatch=True, export=True)
        with mode:
            funs = [FunctionalTensor.to_functional(x) if isinstance(x, torch.Tensor) else x for x in flat]
        args, kwargs = pytree.tree_unflatten(list(funs), in_spec)
        with mode:
            out = fn(*args, **kwargs)
        if mode._tokens:
            raise UnsupportedMutationError(
                "aotgrad.aot_export_module: the program calls an op with ordered side effects; a pre_dispatch "
                "export threads no effect tokens through its signature. Export with pre_dispatch=False.")
        flat_out, found["out_spec"] = pytree.tree_flatten(out)
        mutated, new_values = [], []
        for k, f in enumerate(funs):
            if not isinstance(f, FunctionalTensor):
                continue
            torch._sync(f)
            _refuse_metadata_change(f, _who(k, names, kinds))
            if torch._functionalize_has_data_mutation(f.elem):
                mutated.append(k)
                new_values.append(torch._from_functional_tensor(f.elem))
        found["mutated"] = mutated
        return (*new_values, *(_unwrap(o) for o in flat_out))

    return traced


def _unwrap(o):
    if isinstance(o, FunctionalTensor):
        torch._sync(o)
        return torch._from_functional_tensor(o.elem)
    return o


def _who(k: int, names: list[str], kinds: list[str]) -> str:
    return f"{kinds[k]} {names[k]!r}" if k < len(names) else f"{kinds[k]} {k - len(names)}"


def _refuse_metadata_change(f: FunctionalTensor, who: str) -> None:
    if torch._functionalize_has_metadata_mutation(f.elem) or torch._functionalize_was_storage_changed(f.elem):
        raise UnsupportedMutationError(
            f"aotgrad.aot_export_module: the program changes the metadata or storage of {who} (an in-place "
            "view op such as t_() or unsqueeze_(), or set_()); an exported graph returns new values only. "
            "Use out-of-place ops.")


def _signature(gm: torch.fx.GraphModule, leaves: list, names: list[str], kinds: list[str], in_spec,
               found: dict) -> dict[str, Any]:
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    outputs = list(gm.graph.output_node().args[0])
    mutated = found["mutated"]
    new_values, user_outputs = outputs[:len(mutated)], outputs[len(mutated):]

    def inputs_of(kind):
        return {placeholders[k]: names[k] for k in range(len(names)) if kinds[k] == kind}

    def mutations_of(kind):
        return {node.name: (names[k] if k < len(names) else placeholders[k])
                for k, node in zip(mutated, new_values) if kinds[k] == kind}

    return {
        "parameters": [n for n, k in zip(names, kinds) if k == "parameter"],
        "buffers": [n for n, k in zip(names, kinds) if k == "buffer"],
        "user_inputs": [p for p, k in zip(placeholders, kinds) if k == "user input"],
        "user_outputs": [getattr(o, "name", o) for o in user_outputs],
        "inputs_to_parameters": inputs_of("parameter"),
        "inputs_to_buffers": inputs_of("buffer"),
        "buffers_to_mutate": mutations_of("buffer"),
        "parameters_to_mutate": mutations_of("parameter"),
        "user_inputs_to_mutate": mutations_of("user input"),
        "in_spec": in_spec,
        "out_spec": found["out_spec"],
        "backward_signature": None,
    }
