"""aot_export_module: the exported graph, run by hand, does what the module does in eager (outputs,
buffer updates, gradients), and its signature says the same as upstream's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad import aot_export_module


class LinBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x, y):
        out = self.bn(self.lin(x))
        return F.mse_loss(out, y), out.detach()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _state(mod):
    return [t.detach().clone() for t in [*mod.parameters(), *mod.buffers()]]


def _run(gm, sig, mod, args):
    outs = gm(*_state(mod), *args)
    n_mut = len(sig.buffers_to_mutate) + len(sig.parameters_to_mutate) + len(sig.user_inputs_to_mutate)
    n_user = len(sig.user_outputs)
    return outs[:n_mut], outs[n_mut:n_mut + n_user], outs[n_mut + n_user:]


@pytest.mark.parametrize("trace_joint", [False, True])
def test_exported_graph_does_what_the_module_does(trace_joint):
    torch.manual_seed(0)
    mod = LinBN()
    args = _inputs()
    gm, sig = aot_export_module(copy.deepcopy(mod), args, trace_joint=trace_joint,
                                output_loss_index=0 if trace_joint else None)
    new_buffers, user_outs, grads = _run(gm, sig, mod, args)

    ref = copy.deepcopy(mod)
    with torch.enable_grad() if trace_joint else torch.no_grad():
        loss, out = ref(*args)
    for got, expected in zip(user_outs, (loss, out)):
        torch.testing.assert_close(got, expected)
    names = list(sig.buffers_to_mutate.values())
    assert names == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    for got, name in zip(new_buffers, names):
        torch.testing.assert_close(got, ref.get_buffer(name))
    if trace_joint:
        loss.backward()
        assert sig.backward_signature.loss_output == sig.user_outputs[0]
        params = dict(ref.named_parameters())
        assert list(sig.backward_signature.gradients_to_parameters.values()) == list(params)
        for got, name in zip(grads, sig.backward_signature.gradients_to_parameters.values()):
            torch.testing.assert_close(got, params[name].grad)
    else:
        assert sig.backward_signature is None and not grads


@pytest.mark.parametrize("trace_joint", [False, True])
def test_signature_matches_upstreams(trace_joint):
    from torch._functorch.aot_autograd import aot_export_module as upstream_export

    torch.manual_seed(0)
    mod = LinBN()
    args = _inputs()
    kw = {"trace_joint": trace_joint, "output_loss_index": 0 if trace_joint else None}
    gm, sig = aot_export_module(copy.deepcopy(mod), args, **kw)
    up_gm, up_sig = upstream_export(copy.deepcopy(mod), args, **kw)
    for f in ("parameters", "buffers"):
        assert getattr(sig, f) == getattr(up_sig, f)
    for f in ("inputs_to_parameters", "inputs_to_buffers", "buffers_to_mutate", "user_inputs_to_mutate"):
        assert list(getattr(sig, f).values()) == list(getattr(up_sig, f).values()), f
    assert len(sig.user_inputs) == len(up_sig.user_inputs) and sig.out_spec == up_sig.out_spec
    if trace_joint:
        assert list(sig.backward_signature.gradients_to_parameters.values()) == list(
            up_sig.backward_signature.gradients_to_parameters.values())
    state = _state(mod)
    for got, expected in zip(gm(*state, *args), up_gm(*state, *args)):
        torch.testing.assert_close(got, expected)


class Views(nn.Module):
    def forward(self, x, counter):
        counter.add_(1)  # a user input mutated: returned as its new value
        return x.view(-1), (x * 2).t()


def test_user_input_mutation_and_view_outputs_are_expressed_in_the_graph():
    x, counter = torch.randn(2, 3), torch.zeros(())
    gm, sig = aot_export_module(Views(), (x, counter.clone()), trace_joint=False)
    assert list(sig.user_inputs_to_mutate.values()) == [sig.user_inputs[1]]
    new_counter, flat, doubled_t = gm(x, counter)
    torch.testing.assert_close(new_counter, counter + 1)
    torch.testing.assert_close(flat, x.view(-1))
    torch.testing.assert_close(doubled_t, (x * 2).t())
    assert counter.item() == 0  # the graph is functional: the caller applies the mutation


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y.sum(), y


class BufferTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        self.b.t_()
        return x + 1


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)).sum()


@pytest.mark.parametrize(
    "mod, kwargs, words",
    [
        (TwoOutputs(), {"trace_joint": True}, ["output_loss_index"]),
        (TwoOutputs(), {"trace_joint": True, "output_loss_index": 0}, ["output 1", "requires grad", "detach"]),
        (TwoOutputs(), {"trace_joint": True, "output_loss_index": 1}, ["scalar"]),
        (BufferTransposed(), {"trace_joint": False}, ["buffer 'b'", "metadata"]),
        (Tied(), {"trace_joint": True, "output_loss_index": 0}, ["tied"]),
    ],
)
def test_what_an_exported_graph_cannot_express_is_refused_by_name(mod, kwargs, words):
    with pytest.raises(aotgrad.AotgradError) as info:
        aot_export_module(mod, (torch.randn(2, 3),), **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


class WithKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, xs, *, scale):
        return self.lin(xs[0] + xs[1]) * scale


def test_nested_and_keyword_user_inputs_are_user_inputs():
    """Every flat leaf after the parameters is a user input (pytrees and keyword arguments too)."""
    torch.manual_seed(0)
    mod = WithKeyword()
    xs, scale = (torch.randn(2, 3), torch.randn(2, 3)), torch.randn(())
    gm, sig = aot_export_module(mod, (xs,), kwargs={"scale": scale}, trace_joint=False)
    assert len(sig.user_inputs) == 3 and sig.parameters == ["lin.weight", "lin.bias"]
    (out,) = gm(*_state(mod), *xs, scale)
    with torch.no_grad():
        torch.testing.assert_close(out, mod(xs, scale=scale))
