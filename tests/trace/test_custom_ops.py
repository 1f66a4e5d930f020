"""Custom operators that mutate their arguments (Tensor(a!), Tensor(a!)?, Tensor(a!)[]), the
re-inplacing pass, and FSDP-style mutations that stay in the graph (fsdp.copy_/set_,
inductor.resize_storage_bytes_). Every case is compared with eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param  # noqa: F401  (registers torch.ops.fsdp.copy_)
import torch.nn as nn
from helpers import GraphRecorder
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import aotgrad
from aotgrad import aot_function, aot_module, nop
from aotgrad.compile.compilers import wants_functional_graphs
from aotgrad.errors import UnsupportedMutationError
from aotgrad.testing import check_against_eager

# -- the operators ------------------------------------------------------------------------------------

CALLS = {"list_add": 0}


@torch.library.custom_op("aotgrad_test::add_one_out", mutates_args={"out"})
def add_one_out(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.add(x, 1, out=out)


@torch.library.custom_op("aotgrad_test::list_add", mutates_args={"outs"})
def list_add(x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """outs[i] += (i + 1) * x"""
    CALLS["list_add"] += 1
    for i, o in enumerate(outs):
        o.add_(x * (i + 1))


@torch.library.custom_op("aotgrad_test::maybe_fill", mutates_args={"out"})
def maybe_fill(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None:
        out.copy_(x * 3)
    return x + 1


@maybe_fill.register_fake
def _(x, out):
    return torch.empty_like(x)


@torch.library.custom_op("aotgrad_test::sin_out", mutates_args={"outs"})
def sin_out(x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    for o in outs:
        torch.sin(x, out=o)


LIB = torch.library.Library("aotgrad_test", "FRAGMENT")
# A mutable op with its own autograd formula: y += sin(x).
LIB.define("acc_sin_(Tensor(a!) y, Tensor x) -> ()")
LIB.define("returns_alias_(Tensor(a!) x) -> Tensor(a!)")
LIB.define(
    "gather_into(Tensor all_gather_output, SymInt[] all_gather_input_split_sizes, int dim, Tensor(a!)[] out) -> ()",
    tags=torch.Tag.pt2_compliant_tag,
)


@torch.library.impl(LIB, "acc_sin_", "CompositeExplicitAutograd")
def _acc_sin(y, x):
    y.add_(x.sin())


class _AccSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x):
        with torch._C._AutoDispatchBelowAutograd():
            torch.ops.aotgrad_test.acc_sin_(y, x)
        ctx.mark_dirty(y)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad, grad * x.cos()


@torch.library.impl(LIB, "acc_sin_", "Autograd")
def _acc_sin_autograd(y, x):
    _AccSin.apply(y, x)


@torch.library.impl(LIB, "returns_alias_", "CompositeExplicitAutograd")
def _returns_alias(x):
    return x.add_(1)


@torch.library.impl(LIB, "gather_into", "CPU")
@torch._dynamo.disable
def _gather_into(all_gather_output, all_gather_input_split_sizes, dim, out):
    for o in out:
        o.copy_(all_gather_output)


def _fsdp_set_op():
    """torch.ops.fsdp.set_ as traceable FSDP2 defined it (torch 2.13 ships fsdp.copy_ instead): a
    Functionalize kernel that runs the op on the unwrapped tensors, so it stays in the graph."""
    if hasattr(torch.ops.fsdp, "set_"):
        return torch.ops.fsdp.set_
    lib = torch.library.Library("fsdp", "FRAGMENT")
    lib.define("set_(Tensor(a!) tensor, Tensor data) -> ()")

    def set_(tensor, data):
        tensor.set_(data)

    def set_functionalize(tensor, data):
        torch._sync(tensor)
        torch._sync(data)
        inner, inner_data = torch._from_functional_tensor(tensor), torch._from_functional_tensor(data)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            torch.ops.fsdp.set_.default(inner, inner_data)

    for key in ("CPU", "Meta"):
        lib.impl("set_", set_, key)
    lib.impl("set_", set_functionalize, "Functionalize")
    torch.fx.node.has_side_effect(torch.ops.fsdp.set_.default)
    _fsdp_set_op.lib = lib  # keep the registration alive
    return torch.ops.fsdp.set_


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def inputs(*specs, seed=0):
    """specs: shape tuples (plain) or ("grad", shape) / ("nonleaf", shape); returns make_inputs."""

    def make():
        torch.manual_seed(seed)
        roots, args = [], []
        for s in specs:
            if isinstance(s, tuple) and s and isinstance(s[0], str):
                t = torch.randn(s[1], requires_grad=True)
                roots.append(t)
                args.append(t if s[0] == "grad" else t * 1)
            else:
                args.append(torch.randn(s))
        return tuple(roots), tuple(args)

    return make


# -- seed cases ---------------------------------------------------------------------------------------


def test_add_one_out_into_view_of_buffer_then_fsdp_set():
    set_ = _fsdp_set_op()

    def f(x):
        buf = torch.zeros(2)
        buf_view = buf.view(-1)
        add_one_out(x, out=buf_view)
        set_(x, buf.view(-1))

    ref_x = torch.zeros(2)
    f(ref_x)
    rec = GraphRecorder()
    x = torch.zeros(2)
    aot_function(f, rec)(x)
    torch.testing.assert_close(x, ref_x)
    assert rec.targets().count(torch.ops.fsdp.set_.default) == 1  # kept, once, not re-applied

    x = torch.zeros(2)
    torch._dynamo.reset()
    torch.compile(f, backend="aotgrad_eager")(x)
    torch.testing.assert_close(x, ref_x)


@pytest.mark.parametrize("backend", ["aotgrad_eager", "aotgrad"])
def test_list_of_tensors_mutated_by_schema_defined_op(backend):
    def f(all_gather_output, sizes, dim, out):
        torch.ops.aotgrad_test.gather_into(all_gather_output, sizes, dim, out)

    orig = (torch.ones(4), [2, 3], 0, [torch.empty(4) for _ in range(2)])
    eager_args = pytree.tree_map_only(torch.Tensor, torch.clone, orig)
    f(*eager_args)
    compiled_args = pytree.tree_map_only(torch.Tensor, torch.clone, orig)
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*compiled_args)
    torch.testing.assert_close(compiled_args, eager_args)


def test_sin_out_into_list_of_two_under_torch_compile_with_inductor():
    def g(x):
        outs = [torch.empty_like(x) for _ in range(2)]
        sin_out(x, outs)
        return outs

    x = torch.randn(3)
    torch._dynamo.reset()
    from torch._inductor.utils import run_and_get_code

    y, code = run_and_get_code(torch.compile(g, backend="aotgrad"), x)
    torch.testing.assert_close(y, g(x))
    assert "aotgrad_test.sin_out" in "\n".join(code)  # a fallback kernel call in Inductor's output


def test_inductor_compile_fx_inner_as_the_compiler_of_a_list_mutation():
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def f(x, a, b):
        tmp = [torch.zeros_like(x), a]
        list_add(x, tmp + [b])
        return tmp[0] * 2

    def compiler(gm, example):
        return compile_fx_inner(gm, example)

    compiled = aot_function(f, compiler, decompositions=select_decomp_table())
    check_against_eager(f, inputs(3, 3, 3), compiled=compiled)


# -- functionalization: inputs, intermediates, training ------------------------------------------------


def test_mutated_input_and_intermediate_inference():
    def f(x, y):
        buf = torch.zeros(2)
        add_one_out(x, buf.view(-1))
        add_one_out(x, y)
        return buf * 2

    check_against_eager(f, inputs(2, 2))


def test_mutated_list_element_is_input_requiring_grad():
    def f(x, a, b):
        list_add(x, [a, b])
        return a * b

    # eager: the op has no autograd formula, so gradients do not flow through the mutation
    check_against_eager(f, inputs(("grad", 3), ("nonleaf", 3), 3))
    check_against_eager(f, inputs(3, ("nonleaf", 3), ("grad", 3)))


def test_optional_mutated_argument_none_and_given():
    check_against_eager(lambda x: maybe_fill(x, None) * 2, inputs(3))
    check_against_eager(lambda x, y: maybe_fill(x, y) * y, inputs(3, 3))
    check_against_eager(lambda x, y: maybe_fill(x.detach(), y) * x, inputs(("grad", 3), 3))


def test_same_tensor_twice_in_the_list():
    def f(x, y):
        list_add(x, [y, y])  # y += x, then y += 2x
        return y + 1

    check_against_eager(f, inputs(3, 3))

    def g(x):
        buf = torch.zeros(3)
        list_add(x, [buf, buf[:]])
        return buf

    check_against_eager(g, inputs(3))


def test_custom_op_with_registered_autograd_formula():
    def on_intermediate(x, y):
        z = y * 2
        torch.ops.aotgrad_test.acc_sin_(z, x)
        return z * 3

    def on_input(x, y):
        torch.ops.aotgrad_test.acc_sin_(y, x)
        return y * 3

    check_against_eager(on_intermediate, inputs(("grad", 3), ("grad", 3)))
    check_against_eager(on_input, inputs(("grad", 3), ("nonleaf", 3)))


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_training_runs_the_op_once_under_every_partitioner(partition):
    part = aotgrad.min_cut_rematerialization_partition if partition == "min_cut" else aotgrad.default_partition

    def f(x, w):
        h = x @ w
        buf = torch.zeros_like(h)
        list_add(h.detach(), [buf])
        return (h * buf).tanh().sum()

    compiled = aot_function(f, nop, partition_fn=part)
    check_against_eager(f, inputs(("grad", (4, 3)), ("grad", (3, 5))), compiled=compiled)
    CALLS["list_add"] = 0
    _, args = inputs(("grad", (4, 3)), ("grad", (3, 5)))()
    compiled(*args).backward()
    assert CALLS["list_add"] == 1  # never recomputed in the backward


def test_aot_module_buffer_mutated_by_custom_op():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            y = self.lin(x)
            list_add(y.detach().sum(0), [self.total])
            return y * self.total

    torch.manual_seed(0)
    ref = M()
    mod = copy.deepcopy(ref)
    compiled = aot_module(mod, nop)
    for _ in range(2):
        x = torch.randn(4, 3)
        out_ref, out = ref(x), compiled(x)
        out_ref.sum().backward()
        out.sum().backward()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(mod.total, ref.total)
        torch.testing.assert_close(mod.lin.weight.grad, ref.lin.weight.grad)


def test_unfunctionalizable_schema_is_refused_naming_the_op():
    with pytest.raises(UnsupportedMutationError, match="returns_alias_"):
        aot_function(lambda x: torch.ops.aotgrad_test.returns_alias_(x) * 2, nop)(torch.randn(3))


def test_compiling_under_a_user_dispatch_mode():
    """The trace must not interleave with, or leak into, a mode the caller has active."""

    def f(x, y):
        add_one_out(x, y)
        return y.sin()

    compiled = aot_function(f, nop)
    with PassThrough():
        check_against_eager(f, inputs(3, 3), compiled=compiled)
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None


# -- re-inplacing ----------------------------------------------------------------------------------


def _clones(compiler, f, make):
    _, args = make()
    compiled = aot_function(f, compiler)
    compiled(*args)  # compile outside the count
    _, args = make()
    with torch.autograd.profiler.profile() as prof:  # sees the clones inside higher-order ops too
        compiled(*args)
    return sum(e.name == "aten::clone" for e in prof.function_events)


def test_reinplacing_removes_clones_of_buffers_nobody_else_reads():
    def f(x, y):
        a, b = torch.zeros(3), torch.ones(3)
        list_add(x, [a, b])  # intermediates
        list_add(x, [y])  # an input whose new value is copied back anyway
        return a + b

    make = inputs(3, 3)
    functional = _clones(wants_functional_graphs(nop), f, make)
    in_place = _clones(nop, f, make)
    assert (functional, in_place) == (3, 0)
    check_against_eager(f, make)


def test_reinplacing_keeps_the_clone_when_the_old_value_is_needed():
    def f(x, y):
        h = y.sin().cos()  # min-cut saves y and recomputes h in the backward: y's old value
        list_add(x.detach(), [y])
        return x * h

    rec = GraphRecorder()
    compiled = aot_function(f, rec, partition_fn=aotgrad.min_cut_rematerialization_partition)
    check_against_eager(f, inputs(("grad", 3), 3), compiled=compiled)
    fw = rec.graphs[0].graph
    op = next(n for n in fw.nodes if n.target is torch.ops.aotgrad_test.list_add.default)
    assert all(o.target is torch.ops.aten.clone.default for o in op.kwargs["outs"])

    def g(x, y):
        list_add(x, [y])  # y requires grad: the compiled graph never writes into it
        return y * 2

    rec = GraphRecorder()
    check_against_eager(g, inputs(3, ("nonleaf", 3)), compiled=aot_function(g, rec))
    assert any(n.target is torch.ops.aten.clone.default for n in rec.graphs[0].graph.nodes)


def test_reinplacing_never_writes_into_an_input_that_is_read_later():
    def f(x, y):
        old = y.sum()
        list_add(x, [y])
        return y * old, y.sum()

    check_against_eager(f, inputs(3, 3))

    def g(x, y):
        list_add(x, [y])
        return y

    check_against_eager(g, inputs(3, 3))


# -- FSDP-style ops kept in the graph -----------------------------------------------------------------


def fsdp_step(p, data, inp):
    """FSDP's pattern: an unsharded parameter with no storage is resized, filled, used, freed."""
    torch.ops.inductor.resize_storage_bytes_(p, p.numel() * 4)
    torch.ops.fsdp.copy_(p, data)
    out = inp * p.sum(0)
    torch.ops.inductor.resize_storage_bytes_(p, 0)
    return out


def fsdp_inputs():
    torch.manual_seed(0)
    p = torch.empty(3, 3)
    p.untyped_storage().resize_(0)
    return p, torch.randn(3, 3), torch.randn(2, 3, requires_grad=True)


def test_resize_and_fsdp_copy_stay_in_graph_in_order():
    p, data, inp = fsdp_inputs()
    ref = fsdp_step(p, data, inp)
    ref.sum().backward()
    resize, copy_ = torch.ops.inductor.resize_storage_bytes_.default, torch.ops.fsdp.copy_.default
    for part in (aotgrad.default_partition, aotgrad.min_cut_rematerialization_partition):
        rec = GraphRecorder()
        compiled = aot_function(fsdp_step, rec, partition_fn=part)
        p2, data2, inp2 = fsdp_inputs()
        out = compiled(p2, data2, inp2)
        out.sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(inp2.grad, inp.grad)
        assert p2.untyped_storage().nbytes() == 0
        fw = [n.target for n in rec.graphs[0].graph.nodes if n.op == "call_function"]
        assert [t for t in fw if t in (resize, copy_)] == [resize, copy_, resize]
        bw = [n.target for n in rec.graphs[1].graph.nodes if n.op == "call_function"]
        assert resize not in bw and copy_ not in bw


def test_mutated_argument_is_a_view_of_an_input():
    def f(x, y):
        list_add(x[0], [y[0], y.t()[1]])  # a row, and a strided column
        return y * 2

    check_against_eager(f, inputs((2, 3), (3, 3)))
    check_against_eager(f, inputs(("grad", (2, 3)), ("nonleaf", (3, 3))))

    def g(x, y):
        add_one_out(x, y.view(-1)[2:5])
        return y.sum()

    check_against_eager(g, inputs(3, (2, 4)))


def test_input_mutation_through_the_inductor_backend():
    def f(x, y, z):
        list_add(x, [y, z[1]])
        return (y * 2).sum() + z.sum()

    def make():
        torch.manual_seed(0)
        return torch.randn(3), torch.randn(3), torch.randn(2, 3)

    eager_args = make()
    ref = f(*eager_args)
    args = make()
    torch._dynamo.reset()
    out = torch.compile(f, backend="aotgrad")(*args)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(args, eager_args)


def test_dynamic_shapes_through_the_backend():
    def f(x, y):
        buf = torch.zeros_like(x)
        list_add(x, [buf, y[1:]])
        return buf * 2 + y[:-1].sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotgrad_eager", dynamic=True)
    for n in (4, 6, 9):
        x, y = torch.randn(n - 1), torch.randn(n)
        y_eager = y.clone()
        torch.testing.assert_close(compiled(x, y), f(x, y_eager))
        torch.testing.assert_close(y, y_eager)


def test_mutating_one_piece_of_a_split():
    def f(x):
        buf = torch.zeros(6)
        a, b = buf.split(3)
        before = b * 1
        list_add(x, [a])
        return a + b, before, buf

    check_against_eager(f, inputs(3))
    check_against_eager(f, inputs(("grad", 3)))


@pytest.mark.parametrize("backend", ["aotgrad_eager", "aotgrad"])
def test_fsdp_pattern_through_torch_compile(backend):
    p, data, inp = fsdp_inputs()
    ref = fsdp_step(p, data, inp)
    ref.sum().backward()
    torch._dynamo.reset()
    p2, data2, inp2 = fsdp_inputs()
    out = torch.compile(fsdp_step, backend=backend)(p2, data2, inp2)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(inp2.grad, inp.grad)
    assert p2.untyped_storage().nbytes() == 0
