"""aot_export_module(pre_dispatch=True) (issue 25 item 7): the pre-dispatch aten graph, grad-mode
changes and control flow kept, with upstream's GraphSignature; results against upstream's graph and
eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from functorch.experimental.control_flow import map as control_flow_map
from torch._functorch.aot_autograd import aot_export_module as upstream_export

import aotgrad
from aotgrad import aot_export_module


class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, x, xs):
        y = self.lin(x)
        with torch.no_grad():
            z = y * 2
        with torch.enable_grad():
            w = y + 1
        self.steps.add_(1)
        c = torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (y,))
        m = control_flow_map(lambda a, b: a * b, xs, self.steps)
        return z + w + c, m, x.view(-1)


class MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, counter, *, scale):
        counter.add_(1)
        return (self.lin(x).relu() * scale,)  # upstream's export needs a tuple output


def _state(mod):
    return [t.detach().clone() for t in [*mod.parameters(), *mod.buffers()]]


def _live_targets(gm):
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and (n.users or n.target is torch._C._set_grad_enabled)]
    return [str(n.target) for n in kept]


def _same_signature(sig, up):
    for f in ("parameters", "buffers", "user_inputs", "user_outputs", "inputs_to_parameters", "inputs_to_buffers",
              "buffers_to_mutate", "parameters_to_mutate", "user_inputs_to_mutate", "in_spec", "out_spec",
              "backward_signature"):
        assert getattr(sig, f) == getattr(up, f), f


@pytest.mark.parametrize("positive", [True, False])
def test_pre_dispatch_graph_matches_upstream_and_eager(positive):
    torch.manual_seed(0)
    mod = Program()
    x = torch.randn(2, 4).abs() * (1 if positive else -1)
    args = (x, torch.randn(3, 4))
    gm, sig = aot_export_module(copy.deepcopy(mod), args, trace_joint=False, pre_dispatch=True)
    up_gm, up_sig = upstream_export(copy.deepcopy(mod), args, trace_joint=False, pre_dispatch=True)
    _same_signature(sig, up_sig)
    assert _live_targets(gm) == _live_targets(up_gm)
    targets = _live_targets(gm)
    assert targets.count("<built-in function _set_grad_enabled>") == 4
    assert "cond" in targets and "map_impl" in targets and "aten.linear.default" in targets
    state = _state(mod)
    got = gm(*state, *args)
    for g, e in zip(got, up_gm(*state, *args)):
        torch.testing.assert_close(g, e)
    ref = copy.deepcopy(mod)
    outs = ref(*args)
    torch.testing.assert_close(got[0], ref.steps)
    for g, e in zip(got[1:], outs):
        torch.testing.assert_close(g, e)
    assert torch.is_grad_enabled()  # the graph's grad-mode calls leave grad mode as they found it


def test_user_input_mutation_and_keyword_inputs():
    torch.manual_seed(0)
    mod = MutatesInput()
    args, kwargs = (torch.randn(2, 3), torch.zeros(())), {"scale": torch.tensor(2.0)}
    gm, sig = aot_export_module(copy.deepcopy(mod), args, trace_joint=False, pre_dispatch=True, kwargs=kwargs)
    up_gm, up_sig = upstream_export(copy.deepcopy(mod), args, trace_joint=False, pre_dispatch=True, kwargs=kwargs)
    _same_signature(sig, up_sig)
    state = _state(mod)
    counter = torch.zeros(())
    got = gm(*state, args[0], counter, kwargs["scale"])
    for g, e in zip(got, up_gm(*state, args[0], counter, kwargs["scale"])):
        torch.testing.assert_close(g, e)
    eager_counter = torch.zeros(())
    (expected,) = copy.deepcopy(mod)(args[0], eager_counter, scale=kwargs["scale"])
    torch.testing.assert_close(got[0], eager_counter)
    torch.testing.assert_close(got[1], expected)
    assert counter.item() == 0  # the exported graph is functional: the caller applies the mutation


def test_pre_dispatch_with_dynamic_shapes_serves_other_sizes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            with torch.no_grad():
                scale = x.shape[0] * 1.0
            return self.lin(x) * scale

    mod = Net()
    gm, sig = aot_export_module(mod, (torch.randn(5, 4),), trace_joint=False, pre_dispatch=True,
                                dynamic_shapes=True)
    (x_val,) = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")][2:]
    assert isinstance(x_val.shape[0], torch.SymInt)
    for b in (2, 9):
        x = torch.randn(b, 4)
        (out,) = gm(*_state(mod), x)
        torch.testing.assert_close(out, mod(x))


class Transposes(nn.Module):
    def forward(self, x):
        x.t_()
        return x + 1


@pytest.mark.parametrize(
    "mod, args, kwargs, error, words",
    [
        (Program(), (torch.randn(2, 4), torch.randn(3, 4)), {"trace_joint": True, "output_loss_index": 0},
         aotgrad.UnsupportedInputError, ["pre_dispatch", "trace_joint"]),
        (Transposes(), (torch.randn(2, 3),), {"trace_joint": False}, aotgrad.UnsupportedMutationError,
         ["user input 0", "metadata"]),
        (MutatesInput(), ((t := torch.randn(3, 3)), t[0], ), {"trace_joint": False, "kwargs": {"scale": torch.ones(())}},
         aotgrad.UnsupportedInputError, ["share memory"]),
    ],
)
def test_what_pre_dispatch_export_cannot_express_is_refused(mod, args, kwargs, error, words):
    with pytest.raises(error) as info:
        aot_export_module(mod, args, pre_dispatch=True, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
