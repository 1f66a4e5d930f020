"""Generated run-time code of the subclass stage: guard conditions, prologue and epilogue.

Per signature, straight-line Python as for plain programs (runtime/runner.py): each subclass argument is
read attribute by attribute (or unwrapped through `_Unwrap` where its gradient is needed), the
compiled plain run is called, and each subclass output is rebuilt with its class's
`__tensor_unflatten__` and the context the trace saw (through `_Wrap` where it is differentiable).
No per-call walk over subclass metadata. `AOTGRAD_PRINT_RUNTIME=1` logs it (runtime/runner.py).

    def run(leaves):
        (l0, l1, ) = leaves
        (q0, q1, ) = _unwrap2(_site3, l0)          # TwoTensor requiring grad
        q2 = l1.a                                  # TwoTensor without grad: its inner tensors
        q3 = l1.b
        r = _plain4([q0, q1, q2, q3])
        o0 = _wrap5(_site6, r[0], r[1])
        return o0
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..plan import FromLeaf, GraphOutput, UserOutput
from ..runtime.runner import _Source, _structure, _unreached_when_none, make_autograd_function
from ..signature.subclass_layout import Opaque, SubclassLayout
from . import metadata as subclass_metadata
from .higher import FusedDoubleBackward


class _Rebase(torch.autograd.Function):
    """`t` written in place in grad mode: its history becomes `new`'s (the rebuilt subclass over
    the plain inner tensors, whose history the plain run time rebased), as eager's in-place op does."""

    @staticmethod
    def forward(ctx, t, new):
        ctx.mark_dirty(t)
        ctx.view = t._is_view()
        return t

    @staticmethod
    def backward(ctx, grad):
        # t's old value reaches `new` through the plain run; itself it gets zeros. For a view, autograd's
        # CopySlices passes the base the rest of its gradient beside these zeros (None would drop it all).
        return (torch.zeros_like(grad) if ctx.view else None), grad


def _attr_paths(layout: SubclassLayout, prefix: str) -> list[str]:
    out = []
    for attr, inner in zip(layout.attrs, layout.inner):
        if inner is None:
            out.append(f"{prefix}.{attr}")
        elif not isinstance(inner, Opaque):
            out += _attr_paths(inner, f"{prefix}.{attr}")
    return out


def _rebuild_src(src: _Source, layout: SubclassLayout, values: list[str]) -> str:
    """Source rebuilding a subclass of `layout` from the plain values (consumed from the front)."""
    parts = []
    for attr, inner in zip(layout.attrs, layout.inner):
        if isinstance(inner, Opaque):
            parts.append(f"{attr!r}: {src.bind('opaque', inner.value)}")
        else:
            parts.append(f"{attr!r}: {values.pop(0) if inner is None else _rebuild_src(src, inner, values)}")
    unflatten = src.bind("unflatten", layout.cls.__tensor_unflatten__)
    return (f"{unflatten}({{{', '.join(parts)}}}, {src.bind('ctx', layout.ctx)}, "
            f"{src.bind('size', layout.outer_size)}, {src.bind('stride', layout.outer_stride)})")


def build_run(boundary, run_plain: Callable, mutated: Sequence[int], fns: dict[str, Any]) -> Callable:
    """The generated `run(leaves)` for one boundary (subclass_wrap.Boundary); `fns` holds the
    boundary's `unwrap`, `spread`, `wrap` (autograd Functions' apply) and `replay` (a view chain)."""
    unwrap, spread, wrap, replay = fns["unwrap"], fns["spread"], fns["wrap"], fns["replay"]
    src = _Source()
    n = len(boundary.layouts)
    src.emit(f"({''.join(f'l{i}, ' for i in range(n))}) = leaves")
    grad = torch.is_grad_enabled()
    plain: list[str] = []
    for i, layout in enumerate(boundary.layouts):
        if boundary.first.get(i, i) != i:  # the same tensor again: its first occurrence's plain tensors
            plain += plain[slice(*boundary.ranges[boundary.first[i]])]
        elif i in boundary.spread:
            site = boundary.spread[i]
            names = [f"q{len(plain) + k}" for k in range(site.layout.num_plain)]
            src.emit(f"({''.join(f'{q}, ' for q in names)}) = {src.bind('spread', spread)}({src.bind('site', site)}, l{i})")
            plain += names
        elif layout is None:
            plain.append(f"l{i}")
        elif grad and boundary.requires_grad[i]:
            names = [f"q{len(plain) + k}" for k in range(layout.num_plain)]
            site = src.bind("site", boundary.sites[i])
            src.emit(f"({''.join(f'{q}, ' for q in names)}) = {src.bind('unwrap', unwrap)}({site}, l{i})")
            plain += names
        else:
            plain += _attr_paths(layout, f"l{i}")
    subclass_metadata.emit_prologue(src, boundary.relayouts)
    src.emit(f"r = {src.bind('plain', run_plain)}([{', '.join(plain)}])")
    if boundary.written_in_backward:
        written = "".join(f"l{i}, " for i in sorted(boundary.written_in_backward))
        src.emit(f"{src.bind('bump_in_backward', bump_in_backward)}(r, ({written}))")
    if boundary.early_views:  # views of an argument taken before its metadata changed
        subclass_metadata.emit_early_views(src, boundary, lambda k: _emit_view(src, boundary.outputs[k], k, replay))
    subclass_metadata.emit_epilogue(src, boundary.relayouts, boundary.detached)
    for i, (start, site) in sorted(boundary.rebased_at.items()):  # written in grad mode: as eager's
        values = ", ".join(f"r[{start + j}]" for j in range(site.layout.num_plain))
        src.emit(f"{src.bind('rebase', _Rebase.apply)}(l{i}, {src.bind('wrap', wrap)}({src.bind('site', site)}, {values}))")
    # eager bumps once per in-place op (_Rebase's mark_dirty did one), before the outputs' views are
    # taken: their recorded version is then current, as eager's (a no_grad view's grad_fn stays readable)
    bumped = []
    for i in mutated:
        bumped += [i] * max(boundary.bumps.get(i, 1) - (i in boundary.rebased_at), 0)
    if bumped:
        bump = src.bind("bump", torch.autograd.graph.increment_version)
        src.emit(f"{bump}(({''.join(f'l{i}, ' for i in bumped)}))")
    outs = boundary.outputs
    rank = {"ViewOut": 1, "ViewOfLeafOut": 1, "SameAs": 2}  # bases, then views of them, then repeats
    for k in sorted(range(len(outs)), key=lambda k: rank.get(type(outs[k]).__name__, 0)):
        o = outs[k]
        kind = type(o).__name__
        if k in boundary.early_views:
            continue
        if kind == "PlainOut":
            src.emit(f"o{k} = r[{o.position}]")
        elif kind == "SubclassOut":
            values = [f"r[{o.start + j}]" for j in range(o.site.layout.num_plain)]
            if o.requires_grad:
                src.emit(f"o{k} = {src.bind('wrap', wrap)}({src.bind('site', o.site)}, {', '.join(values)})")
            else:
                src.emit(f"o{k} = {_rebuild_src(src, o.site.layout, values)}")
                if o.leaf_requires_grad:
                    src.emit(f"o{k}.requires_grad_()")
        elif kind == "LeafOut":
            src.emit(f"o{k} = l{o.leaf}")
        elif kind in ("ViewOfLeafOut", "ViewOut"):
            _emit_view(src, o, k, replay)
        else:
            src.emit(f"o{k} = o{o.entry}")
    src.emit(f"return {_structure(src, boundary.out_spec, [f'o{k}' for k in range(boundary.num_user)])}")
    return src.build("run", "def run(leaves):")


def bump_in_backward(outs, written: tuple) -> None:
    """Bump the versions of subclass arguments the backward writes, when the plain backward runs.

    The plain backward writes their inner tensors (a buffer a custom Function's backward updates);
    eager's write goes through the subclass, so its own version moves then too. A hook on the plain
    Function's node (reached from the outputs it made, through views the run time rebuilt) does it."""
    seen, todo = set(), [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while todo:
        node = todo.pop(0)
        if node is None or node in seen or len(seen) > 16:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            node.register_hook(lambda grad_inputs, grad_outputs: torch.autograd.graph.increment_version(written))
            return
        todo += [n for n, _ in node.next_functions]


def _emit_view(src: _Source, o, k: int, replay: Callable) -> None:
    base = f"l{o.leaf}" if type(o).__name__ == "ViewOfLeafOut" else f"o{o.base}"
    src.emit(f"o{k} = {src.bind('replay', replay)}({base}, {src.bind('chain', o.chain)})")
    if o.creation_meta is not None:
        set_meta = src.bind("set_creation_meta", torch._C._autograd._set_creation_meta)
        src.emit(f"{set_meta}(o{k}, {src.bind('meta', o.creation_meta)})")


# ---------------------------------------------------------------------------------------------
# One autograd.Function for the whole call (the common case)


def _fusable_plain(run_plain: Callable) -> bool:
    """The plain run is nothing but its autograd.Function: each graph input one caller leaf of its
    own, outputs returned as the graph returns them, nothing before or after the call."""
    plan, compiled = getattr(run_plain, "plan", None), getattr(run_plain, "compiled", None)
    if plan is None or compiled is None or not plan.is_training or not compiled.num_fw_outputs:
        return False
    lay = plan.layout
    primal_leaves = [s.leaf if isinstance(s, FromLeaf) else None for s in lay.primal_sources]
    tensors_leaves = [p for p in lay.leaf_primal if p is not None]
    return (
        None not in primal_leaves and len(set(primal_leaves)) == len(primal_leaves)
        and len(tensors_leaves) == len(set(tensors_leaves)) and not lay.leaf_views
        and not plan.prologue and not plan.epilogue and not plan.grad_free and not plan.autocast
        and plan.grad_mode_at_call and not plan.symbol_sources and not compiled.written_in_place
        and not any(m.any or m.in_backward for m in plan.mutations)
        and all(isinstance(o.kind, UserOutput) for o in plan.fw_outputs)
        and len(plan.out_sources) == compiled.num_fw_outputs
        and all(isinstance(s, GraphOutput) and s.index == k for k, s in enumerate(plan.out_sources))
    )


def fusable(boundary, run_plain: Callable, mutated: Sequence[int], inner_requires_grad: bool) -> bool:
    """Whether `build_fused_run` can serve this signature; else the general run (`build_run`)."""
    return (
        torch.is_grad_enabled() and not mutated and not boundary.spread and not inner_requires_grad
        and not boundary.rebased_at and not boundary.relayouts and not boundary.detached
        and all(boundary.first.get(i, i) == i for i in range(len(boundary.layouts)))
        and all(type(o).__name__ in ("PlainOut", "SubclassOut") for o in boundary.outputs)
        and len(boundary.outputs) == boundary.num_user
        and _fusable_plain(run_plain)
        and all(_without_gradient(o, run_plain.plan) for o in boundary.outputs
                if type(o).__name__ == "SubclassOut" and not o.requires_grad)
    )


def _without_gradient(o, plan) -> bool:
    """A subclass output eager gives no gradient whose plain values get none either (else it is a
    leaf requiring grad, which the general run rebuilds as such)."""
    return not any(plan.fw_outputs[o.start + j].differentiable for j in range(o.site.layout.num_plain))


def build_fused_run(boundary, run_plain: Callable, examples: Sequence[Any]) -> Callable:
    """The generated `run(leaves)` as ONE autograd.Function around the plain run's own generated
    forward/backward (same ctx): subclass arguments are read attribute by attribute inside its
    forward, which holds the plain forward's body (`_inline_forward`; else calls it), subclass
    outputs built there; its backward flattens the outputs' gradients, runs the plain backward, and
    rebuilds the arguments' gradients. Per call that is one Function.apply where the general run
    has one per argument and output plus the plain one.

        def forward(ctx, l0, ):
            primals = (l0.a, l0.b, )
            outs = _fw(list(primals))          # ... the plain forward's body
            return _unflatten({'a': outs[0], 'b': outs[1]}, None, (1,), (1,))
        def backward(ctx, g0):
            gs = _plain_bw(ctx, *_flatten_grad(g0))
            return _rebuild_grad(gs[0:2])

    None where it cannot (a gradient to fill with zeros of symbolic size): the general run then."""
    plan = run_plain.plan
    plain_fn = make_autograd_function(plan, run_plain.compiled)
    diff = [k for k, o in enumerate(plan.fw_outputs) if o.differentiable]
    may_be_none = {k for ks in _unreached_when_none(plan, run_plain.compiled, diff).values() for k in ks}
    n = len(boundary.layouts)
    leaves = [f"l{i}" for i in range(n)]
    fw, bw = _Source(), _Source()
    # plain leaf expressions (caller leaf -> its inner tensors), then the graph inputs among them
    plain: list[str] = []
    for i, layout in enumerate(boundary.layouts):
        plain += [f"l{i}"] if layout is None else _attr_paths(layout, f"l{i}")
    primals = [plain[s.leaf] for s in plan.layout.primal_sources]
    if not _inline_forward(fw, plain_fn.forward, primals):
        fw.emit(f"outs = {fw.bind('plain_fw', plain_fn.forward)}(ctx, {', '.join(primals)})")
    higher = run_plain.compiled.higher_order is not None
    if higher:  # for a create_graph=True backward (subclass/higher.py); one reference, no copy
        fw.emit(f"ctx.leaves = ({''.join(f'{x}, ' for x in leaves)})")
    outs, grads, nondiff = [], [], []
    for k, o in enumerate(boundary.outputs):
        if type(o).__name__ == "PlainOut":
            outs.append(f"outs[{o.position}]")
            grads.append(f"g{k}, ")
            continue
        m = o.site.layout.num_plain
        fw.emit(f"o{k} = {_rebuild_src(fw, o.site.layout, [f'outs[{o.start + j}]' for j in range(m)])}")
        outs.append(f"o{k}")
        nones = "None, " * m
        if o.requires_grad:
            flat = bw.bind("flatten_grad", o.site.flatten_grad)
            grads.append(f"*({flat}(g{k}) if g{k} is not None else ({nones})), ")
        else:  # a subclass output without gradient (as eager's): its plain values get none either
            nondiff.append(f"o{k}")
            grads.append(nones)
    if nondiff:  # beside the plain forward's own (ctx.mark_non_differentiable replaces the set)
        fw.emit(f"ctx.mark_non_differentiable(*getattr(ctx, 'non_differentiable', ()), {', '.join(nondiff)})")
    fw.emit(f"return {''.join(['('] + [f'{x}, ' for x in outs] + [')'])}")
    forward = fw.build("forward", f"def forward(ctx, {''.join(f'{x}, ' for x in leaves)}):")
    # create_graph=True: a backward autograd records (subclass/higher.py), over the arguments it keeps
    double = FusedDoubleBackward(boundary, plan, plain_fn.backward, higher)
    bw.emit(f"if {bw.bind('grad_enabled', torch.is_grad_enabled)}():")
    bw.emit(f"return {bw.bind('double', double)}(ctx, {''.join(f'g{k}, ' for k in range(len(outs)))})", 2)
    order = sorted(range(len(boundary.outputs)), key=lambda k: _plain_start(boundary.outputs[k]))
    bw.emit(f"gs = {bw.bind('plain_bw', plain_fn.backward)}(ctx, {''.join(grads[k] for k in order)})")
    if higher:  # the plain backward let go of its inputs (the graph is freed): so do we
        bw.emit("if ctx.primals is None:")
        bw.emit("ctx.leaves = None", 2)
    primal_of = {s.leaf: k for k, s in enumerate(plan.layout.primal_sources)}
    returned: list[str] = []
    pos = 0
    for i, layout in enumerate(boundary.layouts):
        width = 1 if layout is None else layout.num_plain
        ks = [primal_of.get(p) for p in range(pos, pos + width)]
        pos += width
        if not boundary.requires_grad[i] or None in ks:
            returned.append("None")
        elif layout is None:
            returned.append(f"gs[{ks[0]}]")
        else:
            rebuild = bw.bind("rebuild_grad", boundary.sites[i].rebuild_grad)
            maybe_none = [k for k in ks if k in may_be_none]
            if not maybe_none:
                returned.append(f"{rebuild}(({''.join(f'gs[{k}], ' for k in ks)}))")
                continue
            # some inner gradients may be None (inputs eager leaves without gradient): all None is
            # no gradient; otherwise the missing ones are zeros, as autograd materialises them
            parts = []
            for k in ks:
                if k in maybe_none:
                    t = examples[plan.layout.primal_sources[k].leaf]
                    if not all(isinstance(d, int) for d in t.shape):
                        return None
                    z = bw.bind("zeros", functools.partial(torch.zeros, tuple(t.shape), dtype=t.dtype, device=t.device))
                    parts.append(f"gs[{k}] if gs[{k}] is not None else {z}()")
                else:
                    parts.append(f"gs[{k}]")
            all_none = " and ".join(f"gs[{k}] is None" for k in maybe_none)
            rebuilt = f"{rebuild}(({''.join(f'{x}, ' for x in parts)}))"
            returned.append(f"(None if {all_none} else {rebuilt})" if len(maybe_none) == len(ks) else rebuilt)
    bw.emit(f"return ({''.join(f'{x}, ' for x in returned)})")
    backward = bw.build("backward", f"def backward(ctx, {''.join(f'g{k}, ' for k in range(len(outs)))}):")
    fused = type("CompiledSubclassFunction", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    # the plain backward reads constants off its ctx's class (runtime: static tangent shapes)
    shapes = getattr(plain_fn._backward_cls, "tangent_shapes", None)
    if shapes is not None:
        fused._backward_cls.tangent_shapes = shapes
    src = _Source()
    src.emit(f"({''.join(f'{x}, ' for x in leaves)}) = leaves")
    names = [f"o{k}" for k in range(len(outs))]
    # Function.apply's Python work (default-argument binding, functorch's dead-wrapper unwrapping)
    # only where a functorch transform is active; else the C apply, called from here (no wrapper frame)
    active, slow = src.bind("transforms_active", torch._C._are_functorch_transforms_active), src.bind("apply", fused.apply)
    direct = src.bind("direct", super(torch.autograd.Function, fused).apply)
    call = f"({', '.join(leaves)})"
    src.emit(f"({''.join(f'{x}, ' for x in names)}) = {slow}{call} if {active}() else {direct}{call}")
    src.emit(f"return {_structure(src, boundary.out_spec, names)}")
    return src.build("run", "def run(leaves):")


def _inline_forward(fw: _Source, forward: Callable, primals: list[str]) -> bool:
    """Emit the plain Function's generated forward body into `fw` (its `outs` then holds the plain
    outputs), so a call makes one Python call less. False, emitting nothing, where its source is not
    the expected shape or its globals would clash with `fw`'s (emitted first: later names are new)."""
    lines = getattr(forward, "__aotgrad_source__", "").rstrip("\n").split("\n")
    if lines[0] != "def forward(ctx, *primals):" or lines[-1] != "    return outs" or fw.lines:
        return False
    names = {k: v for k, v in forward.__globals__.items() if k != "__builtins__"}
    if any(k in fw.globals and fw.globals[k] is not v for k, v in names.items()):
        return False
    fw.globals.update(names)
    fw.emit(f"primals = ({''.join(f'{p}, ' for p in primals)})")
    fw.lines += lines[1:-1]
    return True


def _plain_start(o) -> int:
    return o.position if type(o).__name__ == "PlainOut" else o.start
