"""Parity, the remainder (issue 39): each case compared with eager."""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.testing import check_against_eager


def _usable(t: torch.Tensor) -> None:
    """The caller's tensor works as a plain tensor (symbolic sizes left on it fail here)."""
    t.clone()
    assert all(type(v) is int for v in (*t.shape, *t.stride(), t.storage_offset()))


# -- (a) metadata mutations replayed under dynamic=True leave plain sizes --------------------------


def _unsqueeze_then_specialise(x0, x1, x2):
    x2.unsqueeze_(0)
    with torch.no_grad():
        x2.unsqueeze(0).expand([3, 1, 2, 1, 3, 2])  # specialises x2's sizes: the restride's SymInts are constants
        v1 = x0.unsqueeze(0)
        v2 = x2 - v1
    v1.fill_(3.0)
    return torch.logsumexp(v2, 4), v2


def test_replayed_metadata_mutation_leaves_plain_sizes_under_dynamic():
    cf = aotgrad.aot_function(_unsqueeze_then_specialise, aotgrad.nop, dynamic=True)
    for _ in range(3):
        def make():
            torch.manual_seed(0)
            args = (torch.randn((), dtype=torch.float64), torch.randn(1, dtype=torch.float64),
                    torch.randn(2, 1, 3, 2, dtype=torch.float64))
            return (), args
        check_against_eager(_unsqueeze_then_specialise, make, compiled=cf)
        _, (x0, x1, x2) = make()
        cf(x0, x1, x2)
        for x in (x0, x1, x2):
            _usable(x)


def _transpose_and_view(x, y):
    x.t_()
    y.unsqueeze_(1)
    return x.view(-1), y * 2


def test_metadata_mutations_with_changing_sizes_leave_plain_sizes():
    cf = aotgrad.aot_function(_transpose_and_view, aotgrad.nop, dynamic=True)
    for n, m in ((3, 4), (5, 2), (6, 7)):
        def make(n=n, m=m):
            torch.manual_seed(n)
            return (), (torch.randn(n, m).t().contiguous().t(), torch.randn(m, requires_grad=True).mul(1))
        check_against_eager(_transpose_and_view, make, compiled=cf)
        _, args = make()
        outs = cf(*args)
        for t in (*args, *outs):
            _usable(t)


# -- regression 1: SymInt / SymFloat example inputs in aot_module_simplified's fallback -------------


def _symbolic_number(value):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    if isinstance(value, int):
        return env.create_symintnode(env.create_symbol(value, ConstantSource("n")), hint=value)
    return env.create_symfloatnode(env.create_unspecified_symbol(value, ConstantSource("r")), hint=value)


class _Scale(torch.nn.Module):
    def forward(self, x, k, r):
        return (x * k).sin() * r, x.sum(0) + k


def test_aot_module_simplified_takes_symint_and_symfloat_examples():
    gm = torch.fx.symbolic_trace(_Scale())
    x = torch.randn(3, 4, requires_grad=True)
    compiled = aotgrad.aot_module_simplified(gm, [x, _symbolic_number(5), _symbolic_number(0.5)], aotgrad.nop)
    for k, r, n in ((5, 0.5, 3), (7, 0.5, 3), (5, 1.5, 6)):
        def make(k=k, r=r, n=n):
            torch.manual_seed(n)
            x = torch.randn(n, 4, requires_grad=True)
            return (x,), (x, k, r)
        check_against_eager(gm, make, compiled=compiled)


def _scaled_by_size(x, y):
    return (x * y.shape[0]).sin() + y.sum()


def test_torch_compile_dynamic_with_subclass_input_and_symint_inputs():
    from torch.testing._internal.two_tensor import TwoTensor

    torch._dynamo.reset()

    def backend(gm, example_inputs):
        return aotgrad.aot_module_simplified(gm, example_inputs, aotgrad.nop)

    compiled = torch.compile(_scaled_by_size, backend=backend, dynamic=True)
    for n in (3, 4, 5):
        def make(n=n):
            torch.manual_seed(n)
            a, b = torch.randn(n, 2), torch.randn(n, 2)
            x = TwoTensor(a, b).requires_grad_()
            return (x,), (x, torch.randn(n + 1))
        check_against_eager(_scaled_by_size, make, compiled=compiled)
    torch._dynamo.reset()


# -- regression 2: the user's inference_compiler --------------------------------------------------


class _Compilers:
    """Records which of the user's compilers were called."""

    def __init__(self):
        self.called: list[str] = []

    def kwargs(self) -> dict:
        def make(name):
            def compiler(gm, _example):
                self.called.append(name)
                return gm
            return compiler

        return dict(fw_compiler=make("fw"), bw_compiler=make("bw"), inference_compiler=make("inference"))


def _under_no_grad(fn):
    def call(*args):
        with torch.no_grad():
            return fn(*args)
    return call


def _views_and_product(x, y):
    return x.view(-1), x[1:], y * 2, x


def _views_only(x):
    return x.t(), x


def test_inference_compiler_under_no_grad_with_view_outputs_of_inputs_requiring_grad():
    for fn in (_views_and_product, _views_only):
        compilers = _Compilers()
        cf = aotgrad.aot_function(fn, **compilers.kwargs())
        for n in (3, 3, 4):
            def make(n=n, arity=fn.__code__.co_argcount):
                torch.manual_seed(n)
                x = torch.randn(n, 4, requires_grad=True)
                return (x,), (x, torch.randn(n, 4, requires_grad=True))[:arity]
            check_against_eager(_under_no_grad(fn), make, compiled=_under_no_grad(cf))
        assert compilers.called == ["inference", "inference"], compilers.called


def _returns_nothing_differentiable(x, y, buf):
    buf.add_(x.detach())  # a write into an input that does not require grad
    return (x * y).detach(), x.argmax(), y.view(-1).detach()


def test_inference_compiler_for_program_returning_nothing_that_requires_grad():
    compilers = _Compilers()
    cf = aotgrad.aot_function(_returns_nothing_differentiable, **compilers.kwargs())
    for n in (3, 3, 5):
        def make(n=n):
            torch.manual_seed(n)
            x, y = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
            return (x, y), (x, y, torch.zeros(n))
        check_against_eager(_returns_nothing_differentiable, make, compiled=cf)
    assert compilers.called == ["inference", "inference"], compilers.called


def _write_into_nonleaf_under_no_grad(x):
    with torch.no_grad():
        x.mul_(2)
    return x.detach() + 1


def test_program_changing_an_input_requiring_grad_stays_training():
    compilers = _Compilers()
    cf = aotgrad.aot_function(_write_into_nonleaf_under_no_grad, **compilers.kwargs())

    def make():
        torch.manual_seed(0)
        root = torch.randn(4, requires_grad=True)
        return (root,), (root * 1,)
    check_against_eager(_write_into_nonleaf_under_no_grad, make, compiled=cf)
    assert "inference" not in compilers.called


# -- regression 3: aot_export_module on programs mutating an input requiring grad ----------------


class _MutateReturnInput(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return (x,)


class _MutateReturnView(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return (x[0], x.sum())


@pytest.mark.parametrize("module", [_MutateReturnInput, _MutateReturnView])
@pytest.mark.parametrize("leaf", [False, True])
def test_export_of_program_mutating_input_requiring_grad(module, leaf):
    for n in (3, 3, 5):
        torch.manual_seed(n)
        root = torch.randn(n, requires_grad=True)
        x = root if leaf else root * 1
        gm, sig = aotgrad.aot_export_module(module(), (x.detach().clone().requires_grad_(leaf or True),),
                                             trace_joint=False)
        assert list(sig.user_inputs_to_mutate.values()) == sig.user_inputs
        with torch.no_grad():
            new_x, *outs = gm(x.detach().clone())
            ref_x = x.detach().clone()
            ref = module()(ref_x)
        torch.testing.assert_close(new_x, ref_x)
        for a, b in zip(outs, ref):
            torch.testing.assert_close(a, b)


class _GradRegionOutput(torch.nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            y = x * 2
        return (y,)


class _WriteOverlapping(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1)
        return (y * 2,)


def test_export_refuses_with_aotgrad_errors_not_retrace_signals():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(aotgrad.errors.UnsupportedOutputError, match="enable_grad"):
        aotgrad.aot_export_module(_GradRegionOutput(), (x,), trace_joint=False)
    b = torch.zeros(6)
    with pytest.raises(aotgrad.errors.UnsupportedInputError, match="share memory"):
        aotgrad.aot_export_module(_WriteOverlapping(), (b[:4], b[2:]), trace_joint=False)


# -- item 5: FSDP2's unshard, reshard, unshard again of one parameter in one graph ----------------

_RESIZE = torch.ops.inductor.resize_storage_bytes_.default


def _unshard_twice(p, data, data2, x):
    """A weight used twice (FSDP2 reshards between the uses): resize_storage_bytes_ then set_ under
    no_grad, a use, the reshard (free), and the same again with the next all-gather's data."""
    _RESIZE(p, p.numel() * p.itemsize)
    with torch.no_grad():
        p.set_(data)
    out = x * p.sum(1)
    _RESIZE(p, 0)
    _RESIZE(p, p.numel() * p.itemsize)
    with torch.no_grad():
        p.set_(data2)
    out = out * p.sum(1)
    _RESIZE(p, 0)
    return out


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_fsdp2_unshard_reshard_unshard_again_in_one_graph(partition):
    from helpers import GraphRecorder

    part = {"default": aotgrad.default_partition, "min_cut": aotgrad.min_cut_rematerialization_partition}[partition]
    rec = GraphRecorder()
    cf = aotgrad.aot_function(_unshard_twice, rec, partition_fn=part)

    def make(seed):
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.empty(3, 4))
        p.untyped_storage().resize_(0)
        return p, torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 3, requires_grad=True)

    for seed in range(3):
        ref_args, args = make(seed), make(seed)
        ref, out = _unshard_twice(*ref_args), cf(*args)
        torch.testing.assert_close(out, ref)
        ref.sum().backward()
        out.sum().backward()
        for a, b in zip(args, ref_args):
            assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)
        assert args[0].untyped_storage().data_ptr() == args[2].untyped_storage().data_ptr()
    forward_ops = rec.targets(0, among=(_RESIZE, torch.ops.aotgrad.set_.default))
    assert forward_ops == [_RESIZE, torch.ops.aotgrad.set_.default, _RESIZE] * 2


# -- item 7: an output view marked requires_grad_() while its base input does not require grad ----


def _marked_view(x):
    v = x.view(-1)
    v.requires_grad_()
    return v


def _marked_views_beside_training(x, w):
    v = x[1:].t()
    v.requires_grad_()
    return v, (x * w).sum(), x[0]


def _marked_view_used(x):
    v = x[0]
    v.requires_grad_()
    return v * 2, v


@pytest.mark.parametrize("fn", [_marked_view, _marked_views_beside_training])
def test_output_view_marked_requires_grad_on_input_without_grad(fn):
    cf = aotgrad.aot_function(fn, aotgrad.nop)
    for n in (3, 3, 4):
        def make(n=n, arity=fn.__code__.co_argcount):
            torch.manual_seed(n)
            w = torch.randn(n, 3, requires_grad=True)
            return (w,), (torch.randn(n, 3), w)[:arity]
        check_against_eager(fn, make, compiled=cf)
        _, args = make()
        v = cf(*args)
        v = v[0] if isinstance(v, tuple) else v
        assert v.is_leaf and v.requires_grad and v._base is args[0]


def test_output_view_marked_requires_grad_under_dynamic_and_no_grad():
    cf = aotgrad.aot_function(_marked_view, aotgrad.nop, dynamic=True)
    for n in (3, 5, 6):
        def make(n=n):
            torch.manual_seed(n)
            return (), (torch.randn(n, 2),)
        check_against_eager(_marked_view, make, compiled=cf)
        check_against_eager(_under_no_grad(_marked_view), make, compiled=_under_no_grad(cf))


def test_output_computed_from_a_marked_view_is_still_refused():
    with pytest.raises(aotgrad.errors.UnsupportedOutputError, match="requires_grad_"):
        aotgrad.aot_function(_marked_view_used, aotgrad.nop)(torch.randn(3, 3))


# -- item 6: torch.ops.higher_order.map (nested too) under aot_function --------------------------


def _hop_map(f, xs, *args):
    from torch._higher_order_ops.map import map as hop_map

    return hop_map(f, xs, *args)


def _mapped(xs, w):
    return _hop_map(lambda x, w: (x * w).sin(), xs, w)


def _nested_maps(xs, w):
    return _hop_map(lambda y, w: _hop_map(lambda z, w: z * w + 1, y, w), xs, w).sum()


_CLOSED_OVER = torch.randn(3, requires_grad=True)


def _map_over_closure(xs):
    return _hop_map(lambda x: (x * _CLOSED_OVER).cos(), xs)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fn", [_mapped, _nested_maps, _map_over_closure])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_higher_order_map_under_aot_function(fn, dynamic, requires_grad):
    cf = aotgrad.aot_function(fn, aotgrad.nop, dynamic=dynamic)
    for n in (4, 4, 6):
        def make(n=n, arity=fn.__code__.co_argcount):
            torch.manual_seed(n)
            w = torch.randn(3, requires_grad=requires_grad)
            xs = torch.randn(n, 2, 3, requires_grad=requires_grad)
            return (xs, w, _CLOSED_OVER), (xs, w)[:arity]
        # Eager's map returns a view made inside its autograd.Function, which refuses in-place ops;
        # the compiled output is a plain tensor (as upstream's). Everything else is compared.
        check_against_eager(fn, make, compiled=cf, mutate_outputs=False)


# -- item 8: aot_export_module(dynamic_shapes=True) with .item() ---------------------------------


class _ItemOfInput(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        return torch.ones(k) * 2, x * k + 1


class _ItemComputed(torch.nn.Module):
    def forward(self, x):
        k = (x > 0).sum().item()
        return (x * k, torch.zeros(k))


class _BranchOnItem(torch.nn.Module):
    def forward(self, x, n):
        return (x * 2,) if n.item() > 2 else (x * 3,)


def _item_symbols(gm) -> list[str]:
    return [str(n.meta["val"]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten._local_scalar_dense.default]


@pytest.mark.parametrize("module, make", [
    (_ItemOfInput, lambda n: (torch.randn(n, 4), torch.tensor(n + 1))),
    (_ItemComputed, lambda n: (torch.randn(n, 4),)),
])
def test_export_dynamic_item_is_an_unbacked_symbol(module, make):
    gm, sig = aotgrad.aot_export_module(module(), make(3), trace_joint=False, dynamic_shapes=True)
    assert [s[0] for s in _item_symbols(gm)] == ["u"], _item_symbols(gm)  # unbacked, as upstream's
    for n in (3, 5, 2):  # the graph serves other sizes and values
        torch.manual_seed(n)
        args = make(n)
        out, ref = gm(*args), module()(*args)
        assert len(out) == len(ref)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b)


def test_export_refuses_branch_on_item_and_item_without_dynamic_shapes():
    args = (torch.randn(3, 4), torch.tensor(3))
    with pytest.raises(aotgrad.errors.DataDependentError, match="torch.cond"):
        aotgrad.aot_export_module(_BranchOnItem(), args, trace_joint=False, dynamic_shapes=True)
    with pytest.raises(aotgrad.errors.DataDependentError, match="dynamic_shapes=True"):
        aotgrad.aot_export_module(_ItemOfInput(), args, trace_joint=False)


# -- item 4 (part): a plain input meeting a TwoTensor, written in place -------------------------


def _write_plain_times_subclass(x, y):
    x.add_(1)
    return x * y


def _write_subclass_times_plain(x, y):
    y.add_(1)
    return x * y


def _plain_and_two_tensor(x_requires_grad):
    from torch.testing._internal.two_tensor import TwoTensor

    def make():
        torch.manual_seed(0)
        root = torch.randn(3, requires_grad=x_requires_grad)
        return (root,), (root * 1 if x_requires_grad else root, TwoTensor(torch.randn(3), torch.randn(3)))
    return make


@pytest.mark.parametrize("fn", [_write_plain_times_subclass, _write_subclass_times_plain])
def test_plain_and_two_tensor_with_distinct_storages_one_written(fn):
    for _ in range(3):
        check_against_eager(fn, _plain_and_two_tensor(False))
    check_against_eager(_write_subclass_times_plain, _plain_and_two_tensor(True))


def test_written_plain_input_with_a_subclass_gradient_is_refused_by_name():
    # Its gradient is a TwoTensor (spread over the inner gradients): not "inputs overlap in memory".
    _, args = _plain_and_two_tensor(True)()
    with pytest.raises(aotgrad.errors.UnsupportedMutationError, match="gradient is a tensor subclass"):
        aotgrad.aot_function(_write_plain_times_subclass, aotgrad.nop)(*args)


def _mark_view_while_inputs_overlap(x, y):
    y.add_(1)
    v = x.view(-1)
    v.requires_grad_()
    return v


def test_marked_view_with_overlapping_written_inputs_is_refused_not_unmarked():
    b = torch.randn(4, 3)
    with pytest.raises(aotgrad.errors.UnsupportedMutationError, match="requires_grad_"):
        aotgrad.aot_function(_mark_view_while_inputs_overlap, aotgrad.nop)(b[1:], b[:2])


# -- the dynamic fuzzer's finds on the code before (a): seed 1, symbolic sizes left on inputs ------


@pytest.mark.parametrize("index", [60, 291, 313, 318, 350])  # crashes (60, 291, 318), mismatches (313, 350)
def test_dynamic_fuzz_programs_leave_readable_inputs(index):
    from aotgrad import fuzz

    out = fuzz.check_program(fuzz.with_dynamic(fuzz.generate(1, index)), explain_mismatch=False)
    assert out.kind in ("matched", "refused"), out.message


# -- item 9: compiled autograd over a backward with a subclass in it ----------------------------


@pytest.mark.parametrize("subclass_weight", [False, True])
def test_compiled_autograd_over_backward_with_two_tensor(subclass_weight):
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    w = torch.randn(4, 2, requires_grad=True)
    if subclass_weight:
        w = TwoTensor(w.detach(), torch.randn(4, 2)).requires_grad_()
    x = TwoTensor(torch.randn(3, 4), torch.randn(3, 4))

    def train(x):
        out = (x @ w).sin()
        out.sum().backward()
        return out

    def step(fn):
        w.grad = None
        return fn(x), w.grad

    expected = step(train)
    torch._dynamo.reset()
    compiled = torch.compile(train, backend="aotgrad_eager")
    with torch._dynamo.config.patch(compiled_autograd=True):
        for _ in range(3):
            out, grad = step(compiled)
            assert type(grad) is TwoTensor  # eager's gradient type (x is a TwoTensor)
            for got, ref in ((out, expected[0]), (grad, expected[1])):
                torch.testing.assert_close(got.a, ref.a)
                torch.testing.assert_close(got.b, ref.b)
    torch._dynamo.reset()
