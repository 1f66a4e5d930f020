"""torch 2.13's precompile with aotgrad's backends: `aot_compile`, `save_compiled_function`,
`torch.compiler.load_compiled_function`.

    compiled = torch.compile(model, fullgraph=True, backend="aotgrad").forward.aot_compile(((x,), {}))
    compiled.save_compiled_function("model.pt2c", external_data={"model": model})
    # in a new process: no Dynamo trace, no aotgrad trace, no Inductor compile
    loaded = torch.compiler.load_compiled_function(open("model.pt2c", "rb"), external_data={"model": model})

Dynamo asks the backend for a `SerializableCallable` while it precompiles (it turns on
`torch._functorch.config.bundled_autograd_cache`, which is how `requested()` tells). The backend then
compiles the graph as usual, with two differences: the backward is compiled at once (the saved file
must hold it), and what the compile produced is kept as an aotgrad cache entry (cache_serialize.Entry:
the plan, the graphs, Inductor's FX-graph keys). The saved bytes are that entry, the bytes of
Inductor's FX-graph cache entries for those keys (written back into the loading process's Inductor
cache when missing there, so the file works on a machine that never compiled it), the backend (its
compilers by reference, its Inductor patches), and the inputs' metadata. A load rebuilds the run time
as an on-disk cache hit does (cache_load.rebuild): Inductor's compiled code is loaded by key.

Whatever cannot be saved is refused while `aot_compile` runs, with `PrecompileError` (an
`AotgradError`): a compiler or partitioner without `aotgrad_cache_key`, or one pickle cannot import
by name; tensor subclass, symbolic-size or list inputs; inputs sharing memory; a graph whose
entry cannot be made. A file that is edited, truncated or written by another aotgrad or torch
version is refused at load with `PrecompileLoadError` naming which.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._dynamo.aot_compile_types import SerializableCallable

from ..cache.key import Uncacheable, aotgrad_version, torch_version
from ..cache.store import Probe
from ..errors import AotgradError
from ..inductor import isa_probe
from ..inductor.context import BackendCompileError, _describe_failure, _must_propagate

log = logging.getLogger("aotgrad.precompile")

FORMAT = 1  # bump when what a saved graph holds changes
_MAGIC = b"AOTGRAD-PRECOMPILE\n"


class PrecompileError(BackendCompileError):
    """A graph `aot_compile` asked aotgrad for cannot be saved (the message says what to change)."""


class PrecompileLoadError(AotgradError):
    """A precompiled aotgrad graph cannot be loaded (edited or truncated file, other versions)."""


def requested() -> bool:
    """Whether Dynamo is precompiling (`aot_compile`): it asks backends for serializable results
    by turning on `bundled_autograd_cache` around the backend call."""
    import torch._functorch.config as functorch_config

    return bool(functorch_config.bundled_autograd_cache)


# ----------------------------------------------------------------------------------------------
# aot_compile: compile, and keep what a load needs
# ----------------------------------------------------------------------------------------------


@dataclass
class _Saved:
    """What one precompiled Dynamo graph is saved as (pickled by cache_serialize.dumps)."""

    entry: Any  # cache_serialize.Entry, backward's Inductor key included
    backend: Any  # the AotgradBackend that compiled it (compilers by reference, Inductor patches)
    leaves: tuple  # per graph input: ("tensor", shape, stride, offset, dtype, device, requires_grad) or ("value", v)
    inductor_files: dict  # FX-graph key -> the bytes of Inductor's cache entries under it
    check_sizes: bool  # the forward was compiled without Inductor's input asserts (input_checks.py)
    check_aliasing: bool
    sizes_fixed: bool


_active = threading.local()  # the _Saved being filled while the backend compiles for aot_compile


def probe(backend: Any) -> Probe | None:
    """The backend's cache hook while precompiling (`_PrecompileProbe`), else None."""
    target = getattr(_active, "target", None)
    return None if target is None else _PrecompileProbe(target)


def compile_graph(backend: Any, gm: torch.fx.GraphModule, example_inputs: list, **kwargs) -> PrecompiledGraph:
    """The backend's answer to `aot_compile`: the graph compiled as `backend(gm, example_inputs)`
    compiles it, wrapped with the bytes a load needs. Refusals and failures raise (no eager
    fallback: an eager graph cannot be saved)."""
    from ..trace.interpreter_stack import on_roomy_stack

    chosen = backend._with_compile_options(example_inputs, **kwargs)
    _check_graph(chosen, gm, example_inputs)
    import torch._functorch.config as functorch_config

    target: dict = {}
    _active.target = target
    try:
        # Inductor skips its FX-graph cache in bundled mode; aotgrad saves that cache's entries instead
        # (a cold aot_compile reuses them, a load writes them back: `_restore_inductor_files`).
        with chosen._inductor_patches(), functorch_config.patch(bundled_autograd_cache=False):
            run = on_roomy_stack(chosen._compile, gm, list(example_inputs))
    except Exception as e:
        if _must_propagate(e) or isinstance(e, AotgradError):
            raise
        raise _describe_failure(e, gm) from e
    finally:
        _active.target = None
    if "saved" not in target:
        raise PrecompileError("aotgrad precompile: the graph was compiled without a cache entry to save "
                              "(unexpected; report it)")
    return PrecompiledGraph(run, _encode(target["saved"]))


def _refuse(reason: str) -> PrecompileError:
    return PrecompileError(f"aotgrad cannot save this graph for aot_compile: {reason}.")


def _check_graph(backend: Any, gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """Refuse, before compiling, what a saved graph could not reproduce."""
    from ..api import _named_state
    from ..cache.key import _inputs_parts, _symbolic_placeholders, backend_key
    from ..signature.inputs import alias_key

    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        raise _refuse("the graph takes lists of tensors (compiled autograd)")
    try:
        backend_key(backend)
        _symbolic_placeholders(gm)
        _inputs_parts(list(example_inputs))
    except Uncacheable as e:
        raise _refuse(str(e)) from None
    if _named_state(gm)[1]:
        raise _refuse("parameters or buffers are attributes of the Dynamo graph, not inputs")
    if alias_key(list(example_inputs)):
        raise _refuse("two inputs share memory (the same tensor twice, or views of one storage)")
    try:
        pickle.dumps(backend)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the refusal
        raise _refuse(f"the backend's compilers or partitioner cannot be pickled by name ({type(e).__name__}: {e}); "
                      "use module-level functions") from None


class _PrecompileProbe(Probe):
    """Compile the signature with its entry recorded (cache_serialize), the backward compiled now,
    and keep the result in `target["saved"]` instead of the on-disk cache."""

    def __init__(self, target: dict):
        super().__init__(())
        self.target = target

    def compile(self, backend: Any, compile_signature: Callable, fn, leaves: list, spec, aot_config) -> Callable:
        from ..api import _plan_depends_on_aliasing
        from ..cache.serialize import Recorder, make_entry, on_compiled, with_backward
        from ..compile.compile import placeholder_values

        recorder = Recorder()
        backward_artifacts: list = []
        recording = replace(
            aot_config,
            fw_compiler=recorder.wrap(aot_config.fw_compiler),
            inference_compiler=recorder.wrap(aot_config.inference_compiler),
            bw_compiler=on_compiled(aot_config.bw_compiler, lambda gm, a: backward_artifacts.append(a)),
        )
        run = compile_signature(fn, leaves, spec, recording)
        try:
            entry = make_entry(run, recorder)
        except Uncacheable as e:
            raise _refuse(str(e)) from None
        if entry.training:  # the file must hold the backward: compile it now, not at the first .backward()
            run.compiled.backward(placeholder_values(run.compiled.bw_module))
            entry = with_backward(entry, backward_artifacts[-1] if backward_artifacts else None) or entry
        _check_sources(run.plan)
        check_sizes = backend.forward_inductor_patches.get("size_asserts") is False
        self.target["saved"] = _Saved(
            entry=entry,
            backend=backend,
            leaves=tuple(_describe(x) for x in leaves),
            inductor_files=_inductor_files(entry),
            check_sizes=check_sizes,
            check_aliasing=_plan_depends_on_aliasing(run.plan),
            sizes_fixed=check_sizes or backend._compiled_code_asserts_input_sizes(),
        )
        return run


def _check_sources(plan: Any) -> None:
    from ..plan import FromLeaf

    if not all(isinstance(s, FromLeaf) for s in plan.layout.primal_sources):
        raise _refuse("an input is a view or storage of another input (synthetic base)")


def _describe(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, str(x.device),
                x.requires_grad)
    if isinstance(x, (int, float, bool, type(None))):
        return ("value", x)
    raise _refuse(f"an input of type {type(x).__name__}")


def _inductor_files(entry: Any) -> dict:
    """The bytes of Inductor's FX-graph cache entries behind the entry's keys (usually one file
    per key), so a load does not depend on this machine's Inductor cache."""
    from torch._inductor.codecache import FxGraphCache

    out: dict = {}
    for rec in (entry.forward, entry.backward):
        key = getattr(rec, "inductor_key", None)
        if key is None:
            if rec is not None and entry.forward.inductor_key is not None:  # Inductor compiled, did not cache
                log.info("aotgrad precompile: a graph Inductor did not cache is saved as a graph; a load compiles it")
            continue
        folder = FxGraphCache._get_tmp_dir_for_key(key)
        files = []
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                files.append(f.read())
        out[key] = files
    return out


# ----------------------------------------------------------------------------------------------
# The file format
# ----------------------------------------------------------------------------------------------


def _header() -> bytes:
    return f"format={FORMAT} aotgrad={aotgrad_version()} {torch_version()}\n".encode()


def _encode(saved: _Saved) -> bytes:
    from ..cache.serialize import dumps

    try:
        payload = dumps(saved)
    except Exception as e:  # noqa: BLE001 - whatever does not pickle is the refusal
        raise _refuse(f"its compiled state cannot be pickled ({type(e).__name__}: {e})") from None
    return _MAGIC + _header() + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _decode(data: bytes) -> _Saved:
    from ..cache.serialize import loads

    if not isinstance(data, bytes) or not data.startswith(_MAGIC):
        raise PrecompileLoadError("aotgrad: not an aotgrad precompiled graph (the file is damaged)")
    header, _, rest = data[len(_MAGIC):].partition(b"\n")
    if header + b"\n" != _header():
        raise PrecompileLoadError(
            "aotgrad: this precompiled graph was saved by another version "
            f"({header.decode(errors='replace')[:160]}); this process runs {_header().decode().strip()}. "
            "aot_compile and save it again with this aotgrad and torch."
        )
    checksum, _, payload = rest.partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != checksum:
        raise PrecompileLoadError("aotgrad: the precompiled graph's content hash does not match (the file was "
                                  "truncated or edited); refusing to load it")
    return loads(payload)


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------


class PrecompiledGraph(SerializableCallable):
    """One Dynamo graph compiled by aotgrad, with the bytes that rebuild it in another process."""

    def __init__(self, run: Callable, data: bytes):
        self.run = run
        self.data = data

    @classmethod
    def serialize_compile_artifacts(cls, fn: PrecompiledGraph) -> bytes:
        return fn.data

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PrecompiledGraph:
        return cls(load(data), data)

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)


def load(data: bytes) -> Callable:
    """The compiled graph saved in `data`, its run time rebuilt without tracing or compiling."""
    from ..cache.load import ArtifactMissing, rebuild
    from ..dynamic.shapes import compile_context
    from ..runtime.input_checks import InputsChecked

    saved = _decode(data)
    backend = saved.backend
    # Inductor's C++ kernels wait for its ISA probe: it runs while the rest of the load does.
    probing = bool(saved.inductor_files) and _cpu_graph(saved.leaves) and isa_probe.start(backend.inductor_patches)
    try:
        _restore_inductor_files(saved.inductor_files)
        leaves = _fakes(saved.leaves)
        entry = saved.entry
        if probing:
            isa_probe.prefetch_imports()
        with backend._inductor_patches(), compile_context(leaves):
            run = rebuild(entry, leaves, backend._aot_config(False), backend, lambda artifact: None)
    except ArtifactMissing as e:
        raise PrecompileLoadError(f"aotgrad: a precompiled graph's compiled code could not be loaded: {e}") from e
    finally:
        isa_probe.wait()
    if saved.check_sizes or saved.check_aliasing:
        run = InputsChecked(run, leaves, _other_inputs, check_sizes=saved.check_sizes,
                            check_aliasing=saved.check_aliasing, sizes_fixed=saved.sizes_fixed)
    log.info("aotgrad precompile: loaded a %s graph", "training" if entry.training else "inference")
    return torch._dynamo.disable(lambda *args: run(args), reason="aotgrad: compiled graph")  # as backend's


def _other_inputs() -> Callable:
    """A loaded graph called with inputs Dynamo's guards let through but its plan was not made for
    (other sizes of optimizer state, inputs now sharing memory): a cold compile would compile
    them per signature from the Dynamo graph, which a load does not have."""
    raise AotgradError(
        "aotgrad: a precompiled graph was called with inputs whose sizes, strides or memory overlap differ "
        "from those it was aot_compiled with (not covered by Dynamo's guards); aot_compile it with such inputs"
    )


def _restore_inductor_files(files: dict) -> None:
    """Put Inductor's FX-graph cache entries back where `FxGraphCache` looks (as the mega-cache's
    Inductor artifacts do), unless that exact file is there already."""
    from torch._inductor.codecache import FxGraphCache, InductorCacheArtifact, sha256_hash

    for key, contents in files.items():
        folder = FxGraphCache._get_tmp_dir_for_key(key)
        for content in contents:
            if not os.path.exists(os.path.join(folder, sha256_hash(content))):
                InductorCacheArtifact(key, content).populate_cache()


def _cpu_graph(leaves: tuple) -> bool:
    """Tensor inputs all on the CPU (see backend/dynamo.py's `_cpu_graph`)."""
    return {torch.device(desc[5]).type for desc in leaves if desc[0] != "value"} == {"cpu"}


def _fakes(leaves: tuple) -> list:
    """Fake graph inputs with the saved metadata, in a fresh fake mode: what the run time's
    input checks and the rebuilt graphs' compilers read (never data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    out = []
    with mode:
        for desc in leaves:
            if desc[0] == "value":
                out.append(desc[1])
                continue
            _, shape, stride, offset, dtype, device, requires_grad = desc
            if offset:
                extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
                t = torch.empty(offset + extent, dtype=dtype, device=device).as_strided(shape, stride, offset)
            else:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            t.requires_grad_(requires_grad)
            out.append(t)
    return out

