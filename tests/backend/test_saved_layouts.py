"""Backward graphs made from the compiled one get the saved values' layout Inductor chose.

A backward specialised for outputs without gradient (partition/zero_tangents.py) or re-traced under
autocast is a new graph; Inductor compiled it for the saved values' strides in the joint trace
(contiguous) while its forward returned them channels-last: Inductor's own stride assert failed at
step 0 (transformers' ResNet and ViT in `make test-long`). CPU reproductions, against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        feat = torch.relu(self.bn(self.conv(x)))
        return feat.mean(), feat  # the loss reads the first output only: the second gets no gradient


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "backward_under_autocast"])
def test_backward_without_some_gradients_reads_channels_last_saved_values(autocast):
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotgrad")
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for _ in range(3):
        loss, _ = compiled(x)
        expected, _ = ref(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss.backward()
            expected.backward()
        torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch._dynamo.reset()


def test_a_saved_input_is_the_callers_tensor_not_a_relaid_copy():
    """Under autocast the min-cut saves the convolution's input `x` (the caller holds it anyway) and
    remakes its bf16 cast in the backward. Inductor's layout optimisation (channels-last for
    convolutions, always on CPU with oneDNN, by a heuristic on GPUs) had returned a float32
    channels-last copy of `x` instead: a second `x` alive until the backward, for ResNet-50 at
    64 x 3 x 224^2 on a GPU 38.5 MB. Saved inputs keep their layout now."""
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotgrad")
    x = torch.randn(2, 3, 16, 16)
    saved: list = []
    for call, keep in ((compiled, True), (compiled, True), (ref, False)):
        def pack(t, keep=keep):
            if keep:
                saved.append(t)
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = call(x)
        loss.backward()
    assert any(t.data_ptr() == x.data_ptr() for t in saved)  # x itself is saved
    copies = [t for t in saved if t.shape == x.shape and t.dtype == x.dtype and t.data_ptr() != x.data_ptr()]
    assert not copies, [t.stride() for t in copies]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=2e-2, atol=2e-2)
