"""The caller's thread-local state that decides what a program computes: autocast.

Autocast sits above autograd in the dispatcher, so a trace made under it records its casts as
ordinary `_to_copy` nodes, and a region the program enters with `torch.autocast(enabled=False)`
records none. The graph then holds every cast eager would make *for the state it was traced
under*. Three consequences, each handled here:

- the state is part of the signature (`autocast_key`): a call under another state compiles again;
- a compiled graph must run with autocast off (`no_autocast`), or a graph that runs aten ops
  (the `nop` compiler) would be cast a second time, ignoring the program's own disabled regions;
- eager's backward is cast by the autocast state in force when `.backward()` runs, not the
  forward's. aotgrad traces the backward with autocast off (what PyTorch recommends: backward
  outside the autocast region); a backward that does run under autocast is re-traced from the
  backward graph under that state (`retrace_under_autocast`), which inserts the casts eager's
  backward formulas get from the same ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

# The device types autocast has a state for; the privateuse1 backend's name is added when set.
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu")

any_autocast = torch._C._is_any_autocast_enabled
no_autocast = torch._C._DisableAutocast


def _device_types() -> tuple[str, ...]:
    extra = torch._C._get_privateuse1_backend_name()
    return tuple(dict.fromkeys((*_DEVICE_TYPES, extra)))


def autocast_key() -> tuple:
    """What of autocast's state changes a trace: per enabled device type, its cast dtype.
    Empty when autocast is off (one C call: the common case costs nothing more)."""
    if not any_autocast():
        return ()
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in _device_types() if _enabled(d)
    )


def _enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type this build does not know
        return False


def set_autocast(key: tuple):
    """A context manager that puts autocast in the state `key` (from `autocast_key`) for every
    device type it names, and turns it off for the others."""
    return _AutocastState(key)


class _AutocastState:
    def __init__(self, key: tuple):
        self.key = dict(key)

    def __enter__(self):
        self._old = [(d, _enabled(d), torch.get_autocast_dtype(d)) for d in _device_types() if _known(d)]
        self._cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        for d, _, _ in self._old:
            torch.set_autocast_enabled(d, d in self.key)
            if d in self.key:
                torch.set_autocast_dtype(d, self.key[d])

    def __exit__(self, *exc: Any) -> None:
        for d, enabled, dtype in self._old:
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(self._cache)


def _known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
        return True
    except RuntimeError:
        return False


def retrace_under_autocast(gm: torch.fx.GraphModule, key: tuple, example_inputs: Sequence[Any],
                           decompositions: dict | None = None) -> torch.fx.GraphModule:
    """`gm` (a backward graph traced with autocast off) traced again under autocast state `key`:
    the casts autocast makes to its ops become nodes, as they are for eager's backward formulas,
    which call the same ops. Each value is then cast back to the dtype it has in `gm`, as eager's
    autograd engine casts a gradient to the dtype of the forward value it is for: where the forward
    ran an op in float32 below autocast (a disabled region, SDPA's math path on CPU), autocast
    makes its backward matmul bfloat16, and the next formula (`_softmax_backward_data`) must get
    float32 again. `decompositions`: the table the graph was captured with, for the casts the
    re-trace adds (Inductor's lowers `_to_copy` only through its decomposition)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return _CastBack(gm).run(*args)

    inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with set_autocast(key):
        return make_fx(run, decomposition_table=decompositions, tracing_mode="fake")(*inputs)


class _CastBack(torch.fx.Interpreter):
    """Runs a graph, casting each floating-point tensor result back to its node's recorded dtype."""

    def run_node(self, n: torch.fx.Node) -> Any:
        return _cast_like(super().run_node(n), n.meta.get("val"))


def _cast_like(out: Any, recorded: Any) -> Any:
    if isinstance(out, torch.Tensor) and isinstance(recorded, torch.Tensor):
        if out.dtype != recorded.dtype and out.is_floating_point() and recorded.is_floating_point():
            return out.to(recorded.dtype)
        return out
    if isinstance(out, (tuple, list)) and isinstance(recorded, (tuple, list)) and len(out) == len(recorded):
        return type(out)(_cast_like(o, r) for o, r in zip(out, recorded))
    return out
