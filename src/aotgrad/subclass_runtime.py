"""Generated run-time code of the subclass stage: guard conditions, prologue and epilogue.

Per signature, straight-line Python as for plain programs (runtime.py): each subclass argument is
read attribute by attribute (or unwrapped through `_Unwrap` where its gradient is needed), the
compiled plain run is called, and each subclass output is rebuilt with its class's
`__tensor_unflatten__` and the context the trace saw (through `_Wrap` where it is differentiable).
No per-call walk over subclass metadata. `AOTGRAD_PRINT_RUNTIME=1` logs it (runtime.py).

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

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .runtime import _Source, _structure
from .subclass_layout import Opaque, SubclassLayout


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
        if i in boundary.spread:
            site = boundary.spread[i]
            names = [f"q{len(plain) + k}" for k in range(site.layout.num_plain)]
            src.emit(f"({''.join(f'{q}, ' for q in names)}) = {src.bind('spread', spread)}({src.bind('site', site)}, l{i})")
            plain += names
        elif layout is None:
            plain.append(f"l{i}")
        elif boundary.first[i] != i:
            plain += plain[slice(*boundary.ranges[boundary.first[i]])]
        elif grad and boundary.requires_grad[i]:
            names = [f"q{len(plain) + k}" for k in range(layout.num_plain)]
            site = src.bind("site", boundary.sites[i])
            src.emit(f"({''.join(f'{q}, ' for q in names)}) = {src.bind('unwrap', unwrap)}({site}, l{i})")
            plain += names
        else:
            plain += _attr_paths(layout, f"l{i}")
    src.emit(f"r = {src.bind('plain', run_plain)}([{', '.join(plain)}])")
    outs = boundary.outputs
    rank = {"ViewOut": 1, "ViewOfLeafOut": 1, "SameAs": 2}  # bases, then views of them, then repeats
    for k in sorted(range(len(outs)), key=lambda k: rank.get(type(outs[k]).__name__, 0)):
        o = outs[k]
        kind = type(o).__name__
        if kind == "PlainOut":
            src.emit(f"o{k} = r[{o.position}]")
        elif kind == "SubclassOut":
            values = [f"r[{o.start + j}]" for j in range(o.site.layout.num_plain)]
            if o.requires_grad:
                src.emit(f"o{k} = {src.bind('wrap', wrap)}({src.bind('site', o.site)}, {', '.join(values)})")
            else:
                src.emit(f"o{k} = {_rebuild_src(src, o.site.layout, values)}")
        elif kind == "LeafOut":
            src.emit(f"o{k} = l{o.leaf}")
        elif kind in ("ViewOfLeafOut", "ViewOut"):
            base = f"l{o.leaf}" if kind == "ViewOfLeafOut" else f"o{o.base}"
            src.emit(f"o{k} = {src.bind('replay', replay)}({base}, {src.bind('chain', o.chain)})")
            if o.creation_meta is not None:
                set_meta = src.bind("set_creation_meta", torch._C._autograd._set_creation_meta)
                src.emit(f"{set_meta}(o{k}, {src.bind('meta', o.creation_meta)})")
        else:
            src.emit(f"o{k} = o{o.entry}")
    if mutated:
        bump = src.bind("bump", torch.autograd.graph.increment_version)
        src.emit(f"{bump}(({''.join(f'l{i}, ' for i in mutated)}))")
    src.emit(f"return {_structure(src, boundary.out_spec, [f'o{k}' for k in range(boundary.num_user)])}")
    return src.build("run", "def run(leaves):")
