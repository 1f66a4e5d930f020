"""Inductor as the backend's graph compiler: its decompositions and pre-grad passes, `_InductorCompilers`
(`compile_fx_inner` on aotgrad's graphs), `mode=`/`options=` config patches, and restriding saved values.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from collections.abc import Callable

import torch
import torch.fx

from .. import config
from ..compile.compile import SAME_INPUTS_AS, placeholder_values
from . import avg_pool_backward, cpu_scatter, cudagraphs, donation, isa_probe
from .context import BackendCompileError, _compile_context, _graph_ids

log = logging.getLogger("aotgrad.inductor")


def inductor_compilers(patches: dict | None = None, forward_patches: dict | None = None,
                       static_inputs: cudagraphs.StaticInputs | None = None) -> _InductorCompilers:
    """Forward / backward / inference compilers (and a partition wrapper) that hand aotgrad's graphs
    to Inductor's `compile_fx_inner`, under the Inductor config `patches`; one set per Dynamo graph.
    `forward_patches` add to them for the forward and inference graphs only (the backward's inputs
    are aotgrad's own, so e.g. it keeps its input asserts where the forward's are left out).
    `static_inputs`: the parameters and buffers, which CUDA graphs keep in place (cudagraphs.py)."""
    return _InductorCompilers(patches or {}, forward_patches or {}, static_inputs)


def wake_compile_workers(example_inputs) -> bool:
    """Start Inductor's Triton-compile worker processes now, for a graph with GPU inputs, as Inductor's
    own `compile_fx` does at its start: each worker imports torch and Triton (seconds), and the pool
    stops them after a minute without jobs. Woken by the first kernel instead, a first step waits for
    them (2.8 s of ViT's on the pretend H100). True when woken."""
    if not any(isinstance(x, torch.Tensor) and x.device.type in ("cuda", "xpu") for x in example_inputs):
        return False
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wakeup()
    return True


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """Inductor config for `torch.compile(mode=..., options=...)`, checked as backend="inductor"
    checks it: a known mode, known option names, values of the option's type."""
    from typing import get_origin

    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    patches: dict = {}
    if mode is not None and mode != "default":
        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as e:
            raise BackendCompileError(f"aotgrad backend: {e}") from None
    known = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise BackendCompileError(
                f"aotgrad backend: torch.compile option {key!r} is not an Inductor config option "
                "(see torch._inductor.list_options())."
            )
        expected = inductor_config.get_type(name)
        if get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
            raise BackendCompileError(
                f"aotgrad backend: torch.compile option {key!r} takes a {expected.__name__}, got "
                f"{type(value).__name__}."
            )
        patches[name] = value
    return patches


def _inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _inductor_pre_grad_passes(gm: torch.fx.GraphModule, fakes: list) -> torch.fx.GraphModule:
    from torch._inductor.compile_fx import run_pre_grad_passes

    with _compile_context(fakes):
        return run_pre_grad_passes(gm, fakes)


# The forward module of each backward module (its output strides restride the backward's inputs).
# A side table, not `bw.meta`: Inductor's FX-graph cache key hashes the module's meta, and the forward
# module there (rewritten in place by Inductor's post-grad passes when its compile missed that cache,
# untouched when it hit) made the backward's key differ between a cold and a warm process.
_FORWARD_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def link_backward(bw: torch.fx.GraphModule, fw, pair: cudagraphs.Pair | None = None) -> None:
    """`fw`'s output strides restride `bw`'s inputs; the two share one CUDA-graph `pair`."""
    _FORWARD_OF[bw] = fw
    cudagraphs.link(bw, *([fw] if isinstance(fw, torch.fx.GraphModule) else []), pair=pair)

_NUM_FWD = "aotgrad_num_fwd_outputs"
_OUT_STRIDES = "aotgrad_output_strides"


class _InductorCompilers:
    """Compile aotgrad's graphs with `compile_fx_inner`: fake example inputs from the graph's own
    placeholders, the TracingContext/fake mode Inductor reads, the boxed convention (Inductor's
    compiled graphs take one list), and forward output strides handed to the backward."""

    def __init__(self, patches: dict, forward_patches: dict, static_inputs: cudagraphs.StaticInputs | None = None):
        from torch._guards import TracingContext

        self.static_inputs = static_inputs
        self.patches = patches  # applied here too: the backward may compile after the backend returned
        self.forward_patches = {**patches, **forward_patches}
        self.graph_id = next(_graph_ids)
        self.context = TracingContext.try_get()  # Dynamo's; re-entered for the lazy backward

    def partition(self, partition_fn: Callable) -> Callable:
        def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
            _tensorify_scalars(joint_module)
            _views_alias_their_base(joint_module)
            if config.inductor_graph_passes:
                from torch._inductor.compile_fx import _recursive_joint_graph_passes

                with self._context(placeholder_values(joint_module)):
                    joint_module = _recursive_joint_graph_passes(joint_module)
            fw, bw = partition_fn(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            fw.meta[_NUM_FWD] = num_fwd_outputs
            fw.meta[donation.FRESH_SAVED] = donation.fresh_saved(fw, num_fwd_outputs)
            link_backward(bw, fw)
            return fw, bw

        partition.__name__ = f"inductor_joint_passes({getattr(partition_fn, '__name__', 'partition')})"
        return partition

    def forward(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        n = gm.meta.get(_NUM_FWD)
        return self._compile(gm, visible=n, is_inference=False, is_backward=False, primals=example_inputs)

    def inference(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        example = placeholder_values(gm)
        _tensorify_scalars(gm)
        _views_alias_their_base(gm)
        if config.inductor_graph_passes:
            from torch._inductor.compile_fx import _recursive_joint_graph_passes

            with self._context(example):
                gm = _recursive_joint_graph_passes(gm)
        return self._compile(gm, visible=None, is_inference=True, is_backward=False, primals=example_inputs)

    def backward(self, gm: torch.fx.GraphModule, _example_inputs) -> Callable:
        first = gm.meta.get(SAME_INPUTS_AS)  # a variant of the compiled backward: its forward is that one's
        fw = _FORWARD_OF.get(gm) or _FORWARD_OF.get(first)
        fresh = fw.meta.get(donation.FRESH_SAVED, ()) if fw is not None and config.donated_buffers else ()
        donated = donation.donatable(gm, fresh)
        if fw is not None:
            _restride_saved(gm, fw)
        if cudagraphs.pair_of(gm) is None and first is not None and cudagraphs.pair_of(first) is not None:
            cudagraphs.link(gm, pair=cudagraphs.pair_of(first))
        return self._compile(gm, visible=None, is_inference=False, is_backward=True, forward=fw, donated=donated)

    @contextlib.contextmanager
    def _context(self, example: list, patches: dict | None = None):
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.virtualized import V
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

        # The graph's own fake mode (detect_fake_mode would prefer the active TracingContext's,
        # which is Dynamo's even when aotgrad traced real inputs in a fresh mode).
        fake_mode = _mode_of(example) or FakeTensorMode(allow_non_fake_inputs=True)
        ctx = TracingContext.try_get() or self.context
        if ctx is None or ctx.fake_mode is not fake_mode:
            ctx = TracingContext(fake_mode)
        patches = self.patches if patches is None else patches
        patched = inductor_config.patch(patches) if patches else contextlib.nullcontext()
        with patched, V.set_fake_mode(fake_mode), tracing(ctx), enable_python_dispatcher():
            yield ctx

    def _cudagraph_kwargs(self, gm, kind: str, primals, forward, visible) -> tuple[dict, list[int]]:
        """CUDA graphs for this graph (inductor/cudagraphs.py): `compile_fx_inner`'s arguments, and
        for a forward the backward inputs that will be static (read before Inductor rewrites it)."""
        if kind == "backward":
            graph_kwargs = cudagraphs.backward_kwargs(gm, forward)
        else:
            graph_kwargs = cudagraphs.forward_kwargs(gm, list(primals), self.static_inputs,
                                                     is_inference=kind == "inference")
        saved = cudagraphs.static_saved(gm, visible, graph_kwargs["static_input_idxs"]) if kind == "forward" else []
        log.debug("aotgrad: %s graph %s to compile_fx_inner: cudagraphs=%s static_input_idxs=%s", kind,
                  self.graph_id, graph_kwargs["cudagraphs"].value, graph_kwargs["static_input_idxs"])
        return graph_kwargs, saved

    def _compile(self, gm, *, visible, is_inference, is_backward, primals=(), forward=None,
                 donated: tuple[int, ...] = ()) -> Callable:
        from torch._guards import TracingContext
        from torch._inductor.compile_fx import compile_fx_inner

        cpu_scatter.route_to_aten(gm)
        avg_pool_backward.route_to_aten(gm)
        example = placeholder_values(gm)
        out = gm.graph.output_node()
        outs = list(out.args[0])
        n = len(outs) if visible is None else visible
        # Outputs the run time hands to the user (or rebuilds views from) keep eager's strides.
        # So do saved graph inputs: the partitioner saved them because the caller holds them anyway,
        # which a copy in Inductor's preferred layout (channels-last for convolutions) would undo.
        out.meta["user_visible_output_idxs"] = [
            i for i, o in enumerate(outs) if isinstance(o, torch.fx.Node) and (i < n or o.op == "placeholder")]
        kind = "backward" if is_backward else "inference" if is_inference else "forward"
        isa_probe.wait()  # Inductor's first C++ kernel asks for the probe's result
        with self._context(example, self.patches if is_backward else self.forward_patches) as ctx:
            graph_kwargs, saved = self._cudagraph_kwargs(gm, kind, primals, forward, visible)
            requested = graph_kwargs["cudagraphs"].value
            if requested:  # donated buffers under CUDA graphs have not been checked on a GPU yet
                donated = ()
            with TracingContext.report_output_strides() as strides, donation.donating(ctx, donated):
                compiled = compile_fx_inner(
                    gm,
                    example,
                    graph_id=self.graph_id,
                    is_inference=is_inference,
                    is_backward=is_backward,
                    **graph_kwargs,
                )
            cudagraphs.report(kind, requested, compiled, graph_kwargs)
            if saved:
                gm.meta[cudagraphs.STATIC_SAVED] = saved
            if kind == "forward" and strides is not None:
                # Concrete strides (size hints); the expressions they came from, for symbolic sizes.
                gm.meta[_OUT_STRIDES] = list(zip(strides, getattr(compiled, "output_strides", None) or strides))
        return donation.guard(compiled, donated)


def _views_alias_their_base(gm: torch.fx.GraphModule) -> None:
    """Give each view node a value that is a view of its input's value.

    The trace computes views as copies (functionalization without reapplied views), so a view
    node's value had a storage of its own. Inductor reads aliasing off node values: its no-op
    removal then dropped `clone(permute(x))`'s clone, returning a view of input x as a fresh output,
    and its re-inplacing would misjudge which buffers a write can reuse."""
    from torch.fx.experimental.proxy_tensor import enable_python_dispatcher

    from ..trace.analysis import is_view_op

    fake_mode = _mode_of(placeholder_values(gm))
    if fake_mode is None:
        return
    with fake_mode, enable_python_dispatcher():
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not is_view_op(target):
                continue
            if not node.args or not isinstance(node.args[0], torch.fx.Node):
                continue
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                value = target(*args, **kwargs)
            except Exception:  # keep the traced value
                continue
            node.meta["val"] = value
            if isinstance(value, (tuple, list)):
                for user in node.users:
                    if user.target is operator.getitem and isinstance(user.args[1], int):
                        user.meta["val"] = value[user.args[1]]


def _tensorify_scalars(gm: torch.fx.GraphModule) -> None:
    """Turn arithmetic on floats that Dynamo made dynamic back into tensor arithmetic.

    Dynamo passes such a float (a module's `eps`, `norm_type`...) as a 0-d tensor and calls `.item()`
    on it; Inductor cannot lower an `.item()` whose answer the shape environment already knows.
    torch.fx's pass rewrites those uses into tensor ops, or asks Dynamo to restart with the float
    specialised (an exception that reaches Dynamo unchanged)."""
    from torch.fx.passes._tensorify_python_scalars import tensorify_python_scalars

    fake_mode = _mode_of(placeholder_values(gm))
    if fake_mode is None or fake_mode.shape_env is None:
        return
    if any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes):
        tensorify_python_scalars(gm, fake_mode.shape_env, fake_mode)


def _specialise_dynamic_floats(gm: torch.fx.GraphModule) -> None:
    """A graph compiled per concrete shape is traced on the real inputs, where `.item()` of a float
    Dynamo made dynamic (passed as a 0-d tensor) has no symbol to answer with: ask Dynamo to restart
    with those floats specialised (baked in and guarded), as tensorify_python_scalars does."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._subclasses.fake_tensor import FakeTensor

    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        memo = value.item_memo if isinstance(value, FakeTensor) else None
        symbol = getattr(memo.node, "_expr", None) if isinstance(memo, torch.SymFloat) else None
        if symbol is not None and hasattr(symbol, "name"):  # unreplaced, as Dynamo looks it up
            names.append(symbol.name)
    if names:
        for name in names:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


def _restride_saved(bw: torch.fx.GraphModule, fw: torch.fx.GraphModule) -> None:
    """Give the backward's saved-value placeholders the strides Inductor chose for them.

    A symbolic stride is compared by its size hint, never with `==` on the symbol: that would add a
    guard pinning the size (a recompile for every new length). Where the hint differs, the
    stride expression Inductor recorded becomes the new symbolic stride."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    from ..torch_compat import optimization_hint

    strides = fw.meta.get(_OUT_STRIDES)
    n_fwd = fw.meta.get(_NUM_FWD)
    if not strides or n_fwd is None:
        return
    placeholders = [p for p in bw.graph.nodes if p.op == "placeholder"]
    for p, (stride, expressions) in zip(placeholders, strides[n_fwd:]):
        val = p.meta.get("val")
        if stride is None or not isinstance(val, torch.Tensor):
            continue
        fake_mode = getattr(val, "fake_mode", None)
        if free_symbols(val):
            if [optimization_hint(s, fallback=-1) for s in val.stride()] == [int(s) for s in stride]:
                continue
            shape_env = getattr(fake_mode, "shape_env", None)
            if shape_env is None or not all(isinstance(e, str) for e in expressions):
                continue
            stride = tuple(shape_env.deserialize_symexpr(e) for e in expressions)
        elif tuple(val.stride()) == tuple(stride):
            continue
        ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
        with ctx:
            p.meta["val"] = torch.empty_strided(val.shape, tuple(stride), dtype=val.dtype, device=val.device)


def _mode_of(values: list):
    from torch._subclasses.fake_tensor import FakeTensor

    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _fake_bw_inputs(compiler: Callable) -> Callable:
    """Backward compilers get fake example inputs (the placeholders' values), as with upstream."""

    def bw_compiler(gm, _example_inputs):
        vals = placeholder_values(gm)
        return compiler(gm, vals if all(v is not None for v in vals) else list(_example_inputs))

    return bw_compiler
