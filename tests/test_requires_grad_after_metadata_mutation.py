"""An input whose shape the program changes in place (`t_()`) and then marks `requires_grad_()`:
eager's gradient has the new shape, the compiled function's autograd input the old one. Found by
the fuzzer's closure mode (seed 2, program 906); refused by name instead of autograd's shape error."""

from __future__ import annotations

import pytest
import torch

from aotgrad import UnsupportedMutationError, aot_function, nop


def test_requires_grad_after_transposing_an_input_in_place_is_refused():
    def f(a):
        a.t_()
        a.requires_grad_()
        return a * 2

    with pytest.raises(UnsupportedMutationError, match=r"input 0 in place .*requires_grad_\(\)"):
        aot_function(f, nop)(torch.randn(2, 4))


def test_requires_grad_after_a_same_shape_metadata_change_still_compiles():
    def f(a):
        a.unsqueeze_(0).squeeze_(0)
        a.requires_grad_()
        return a * 2

    x = torch.randn(3)
    y = x.clone()
    out, ref = aot_function(f, nop)(x), f(y)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
