"""Regressions found by the differential fuzzer (scripts/fuzz.py), one test per bug.

Each test is a shrunk fuzzer program (seed and program number in its docstring) checked against eager
with `check_against_eager`, or, where aotgrad cannot be faithful, checked to be a clear refusal.
"""

from __future__ import annotations

import os

import pytest
import torch

from aotgrad import aot_function, nop
from aotgrad.errors import UnsupportedAliasingError, UnsupportedMutationError
from aotgrad.testing import check_against_eager


def _leaf(*shape, dtype=torch.float32, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=dtype)
    return t.requires_grad_() if requires_grad else t


def _as_leaf(*shape, **kw):
    """make_inputs: one leaf passed as is."""

    def make():
        r = _leaf(*shape, **kw)
        return (r,), (r,)

    return make


def _as_clone(*shape, **kw):
    """make_inputs: a non-leaf clone of a leaf (so the program may mutate it)."""

    def make():
        r = _leaf(*shape, **kw)
        return (r,), (r.clone(),)

    return make


# --- multi-output views (unbind / split / chunk) --------------------------------------------------


@pytest.mark.parametrize(
    "take",
    [
        lambda v: v.unbind(1)[0].t(),  # seed 11 program 2189
        lambda v: v.split(1, 1)[1].unsqueeze(0),
        lambda v: v.chunk(2, 0)[0].t().unsqueeze(1),
    ],
    ids=["unbind_then_t", "split_then_unsqueeze", "chunk_then_t_then_unsqueeze"],
)
def test_view_of_multi_output_view_refuses_inplace_as_eager(take):
    """A view of an unbind/split/chunk output keeps eager's MULTI_OUTPUT_NODE creation meta, so an
    in-place op on it afterwards raises as in eager. The rebuilt view used to replay as_strided (the
    recorder lost the chain after the multi-output op) and allowed the in-place op."""

    def f(a):
        return (take(a.sin()),)

    check_against_eager(f, _as_leaf(4, 2))


# --- views of .detach()ed inputs -------------------------------------------------------------------


def test_views_of_one_detached_input_share_its_base():
    """Seed 11 program 387: both views' `._base` is the same hidden detached tensor in eager."""

    def f(a):
        d = a.detach()
        v = d.view((-1,))
        s = d.select(0, 0)
        return s.add_(0.5), v

    check_against_eager(f, _as_leaf(2, 2, requires_grad=False))


def test_view_returned_before_its_detached_base():
    """Seed 11 programs 1895, 2644: `._base` of the first output is the second output."""

    def f(a):
        d = a.detach()
        return d.t(), d

    check_against_eager(f, _as_leaf(3, requires_grad=False))
    check_against_eager(f, _as_clone(3))


def test_views_of_twice_detached_mutated_input():
    """Seed 11 program 1506: views of `x.detach().detach()` after the input is mutated."""

    def f(a):
        d = a.detach().detach()
        v2 = d.as_strided((3,), (1,), 0)
        v3 = d.unsqueeze(1)
        a.sub_(-1)
        return v3, v2

    check_against_eager(f, _as_clone(3))


# --- views of intermediates ------------------------------------------------------------------------


def test_no_grad_view_of_intermediate_leaves_unused_input_grad_none():
    """Seed 11 program 232: the only view of `a.sin()` is taken under no_grad, so eager's grad of `a`
    is None. The intermediate base was a differentiable output of the compiled Function, which gave
    `a` a zero grad instead."""

    def f(a, b):
        v0 = a.sin()
        with torch.no_grad():
            v2 = v0.t()
        return b + b, v2

    def make():
        a, b = _leaf(2, seed=1), _leaf(3, 4, seed=2)
        return (a, b), (a, b)

    check_against_eager(f, make)


def test_no_grad_view_of_intermediate_after_input_metadata_mutation():
    """Seed 11 program 1042: eager never differentiates through `v0`'s saved input (which `t_()`
    changed); tracing a backward through it crashed."""

    def f(a):
        v0 = a * a
        a.t_()
        v1 = torch.add(v0, v0, alpha=2)
        with torch.no_grad():
            v3 = v1.squeeze()
        return (v3,)

    check_against_eager(f, _as_clone(2, 3))


def test_view_of_intermediate_detached_in_place_is_refused():
    """Seed 11 programs 856, 1353, 2504: eager's view keeps its autograd history after its base is
    `detach_()`ed; a view rebuilt from the detached base cannot, so aotgrad refuses."""

    def f(a):
        v0 = a - 1
        v2 = v0.as_strided((3,), (1,), 2)
        v0.detach_()
        return (v2,)

    (r,), (x,) = _as_leaf(3, 2)()
    f(x)  # fine in eager
    with pytest.raises(UnsupportedAliasingError, match="output 0 is a view of an intermediate"):
        aot_function(f, nop)(x)


# --- metadata mutations of aliased tensors, writes through views of overlapping views --------------


@pytest.mark.parametrize(
    "body, shape",
    [
        ("v = a.view((-1,)); a.t_(); v.add_(1.5); return v", (2, 4)),  # seed 11 program 172
        ("v = a[:, :, 0]; v.unsqueeze_(1); a.add_(-1); return v - a", (3, 2, 2)),  # seed 11 program 974
        ("v = a[::2]; v.squeeze_(0); a.add_(a); return v.tanh()", (2,)),  # seed 11 program 1621
    ],
    ids=["base_t_then_write_view", "view_unsqueeze_then_write_base", "view_squeeze_then_write_base"],
)
def test_metadata_mutation_of_aliased_tensor_is_refused_clearly(body, shape):
    """Functionalization cannot follow views of a tensor whose metadata changed in place (the trace
    crashed: invalid gradient shapes, impossible views); the refusal names the op and the input."""
    f = _function(body)
    x = _leaf(*shape)
    f(x.clone())  # fine in eager
    # Refused at the trace failure, or earlier at the write into the base of a view restrided in place.
    with pytest.raises(UnsupportedMutationError, match=r"calls aten\.\w+_\.\w+ on (a view of )?input 0|restrided in place by"):
        aot_function(f, nop)(x.clone())


@pytest.mark.parametrize(
    "body, make",
    [
        # seed 11 program 241: as_strided with a zero stride, then a write through one of its items
        ("v = a.as_strided((1, 3), (2, 0), 0); v.unbind(1)[1].add_(1); return a", lambda: _leaf(2, 2, requires_grad=False)),
        # seed 11 program 2339: the input itself is expanded; a select of it is written
        ("a.select(0, 2).fill_(3); return a", lambda: _leaf(2, 2, 3, requires_grad=False).expand((3, 2, 2, 3))),
    ],
    ids=["view_of_zero_stride_as_strided", "select_of_expanded_input"],
)
def test_write_through_view_of_overlapping_view_is_refused(body, make):
    """Eager writes the elements once; the functional graph scatters back into the overlapping view and
    crashed at run time ("more than one element of the written-to tensor refers to a single memory
    location")."""
    f = _function(body)
    f(make())  # fine in eager
    with pytest.raises(UnsupportedMutationError, match="whose elements overlap in memory"):
        aot_function(f, nop)(make())


def _matches_eager(f, make_inputs):
    compiled = aot_function(f, nop)
    for _ in range(2):  # the second call takes the cached fast path
        check_against_eager(f, make_inputs, compiled=compiled)


def _function(body: str):
    ns: dict = {"torch": torch}
    exec("def f(a):\n    " + body.replace("; ", "\n    "), ns)
    return ns["f"]


# --- seed 3 -------------------------------------------------------------------------------------------


def test_multi_output_view_rebuilt_with_as_strided_refuses_inplace_as_eager():
    """Seed 3 programs 298, 1465: after a metadata mutation of the input the chunk/split output is
    rebuilt with as_strided; it must still carry MULTI_OUTPUT_NODE so that add_() on it fails as in
    eager."""

    def f(a):
        a.squeeze_(0)
        return (a.chunk(2, 0)[0],)

    check_against_eager(f, _as_clone(1, 1))

    def g(a, b):
        b.squeeze_()
        return (a.split(2, 1)[0],)

    def make():
        r = _leaf(2, 2)
        c = r.clone()
        return (r,), (c, c)

    check_against_eager(g, make)


def test_metadata_mutation_of_view_input_after_its_base_got_grad():
    """Seed 3 program 2137: the epilogue's copy_ gives the synthetic base a grad_fn; the grad-mode
    as_strided_ on the view input then needs the view's refreshed grad_fn, as eager's reads had."""

    def f(a0, a1, a2):
        a1.add_(a2)
        v3 = torch.add(a0, a2, alpha=2)
        a0.squeeze_()
        return v3, a1

    def make():
        r0, r1 = _leaf(3, requires_grad=False), _leaf(seed=1)
        c0 = r0.clone()
        return (r0, r1), (c0.view((3,)), c0, r1)

    check_against_eager(f, make)


def test_version_bump_of_input_sharing_storage_with_a_saved_input():
    """Seed 3 program 4196: t_() on a detached alias bumps the version counter shared with another
    input the forward saves; that saved input must be protected from the epilogue's bump."""

    def f(a0, a1):
        v0 = a0.detach()
        v0.t_()
        return (a1 @ a1,)

    def make():
        r = _leaf(3)
        c = r.clone()
        return (r,), (c, c.narrow(0, 1, 2))

    check_against_eager(f, make)


@pytest.mark.parametrize("mutate_after", [False, True], ids=["returned", "mutated_then_used"])
def test_reshape_of_expanded_input_copies_as_eager(mutate_after):
    """Seed 3 programs 432, 1635 (then refused), seed 26 program 1173: the trace sees a dense copy of
    an expand()ed input that requires grad, where reshape is a view; eager's reshape copies. Replaying
    the view crashed; a mul_ of it after a no_grad reshape crashed autograd ("view created in no_grad
    mode"). reshape now decides view-or-copy on the caller's layout."""

    def f(a, b):
        with torch.no_grad():
            v = a.reshape((-1,))
        if mutate_after:
            v.mul_(b)
        return (a[:, :1] - v,)

    def make():
        r = _leaf(2, seed=3)
        return (r,), (r.clone().expand((2, 2)), torch.randn(4, generator=torch.Generator().manual_seed(4)))

    check_against_eager(f, make)


# --- fuzz round 2 (seeds 21-24) ---------------------------------------------------------------------


def test_inplace_on_value_saved_for_backward_is_refused():
    """Seed 23 program 1899: tanh saves its output, which is then clamped in place. Eager's forward
    runs (the caller's leaf is detach_()ed, so the fuzzer never backprops) but its backward would fail;
    aotgrad traces the backward ahead of time and crashed with autograd's version-counter error."""

    def f(a):
        v = a.tanh()
        a.detach_()
        v.unsqueeze(-2).clamp_(0, 1)
        return (a + v,)

    with pytest.raises(UnsupportedMutationError, match="saved for the backward.*output 0 of Tanh"):
        aot_function(f, nop)(_leaf(1, 3))


def test_write_into_expanded_input_that_requires_grad_is_refused():
    """Seed 24 program 756: zero_() under no_grad on an expand()ed input that requires grad. The trace
    sees a dense clone (so the overlap check passed) and the epilogue's copy_ into the caller's
    overlapping tensor crashed at run time."""

    def f(a):
        with torch.no_grad():
            a.zero_()
        return (a.squeeze(3),)

    def make():
        r = _leaf(2, 3, 1)
        return (r,), (r.expand((3, 2, 3, 1)),)

    with pytest.raises(UnsupportedMutationError, match="zero_.*writes into input 0, whose elements overlap"):
        aot_function(f, nop)(*make()[1])


@pytest.mark.parametrize(
    "view", [torch.view_as_real, lambda c: c.real], ids=["view_as_real", "real"]
)
def test_mutated_float_views_of_one_complex_tensor(view):
    """Seeds 21/24 programs 2588/908: two float views of one complex tensor, one mutated. They became
    one synthetic base, their complex `._base`, and the graph's float as_strided views of it ran out of
    bounds ("setStorage ... out of bounds"). Now the base is a float view of the whole storage, which
    shares the caller's version counter."""

    def f(a, b):
        a[:1].add_(-0.25)
        return (a + b,)

    def make():
        c = torch.randn((2, 3), generator=torch.Generator().manual_seed(0), dtype=torch.complex64)
        return (c,), (view(c), view(c))

    check_against_eager(f, make)


@pytest.mark.parametrize(
    "body, shape",
    [
        # seed 23 program 2914: a write through a diagonal taken before t_() on its base
        ("v = a.diagonal(-1, 0, 1); a.t_(); v.mul_(0.5); return (a,)", (2, 3)),
        # seed 22 program 2799: a write through a select taken before squeeze_() on its base
        ("a.add_(a); v = a.select(0, 0); a.squeeze_(); v.zero_(); return (a.clone(),)", (1, 4)),
        # seed 22 program 3541: a read of an expand taken before transpose_() on its base
        ("v = a.expand((2, 2, 2, 4)); a.transpose_(0, 1); return (v * v,)", (2, 2, 4)),
    ],
    ids=["write_after_t_", "write_after_squeeze_", "read_after_transpose_"],
)
def test_use_of_view_taken_before_inplace_metadata_op_is_refused(body, shape):
    """The trace replays view functions (view replay is on), so autograd rebuilt such a view's grad_fn
    (or the CopySlices of a write through it) on the base's *new* layout: silently wrong gradients,
    where eager uses the view's own geometry."""
    f = _function(body)
    f(*_as_clone(*shape)()[1])  # fine in eager
    with pytest.raises(UnsupportedMutationError, match="taken before the in-place aten.*on input 0"):
        aot_function(f, nop)(*_as_clone(*shape)()[1])


def test_view_of_a_view_restrided_in_place_is_rebuilt_with_its_new_layout():
    """Seed 22 program 1283: `v.t_()` on a view, then an output view of `v`. Autograd's view function
    of the output predates the t_(); it was replayed and gave the un-transposed strides."""

    def f(a):
        v = a[:, 2:6:2].mul_(-1)
        v.t_()
        return (v.unsqueeze(2),)

    def make():
        r = _leaf(2, 3, 3, requires_grad=False)
        return (r,), (r.clone().view((2, 9)),)

    check_against_eager(f, make)


def test_detach_then_copy_from_tensor_requiring_grad_gives_none_grad():
    """Seed 24 program 1695: `a.detach_(); a.copy_(b)` makes `a` require grad again (through `b`), so
    capture did not see the detach_ (autograd handles it above the dispatcher) and the epilogue's copy_
    kept `a`'s old history: a zero gradient for `a`'s leaf where eager gives None."""

    def f(a0, a1):
        v = a1.transpose(2, 2)
        a1.detach_()
        a1.copy_(a0[2])
        return (v * a0.view((3, 1)),)

    def make():
        r0, r1 = _leaf(3, 1, 2, seed=1), _leaf(3, seed=2)
        return (r0, r1), (r1, r0.clone())

    check_against_eager(f, make)


@pytest.mark.parametrize(
    "body, shape, make_view",
    [
        # seed 21 program 641: zero strides over a 0-d view at offset 1
        ("return (a.as_strided((3, 1, 1), (0, 0, 2), 1) + -1,)", (2,), lambda c: c.as_strided((), (), 1)),
        # seed 23 program 4338: zero stride over a row at offset 9
        ("v = a.as_strided((3, 1, 1), (0, 3, 1), 11); w = a.clone(); return (torch.add(w - v, w, alpha=2),)",
         (4, 3), lambda c: c.select(0, 3)),
        # seed 25 program 290: an output built by as_strided at the input's own offset
        ("return (a.as_strided((), (), 1),)", (2,), lambda c: c[1]),
    ],
    ids=["zero_strides_0d", "zero_stride_row", "output_alias"],
)
def test_as_strided_offsets_on_views_of_inputs_that_require_grad(body, shape, make_view):
    """as_strided's offset is absolute in the caller's storage, but an input that requires grad is traced
    as a clone at offset 0: the backward (and the forward, once the clone stayed in the graph) read other
    elements. The offset is now rewritten into the clone's coordinates above autograd."""
    f = _function(body)

    def make():
        r = _leaf(*shape)
        return (r,), (make_view(r.clone()),)

    check_against_eager(f, make)


def test_as_strided_outside_an_input_that_requires_grad():
    """Reading elements of the caller's storage outside the input cannot be traced on its clone; it
    was refused, and now reads the graph input itself (the clone is unmutated)."""

    def f(a):
        return (a.as_strided((2,), (1,), 0) * 2,)

    def make():
        r = _leaf(3)
        return (r,), (r.clone()[1:],)

    check_against_eager(f, make)


@pytest.mark.parametrize(
    "body, shape, make_view",
    [
        # seed 23 program 462: contiguous on the caller's layout (eager returns the view), not in the trace
        ("return (a[:, -2:2].diagonal(0, 2, 0).contiguous(),)", (3, 3), lambda c: c.expand((2, 3, 3))),
        # seed 24 program 4666: contiguous in the trace, a zero stride on the caller's layout (eager copies)
        ("return (a[:].contiguous(),)", (1, 4), lambda c: c.as_strided((3,), (0,), 3)),
    ],
    ids=["alias_in_eager", "copy_in_eager"],
)
def test_contiguous_of_view_of_overlapping_input_decides_as_eager(body, shape, make_view):
    """An input that overlaps itself and requires grad is traced as a dense clone, so `.contiguous()`
    of a view of it copied where eager aliased, or aliased where eager copied (`._base` differed)."""
    f = _function(body)

    def make():
        r = _leaf(*shape)
        return (r,), (make_view(r.clone()),)

    check_against_eager(f, make)


def test_write_through_view_restrided_in_place_is_refused():
    """Seed 23 program 3395: a synthetic-base member (a view) is transpose_()d, then written through.
    Autograd's view function of it predates the transpose_, so the traced CopySlices replayed it on
    the base without the transpose: silently wrong gradients."""

    def f(a0, a1):
        a1.transpose_(-1, 0)
        v = a1.add_(-1)
        return (v[:, 1].fill_(1.5),)

    def make():
        c = _leaf(2, 3).clone()
        return (c.diagonal(0, 0, 1), c)

    # Now refused earlier, at the transpose_ of an input that another input views.
    with pytest.raises(UnsupportedMutationError, match="transpose_.* on input 1, which shares memory"):
        aot_function(f, nop)(*make())


def test_metadata_op_under_no_grad_on_caller_view_is_refused():
    """Seed 26 program 237: unsqueeze_() under no_grad on an input that is a view requiring grad. The
    trace sees a clone (not a view), so the existing refusal missed it and autograd's shape check
    crashed in the traced backward."""

    def f(a):
        with torch.no_grad():
            a.unsqueeze_(1)
        return (torch.add(a, a, alpha=2),)

    with pytest.raises(UnsupportedMutationError, match="unsqueeze_.*under no_grad on a leaf or a view"):
        aot_function(f, nop)(_leaf(4, 4, 1).diagonal(-1, 1, 2))


def test_detach_of_value_saved_for_backward_is_refused():
    """Seed 27 program 2318: `a` is saved by a mul, then detach_()ed; eager's backward would fail
    ("saved tensor that has been detached in-place"), aotgrad's traced backward crashed."""

    def f(a):
        v = a[0] * a
        a.detach_()
        return (v.sin(),)

    with pytest.raises(UnsupportedMutationError, match="saved for the backward"):
        aot_function(f, nop)(_leaf(2))


def test_no_grad_dtype_view_of_restrided_intermediate():
    """Seed 34 program 1289: `.real` under no_grad of an intermediate that was squeeze_()d. In eager
    it is an autograd leaf that requires grad; it cannot be rebuilt as a view (as_strided cannot change
    dtype), and returning it from the graph as differentiable crashed the traced backward."""

    def f(a):
        v = a.clone()
        v.squeeze_(0)
        with torch.no_grad():
            r = v.real
        return (r,)

    # Was refused; the recorded view chain (squeeze_ of a 1-element tensor leaves `.real`'s geometry
    # as it was) now rebuilds it exactly.
    check_against_eager(f, _as_leaf(1, dtype=torch.complex64))


def test_as_strided_offset_on_input_view_after_its_data_mutation():
    """seed 41 program 36821: a data mutation replaces the functional value of an input at storage
    offset 1 by a fresh tensor at offset 0; an absolute as_strided offset taken afterwards must be
    shifted onto that value."""

    def make_inputs():
        torch.manual_seed(0)
        r = torch.randn(3)
        return (r,), (r[1:3],)

    def f(x):
        x.mul_(x)
        x.as_strided((1,), (0,), 1).add_(-0.25)
        return x * 2

    check_against_eager(f, make_inputs)


def test_as_strided_offset_on_detached_alias_of_mutated_input():
    """seed 41 program 12163 (and seed 42 programs 9905, 15525, 33825 for the view/alias variants):
    as_strided with an absolute offset on a .detach()ed alias of an input at a non-zero storage
    offset, after the input's data was mutated, crashed at run time (setStorage out of bounds)."""

    def make_inputs():
        torch.manual_seed(0)
        r = torch.randn(4)
        return (r,), (r.select(0, -2),)

    def f(x):
        alias = x.t().detach()
        x.mul_(0.5)
        picked = alias.as_strided((), (), 2)
        y = x.t()
        y.copy_(picked)
        return y

    check_against_eager(f, make_inputs)

    def g(x):
        piece = x.split(1, 0)[0]
        x.mul_(x)
        return x.view(-1) + 2 * piece.as_strided((1, 1), (3, 3), 6)

    def make_rows():
        torch.manual_seed(0)
        r = torch.randn(3, 3)
        return (r,), (r.as_strided((1, 3), (3, 1), 5),)

    check_against_eager(g, make_rows)


def test_view_possible_only_on_the_callers_expanded_layout_is_refused():
    """seed 42 program 23288: view() of a transposed expand()ed input that requires grad is possible
    on the caller's layout but not on the dense copy aotgrad traces; it crashed inside the trace."""
    base = torch.randn(2, 1, 2, requires_grad=True)
    x = base.clone().expand(2, 3, 2)
    compiled = aot_function(lambda t: t.transpose(1, 0).view(3, -1) * 2, nop)
    with pytest.raises(UnsupportedAliasingError, match="view"):
        compiled(x)


# --- session 3: aliased inputs, detach_() of tensors with views, no_grad metadata ops ---------------


def _clone_and_view(view, *shape, seed=0):
    """make_inputs: a non-leaf clone that requires grad, and a view of it, passed as two inputs."""

    def make():
        r = _leaf(*shape, seed=seed)
        c = r.clone()
        return (r,), (c, view(c))

    return make


def test_no_grad_metadata_op_on_non_leaf_input_is_refused():
    """Seed 41 program 38206: eager's t_() under no_grad on an input that requires grad leaves its
    autograd history on the old layout (gradients come back transposed); the graph cannot follow."""

    def f(a):
        v = a + a
        with torch.no_grad():
            a.t_()
        a.unsqueeze_(1)
        return v.squeeze()[:, :1]

    with pytest.raises(UnsupportedMutationError, match=r"both under no_grad and with grad on"):
        aot_function(f, nop)(_as_clone(3, 3)()[1][0])


@pytest.mark.parametrize("op", [lambda t: t.squeeze_(1), lambda t: t.t_()], ids=["squeeze_", "t_"])
def test_metadata_op_on_input_sharing_memory_with_another_is_refused(op):
    """Seeds 41/51 programs 588, 19040 (and the crash 42/28647): an in-place metadata op on an input
    whose memory another input views; eager rebuilds the other's autograd view on the new layout."""

    def f(a, b):
        op(a)
        a.mul_(2)
        return b

    make = _clone_and_view(lambda c: c.t(), 2, 1)
    with pytest.raises(UnsupportedMutationError, match=r"shares memory with another input"):
        aot_function(f, nop)(*make()[1])


def test_detach_in_place_of_tensor_with_views_is_refused():
    """Seeds 41/42 programs 28390, 20481: eager's detach_() leaves views already taken with their
    gradient history; the functional graph rebuilt them from the detached value (no grad)."""

    def f(x, y):
        v = y.detach()
        v.copy_(x)
        piece = v.split(1, 0)[3]
        v.detach_()
        return piece

    with pytest.raises(UnsupportedAliasingError, match=r"aliases input 1, which \(or a .detach\(\) of it, or an input sharing its memory\) the program detach_\(\)es"):
        aot_function(f, nop)(_leaf(4), _leaf(4, seed=1))


def test_inplace_write_into_input_whose_view_is_another_input():
    """Seed 41 program 13849: two inputs sharing memory (a tensor and a reshape of it) are traced as
    views of one base; after a write through one, autograd took the other (not a view in eager) for a
    leaf and refused its in-place op."""

    def f(a, x, b):
        b.add_(x)
        a.add_(-0.25)
        return (x.select(0, 1) * x.reshape(-1)).detach()

    def make():
        r0 = _leaf(2)
        c1 = _leaf(2, 4, requires_grad=False, seed=1)
        return (r0,), (c1, r0, c1.reshape(2, 2, 2))

    check_against_eager(f, make)


def test_no_grad_view_of_input_sharing_memory_then_detach_is_refused():
    """Seed 51 program 10950: a view taken under no_grad of one of two inputs sharing memory, a write
    through it with grad on, then detach_() of the other input: traced apart, autograd raised inside
    the trace; as one base, the detach_() is refused by name."""

    def f(a0, a1, a2):
        with torch.no_grad():
            v0 = a2.t()
        a2.sin_()
        a1.detach_()
        return v0.reshape(-1).detach(), a0

    def make():
        r1 = _leaf(4)
        c1 = r1.clone()
        return (r1,), (_leaf(2, requires_grad=False, seed=2), c1, c1.as_strided((), (), 3))

    with pytest.raises(UnsupportedMutationError, match=r"detach_\(\) of .*shares memory"):
        aot_function(f, nop)(*make()[1])


def test_dtype_view_of_input_whose_alias_is_restrided():
    """Seed 42 program 28647: an output that is a complex->real view of an input (not rebuildable as a
    view chain) was returned from the graph as a plain output, while another input sharing its memory
    was unsqueeze_()d: the epilogue's restride then broke the output's autograd view at run time."""

    def f(a0, a1):
        a1.unsqueeze_(-1)
        return (torch.view_as_real(a0.as_strided((), (), 1)),)

    def make():
        r = _leaf(3, dtype=torch.complex64)
        c0 = r.clone()
        return (r,), (c0, c0.view(-1))

    # Refused at first; the recorded chain (as_strided then view_as_real) now replays exactly.
    check_against_eager(f, make)


def test_stale_view_inside_a_list_argument_is_refused():
    """Seed 62 program 12631: a view taken before transpose_() of its base, used inside torch.cat's
    list argument: the stale-view check only looked at tensor arguments, not at lists of them."""

    def f(a):
        v = a[2:3]
        a.transpose_(1, 0)
        return torch.cat([v, a]).reshape(12)

    with pytest.raises(UnsupportedMutationError, match="cat.* taken before the in-place aten.transpose_"):
        aot_function(f, nop)(_as_clone(3, 3)()[1][0])


def test_metadata_op_on_view_of_0d_intermediate_then_dtype_view():
    """Seed 61 program 13699: t_() of a 0-d intermediate, then view_as_real of it: the output lost its
    ._base (rebuilt as as_strided, which cannot change dtype, so returned as a plain graph output)."""

    def f(a):
        v = a.reshape(6)
        w = v @ v
        w.t_()
        return w, torch.view_as_real(w)

    check_against_eager(f, _as_leaf(2, 3, dtype=torch.complex64, requires_grad=False))


@pytest.mark.parametrize(
    "body",
    [
        lambda a: (a.as_strided((1,), (0,), 2), a.zero_())[0].sub_(1.5),  # seed 62 program 6525
        lambda a: (a.as_strided((), (), 1), a.add_(1))[0].reshape(1).abs(),  # seed 62 program 6545
    ],
    ids=["write_through_it", "read_it"],
)
def test_absolute_as_strided_offset_then_data_mutation_is_refused(body):
    """Seed 62 programs 6525, 6545: an as_strided view with an absolute offset of an input at a
    non-zero storage offset, then a data mutation: functionalization rebuilt the view on a fresh copy
    of the input at offset 0 (crash at run time: setStorage out of bounds)."""

    r = _leaf(3, requires_grad=False)
    with pytest.raises(UnsupportedAliasingError, match="input 0 sits at storage offset 2"):
        aot_function(lambda a: (body(a),), nop)(r[2])


def test_output_as_strided_view_of_input_after_data_mutation_is_refused():
    """Seed 62 program 3844: the as_strided offset of an output view, taken after a data mutation of
    an input at a non-zero storage offset, was replayed on the caller's tensor in the trace's
    coordinates (another element, and the output no longer aliased the input)."""

    def f(a):
        v = a.sub_(a + 1)
        return v.as_strided((1, 1, 1), (3, 0, 2), 3)

    r = _leaf(3, 2, requires_grad=False)
    with pytest.raises(UnsupportedAliasingError, match=r"output 0 \(an as_strided view of input 0\)"):
        aot_function(f, nop)(r[1])


def test_no_grad_squeeze_of_tensor_autograd_differentiates_is_refused():
    """Seed 61 program 13425: squeeze_() under no_grad of an intermediate that a later backward goes
    through: the traced backward failed on a shape mismatch (a crash, not an aotgrad error)."""

    def f(a):
        v0 = a.expand(3)
        with torch.no_grad():
            v1 = v0.expand(1, 3)
            v2 = a * -1
        v3 = v1 * v2
        with torch.no_grad():
            v3.squeeze_(0)
        return v3

    with pytest.raises(UnsupportedMutationError, match="the backward, which aotgrad traces ahead of time"):
        aot_function(f, nop)(_leaf())


def test_stale_view_whose_replay_changes_only_its_rank_is_refused():
    """Seed 61 program 15217: `a[::2]` over a size-1 dimension, then `a.unsqueeze_(2)`: the replayed view
    addresses the same elements with one more dimension, which the stale-view check (comparing only
    dimensions of size > 1) took for the same view; the gradient then broadcast differently."""

    def f(a):
        v0 = a[::2]
        v1 = v0.view(1, 3, 1, 1)
        a.unsqueeze_(2)
        return a - (v0 + v1).transpose(3, -4)

    with pytest.raises(UnsupportedMutationError, match="taken before the in-place aten.unsqueeze_"):
        aot_function(f, nop)(_as_clone(1, 3, 1)()[1][0])


def test_as_strided_of_intermediate_from_expanded_input_is_refused():
    """Seed 62 program 17038: an expand()ed input that requires grad is traced as a dense copy, so an
    intermediate computed from it can have other strides than in eager; as_strided on it read other
    elements."""

    def f(a):
        v2 = a.transpose(1, -1).permute(1, 0).neg()
        return (v2 * v2.detach()).as_strided((2, 1), (1, 2), 3)

    with pytest.raises(UnsupportedAliasingError, match="as_strided on an intermediate while input 0 overlaps"):
        aot_function(f, nop)(_leaf(4).expand(2, 4))


def test_write_through_restrided_view_with_grad_is_refused():
    """Seed 62 program 29080 (and torch alone, measured): under functionalization, a data write through
    a view whose layout an in-place op changed (`v.unsqueeze_(1); v.mul_(w)`) gets gradients wrong
    (here 9x for the broadcast operand); eager is right. Refused by name."""

    def f(a0, a1, a2, a3):
        a0.unsqueeze_(1)
        a0.mul_(a3)
        return a2

    def make():
        c0 = _leaf(3, 3, requires_grad=False)
        r1 = _leaf(1, seed=1)
        return (r1,), (c0.view(9), c0, r1, r1)

    with pytest.raises(UnsupportedMutationError, match="writes through input 0, whose layout an in-place"):
        aot_function(f, nop)(*make()[1])


@pytest.mark.parametrize("write", [lambda v, w: v.fill_(1.5), lambda v, w: v.mul_(w)], ids=["fill_", "mul_"])
def test_write_through_a_view_older_than_a_transpose_of_its_base_is_refused(write):
    """Seed 61 program 24645: after unsqueeze_/transpose_ of an input, a write through an older view.
    First the compiled backward crashed (it recorded a `view` only functionalization's inner layout
    allowed; such views now get a contiguous copy); then `fill_` matched eager, but only because a
    constant fill does not care which element goes where: with `mul_(w)` the values were silently
    wrong. The view's replay on the transposed base is one only fake tensors accept (seed 141 program
    13580), so both are now refused."""

    def f(a1, w):
        a1.unsqueeze_(1)
        v0 = a1.mul_(0.5)
        v1 = v0.reshape((3, 1, 2))
        v0.transpose_(-4, -1)
        write(v1, w)
        return (a1[:, -1:],)

    args = (_leaf(3, 1, 2).clone(), _leaf(3, 1, 2, seed=1))
    with pytest.raises(UnsupportedMutationError, match="view ops that no longer apply to it"):
        aot_function(f, nop)(*args)


def test_fake_tensor_cache_does_not_leak_a_stale_storage_offset():
    """Seed 72 program 14959: after another program traced an input at storage offset 4, torch's
    fake-tensor cache answered `aten.copy` of this program's input with that program's output offset;
    the absolute as_strided offset was then not shifted (silently wrong values). Tracing an input at
    a non-zero storage offset now runs with the fake cache off."""

    from aotgrad.testing import fuzz

    def second(a0):
        v0 = a0.unbind(0)[0]
        a0.reshape((4,)).copy_(v0)
        return a0.as_strided((3, 3), (0, 1), 5).reshape((-1,))

    def make():
        r0 = _leaf(3, 4, requires_grad=False)
        return (r0,), (r0.split(1, 0)[1],)

    assert fuzz.check_program(fuzz.generate(72, 14959)).kind == "refused"  # fills the fake cache
    check_against_eager(second, make)


def test_restrided_dtype_view_of_input_returned():
    """Seed 71 program 1215: `.real` of an input, squeeze_()d, returned: not rebuildable as a view
    chain (as_strided cannot change dtype), it was returned from the autograd.Function as a view of
    the input and autograd refused it at run time."""

    def f(a):
        v = a.real
        v.squeeze_(0)
        return v

    # Refused at first; now rebuilt as `.real` then an as_strided in its own coordinates.
    check_against_eager(f, _as_clone(1, dtype=torch.complex64))


def test_write_into_input_sharing_memory_with_a_restrided_input_is_refused():
    """Seed 71 program 38941: two views of one tensor passed as inputs; unsqueeze_() of one, then a
    write through the other with gradients flowing: the gradient through the restrided one differed."""

    def f(a0, a1):
        a1.unsqueeze_(2)
        a0.add_(2)
        return a1 - a0

    def make():
        r0 = _leaf(3, 1)
        c0 = r0.clone()
        return (r0,), (c0.view(-1), c0.t())

    with pytest.raises(UnsupportedMutationError, match="shares memory with input 1, restrided in place"):
        aot_function(f, nop)(*make()[1])


def test_write_into_base_of_a_view_restrided_in_place_is_refused():
    """Seed 82 program 5098: unsqueeze_() of a view of an input, then a write into the input with
    gradients flowing, then a read of the view: functionalization's autograd rebuilt the view's history
    unlike eager (one gradient element off)."""

    def f(a0, a1):
        v0 = a1.select(1, 1)
        v0.unsqueeze_(-1)
        a1.clamp_(-1, 0.5)
        return torch.add(a0 * -1, v0, alpha=2)

    with pytest.raises(UnsupportedMutationError, match="writes into input 1, which shares memory with a view"):
        aot_function(f, nop)(_leaf(3, requires_grad=False), _as_clone(1, 3, 3)()[1][0])


def test_backward_through_multi_output_view_after_detach_is_refused():
    """Seed 82 program 34737: a view of a chunk() output taken before detach_() of its leaf; the caller
    takes no gradient, so eager's backward never runs, but aotgrad's ahead-of-time backward hit
    autograd's multi-output-view error (a crash, not an aotgrad error)."""

    def f(a0):
        v0 = a0[1:2]
        v2 = v0.chunk(2, 0)[0].as_strided((), (), 1)
        a0.detach_()
        v5 = v0 * v2
        a0.add_(-1)
        return v5

    with pytest.raises(UnsupportedMutationError, match="the backward, which aotgrad traces ahead of time"):
        aot_function(f, nop)(_leaf(2))


def test_reshape_of_expanded_input_that_requires_grad_copies_as_in_eager():
    """Seed 81 program 47220: fake tensors let `view()` merge a stride-0 dimension that real tensors
    cannot, so the reshape of an expand()ed input was taken for a view and rebuilt as one at run time
    (crash). Viewability is now computed with ATen's rule (`analysis.view_possible`)."""

    def make():
        r1 = _leaf(1, 2)
        return (r1,), (r1.clone().expand(2, 1, 2),)

    check_against_eager(lambda a: (a.reshape(4),), make)


def test_view_possible_agrees_with_aten():
    from aotgrad.trace.analysis import view_possible

    for size, stride, shape in [((2, 1, 2), (0, 2, 1), (4,)), ((2, 3), (3, 1), (3, 2)), ((2, 3), (1, 2), (6,)),
                                ((3, 2), (1, 3), (-1,)), ((4, 1), (1, 7), (2, 2)), ((2, 2), (0, 1), (2, 1, 2))]:
        t = torch.empty(64).as_strided(size, stride)
        try:
            t.view(shape)
            expected = True
        except RuntimeError:
            expected = False
        assert view_possible(size, stride, shape) is expected, (size, stride, shape)


def test_dtype_view_of_intermediate_restrided_in_place_stays_a_view():
    """Seed 81 program 39606: view_as_real of a complex intermediate, reshaped, squeeze_()d, returned
    with the intermediate: as_strided cannot change dtype, so it was returned as a plain tensor (not
    a view of output 0 as in eager); the recorded chain plus an as_strided in the real view's own
    coordinates now rebuilds it."""

    def f(a0):
        v2 = (a0 + a0.t()).sum(-1)
        v5 = torch.view_as_real(v2).reshape((2, 1))
        v5.squeeze_()
        return (v2, v5)

    check_against_eager(f, _as_leaf(2, dtype=torch.complex64, requires_grad=False))


def _leaf_at_offset(offset=5, n=10, seed=0):
    """make_inputs: a leaf that requires grad at a non-zero offset of a larger storage (as OpInfo's
    as_strided.partial_views builds it)."""

    def make():
        storage = _leaf(offset + n, requires_grad=False, seed=seed).untyped_storage()
        x = torch.empty(0)
        x.set_(storage, offset, (n,), (1,))
        x.requires_grad_()
        return (x,), (x,)

    return make


@pytest.mark.parametrize("offset", [0, 2, 10])
def test_as_strided_reading_storage_around_a_leaf_input(offset):
    """OpInfo as_strided.partial_views: as_strided with an absolute offset that reaches storage outside
    a leaf input that requires grad (traced as a copy of its own elements) was refused; while the copy
    is unmutated the read now goes to the graph input itself."""
    check_against_eager(lambda x: x.as_strided((2, 2), (1, 2), offset), _leaf_at_offset())
    check_against_eager(lambda x: (x.as_strided((2, 2), (1, 2), offset) * x[:4].view(2, 2)).sum(), _leaf_at_offset())


def test_as_strided_read_around_an_input_then_its_mutation_is_refused():
    def f(x):
        y = x.as_strided((2, 2), (1, 2), 0)
        x.mul_(2)
        return y * 1

    def make():
        r = _leaf(6)
        return (r,), ((r * 1)[1:],)

    with pytest.raises(UnsupportedAliasingError, match="reads storage outside input 0 with as_strided"):
        aot_function(f, nop)(*make()[1])


def test_in_place_metadata_op_on_a_read_around_an_input_is_refused():
    """Seed 102 program 10352 (on the first version of the as_strided read above): t_() of such a
    read went unseen (eager bumps the input's version; aotgrad did not). Only a direct as_strided of
    the input reads around it now, and in-place ops on the result are refused."""

    def f(x):
        v = x.as_strided((2, 1), (0, 1), 0)
        v.t_()
        return v * 1

    with pytest.raises(UnsupportedAliasingError, match="reads the caller's storage outside an input"):
        aot_function(f, nop)(*_leaf_at_offset()()[1])


def test_stale_view_of_a_base_whose_rank_changed_is_refused_without_replay():
    """Seed 101 program 1593: replaying a 0-d view's recorded view ops (split, then view) on a base
    unsqueeze_()d since crashed torch (segfault). A view whose base changed rank is refused as stale
    without replaying."""

    def f(a1, a2):
        v2 = a1.split(2, 0)[1]
        a1.view((3,)).mul_(2)
        a1.unsqueeze_(-2)
        with torch.no_grad():
            v6 = v2.view(())
        return a2 - v6

    def make():
        r1 = _leaf(3, dtype=torch.complex64)
        c1 = r1.clone()
        return (r1,), (c1.view(3), c1)

    with pytest.raises(UnsupportedMutationError, match="taken before the in-place aten.unsqueeze_"):
        aot_function(f, nop)(*make()[1])


def test_as_strided_of_a_detached_input_view_at_a_storage_offset():
    """Seed 122 program 19970: an output rebuilt from a hidden `.detach()` of an input (at storage
    offset 1) replayed its as_strided step with the offset of the input's traced copy (0), reading the
    caller's element 0. Steps replayed from another output now move to the caller's storage offsets."""

    def f(a):
        return (a.detach().as_strided((3,), (0,), 1)[-2:2:2],)

    def make():
        r = _leaf(4)
        return (r,), (r.clone().as_strided((), (), 1),)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, make, compiled=compiled)


def test_real_of_a_view_taken_before_its_base_was_transposed_in_place():
    """Seed 122 program 20366: `.real` of a view taken before transpose_() of its base was rebuilt as
    the replayed view ops then an as_strided to the view's layout; the values were right but the
    as_strided's backward dropped gradients outside the replayed view's elements. It is now the base
    reinterpreted as real numbers, then one as_strided."""

    def f(a):
        v = a.select(1, -2)
        a.transpose_(2, 1)
        return (v.real.squeeze(),)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, _as_clone(2, 2, 4, dtype=torch.complex64), compiled=compiled)


def test_view_of_one_of_two_real_views_of_a_complex_input_keeps_eager_base():
    """Seed 131 program 22166: two `.real` views of one complex tensor (one mutated) reach the graph
    as one flat real tensor over their storage; a returned view of one of them was rebuilt on that
    flat tensor, so its `._base` was not the caller's complex tensor. It is now rebuilt from the
    caller's argument it was taken from."""

    def f(a0, a1):
        v0 = a0[-2:3]
        a1.clamp_(0, 1)
        return (v0, v0)

    def make():
        r = _leaf(4, dtype=torch.complex64, requires_grad=False)
        c = r.clone()
        return (r,), (c.real, c.real)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, make, compiled=compiled)


def test_write_with_grad_into_a_view_taken_before_its_base_was_transposed_in_place_is_refused():
    """Seed 132 program 16645: a write that brings gradients (`v.copy_(w)`, w requires grad) into a
    view of a tensor that did not require grad, taken before t_() of that tensor. Autograd in the
    trace rebuilds the view from the transposed base, eager keeps its elements: the gradient of w was
    transposed. The stale-view check only looked at views that already required grad."""

    def f(a0, a1, a2):
        v0 = a2.transpose(-2, 1)
        a2.t_()
        v0.copy_(a1)
        return (a0,)

    args = (_leaf(1, 1, 1, requires_grad=False), _leaf(1, 2, seed=1), _leaf(2, 2, requires_grad=False, seed=2))
    with pytest.raises(UnsupportedMutationError, match="taken before the in-place aten.t_"):
        aot_function(f, nop)(*args)


def test_use_of_a_view_whose_replay_only_fake_tensors_accept_is_refused():
    """Seed 141 program 13580: a flat view of an input, used after two transpose_()s of the input. The
    stale-view check replays the view's function on the base's new layout; fake tensors accept that
    `view(12)` (a permuted block, stride (1,)) where real tensors refuse it, so the view passed as
    unchanged, and the traced autograd graph gave the gradient in transposed order. Replays are now
    checked on a meta-device tensor too."""

    def f(a):
        v = a.view((12,))
        v.clamp_(0, 1)
        a.transpose_(1, -1)
        a.transpose_(1, 0)
        return (v + v,)

    with pytest.raises(UnsupportedMutationError, match="view ops that no longer apply to it"):
        aot_function(f, nop)(*_as_clone(1, 4, 3)()[1])


def test_imag_of_an_intermediate_view_squeezed_in_place_stays_a_view():
    """Seed 142 program 4252: `.imag` of a view of an intermediate that was squeeze_()d in place was
    returned as a plain graph output (the view function of a view restrided in place replays the
    in-place op, which the chain recorder does not take), so its `._base` was None. It is now rebuilt
    as the intermediate reinterpreted as real numbers, then one as_strided."""

    def f(a):
        v = (a[1] + 1.5).reshape((1,))
        v.squeeze_(0)
        w = v.imag
        return (w.reshape((-1,)), w)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, _as_leaf(2, dtype=torch.complex64, requires_grad=False), compiled=compiled)


def test_real_view_of_an_input_unsqueezed_in_place_is_rebuilt_without_replaying_its_view_ops():
    """Seed 161 program 13178: a split of `.real` of a complex input, returned after `unsqueeze_()` of
    the input. Rebuilding it replayed the view's recorded ops (made for a 1-d base) on the base's new
    2-d layout, and libtorch segfaulted. Recorded view ops are now never replayed on a base of another
    rank; the output is rebuilt as the base reinterpreted as real numbers, then one as_strided."""

    def f(a):
        v = a.real.split(2, 0)[1]
        a.unsqueeze_(0)
        return (v,)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, _as_leaf(3, dtype=torch.complex64, requires_grad=False), compiled=compiled)


def test_view_of_an_input_whose_memory_another_input_detaches_in_place_is_refused():
    """Seed 162 program 12750: input 0 is a view of input 1; the program returns a view of input 0
    (which requires grad) and detach_()es input 1. Eager's view keeps its history; aotgrad rebuilt it
    from input 0 after the epilogue's detach_() and version bump, so autograd rebuilt input 0's history
    from the detached tensor and the gradient was lost (None against eager's). Refused now, as for a
    view of the detached input itself; an output that does not require grad still matches."""

    def f(a0, a1):
        v0 = a0.t()
        v0.unsqueeze_(1)
        a1.detach_()
        return (v0.transpose(-2, 1),)

    def make_inputs():
        r = _leaf(3)
        c = r.clone()
        return (r,), (c.reshape((-1,)), c)

    with pytest.raises(UnsupportedAliasingError, match="an input sharing its memory"):
        aot_function(f, nop)(*make_inputs()[1])

    def no_grad_inputs():
        c = _leaf(3, requires_grad=False)
        return (c,), (c.reshape((-1,)), c)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, no_grad_inputs, compiled=compiled)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("op", ["contiguous", "reshape"])
def test_contiguous_or_reshape_of_a_view_taken_after_a_data_mutation_of_a_non_dense_input_as_in_eager(op, requires_grad):
    """Seed 171 program 32239: input 0 is `x[:, :1]` (strides (2, 1)); the program fill_()s it, then
    returns `a.unsqueeze(2).contiguous()`. Functionalization's value of the mutated input is a fresh
    dense tensor, so the view taken afterwards was contiguous in the trace and contiguous() returned it:
    the output came back as a view of the input (and a later in-place op on it wrote into the input),
    where eager's is a copy. contiguous() and reshape() (here of `x[:, :2]`, which eager cannot flatten
    as a view) now decide on the input's own layout."""

    def f(a):
        a.mul_(1.5)
        v = a.unsqueeze(2)
        return (a.narrow(0, 0, 1), v.contiguous() if op == "contiguous" else v.reshape(-1))

    def make_inputs():
        r = _leaf(3, 4, requires_grad=requires_grad)
        x = r.clone() if requires_grad else r
        return (r,), (x[:, :1] if op == "contiguous" else x[:, :2],)

    compiled = aot_function(f, nop)
    for _ in range(2):
        check_against_eager(f, make_inputs, compiled=compiled)


def test_use_with_grad_of_an_input_view_restrided_in_place_then_written_under_no_grad_is_refused():
    """Seed 181 program 12204: input 0 is a view of input 1 (both require grad); the program takes
    `-a0`, `a0.transpose_(2, 1)`, then `a0.add_(2)` under no_grad, and returns `-a0 + a0`'s broadcast.
    The write makes autograd rebuild a0's history from its view function, which predates the
    transpose_ (the broadcast gradient was summed over the wrong dimension: zero gradients against
    eager's). Refused; without the write the same program matches."""

    def f(a0, a1, write=True):
        v0 = a0.neg()
        a0.transpose_(2, 1)
        if write:
            with torch.no_grad():
                a0.add_(2)
        return (v0 + a0,)

    def make_inputs():
        r = _leaf(1, 2, 1)
        c = r.clone()
        return (r,), (c.view_as(c), c)

    with pytest.raises(UnsupportedMutationError, match="changed in place by"):
        aot_function(f, nop)(*make_inputs()[1])

    def no_write(a0, a1):
        return f(a0, a1, write=False)

    _matches_eager(no_write, make_inputs)


def test_write_with_grad_through_an_absolute_as_strided_view_of_an_input_at_an_offset_is_refused():
    """Seed 181 program 16031: input 0 is `r[-1:]` (storage offset 8) and does not require grad; the
    program writes `a0.as_strided(size, stride, 9).mul_(a1)` with `a1` requiring grad. Autograd's record
    of that write replays the as_strided view in the backward on a fresh copy of the input at offset 0,
    where offset 9 is out of bounds (a crash here; other elements, silently, with a larger input).
    Refused; the same write under no_grad matches."""

    def f(a0, a1, grad=True):
        with torch.set_grad_enabled(grad):
            a0.as_strided((1, 2, 1), (1, 1, 1), 9).mul_(a1)
        return (a0.detach().abs().squeeze(0),)

    def make_inputs():
        r0 = _leaf(3, 2, 2, requires_grad=False)
        r1 = _leaf(2, 1, seed=1)
        return (r0, r1), (r0[-1:], r1)

    with pytest.raises(UnsupportedAliasingError, match="storage offset 8"):
        aot_function(f, nop)(*make_inputs()[1])

    def no_grad_write(a0, a1):
        return f(a0, a1, grad=False)

    _matches_eager(no_grad_write, make_inputs)


@pytest.mark.parametrize("at_offset", [False, True])
def test_views_of_a_detached_real_part_of_an_input_share_their_base_as_in_eager(at_offset):
    """Seed 192 program 9271: the program returns two views of `a.real.detach()` (a complex input).
    In eager both have that detached tensor as `._base`; aotgrad returned them from the graph, right
    values but no `._base`, because rebuilding a detached alias of another dtype was not supported.
    It is now rebuilt once from the input reinterpreted as real numbers. With the input at a storage
    offset and requiring grad (traced as a copy at offset 0) its as_strided offset is converted in
    real-number units (two per complex element)."""

    def f(a):
        v = a.real.detach().reshape((-1,))
        if at_offset:
            return (v[:1].unsqueeze(0), v)
        return (v.as_strided((1, 1), (2, 2), 0).permute(0, 1), v)

    def make_inputs():
        r = _leaf(3, dtype=torch.complex64, requires_grad=at_offset)
        return (r,), ((r.clone()[1:] if at_offset else r[0]),)

    _matches_eager(f, make_inputs)


def test_absolute_as_strided_of_the_real_part_of_an_input_traced_as_a_copy_at_an_offset():
    """Found reviewing the fix above: an as_strided view with an absolute offset of `.real` of a complex
    input at a storage offset that requires grad (traced as a copy at offset 0) had its offset moved
    by the input's offset in complex elements, where the view counts real numbers (two per element):
    here it read `a[1].real` for eager's `a[0].imag`. The offset is now converted in the view's units."""

    def f(a):
        return (a.real.as_strided((1,), (1,), 3) * 2,)

    def make_inputs():
        r = _leaf(5, dtype=torch.complex64)
        return (r,), (r.clone()[1:],)

    _matches_eager(f, make_inputs)


def test_write_with_grad_into_inputs_sharing_memory_without_an_autograd_base_of_their_dtype_is_refused():
    """Seed 191 program 36828: inputs 0 and 1 are two `view_as_real` views of one complex tensor
    (neither requires grad); the program copies a value that requires grad into input 0. In eager both
    inputs then require grad (through their complex base); aotgrad, which gives the graph their shared
    memory as one flat tensor outside autograd, left them as they were. Refused; the same write under
    no_grad matches."""

    def f(a0, a1, a2, grad=True):
        with torch.set_grad_enabled(grad):
            a0.copy_(a2.reshape((1,)))
        return (a0 + a2, a1 * 2)

    def make_inputs():
        c = _leaf(4, dtype=torch.complex64, requires_grad=False)
        w = _leaf(seed=1)
        return (c, w), (torch.view_as_real(c), torch.view_as_real(c), w)

    with pytest.raises(UnsupportedMutationError, match="share memory without one autograd base"):
        aot_function(f, nop)(*make_inputs()[1])

    def no_grad_write(a0, a1, a2):
        return f(a0, a1, a2, grad=False)

    _matches_eager(no_grad_write, make_inputs)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_view_as_real_of_an_input_returned_after_the_input_is_transposed_in_place(requires_grad):
    """Seed 201 program 16988: the program returns `view_as_real(a)` taken before `a.transpose_(1, 0)`.
    Eager's autograd rebuilds the view's history after the version bump by replaying view_as_real on
    the transposed input, so its gradient comes out transposed; aotgrad rebuilt the view by its own
    geometry (the gradient of the elements it holds). Refused when it requires grad; without grad
    the same program matches."""

    def f(a):
        v = torch.view_as_real(a)
        a.transpose_(1, -2)
        return (v,)

    def make_inputs():
        r = _leaf(2, 2, dtype=torch.complex64, requires_grad=requires_grad)
        return (r,), (r.clone(),)

    if requires_grad:
        with pytest.raises(UnsupportedAliasingError, match="replaying the view on the new layout"):
            aot_function(f, nop)(*make_inputs()[1])
    else:
        _matches_eager(f, make_inputs)


def test_unbind_of_a_view_restrided_in_place_is_not_replayed():
    """Seed 201 program 44089 (a segfault): `v0 = a1.view(4, 1); v0.t_()`, an in-place metadata op on
    another input, then `v0.unbind(1)[1].sum()`. Checking whether autograd would rebuild that view
    with other elements replayed its recorded view function, and libtorch crashed replaying a
    multi-output view op taken from a view restrided in place. Such a view function is never
    replayed now; the use is refused as one whose rebuilt view cannot be checked."""

    def f(a0, a1):
        v0 = a1.view((4, 1))
        v0.t_()
        a0.squeeze_()
        return (v0.unbind(1)[1].sum(),)

    r = _leaf(4)
    with pytest.raises(UnsupportedMutationError, match="view ops that no longer apply"):
        aot_function(f, nop)(torch.zeros(3, 1), r.clone())


# --- seed 221 -----------------------------------------------------------------------------------------


def test_float64_scalar_gradient_through_float32_math_is_compared_at_float32_precision():
    """Seed 221 program 15781: a float32 input multiplied in place by a 0-d float64 tensor that
    requires grad. The scalar's gradient is float64 but computed by float32 sums, and eager and the
    compiled backward add the contributions of three views in another order (20 float32 ulps apart
    after cancellation). A test-side finding: `check_against_eager` now compares with the tolerance
    of the least precise input dtype."""

    def f(a0, a1, a2):
        a1.squeeze().unsqueeze(2).mul_(a2)
        return (a1.as_strided((1, 3), (3, 1), 0),)

    def make_inputs():
        g = torch.Generator().manual_seed(221016444)
        r0 = torch.randn((4, 3), generator=g, dtype=torch.float32)
        c0 = r0.clone()
        r1 = torch.randn((), generator=g, dtype=torch.float64).requires_grad_()
        return (r0, r1), (c0[:, 1:], c0.view((1, 4, 3)), r1)

    _matches_eager(f, make_inputs)


def test_view_of_an_intermediate_computed_from_an_expanded_input_is_refused():
    """Seed 221 program 25359 (a crash): `(a.transpose(-2, 0) * 2).view(12)` for an expand()ed
    input that requires grad. aotgrad traces that input as a dense copy, and the product takes its
    layout from it ((2, 6, 1) where eager's is contiguous), so the view failed inside the trace.
    Refused now, naming the input (the view of the input itself was refused already)."""
    base = torch.randn(2, 1, 2, requires_grad=True)
    compiled = aot_function(lambda a: ((a.transpose(-2, 0) * 2).view(12),), nop)
    with pytest.raises(UnsupportedAliasingError, match="computed while input 0 overlaps itself"):
        compiled(base.expand(2, 3, 2))
    reshaped = aot_function(lambda a: ((a.transpose(-2, 0) * 2).reshape(12),), nop)
    torch.testing.assert_close(reshaped(base.expand(2, 3, 2))[0], (base.expand(2, 3, 2).transpose(-2, 0) * 2).reshape(12))


def test_write_through_an_empty_view_taken_before_a_restride_of_its_base_is_refused():
    """Seed 231 program 15085: `v = a.diagonal(-1)` of a (1, 3) input that requires grad is empty;
    after `a.t_()`, `v.copy_(x)` writes nothing, but eager's autograd records the write by replaying
    the view on the transposed (3, 1) base, where it covers one element, and zeroes that element's
    gradient. The check for such stale views skipped empty ones; it replays them now and refuses."""

    def f(a0, a1):
        v1 = a1.diagonal(-1, 0, 1)
        a1.t_()
        v1.copy_(a0)
        return (v1.expand((2, 0)),)

    r = _leaf(1, 3)
    with pytest.raises(UnsupportedMutationError, match="taken before the in-place aten.t_.default"):
        aot_function(f, nop)(torch.randn(()), r.clone())


def test_view_of_an_input_marked_requires_grad_is_a_new_leaf_and_refused():
    """Seed 1 program 2465 (the strict 20,000-program run): `v = a[1]; v.requires_grad_()` on an
    input that does not require grad makes the view an autograd leaf of its own; eager's output
    `a * v` requires grad, aotgrad's came back detached. Such a view is a new leaf like any tensor
    the program marks (a view taken under no_grad of an input that requires grad stays allowed)."""
    from aotgrad.errors import UnsupportedOutputError

    def f(a0):
        v0 = a0[1]
        v0.requires_grad_()
        return ((a0 * v0).permute(2, 0, 1),)

    with pytest.raises(UnsupportedOutputError, match="marked with requires_grad_"):
        aot_function(f, nop)(torch.randn(2, 4, 3))


def test_view_of_a_detached_input_taken_before_it_is_marked_requires_grad_is_refused():
    """Seed 1 program 3321 (a crash): `v1 = a.detach(); v2 = v1.as_strided((), (), 0);
    v1.requires_grad_()` makes v2 a view that requires grad with no grad_fn (eager returns it so);
    tracing its backward failed inside autograd. Its base is a new leaf: refused by name."""
    from aotgrad.errors import UnsupportedOutputError

    def f(a1):
        v1 = a1.detach()
        v2 = v1.as_strided((), (), 0)
        v1.requires_grad_()
        return (v2,)

    with pytest.raises(UnsupportedOutputError, match="output 0 is a leaf tensor created inside the program"):
        aot_function(f, nop)(torch.randn((), requires_grad=True))


def test_input_written_with_a_value_of_a_new_leaf_is_refused():
    """Seed 1 program 9225: `v = a + a; v.requires_grad_(); a.add_(v)` on an input that does not
    require grad: in eager the input comes to require grad (its history is the write), aotgrad's
    stayed without. Refused by name."""

    def f(a0):
        v0 = a0 + a0
        v0.requires_grad_()
        v1 = a0.detach()
        a0.add_(v0)
        return (v1,)

    with pytest.raises(UnsupportedMutationError, match="writes into input 0 a value that requires grad only"):
        aot_function(f, nop)(torch.randn(2, 2))


def test_clone_of_a_view_taken_before_its_base_was_marked_requires_grad_is_refused():
    """Seed 1 program 15882 (found on a 16-process run of the strict 20,000): `v2 = v0.unbind(0)[2]`
    then `v0.requires_grad_()`: v2 requires grad with no grad_fn, and `v2.clone()` requires grad
    with an edge to nothing. Eager returns it requiring grad; aotgrad's came back detached."""
    from aotgrad.errors import UnsupportedOutputError

    def f(a0, a1):
        v0 = a1 * a0
        v2 = v0.unbind(0)[2]
        v0.requires_grad_()
        return (v2.clone().reshape(()),)

    with pytest.raises(UnsupportedOutputError, match="marked with requires_grad_"):
        aot_function(f, nop)(torch.randn(3, 1), torch.tensor(True))


def test_detach_then_requires_grad_on_an_input_is_refused():
    """Seed 1 program 17216: `a.detach_(); a.requires_grad_()` on an input that requires grad
    leaves it, in eager, a new autograd leaf in the same object; aotgrad's came back detached."""

    def f(a0, a1):
        a1.detach_()
        a1.requires_grad_()
        return (a0,)

    with pytest.raises(UnsupportedMutationError, match="detach_\\(\\) and then requires_grad_\\(\\) on input 1"):
        aot_function(f, nop)(torch.randn(1, 2), torch.randn(4, 3, requires_grad=True))


def test_view_of_an_intermediate_later_marked_requires_grad_is_refused_not_a_torch_error():
    """Seed 31 program 330: `v3` is a view of `v2`, which the program then marks with requires_grad_();
    reading v3's requires_grad regenerates its grad_fn, an op on a FunctionalTensor that ran outside
    its mode (torch's "Attempting to use FunctionalTensor on its own"). Now read inside the mode: the
    usual refusal of an output of a new autograd leaf."""
    from aotgrad.errors import UnsupportedOutputError

    def f(a1):
        v2 = a1 * a1.view((-1,))
        v3 = v2.transpose(0, 0)
        v2.copy_(a1)
        v2.requires_grad_()
        return (v3,)

    with pytest.raises(UnsupportedOutputError, match="marked with requires_grad_"):
        aot_function(f, nop)(torch.randn(3, 1))


def test_write_through_an_expand_of_a_bool_input_under_dynamic_is_refused_not_a_torch_error():
    """--dynamic seed 4 program 166: functionalization writes back through `expand` by subtracting,
    which torch refuses for bool tensors; make_fx's symbolic trace records the subtraction without
    its check, so the graph failed when it ran (torch's raw error). Refused by name, as with static
    sizes."""

    def f(a0):
        a0.expand((1, 2, 4, 2)).diagonal(-1, 1, 2).mul_(True)
        return (a0.sum(),)

    for dynamic in (False, True):
        with pytest.raises(UnsupportedMutationError, match="functionalization cannot express"):
            aot_function(f, nop, dynamic=dynamic)(torch.randint(0, 2, (2, 4, 2)).bool())


def test_write_into_a_no_grad_view_of_a_marked_view_input_is_refused_not_a_torch_error():
    """Seed 24 program 7703: input 0 is a view of a tensor the caller did not pass, and the program
    marks it with requires_grad_(), takes a view of it under no_grad and zeroes that view with grad
    mode on. Eager lets it through (the view belongs to the unpassed base, which requires no grad);
    the trace raised torch's "A view was created in no_grad mode and is being modified inplace". Now
    refused by name, as is the same program on a plain input, where eager raises that error itself."""

    def f(a0, a1):
        a0.requires_grad_()
        with torch.no_grad():
            v = a0.view((-1,))
        v.zero_()
        return a1 * 2, v

    x = torch.randn(3).view(3)
    f(x, torch.randn(3, requires_grad=True))  # eager runs it
    for a0 in (torch.randn(3).view(3), torch.randn(3)):
        with pytest.raises(UnsupportedMutationError, match="into a view it took under no_grad"):
            aot_function(f, nop)(a0, torch.randn(3, requires_grad=True))


def test_no_grad_view_read_after_a_no_grad_write_is_refused_not_a_torch_error():
    """Seed 29 program 566: input 0 is a view of a tensor the caller did not pass; a view of it taken
    under no_grad, the input written in place under no_grad, then marked with requires_grad_(), the
    view read with grad mode on. Eager runs it (the views belong to the unpassed base); the
    functional trace brings the write into the view at that read, with grad mode on, and raised
    torch's "A view was created in no_grad mode and its base ... modified inplace with grad mode
    enabled". Now refused by name."""

    def f(a0):
        v0 = a0.diagonal(0, 0, 1)
        with torch.no_grad():
            v2 = v0.expand((2,))
            a0.clamp_(-0.5, 1)
        a0.requires_grad_()
        return a0 * 1, v2.clone()

    def view_input():
        return torch.randn(2, 3)[:, 1:2]

    f(view_input())  # eager runs it
    with pytest.raises(UnsupportedMutationError, match="reads, with grad mode on, a view it took under no_grad"):
        aot_function(f, nop)(view_input())


_UNBIND_THEN_TRANSPOSE = """
import torch
from torch.testing._internal.two_tensor import TwoTensor
from aotgrad import aot_function, nop
from aotgrad.testing import check_against_eager

def f(a0, a1):
    v0 = a1.unbind(0)[2]
    a1.transpose_(1, 0)
    return (v0, a1 * 2)

def make_inputs():
    g = torch.Generator().manual_seed(0)
    r = torch.randn((3, 2), generator=g)
    c = TwoTensor(r.clone(), r * 2)
    return (r,), (c, c)

compiled = aot_function(f, nop, keep_inference_input_mutations=True)
for _ in range(2):
    check_against_eager(f, make_inputs, compiled=compiled)
print("matches eager")
"""


def test_view_from_unbind_of_a_subclass_input_restrided_afterwards_does_not_crash():
    """Seed 29 subclass program 708: `unbind(0)[2]` of a (3, 2) TwoTensor input, then the input's
    `transpose_`, the view returned. Rebuilding the view replayed its view function on the base as
    it is after the transpose, (2, 3), where unbind has no output 2: libtorch read out of bounds and
    the process died (SIGSEGV). Run in a child process, so that a crash fails this test alone."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNBIND_THEN_TRANSPOSE], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "AOTGRAD_CACHE": "0"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "matches eager" in done.stdout
