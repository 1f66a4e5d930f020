"""Folding view round trips (trace/view_roundtrips.py): an in-place op on a view, read back through
the views, reaches the compiler as the value it equals; results, gradients, input mutations and
aliasing stay eager's, and reads that are not round trips are left alone."""

from __future__ import annotations

import pytest
import torch
from helpers import run_both

from aotgrad import aot_function
from aotgrad.trace.view_roundtrips import fold_view_roundtrips

aten = torch.ops.aten


def _inductor_table():
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def shifted_scores(q, r, mask):
    """Funnel's relative shift (transformers' `_relative_shift_gather`), then `*=` on the shifted view."""
    scores = torch.einsum("bih,th->bit", q, r)  # (batch, 8, 32)
    b, s, t = scores.shape
    scores = scores.reshape(b, t, s)[:, 2:, :].reshape(b, s, t - 2)[..., :16]
    scores *= mask
    return scores.softmax(-1)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True), torch.rand(8, 16)]


def _graphs(fn, decompositions):
    seen = []

    def keep(gm, _):
        seen.append(gm)
        return gm

    out = aot_function(fn, keep, keep, decompositions=decompositions)(*_inputs())
    out.sum().backward()
    return seen


def _count(gm, *targets) -> int:
    return sum(n.target in targets for n in gm.graph.nodes)


SCATTERS = (aten.slice_scatter.default, aten.slice_backward.default)



@pytest.mark.parametrize("table", ["aotgrad", "inductor"])
def test_a_write_through_the_relative_shift_reaches_the_compiler_without_read_backs(table):
    """Before the fold the forward rebuilt the base with 2 scatters and read it back through 4 views
    and 2 slices, and the backward (autograd's CopySlices) did the same with the gradient: 6 scatters
    (Inductor spent over 300 s on one index of that chain). Only the shift's own gradient is left."""
    fw, bw = _graphs(shifted_scores, _inductor_table() if table == "inductor" else None)
    assert _count(fw, *SCATTERS) == 0, fw.code
    assert _count(fw, aten.slice.Tensor) == 2, fw.code
    assert _count(bw, *SCATTERS) == 2, bw.code
    assert _count(bw, aten.slice.Tensor, aten.copy.default) == 0, bw.code


@pytest.mark.parametrize("table", ["aotgrad", "inductor"])
def test_the_folded_graphs_give_eagers_values_and_gradients(table):
    run_both(shifted_scores, _inputs, decompositions=_inductor_table() if table == "inductor" else None)


def test_under_inductor_the_folded_graphs_give_eagers_values_and_gradients():
    from helpers import _clone

    eager_in = _inputs()
    ours = [_clone(x) for x in eager_in]
    expected = shifted_scores(*eager_in)
    got = torch.compile(shifted_scores, backend="aotgrad", fullgraph=True)(*ours)
    torch.testing.assert_close(got, expected)
    torch.autograd.backward(expected, torch.ones_like(expected))
    torch.autograd.backward(got, torch.ones_like(got))
    for x, y in zip(ours[:2], eager_in[:2]):
        torch.testing.assert_close(x.grad, y.grad)


def test_an_input_written_through_a_view_keeps_its_mutation_and_its_read_back():
    """The base is an input: its write stays (copied back into the caller's tensor), and the read of
    the written region after it is not folded into a value from before the write."""
    def f(x, m):
        x.view(4, 6)[:, 1:3] *= m
        y = x.view(4, 6)[:, 1:3] + 1
        return y, x.sum()

    run_both(f, lambda: [torch.randn(24), torch.randn(4, 2, requires_grad=True)], backward=True)


def test_an_output_viewing_the_written_base_keeps_eagers_aliasing():
    def f(q, m):
        base = q * 2
        view = base.view(3, 8)[:, :4]
        view *= m
        return base, base.view(3, 8)[:, :4]

    _, (base, view), _ = run_both(f, lambda: [torch.randn(24, requires_grad=True), torch.randn(3, 4)])
    expected_base, expected_view = f(torch.randn(24, requires_grad=True), torch.randn(3, 4))
    assert expected_view._base is expected_base
    assert view._base is base and view.data_ptr() == base.data_ptr()
    assert view.grad_fn.name() == expected_view.grad_fn.name()


def _node(graph, target, args, shape, kwargs=None):
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = torch.empty(shape)
    return node


def _placeholder(graph, name, shape):
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape)
    return node


def test_reads_that_are_not_round_trips_are_left_alone():
    """A slice over another range than the scatter's, a view to a shape the chain never had and a
    permute that does not undo the one before: each differs from every value before it."""
    graph = torch.fx.Graph()
    x, src = _placeholder(graph, "x", (4, 6)), _placeholder(graph, "src", (4, 2))
    scatter = _node(graph, aten.slice_scatter.default, (x, src, 1, 1, 3), (4, 6))
    other_range = _node(graph, aten.slice.Tensor, (scatter, 1, 2, 4), (4, 2))
    perm = _node(graph, aten.permute.default, (x, [1, 0]), (6, 4))
    new_shape = _node(graph, aten.view.default, (perm, [2, 12]), (2, 12))
    cube = _placeholder(graph, "cube", (2, 2, 2))
    turned = _node(graph, aten.permute.default, (cube, [1, 2, 0]), (2, 2, 2))
    turned_on = _node(graph, aten.permute.default, (turned, [1, 2, 0]), (2, 2, 2))
    total = _node(graph, aten.add.Tensor, (other_range, 1), (4, 2))
    graph.output((total, _node(graph, aten.mul.Tensor, (new_shape, 2), (2, 12)),
                  _node(graph, aten.mul.Tensor, (turned_on, 2), (2, 2, 2))))
    assert fold_view_roundtrips(graph) == 0
    assert total.args[0] is other_range


def test_a_permute_undone_by_another_is_its_input():
    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", (2, 3, 4))
    p = _node(graph, aten.permute.default, (x, [1, 2, 0]), (3, 4, 2))
    dense = _node(graph, aten.clone.default, (p,), (3, 4, 2), {"memory_format": torch.contiguous_format})
    back = _node(graph, aten.permute.default, (dense, [2, 0, 1]), (2, 3, 4))
    again = _node(graph, aten.permute.default, (dense, [1, 2, 0]), (4, 2, 3))
    out = _node(graph, aten.mul.Tensor, (back, 2), (2, 3, 4))
    out2 = _node(graph, aten.mul.Tensor, (again, 2), (4, 2, 3))
    graph.output((out, out2))
    assert fold_view_roundtrips(graph) == 1
    assert out.args[0] is x and out2.args[0] is again


def test_symbolic_sizes_fold_too():
    """A recompile with a dynamic batch (Dynamo's second shape) gets the same graphs as the first."""
    import aotgrad

    seen = []

    def keep(gm, _):
        seen.append(gm)
        return gm

    compiled = torch.compile(shifted_scores, backend=aotgrad.backend(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True)
    torch.manual_seed(0)
    q, r, mask = torch.randn(3, 8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True), torch.rand(8, 16)
    torch._dynamo.mark_dynamic(q, 0)
    out = compiled(q, r, mask)
    expected = shifted_scores(q.detach().clone().requires_grad_(), r, mask)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    fw, bw = seen
    assert any(isinstance(s, torch.SymInt) for n in fw.graph.nodes if n.op == "placeholder"
               for s in getattr(n.meta.get("val"), "shape", ())), "the batch is symbolic"
    assert _count(fw, *SCATTERS) == 0, fw.code
    assert _count(bw, *SCATTERS) == 2, bw.code
    assert _count(bw, aten.slice.Tensor, aten.copy.default) == 0, bw.code


def test_every_size_symbolic_gives_eagers_values_and_gradients():
    """With every size symbolic some read-backs stay (a size through two reshapes is not provably
    one symbol); what is folded, and the recorded layouts redone after it, still compute eager's."""
    compiled = torch.compile(shifted_scores, backend="aotgrad_eager", dynamic=True, fullgraph=True)
    for batch in (2, 3):
        torch.manual_seed(batch)
        q, r, mask = torch.randn(batch, 8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True), torch.rand(8, 16)
        q2, r2 = q.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
        got, expected = compiled(q, r, mask), shifted_scores(q2, r2, mask)
        torch.testing.assert_close(got, expected)
        (got * expected.detach()).sum().backward()
        (expected * expected.detach()).sum().backward()
        torch.testing.assert_close(q.grad, q2.grad)
        torch.testing.assert_close(r.grad, r2.grad)


def test_a_fold_whose_layouts_cannot_be_redone_is_undone_whole(monkeypatch, caplog):
    """The layout refresh runs fake ops on the folded values; one that refused (none is known to)
    left a half-folded graph and torch's raw error. Now the graph goes on unfolded, as traced."""
    from aotgrad.trace import capture, view_roundtrips

    with monkeypatch.context() as off:
        off.setattr(capture, "fold_view_roundtrips", lambda graph: 0)
        unfolded = [gm.code for gm in _graphs(shifted_scores, None)]

    def refuses(graph, start):
        for node in start:
            node.meta["val"] = None  # half redone, as a failure midway would leave it
        raise RuntimeError("a fake op refused the new layout")

    monkeypatch.setattr(view_roundtrips, "_refresh_layouts", refuses)
    with caplog.at_level("WARNING", logger="aotgrad.trace"):
        fw, bw = _graphs(shifted_scores, None)
    assert "view round trips left unfolded" in caplog.text and "refused the new layout" in caplog.text
    assert [fw.code, bw.code] == unfolded
    assert all(isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt, int, float, list, tuple))
               for n in fw.graph.nodes if n.op == "call_function"), fw.code
    run_both(shifted_scores, _inputs)


def test_a_permuted_value_with_a_symbolic_size_is_known_not_to_view():
    """funnel's batch-3 recompile under autocast: the fold handed a `view` a permuted input of shape
    (4, s, 16, 32); ATen's rule cannot decide with `s` symbolic, the view was tried and raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from aotgrad.trace.analysis import view_fails, view_possible

    x = torch.empty_strided((5, 4, 16, 32), (2048, 512, 32, 1))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 3)
        fake = mode.from_tensor(x, symbolic_context=context)
        permuted = fake.permute(1, 0, 2, 3)  # (4, s, 16, 32), strides (512, 2048, 32, 1)
        s = permuted.shape[1]
        assert view_possible(permuted.shape, permuted.stride(), [4, s * 16, 32]) is None
        assert view_fails(permuted, [4, s * 16, 32])
        assert not view_fails(permuted, [4, s, 512])
        assert not view_fails(fake, [s * 4, 16, 32])
