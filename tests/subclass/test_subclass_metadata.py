"""Metadata mutations of subclass inputs (issue 27 item 3): `t_()`, `transpose_`, `unsqueeze_`,
`squeeze_`, `as_strided_` on a TwoTensor argument, replayed on the caller's subclass as eager does
(subclass_metadata.py).

Each test runs the program eagerly and through aotgrad on copies of the same inputs and compares the
outputs and the caller's argument after the call at every level: the wrapper's and each inner
tensor's size, stride, offset, version counter, storage (still the caller's own) and values, and the
autograd state (requires_grad, is_leaf, grad_fn); then the gradients where eager has some. What stays
refused is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import check_nonleaf_subclass_argument
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils import _pytree as pytree

import aotgrad
from aotgrad.compile.compilers import nop
from aotgrad.errors import AotgradError, InplaceOnLeafError, UnsupportedMutationError
from aotgrad.signature.subclass_layout import is_subclass

# ---------------------------------------------------------------------------------------------
# Comparison with eager, level by level


def _snapshot(x, storages=None, layout=True):
    """Everything eager lets a caller see of tensor `x` (a subclass: every level); `layout=False`:
    not strides and versions (gradients: their layout is autograd's choice, as for plain programs)."""
    if not isinstance(x, torch.Tensor):
        return ("value", x)
    out = [type(x).__name__, tuple(x.shape), x.requires_grad, _autograd_state(x)]
    if layout:
        out += [tuple(x.stride()), x.storage_offset(), x._version]
    if is_subclass(x):
        attrs, ctx = x.__tensor_flatten__()
        out += [(a, _snapshot(getattr(x, a), storages, layout)) for a in attrs]
    else:
        out.append(x.detach().clone())
        if storages is not None:
            out.append(storages.get(id(x)) == x.untyped_storage().data_ptr())
    return out


def _autograd_state(x):
    """is_leaf and whether there is a grad_fn; eager refuses reading them on a no_grad view whose base
    was changed in place in grad mode: that refusal is the state to compare then."""
    try:
        return x.is_leaf, x.grad_fn is None
    except RuntimeError as e:
        return "error", str(e)[:40]


def _storages(x, out=None) -> dict:
    """id -> storage pointer of every plain inner tensor of `x` (before the call)."""
    out = {} if out is None else out
    if is_subclass(x):
        for a in x.__tensor_flatten__()[0]:
            _storages(getattr(x, a), out)
    elif isinstance(x, torch.Tensor):
        out[id(x)] = x.untyped_storage().data_ptr()
    return out


def _same(a, b, what):
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{what}: {a} vs {b}"
        for k, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{k}]")
    elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], list):
        _same(a[1], b[1], f"{what}.{a[0]}")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, msg=what)
    else:
        assert a == b, f"{what}: eager {a} vs compiled {b}"


def _two(shape, requires_grad=False, nonleaf=False, nested=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g)
    if nested:
        x = TwoTensor(TwoTensor(a, a * 2), TwoTensor(a - 1, a * 3 + 1))
    else:
        x = TwoTensor(a, a * 2 + 1)
    if requires_grad:
        x.requires_grad_()
        root = x
        if nonleaf:
            x = x * 1
        return root, x
    return None, x


def run_both(f, make, grad_mode=True, calls=2, backward=True):
    """`f` eagerly and compiled on equal inputs, `calls` times (the later calls take the cached path).
    `make()` gives (root, x) (`root`: the leaf requiring grad x comes from, or None) or (roots, args)."""
    compiled = aotgrad.aot_function(f, nop)
    for _ in range(calls):
        results = []
        for fn in (f, compiled):
            roots, args = make()
            roots = [] if roots is None else list(roots) if isinstance(roots, (list, tuple)) else [roots]
            args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
            storages: dict = {}
            for a in args:
                _storages(a, storages)
            with contextlib.nullcontext() if grad_mode else torch.no_grad():
                out = fn(*args)
                # read in the call's grad mode (eager refuses reading some views' grad_fn outside it)
                seen = [_snapshot(o) for o in pytree.tree_leaves(out)], [_snapshot(a, storages) for a in args]
            # one loss per output: each output's gradient of its own type
            losses = [o.sum() for o in pytree.tree_leaves(out)
                      if backward and isinstance(o, torch.Tensor) and o.requires_grad]
            grads = []
            roots = [r for r in roots if r.requires_grad]  # a leaf the program detach_()ed: none
            if roots and losses:
                grads = torch.autograd.grad(losses, roots, allow_unused=True)
            results.append((*seen, [_snapshot(g, layout=False) if g is not None else None for g in grads]))
        (oe, xe, ge), (oc, xc, gc) = results
        _same(oe, oc, "output")
        _same(xe, xc, "argument after the call")
        _same(ge, gc, "gradient")
    return compiled


OPS = {
    "t_": lambda x: x.t_(),
    "transpose_": lambda x: x.transpose_(0, 1),
    "swapdims_": lambda x: x.swapdims_(1, 0),
    "unsqueeze_": lambda x: x.unsqueeze_(1),
    "squeeze_": lambda x: x.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda x: x.as_strided_((2, 2), (1, 3), 1),
    "t_t_": lambda x: x.t_().t_(),
}


# ---------------------------------------------------------------------------------------------
# Works as in eager


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("nested", [False, True])
def test_metadata_mutation_of_input_without_grad(op, nested):
    def f(x):
        OPS[op](x)
        return x * 2, x

    run_both(f, lambda: _two((2, 3), nested=nested))


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "as_strided_"])
@pytest.mark.parametrize("nonleaf", [False, True])
def test_metadata_mutation_under_no_grad_call_of_input_requiring_grad(op, nonleaf):
    def f(x):
        OPS[op](x)
        return x + 1

    run_both(f, lambda: _two((2, 3), requires_grad=True, nonleaf=nonleaf), grad_mode=False)


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "as_strided_", "transpose_"])
@pytest.mark.parametrize("nested", [False, True])
def test_metadata_mutation_in_grad_mode_of_nonleaf_requiring_grad(op, nested):
    """Eager gives it new history (TBackward): rebased as for a data write (subclass_runtime._Rebase),
    on the replayed metadata."""
    def f(x):
        OPS[op](x)
        return x * 2, x

    run_both(f, lambda: _two((2, 3), requires_grad=True, nonleaf=True, nested=nested))


def test_metadata_and_data_mutation_in_grad_mode_of_nonleaf_requiring_grad():
    def f(x):
        x.t_()
        x.mul_(3)
        x.unsqueeze_(0)
        return x.sum(1)

    run_both(f, lambda: _two((2, 3), requires_grad=True, nonleaf=True))


def test_metadata_then_data_mutation_and_data_then_metadata():
    def f(x):
        x.add_(1)
        x.t_()
        x.mul_(2)
        return x.sum(0)

    run_both(f, lambda: _two((2, 3)))


def test_views_of_the_argument_taken_after_the_metadata_mutation():
    def f(x):
        x.t_()
        return x[0], x.view(-1) if x.is_contiguous() else x.reshape(-1), x.diagonal()

    run_both(f, lambda: _two((3, 3)))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("grad", ["none", "requires_grad_under_no_grad"])
def test_views_of_the_argument_taken_before_the_metadata_mutation(nested, grad):
    """Eager's view keeps the argument's old layout: rebuilt on the caller's argument before its
    metadata is set (the plain run's restride of the inner tensors undone for it)."""
    def f(x):
        v = x[0]
        w = x.view(-1)
        x.t_()
        x.unsqueeze_(0)
        return v, w, x, x[0]

    # no backward: eager refuses one through no_grad views of a base changed in place
    run_both(f, lambda: _two((3, 3), nested=nested, requires_grad=grad != "none"), grad_mode=grad == "none",
             backward=grad == "none")


def test_view_of_the_argument_taken_between_two_metadata_mutations_refused_by_name():
    def f(x):
        x.t_()
        v = x[0]
        x.unsqueeze_(0)
        return v

    with pytest.raises(AotgradError, match="output 0"):
        aotgrad.aot_function(f, nop)(_two((3, 3))[1])


def test_view_of_an_intermediate_restrided_after_it_was_taken_refused_by_name():
    def f(x):
        y = x * 2
        v = y[0]
        y.t_()
        return v

    with pytest.raises(AotgradError, match="output 0"):
        aotgrad.aot_function(f, nop)(_two((3, 3))[1])


def test_output_computed_from_a_metadata_mutated_input_with_a_plain_input_requiring_grad():
    w = torch.randn(3, 4, requires_grad=True)

    def f(x):
        x.t_()
        return x @ w

    run_both(f, lambda: _two((3, 2)))


def test_generated_run_sets_every_level(caplog):
    """The replay is straight-line code in the generated run time, not a walk per call."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="aotgrad.runtime.source"):
        run_both(lambda x: x.t_() * 1, lambda: _two((2, 3), nested=True), calls=1)
    src = "\n".join(r.getMessage() for r in caplog.records)
    assert "l0.a.a, " in src and "_set_metadata" in src


@pytest.mark.parametrize("nonleaf", [False, True])
@pytest.mark.parametrize("returned", [False, True])
def test_detach_in_place_of_an_argument_requiring_grad(nonleaf, returned):
    """Outputs computed before it keep their history; the caller's argument is a leaf without grad."""
    def f(x):
        y = x * 2
        x.detach_()
        return (y, x * 3, x) if returned else y

    run_both(f, lambda: _two((3, 3), requires_grad=True, nonleaf=nonleaf))


def test_detach_in_place_in_a_no_grad_call():
    def f(x):
        x.detach_()
        return x * 3

    run_both(f, lambda: _two((3, 3), requires_grad=True), grad_mode=False)


def test_detach_in_place_then_requires_grad_refused_by_name():
    """Eager makes it a new leaf (fuzz seed 1, program 7403)."""
    def f(x):
        x.detach_()
        x.requires_grad_()
        return x * 3

    with pytest.raises(UnsupportedMutationError, match="detach_.* subclass input 0 .*requires_grad_"):
        aotgrad.aot_function(f, nop)(_two((3, 3), requires_grad=True, nonleaf=True)[1])


def test_detach_in_place_of_an_argument_viewed_by_an_output_refused_by_name():
    def f(x):
        v = x[0]
        x.detach_()
        return v

    f(_two((3, 3), requires_grad=True, nonleaf=True)[1])  # eager allows it (the view keeps its history)
    with pytest.raises(UnsupportedMutationError, match="detach_.* subclass input 0"):
        aotgrad.aot_function(f, nop)(_two((3, 3), requires_grad=True, nonleaf=True)[1])


def test_detach_in_place_of_a_view_argument_refused_like_eager():
    def f(x):
        x.detach_()
        return x * 2

    def make():
        root, x = _two((3, 3), requires_grad=True)
        return x[1:]

    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        f(make())
    with pytest.raises(UnsupportedMutationError, match="detach_.* subclass input 0"):
        aotgrad.aot_function(f, nop)(make())


# ---------------------------------------------------------------------------------------------
# Refused by name


def test_leaf_requiring_grad_in_grad_mode_refused_like_eager():
    def f(x):
        x.t_()
        return x * 2

    with pytest.raises(RuntimeError, match="leaf Variable"):
        f(_two((2, 3), requires_grad=True)[1])
    with pytest.raises(InplaceOnLeafError, match="input 0"):
        aotgrad.aot_function(f, nop)(_two((2, 3), requires_grad=True)[1])


def test_nonleaf_requiring_grad_viewed_by_an_output():
    """Its new history is rebased (below), and the output views it after that, as eager's."""
    def f(x):
        x.t_()
        return x[0]

    check_nonleaf_subclass_argument(f, 2, 3)


def test_plain_argument_whose_gradient_is_a_subclass_refused_by_name():
    """Passed as aliases per plain gradient (`_Spread`): its metadata mutation is not carried back."""
    def f(y, x):
        y.t_()
        return y * x.t()

    def make():
        root, x = _two((2, 3))
        y = torch.randn(2, 3, requires_grad=True)
        return [y], (y * 1, x)

    make()[1][0].t_()  # eager allows it (a non-leaf)
    with pytest.raises(AotgradError, match="input 0 .*gradient is a tensor subclass"):
        aotgrad.aot_function(f, nop)(*make()[1])


# ---------------------------------------------------------------------------------------------
# A plain argument's metadata mutation beside a subclass argument: the plain run replays it


@pytest.mark.parametrize("case", ["plain", "nonleaf_requiring_grad"])
def test_metadata_mutation_of_plain_argument_beside_a_subclass(case):
    def f(x, y):
        y.t_()
        return x * 2, y, y.sum(0)

    def make():
        root, x = _two((2, 3), requires_grad=True)
        y = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        if case == "plain":
            return [root], (x, y)
        y.requires_grad_()
        return [root, y], (x, y * 1)

    run_both(f, make)


def test_metadata_mutation_under_no_grad_of_plain_leaf_requiring_grad_refused_as_without_subclasses():
    def f(x, y):
        with torch.no_grad():
            y.t_()
        return x * 2, y * 1

    with pytest.raises(UnsupportedMutationError, match="t_.*under no_grad on a leaf"):
        aotgrad.aot_function(f, nop)(_two((2, 3))[1], torch.randn(3, 4, requires_grad=True))
