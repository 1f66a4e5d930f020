"""CUDA graphs for aotgrad's Inductor graphs (`mode="reduce-overhead"`, `options={"triton.cudagraphs": True}`).

Inductor records and replays the graphs itself (cudagraph trees) when `compile_fx_inner` is asked to,
and decides per graph whether it can (devices, input mutations, incompatible ops). What it cannot
know comes from here:

- which inputs are static (parameters and buffers, kept at their address instead of copied in on
  every replay): the Dynamo graph's lifted state and the placeholders Dynamo marked static, found
  again among a graph's inputs by identity, since aotgrad's input order is its own;
- for the backward, the saved values that are such inputs returned as they are (a saved weight);
  the other saved values are the forward graph's outputs, which the trees already manage;
- that a backward gets CUDA graphs only if its forward did (one box shared by the pair, as the trees
  need the forward's device and generation before they can record a backward);
- the reason a graph runs without them, said once per reason (Inductor stays silent about graphs
  that are not on a CUDA device, and says nothing of the pair rule).
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

log = logging.getLogger("aotgrad.inductor.cudagraphs")

# Forward meta: positions among the backward's inputs of the saved values that are static inputs of
# the forward (kept by the on-disk cache with the rest of the forward's "aotgrad_" meta).
STATIC_SAVED = "aotgrad_static_saved"

_said: set[str] = set()  # reasons already said, without their node names and stack traces


def wanted() -> bool:
    """Whether the Inductor config in force asks for CUDA graphs."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def static_leaf_positions(gm: torch.fx.GraphModule, num_state: int, example_inputs: Sequence[Any]) -> list[int]:
    """Positions, among the backend's leaves (lifted state, then Dynamo's placeholders), of the
    parameters and buffers: all lifted state, and the placeholders Dynamo marked static (what
    upstream treats as static inputs of the forward)."""
    from torch._dynamo.utils import get_static_address_type

    out = list(range(num_state))
    placeholders = gm.graph.find_nodes(op="placeholder")
    for pos, node in enumerate(placeholders):
        example = example_inputs[pos] if pos < len(example_inputs) else None
        marked = (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
        if marked or get_static_address_type(example) is not None:
            out.append(num_state + pos)
    return out


class StaticInputs:
    """The tensors that are static inputs, recognised by identity (the fakes a compile traces with
    and the real state) or by Dynamo's static-address mark (real parameters at run time)."""

    def __init__(self, tensors: Sequence[Any] = ()):
        from torch.utils.weak import WeakIdKeyDictionary

        self._known = WeakIdKeyDictionary()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._known[t] = True

    def __contains__(self, x: Any) -> bool:
        from torch._dynamo.utils import get_static_address_type

        return isinstance(x, torch.Tensor) and (x in self._known or get_static_address_type(x) is not None)

    def indices(self, example_inputs: Sequence[Any]) -> list[int]:
        return [i for i, x in enumerate(example_inputs) if x in self]


@dataclass
class Pair:
    """What a forward shares with its backward: whether CUDA graphs are on (the forward's compile
    may turn the box off) and the device the forward's graphs record on."""

    cudagraphs: Any = None  # a BoxedBool once the forward is compiled
    device: Any = field(default=None)

    def __post_init__(self):
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex

        if self.device is None:
            self.device = BoxedDeviceIndex(None)


_PAIR_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def link(*modules: torch.fx.GraphModule, pair: Pair | None = None) -> Pair:
    """Make `modules` (a forward and its backward) share one `Pair`."""
    pair = pair or Pair()
    for m in modules:
        _PAIR_OF[m] = pair
    return pair


def pair_of(gm: Any) -> Pair | None:
    try:
        return _PAIR_OF.get(gm)
    except TypeError:  # not weak-referenceable
        return None


def forward_kwargs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], static: StaticInputs | None,
                   *, is_inference: bool) -> dict:
    """`compile_fx_inner`'s CUDA-graph arguments for a forward or inference graph."""
    from torch._inductor.utils import BoxedBool

    pair = (None if is_inference else pair_of(gm)) or Pair()
    if not is_inference:
        link(gm, pair=pair)
    pair.cudagraphs = BoxedBool(wanted())
    if pair.cudagraphs.value and _in_differentiable_backward():
        # a differentiable backward's graphs, which the trees would record as a new forward in the
        # middle of the backward they run
        BoxedBool.disable(pair.cudagraphs)
        say("inference" if is_inference else "forward", "a graph that a backward with create_graph=True runs")
    n = len(gm.graph.find_nodes(op="placeholder"))
    idxs = []  # only with CUDA graphs: elsewhere Inductor would skip the alignment check of these inputs
    if pair.cudagraphs.value and static is not None and len(example_inputs) == n:
        idxs = static.indices(example_inputs)
    return {"cudagraphs": pair.cudagraphs, "static_input_idxs": idxs, "boxed_forward_device_index": pair.device}


def _in_differentiable_backward() -> bool:
    """A backward with create_graph=True is running (autograd runs a backward without it under no_grad)."""
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


def static_saved(fw: torch.fx.GraphModule, num_fw_outputs: int | None, static_idxs: Sequence[int]) -> list[int]:
    """Which saved values the forward returns as one of its static inputs (read before Inductor's
    passes rewrite the forward): at those positions the backward's inputs are static too."""
    if num_fw_outputs is None or not static_idxs:
        return []
    from ..trace.analysis import is_view_op

    placeholders = {n: i for i, n in enumerate(fw.graph.find_nodes(op="placeholder"))}
    static = set(static_idxs)

    def source(node):  # a view of an input lives where the input does (a saved `weight.t()`)
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args and (
                isinstance(node.target, torch._ops.OpOverload) and is_view_op(node.target)):
            node = node.args[0]
        return node

    saved = list(fw.graph.output_node().args[0])[num_fw_outputs:]
    return [j for j, node in enumerate(saved) if placeholders.get(source(node)) in static]


def backward_kwargs(bw: torch.fx.GraphModule, fw: Any) -> dict:
    """`compile_fx_inner`'s CUDA-graph arguments for a backward: its forward's box (off where the
    forward's graphs are not wrapped, or no forward is known), its saved static inputs as static."""
    from torch._inductor.utils import BoxedBool

    pair = pair_of(bw)
    if pair is None or pair.cudagraphs is None or (pair.cudagraphs.value and pair.device.value is None):
        # no forward known, or Inductor did not wrap it (a graph without ops): the trees would have
        # no device or generation to record this backward under
        if wanted():
            log.debug("aotgrad: a backward whose forward has no CUDA graphs runs without them")
        return {"cudagraphs": BoxedBool(False), "static_input_idxs": [], "boxed_forward_device_index": None}
    saved = []
    if pair.cudagraphs.value:
        saved = (getattr(fw, "meta", None) or {}).get(STATIC_SAVED) or []
    return {"cudagraphs": pair.cudagraphs, "static_input_idxs": list(saved), "boxed_forward_device_index": pair.device}


def report(kind: str, requested: bool, compiled: Any, kwargs: dict) -> None:
    """Say once why a graph that asked for CUDA graphs runs without them (Inductor turned its box
    off while compiling). `requested`: the box was on when the graph went to Inductor."""
    box = kwargs.get("cudagraphs")
    if not requested or box is None or box.value:
        return
    devices = sorted(getattr(compiled, "device_types", None) or ())
    if devices and "cuda" not in devices:  # Inductor's reason for these reads "multiple devices: "
        say(kind, f"{' and '.join(devices)} tensors (CUDA graphs record CUDA work only)")
        return
    reason = getattr(compiled, "disabled_cudagraphs_reason", None)
    info = getattr(compiled, "cudagraph_info", None)
    if not reason and info is not None and info.cudagraph_fail_reasons:
        reason = ", ".join(info.cudagraph_fail_reasons)
    if reason:
        say(kind, reason, said_by_inductor="cuda" in devices)
    elif getattr(compiled, "partition_maps", None) == []:  # Inductor turns these off without a word
        say(kind, "no CUDA kernels to record (the graph has no partition for CUDA graphs)")
    else:
        say(kind, "Inductor turned them off")


def say(kind: str, reason: str, *, said_by_inductor: bool = False) -> None:
    """Log `reason` at WARNING the first time it comes up (DEBUG where Inductor logged it already),
    with the line of the program it names, not its whole stack trace."""
    head, _, trace = reason.strip().partition(". Found from")
    first = (head.splitlines() or [""])[0].removeprefix("skipping cudagraphs due to ").rstrip(". ")
    key = re.sub(r"\s*\(.*$", "", first)  # without the node name or count: one line per kind of reason
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    where = f" ({frames[-1]})" if frames else ""
    level = logging.DEBUG if said_by_inductor or key in _said else logging.WARNING
    _said.add(key)
    log.log(level, "aotgrad: the %s graph runs without CUDA graphs: %s%s", kind, first, where)
