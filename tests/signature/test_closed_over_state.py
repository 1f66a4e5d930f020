"""Closed-over state under aot_function / aot_module against eager (issue 38): tensors the program
reaches without being passed them (closure cells, globals, module attributes, buffers of modules
reached through a closure) are read per call, mutated once, followed when rebound; closed-over
modules' training flags, hooks and parameters are guarded. Each case runs three calls with the
state changed between them, on an eager copy and a compiled copy built the same way."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch.testing._internal.two_tensor import TwoTensor

from aotgrad import InplaceOnLeafError, UnsupportedMutationError, aot_function, aot_module, nop
from aotgrad.testing import check_against_eager


def _tensors(state: SimpleNamespace) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in vars(state).items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        elif isinstance(v, nn.Module):
            out.update({f"{k}.{n}": t for n, t in v.state_dict(keep_vars=True).items()})
            out.update({f"{k}.{n}": t for n, t in _plain_attrs(v)})
    return out


def _plain_attrs(mod: nn.Module):
    for path, sub in mod.named_modules():
        for k, v in vars(sub).items():
            if isinstance(v, torch.Tensor):
                yield f"{path}.{k}", v


def three_calls(build: Callable, change: Callable, make_inputs: Callable, wrap: Callable | None = None) -> None:
    """`build()` -> (fn, state): run `fn` eagerly on one copy and compiled (`wrap`, default
    aot_function(nop)) on another, three calls, `change(state, i)` applied to both between calls;
    outputs, input gradients, and the state's tensors (values, .grad) must match eager's."""
    torch.manual_seed(0)
    eager_fn, eager_state = build()
    torch.manual_seed(0)
    comp_fn, comp_state = build()
    compiled = (wrap or (lambda f: aot_function(f, nop)))(comp_fn)
    for i in range(3):
        torch.manual_seed(i)
        xe = make_inputs()
        xc = [x.detach().clone().requires_grad_(x.requires_grad) for x in xe]
        out_e, out_c = eager_fn(*xe), compiled(*xc)
        torch.testing.assert_close(out_c, out_e, msg=lambda m, i=i: f"call {i}: output: {m}")
        if out_e.requires_grad:
            out_e.sum().backward()
            out_c.sum().backward()
            for a, b in zip(xc, xe):
                torch.testing.assert_close(a.grad, b.grad)
        te, tc = _tensors(eager_state), _tensors(comp_state)
        assert te.keys() == tc.keys()
        for k in te:
            torch.testing.assert_close(tc[k], te[k], msg=lambda m, k=k, i=i: f"call {i}: {k}: {m}")
            torch.testing.assert_close(tc[k].grad, te[k].grad, msg=lambda m, k=k, i=i: f"call {i}: {k}.grad: {m}")
        change(eager_state, i)
        change(comp_state, i)


def _x():
    return (torch.randn(3, requires_grad=True),)


# 1. closed-over tensors that do not require grad: current value, mutations once, rebinding ----------


def test_closed_over_buffer_mutated_in_place_once_per_call():
    def build():
        st = SimpleNamespace(buf=torch.zeros(3))

        def f(x):
            st.buf.add_(1)
            return x * st.buf

        return f, st

    def change(st, i):
        st.buf.mul_(3)  # the caller's own update between calls is seen

    three_calls(build, change, _x)


def test_closure_cell_mutated_and_rebound():
    def build():
        buf = torch.zeros(3)
        st = SimpleNamespace(buf=buf)

        def f(x):
            buf.add_(1)
            return x * buf + st.scale

        st.scale = torch.ones(3)
        return f, st

    def change(st, i):
        st.scale = torch.full((3,), float(i + 2))  # rebound: the new tensor is read

    three_calls(build, change, _x)


G_STEP = torch.zeros(())
G_SCALE = torch.ones(3)


def _uses_globals(x):
    G_STEP.add_(1)
    return x * G_SCALE * G_STEP


def test_global_tensors_mutated_and_rebound():
    global G_STEP, G_SCALE
    f = aot_function(_uses_globals, nop)
    for i in range(3):
        x = torch.randn(3, requires_grad=True)
        step, scale = G_STEP.clone(), G_SCALE.clone()
        out = f(x)
        torch.testing.assert_close(out, x * scale * (step + 1))
        torch.testing.assert_close(G_STEP, step + 1)
        out.sum().backward()
        torch.testing.assert_close(x.grad, scale * (step + 1))
        G_SCALE = torch.full((3,), float(i + 2))  # rebound
        if i == 1:
            G_STEP = torch.full((), 10.0)


def test_first_call_does_not_run_the_program_on_the_callers_tensors():
    buf = torch.zeros(3)
    f = aot_function(lambda x: x * buf.add_(1), nop)
    out = f(torch.ones(3))
    torch.testing.assert_close(buf, torch.ones(3))
    torch.testing.assert_close(out, torch.ones(3))


class Counting(nn.Module):
    """A plain tensor attribute (not a registered buffer) updated in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = torch.zeros(1)

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) * self.calls


def test_module_tensor_attribute_through_closure_and_aot_module():
    def build():
        st = SimpleNamespace(m=Counting())
        return (lambda x: st.m(x)), st

    def change(st, i):
        if i == 0:
            st.m.calls = torch.full((1,), 5.0)  # a rebound attribute
        else:
            with torch.no_grad():
                st.m.lin.weight.mul_(2)

    three_calls(build, change, _x)

    def build_module():
        m = Counting()
        return m, SimpleNamespace(m=m)

    three_calls(build_module, change, _x, wrap=lambda m: aot_module(m, nop))


def test_rebinding_inside_the_program_is_refused_by_name_and_undone():
    class Rebinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = torch.zeros(1)

        def forward(self, x):
            self.calls = self.calls + 1
            return x * self.calls

    m = Rebinds()
    before = m.calls
    f = aot_function(lambda x: m(x), nop)
    with pytest.raises(UnsupportedMutationError, match=r"m\.calls.*in place"):
        f(torch.ones(1))
    assert m.calls is before


def test_closed_over_leaf_mutated_in_place_is_named():
    W = torch.zeros(3, requires_grad=True)

    def f(x):
        W.add_(x)
        return x

    with pytest.raises(RuntimeError):  # eager refuses it too
        f(torch.ones(3))
    with pytest.raises(InplaceOnLeafError, match="closed-over closure variable 'W'"):
        aot_function(f, nop)(torch.ones(3))


# 2. modules reached through a closure: training flags, hooks, reassigned parameters ----------------


def test_dropout_mode_toggled_between_calls():
    drop = nn.Dropout(0.5)
    f = aot_function(lambda t: drop(t), nop)
    x = torch.ones(200)
    for training in [True, False, True]:
        drop.train(training)
        out = f(x)
        if training:
            assert set(out.unique().tolist()) == {0.0, 2.0}
        else:
            torch.testing.assert_close(out, x)


def test_hooks_added_and_removed_between_calls():
    def build():
        st = SimpleNamespace(lin=nn.Linear(3, 3), handles=[])
        return (lambda x: st.lin(x).relu()), st

    def change(st, i):
        if i == 0:
            st.handles.append(st.lin.register_forward_hook(lambda m, a, out: out * 2))
            st.handles.append(module_globals.register_module_forward_pre_hook(lambda m, a: (a[0] + 1,)))
        else:
            for h in st.handles:
                h.remove()
            st.handles.clear()

    try:
        three_calls(build, change, _x)
    finally:
        module_globals._global_forward_pre_hooks.clear()


def test_reassigned_parameter_and_replaced_submodule():
    def build():
        st = SimpleNamespace(m=nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        return (lambda x: st.m(x)), st

    def change(st, i):
        torch.manual_seed(10 + i)
        if i == 0:
            st.m[0].weight = nn.Parameter(torch.randn(4, 3))
        else:
            st.m[2] = nn.Linear(4, 2)

    three_calls(build, change, _x)


def _bn_model():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("path", ["aot_function", "aot_module"])
def test_batchnorm_functorch_swap_updates_running_stats_once(path):
    """`aot_function(lambda x, y: loss(model(x), y), nop)`: the running-stat update is lifted and
    applied once per call; eval() between calls switches to the running stats."""

    def build():
        st = SimpleNamespace(model=_bn_model(), y=torch.randn(5, 2))
        if path == "aot_module":
            return st.model, st
        return (lambda x: nn.functional.mse_loss(st.model(x), st.y)), st

    def change(st, i):
        st.model.train(i == 1)

    three_calls(build, change, lambda: (torch.randn(5, 4, requires_grad=True),),
                wrap=None if path == "aot_function" else (lambda m: aot_module(m, nop)))


def test_module_mode_toggle_compiles_once_per_mode():
    model = _bn_model()
    compiles = []

    def counting(gm, _):
        compiles.append(gm)
        return gm

    f = aot_function(lambda x: model(x).sum(), counting)
    x = torch.randn(5, 4)
    for training in [True, False, True, False]:
        model.train(training)
        torch.testing.assert_close(f(x), model(x).sum())
    assert len(compiles) == 2  # one forward per mode: toggling back reuses the first


# 3. a closed-over tensor subclass requiring grad (fuzzer --subclass --seed 77, program 1077) --------


W_TWO = None


def _two_tensor_global(a, b):
    return a * a * W_TWO, b


def test_closed_over_two_tensor_requiring_grad():
    def make_inputs():
        global W_TWO
        g = torch.Generator().manual_seed(1)
        W_TWO = TwoTensor(torch.randn((), generator=g), torch.randn((), generator=g)).requires_grad_()
        a = TwoTensor(torch.randn(3, generator=g), torch.randn(3, generator=g)).requires_grad_()
        return (a, W_TWO), (a, torch.ones(2))

    compiled = aot_function(_two_tensor_global, nop)
    for _ in range(3):
        check_against_eager(_two_tensor_global, make_inputs, compiled=compiled)



def test_plain_argument_passed_twice_with_a_subclass_gradient():
    """Program 1077's retrace: a plain argument passed twice whose gradient is a TwoTensor (spread
    into one plain input per inner gradient) gets the same plain inputs at both places."""

    def f(w, a, b):
        return a * w + b * 2

    def make_inputs():
        g = torch.Generator().manual_seed(2)
        w = TwoTensor(torch.randn((), generator=g), torch.randn((), generator=g)).requires_grad_()
        r = torch.randn(3, generator=g).requires_grad_()
        return (w, r), (w, r, r)

    compiled = aot_function(f, nop)
    for _ in range(3):
        check_against_eager(f, make_inputs, compiled=compiled)


G_BIAS = torch.zeros(3)


class Outer(nn.Module):
    """Reaches a module it does not register (a list) and a global tensor it updates in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.side = [nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0), nn.BatchNorm1d(3))]

    def forward(self, x):
        G_BIAS.add_(0.5)
        return self.side[0](self.lin(x)) + G_BIAS


@pytest.mark.parametrize("path", ["aot_function", "aot_module"])
def test_unregistered_submodule_and_global_through_a_module(path):
    """The side module's mode and hooks, the global's in-place update and rebinding, a new
    parameter object in the side module: all followed between the three calls."""
    global G_BIAS
    saved = G_BIAS

    def build():
        global G_BIAS
        G_BIAS = torch.zeros(3)
        torch.manual_seed(0)
        st = SimpleNamespace(m=Outer())
        return (st.m if path == "aot_module" else (lambda x: st.m(x))), st

    def change(st, i):
        global G_BIAS
        side = st.m.side[0]
        if i == 0:
            side.eval()
            side[0].register_forward_hook(lambda m, a, out: out * 3)
        else:
            side.train()
            side[0].bias = nn.Parameter(torch.ones(3))
            G_BIAS = torch.full((3,), 2.0)

    try:
        # the eager and compiled copies share the global: compare each call's output and update
        eager_fn, est = build()
        comp_fn, cst = build()
        compiled = aot_module(comp_fn, nop) if path == "aot_module" else aot_function(comp_fn, nop)
        for i in range(3):
            torch.manual_seed(i)
            x = torch.randn(4, 3)
            before = G_BIAS.clone()
            out_e = eager_fn(x)
            G_BIAS.copy_(before)
            out_c = compiled(x)
            torch.testing.assert_close(out_c, out_e, msg=lambda m, i=i: f"call {i}: {m}")
            torch.testing.assert_close(G_BIAS, before + 0.5)
            for a, b in zip(_tensors(est).values(), _tensors(cst).values()):
                torch.testing.assert_close(b, a)
            side_e, side_c = est.m.side[0], cst.m.side[0]
            torch.testing.assert_close(side_c[2].running_mean, side_e[2].running_mean)
            change(est, i)
            change(cst, i)
    finally:
        G_BIAS = saved


# 4. the per-call check: one generated guard per entry (issue 38, item 6) ---------------------------


def _counting(compiled):
    """Wrap each fast-path guard and the state check of `compiled`, and its slow path: count calls."""
    calls = {"guards": [], "state": 0, "slow": 0}
    state, slow = compiled._state_ok, compiled._call_slow

    def wrap(guard):
        def counted(args):
            calls["guards"].append(guard)
            return guard(args)

        counted.__aotgrad_args__ = guard.__aotgrad_args__  # refolded from it when the state check changes
        return counted

    def counted_state():
        calls["state"] += 1
        return state()

    def counted_slow(*a):
        calls["slow"] += 1
        return slow(*a)

    compiled.fast = [(wrap(g), r) for g, r in compiled.fast]
    compiled._state_ok, compiled._call_slow = counted_state, counted_slow
    return calls


def test_closed_over_state_is_checked_in_each_entrys_one_guard():
    """A program closing over a module and a tensor, compiled for two shapes: a call runs one
    generated guard per entry it tries (the arguments and the state in one function) and no
    separate state check; each guard's source holds both."""
    lin = nn.Linear(3, 3)
    w = torch.full((3,), 2.0)

    def f(x):
        return lin(x) * w

    compiled = aot_function(f, nop)
    small, big = torch.randn(3), torch.randn(2, 3)
    compiled(small)
    compiled(big)
    assert len(compiled.fast) == 2 and compiled._state_ok is not None
    for guard, _ in compiled.fast:
        src = guard.__aotgrad_source__
        assert src.count("def ") == 1 and "len(args) == 4" in src
        assert "cell_contents is _L" in src and ".training is True" in src
    calls = _counting(compiled)
    torch.testing.assert_close(compiled(small), f(small))  # the older entry: both guards tried
    assert len(calls["guards"]) == 2 and calls["guards"][0] is not calls["guards"][1]
    assert calls["state"] == 0 and calls["slow"] == 0
    torch.testing.assert_close(compiled(big), f(big))  # the newer entry: its guard only
    assert len(calls["guards"]) == 3 and calls["state"] == 0 and calls["slow"] == 0


def test_rebinding_refolds_the_guards_so_later_calls_take_the_fast_path():
    """A rebound closed-over tensor fails the guard once (the slow path reads the new tensor and
    folds the new state check into every entry); the next calls are on the fast path again. The
    same for a module's mode (its own entry, compiled once)."""
    lin = nn.Linear(3, 3)
    w = torch.full((3,), 2.0)

    def f(x):
        return lin(x) * w

    def rebind(v):
        nonlocal w
        w = v

    compiled = aot_function(f, nop)
    x = torch.randn(3)
    compiled(x)
    calls = _counting(compiled)
    torch.testing.assert_close(compiled(x), f(x))
    assert calls["slow"] == 0
    rebind(torch.full((3,), 5.0))
    torch.testing.assert_close(compiled(x), f(x))
    assert calls["slow"] == 1 and compiled.lifted[-1] is w
    calls["guards"].clear()
    torch.testing.assert_close(compiled(x), f(x))
    assert calls["slow"] == 1 and len(calls["guards"]) == 0  # the refolded guard (not the counted one)
    (guard, _), = compiled.fast
    assert guard(tuple(compiled.lifted) + (x,))
    lin.eval()
    for _ in range(2):
        torch.testing.assert_close(compiled(x), f(x))
    assert calls["slow"] == 2  # once for the new mode, then its own entry's guard


def test_rebinding_keeps_the_entrys_guard_with_its_names_rebound():
    """A rebound tensor changes what the state terms compare against, not the terms: the entry's
    guard is kept (no code generated on that call) and sees the new tensor."""
    w = torch.ones(3)

    def f(x):
        return x * w

    compiled = aot_function(f, nop)
    x = torch.randn(3)
    compiled(x)
    (guard, _), = compiled.fast
    for value in (3.0, 4.0):
        w = torch.full((3,), value)
        torch.testing.assert_close(compiled(x), x * value)
        (again, _), = compiled.fast
        assert again is guard and compiled.lifted == (w,) and guard((w, x))
    assert len(compiled.cache) == 1


def test_no_closed_over_state_means_the_argument_guard_alone():
    compiled = aot_function(lambda x: x.sin(), nop)
    compiled(torch.randn(3))
    (guard, _), = compiled.fast
    assert compiled._state_ok is None and compiled.lifted == ()
    assert not hasattr(guard, "__aotgrad_args__") and "try:" not in guard.__aotgrad_source__


def test_folded_guard_calls_both_checks_where_their_names_collide():
    from aotgrad.signature import lifting

    scope = {"_L0": 1}
    exec("def guard(args):\n    return _L0 == 1 and len(args) == 1", scope)
    guard = scope["guard"]
    guard.__aotgrad_conds__ = ["_L0 == 1", "len(args) == 1"]
    t = torch.ones(1)
    cell = (lambda: t).__closure__[0]
    state = lifting.make_state_guard([t], [lifting.Place(cell, None, "t")], [])
    combined = lifting.with_state(guard, state)
    assert "_args(args)" in combined.__aotgrad_source__ and "_state()" in combined.__aotgrad_source__
    assert combined((0,)) and not combined((0, 1))
    assert lifting.with_state(combined, None) is guard


@pytest.mark.parametrize("width", [1, 40])  # one inline condition per item, and the `map` terms past _INLINE
def test_module_state_guard_sees_each_kind_of_change(width):
    from aotgrad.signature import module_state

    def make():
        return nn.Sequential(*[nn.Linear(2, 2) for _ in range(width)], nn.BatchNorm1d(2))

    changes = [
        lambda m: m[0].eval(),
        lambda m: m[0].register_forward_hook(lambda *a: None),
        lambda m: m[-1].register_forward_pre_hook(lambda *a: None),
        lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(2, 2))),
        lambda m: m[0].register_buffer("extra", torch.ones(1)),
        lambda m: delattr(m[-1], "running_mean"),
        lambda m: m.append(nn.ReLU()),
        lambda m: setattr(m, "0", nn.Linear(2, 2)),
    ]
    for change in changes:
        mod = make()
        guard = module_state.make_state_guard(mod, [])
        assert guard()
        change(mod)
        assert not guard()
    mod = make()
    mod[0].register_forward_hook(lambda *a: None)
    guard = module_state.make_state_guard(mod, [])
    handle = mod[0].register_forward_hook(lambda *a: None)
    assert not guard()
    handle.remove()
    assert guard()
    mod[0]._forward_hooks.clear()  # the same number of hooks, another one
    mod[0].register_forward_hook(lambda *a: None)
    assert not guard()
