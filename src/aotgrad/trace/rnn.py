"""LSTMs traced through torch's decomposition, as upstream traces them.

On CPU, eager's `torch._VF.lstm` takes oneDNN's fused kernel (`mkldnn_rnn_layer`) for float32 and
bfloat16 inputs, and that kernel's autograd formula saves a workspace tensor that is undefined in
eval mode. An undefined tensor cannot cross a graph boundary (it arrives in the backward graph as
None, which the backward op refuses), so a graph that records the fused kernel cannot run its
backward. Upstream traces with the Python dispatcher, under which `aten.lstm` runs its Python
decomposition (`torch._decomp.decompositions.lstm_impl`): plain aten ops, differentiable op by op.
aotgrad's trace calls the same decomposition (trace_modes.TraceHooks sends `_VF.lstm` here).
"""

from __future__ import annotations

from typing import Any

import torch


def is_lstm(func: Any) -> bool:
    return func is torch._VF.lstm


def lstm(args: tuple, kwargs: dict):
    """`torch._VF.lstm(...)` by torch's decomposition (the `input` or the packed `data` overload)."""
    from torch._decomp.decompositions import lstm_data_impl, lstm_impl

    packed = len(args) > 1 and isinstance(args[1], torch.Tensor)  # lstm.data: (data, batch_sizes, hx, ...)
    with _without_mkldnn_when_differentiating(args):
        return (lstm_data_impl if packed else lstm_impl)(*args, **kwargs)


class _without_mkldnn_when_differentiating:
    """The decomposition itself still picks the fused kernel when the input does not require grad;
    when a weight or a hidden state does, that again saves an undefined workspace: turn oneDNN off
    for the decomposition then (the plain ops compute the same values)."""

    def __init__(self, args: tuple):
        tensors = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
        self.off = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    def __enter__(self):
        if self.off:
            self.previous = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)

    def __exit__(self, *exc):
        if self.off:
            torch._C._set_mkldnn_enabled(self.previous)


def _flat(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flat(item)
    else:
        yield x
