"""What one capture trace carries: the forward's facts (`_Forward`), the node recorder, and node tags.

Shared by trace/capture.py and the capture_* stages it drives, so none of them imports the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import get_proxy_slot

from ..plan import FwOutput
from . import analysis
from .tracer import LeanTracer

INPUT_CLONE = "aotgrad_input_clone"
BACKWARD_MUTATION = "aotgrad_backward_mutation"


class NeedsSyntheticBase(Exception):
    """Raised inside capture when inputs sharing a storage were mutated: retrace with a merged base."""

    def __init__(self, groups):
        super().__init__(groups)
        self.groups = groups


class NeedsTraining(Exception):
    """Raised inside an inference capture (the call was made under no_grad) when the program turned
    grad mode on and computed an output from an input that requires grad: retrace for training."""


@dataclass
class _Forward:
    """What the traced forward produced, before tangents are added."""

    fw_values: list = field(default_factory=list)  # traced tensors returned by the forward graph
    fw_outputs: list = field(default_factory=list)  # FwOutput per value
    fw_functional: list = field(default_factory=list)  # the functional tensor per value (for autograd)
    out_sources: list = field(default_factory=list)
    out_spec: Any = None
    mutations: list = field(default_factory=list)
    epilogue: list = field(default_factory=list)
    prologue: list = field(default_factory=list)
    relayout: set = field(default_factory=set)  # primals whose functional value changed layout
    restrided: set = field(default_factory=set)  # synthetic bases with a member's metadata mutated
    memory_detached: set = field(default_factory=set)  # primals sharing memory with one detach_()ed


def _recorder():
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)


def _node_of(t: torch.Tensor) -> torch.fx.Node:
    mode = _recorder()
    if isinstance(mode, LeanTracer):
        return mode.node_of(t)
    return get_proxy_slot(t, mode.tracer).proxy.node


def _last_node() -> torch.fx.Node:
    mode = _recorder()
    graph = mode.graph if isinstance(mode, LeanTracer) else mode.tracer.graph
    return next(iter(reversed(graph.nodes)))


def _add_fw_value(fw: _Forward, t, kind, differentiable: bool) -> int:
    fw.fw_values.append(analysis.unwrap(t))
    fw.fw_outputs.append(FwOutput(kind, differentiable))
    fw.fw_functional.append(t)
    return len(fw.fw_values) - 1
