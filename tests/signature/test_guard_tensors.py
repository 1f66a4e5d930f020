"""The generated guard's tensor metadata as one C++ check (guard_tensors.py), against eager: a call
whose tensors differ in what it checks recompiles, a call it rejects for stricter reasons (dispatch
keys) still runs the right entry, and without the C++ check the Python conditions do the same."""

from __future__ import annotations

import pytest
import torch
from helpers import counting_compiler
from torch.testing._internal.two_tensor import TwoTensor

from aotgrad import aot_function, nop
from aotgrad.signature import guard_tensors


def _f(x):
    return x.sin() * 2


def _two(a: torch.Tensor) -> TwoTensor:
    return TwoTensor(a.clone(), a.clone() * 3)


def _check(out, ref):
    assert type(out) is type(ref)
    if isinstance(ref, TwoTensor):
        torch.testing.assert_close(out.a, ref.a)
        torch.testing.assert_close(out.b, ref.b)
    else:
        torch.testing.assert_close(out, ref)
    assert out.requires_grad == ref.requires_grad


def _variants(make):
    """Arguments that differ from the first in one thing the metadata check covers."""
    base = torch.randn(3, 4)
    return [
        make(base),
        make(base.double()),  # dtype
        make(torch.randn(4, 3)),  # shape
        make(torch.randn(4, 3).t()),  # strides
        make(base).requires_grad_(),  # requires_grad
    ]


@pytest.mark.parametrize("make", [lambda t: t.clone(), _two], ids=["plain", "TwoTensor"])
@pytest.mark.parametrize("python_conditions", [False, True], ids=["tensor_check", "python"])
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_each_metadata_change_recompiles(make, python_conditions, grad_mode, monkeypatch):
    if python_conditions:
        monkeypatch.setattr(guard_tensors, "tensor_check", lambda tensors: None)
    compiler = counting_compiler()
    f = aot_function(_f, compiler)
    variants = _variants(make)
    with torch.set_grad_enabled(grad_mode):
        _compare_variants(f, variants, python_conditions)
    assert len(f.cache) == len(variants)


def _compare_variants(f, variants, python_conditions):
    for k, x in enumerate(variants):
        _check(f(x), _f(x))
        _check(f(x), _f(x))  # the fast path, now that this signature is compiled
        guard, _ = f.fast[0]
        assert guard((x,))
        assert ("_tensor_check(" in guard.__aotgrad_source__) is not python_conditions
        assert not any(g((y,)) for g, _ in f.fast for y in variants[k + 1:])


def test_inner_tensor_metadata_is_checked():
    """A TwoTensor whose inner tensor differs only in requires_grad (outer one alike) recompiles."""
    f = aot_function(_f, counting_compiler())
    x = _two(torch.randn(3))
    _check(f(x), _f(x))
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    y = TwoTensor(a, b)  # inner tensors requiring grad (the outer one follows)
    z = TwoTensor(a.detach(), b.detach()).requires_grad_()
    for arg in (y, z):
        assert not f.fast[-1][0]((arg,))
        _check(f(arg), _f(arg))
    assert len(f.cache) == 3


def test_stricter_dispatch_keys_fall_back_to_the_signature():
    """A conjugate-bit view has other dispatch keys but the same signature: the guard rejects it,
    the call finds its entry by signature (no recompile) and gives eager's result."""
    compiler = counting_compiler()
    f = aot_function(_f, compiler)
    x = torch.randn(3, dtype=torch.complex64)
    _check(f(x), _f(x))
    y = torch.randn(3, dtype=torch.complex64).conj()
    assert y.is_conj() and not f.fast[0][0]((y,))
    _check(f(y), _f(y))
    assert len(compiler.calls) == 1


def test_symbolic_sizes_keep_python_conditions():
    from aotgrad.dynamic import shapes as dynamic_shapes

    (fake,) = dynamic_shapes.symbolic_fakes([torch.randn(3)])
    assert isinstance(fake.shape[0], torch.SymInt)
    assert guard_tensors.tensor_check([fake]) is None
    assert guard_tensors.tensor_check([torch.randn(3)]) is not None


def test_the_check_holds_no_tensor():
    """The guard outlives calls: it must not keep the caller's tensors alive."""
    import gc
    import weakref

    x = _two(torch.randn(3))
    refs = [weakref.ref(t) for t in (x, x.a, x.b)]
    f = aot_function(_f, nop)
    _check(f(x), _f(x))
    assert "_tensor_check(" in f.fast[0][0].__aotgrad_source__
    del x
    gc.collect()
    assert all(r() is None for r in refs)
