"""The OpInfo sweep's raw torch errors, now aotgrad's named refusals (each was a torch RuntimeError
through `aot_function(f, nop)`; upstream fails on the same ops with its own internal errors).
Each case checks eager first: the program itself is fine there."""

from __future__ import annotations

import pytest
import torch

import aotgrad


def test_a_sparse_input_is_refused_by_name():
    """OpInfo `sparse.sampled_addmm`, `sparse.mm.reduce`: the call's cache key read the strides of
    a CSR tensor ("Sparse CSR tensors do not have strides")."""
    def f(a, b):
        return a.to_dense() @ b

    a = torch.eye(3).to_sparse_csr()
    b = torch.randn(3, 2)
    torch.testing.assert_close(f(a, b), b)
    with pytest.raises(aotgrad.UnsupportedInputError, match="input 0 has layout torch.sparse_csr"):
        aotgrad.aot_function(f, aotgrad.nop)(a, b)


def test_an_op_reading_a_tensor_arguments_values_is_refused_by_name():
    """OpInfo `tensor_split` with its indices as a tensor: its kernel reads them ("its data is not
    allocated yet" on the trace's placeholders)."""
    def f(x, idx):
        return [t.sin() for t in torch.tensor_split(x, idx)]

    x, idx = torch.randn(7), torch.tensor([2, 5])
    assert [t.shape[0] for t in f(x, idx)] == [2, 3, 2]
    with pytest.raises(aotgrad.DataDependentError, match="reads the values of a tensor argument"):
        aotgrad.aot_function(f, aotgrad.nop)(x, idx)


def test_a_sparse_output_requiring_grad_is_refused_and_runs_without_grad():
    """OpInfo `to_sparse`: the sparse output's gradient reached the compiled backward, which failed
    in torch ("unsupported memory format option Contiguous"). Without grad it runs as eager."""
    def f(x):
        return (x * 2).to_sparse()

    x = torch.randn(3, 3, requires_grad=True)
    expected = f(x)
    assert expected.layout is torch.sparse_coo and expected.requires_grad
    compiled = aotgrad.aot_function(f, aotgrad.nop)
    with pytest.raises(aotgrad.UnsupportedOutputError, match="output 0 is a torch.sparse_coo tensor that requires grad"):
        compiled(x)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got.to_dense(), f(x).to_dense())
