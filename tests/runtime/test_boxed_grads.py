"""The backward takes its gradients as one list (torch 2.13's `boxed_grads_call`) and lets go of
them: a language model split by a graph break before its loss (transformers' GPT-2 is) gets its
logits gradient as the model graph's incoming gradient, a whole logits buffer, which was alive
through that graph's whole backward. GPT-2 at the GPU suite's `--mid` size on CPU: peak 181 MiB
against upstream Inductor's 136 before, 132 after (issue 41)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from helpers import assert_same_results

from aotgrad.runtime.runner import _ENGINE_BOXES

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)

from gpu_suite import activation_peak  # noqa: E402

VOCAB = 4096


class _SplitLanguageModel(torch.nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, tokens):
        logits = self.head(self.embed(tokens))
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _run(model, backend, tokens):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    compiled(tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, activation_peak(torch.device("cpu"), lambda: compiled(tokens).backward())


@pytest.mark.skipif(not _ENGINE_BOXES, reason="torch < 2.13 has no boxed_grads_call: the gradients stay held")
def test_the_incoming_logits_gradient_is_freed_during_the_backward():
    torch.manual_seed(0)
    model, tokens = _SplitLanguageModel(), torch.randint(0, VOCAB, (2, 128))
    ref = copy.deepcopy(model)
    ref(tokens).backward()
    grads, peak = _run(model, "aotgrad", tokens)
    _, upstream = _run(copy.deepcopy(ref), "inductor", tokens)
    assert_same_results(grads, {n: p.grad for n, p in ref.named_parameters()}, exact=False)
    assert peak <= upstream, (peak, upstream)


def test_gradients_given_twice_and_missing_ones_still_match_eager():
    """Unboxed and boxed alike: a graph with two outputs, one without a gradient, backward twice."""
    def f(x, w):
        y = x @ w
        return y.sin(), y.cos()

    x, w = torch.randn(4, 5), torch.randn(5, 3, requires_grad=True)
    ref_w = w.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotgrad")
    for call, weight in ((compiled, w), (f, ref_w)):
        a, _ = call(x, weight)
        a.sum().backward(retain_graph=True)
        a.pow(2).sum().backward()
    assert_same_results(w.grad, ref_w.grad, exact=False)
