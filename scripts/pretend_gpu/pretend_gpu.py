"""The Python half of the pretend GPU (README.md here): library kernels that only make their outputs.

The C shims answer the CUDA runtime and driver, so ATen's own kernels and Triton's launch into nothing.
cuBLAS and cuDNN need a real device, so their ATen ops get CUDA kernels here that run the op's meta
kernel (its shape, stride and dtype checks: "mat1 and mat2 must have the same dtype" raises as on a
GPU) and return empty CUDA tensors of the meta result's layout. No value is ever computed.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.utils._pytree as pytree

# The ops whose CUDA kernels call cuBLAS, cuDNN or a library that reads device memory on the host
# (cub's sort in the embedding backward), as a model's training step reaches them.
LIBRARY_OPS = (
    "mm", "mm.out", "addmm", "addmm.out", "bmm", "bmm.out", "baddbmm", "baddbmm.out",
    "_addmm_activation", "_addmm_activation.out", "addmv", "addmv.out", "dot", "mv",
    "convolution", "convolution_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "embedding_dense_backward",
)

_library = None
_library_calls = 0  # library ops run on the device (each would be one or more cuBLAS/cuDNN kernels)
_fake_mode = None  # convolutions' layouts come from their meta kernels run on fake CUDA tensors


def _like(x, device: str, mode=None):
    """Empty tensors of x's CUDA tensors' metadata on `device` (under `mode`, if given), through any nesting."""
    def one(t):
        if t.device.type not in ("cuda", "meta"):
            return t
        with mode if mode is not None else contextlib.nullcontext():
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    return pytree.tree_map_only(torch.Tensor, one, x)


def _conv_on_fakes(op, args, kwargs):
    """The meta kernel picks a convolution's layout by device (cuDNN's rule on CUDA), so it runs on
    fake CUDA tensors; None where this is called with Python dispatch off (the fakes would be real)."""
    fargs, fkwargs = _like((args, kwargs), "cuda", _fake_mode)
    if not all(getattr(a, "fake_mode", None) is _fake_mode for a in fargs[:2]):
        return None
    with _fake_mode:
        return op(*fargs, **fkwargs)


def _outputs_only(op: torch._ops.OpOverload):
    out_names = [a.name for a in op._schema.arguments if a.is_out]
    conv = "convolution" in op._schema.name

    def kernel(*args, **kwargs):
        global _library_calls
        _library_calls += 1
        result = _conv_on_fakes(op, args, kwargs) if conv else None
        if result is None:
            # Meta tensors dispatch alike under any mode, so this works where a fake mode calls a
            # real kernel with Python dispatch off (its constant folding does).
            margs, mkwargs = _like((args, kwargs), "meta")
            result = op(*margs, **mkwargs)
        if not out_names:
            return _like(result, "cuda")
        outs = [kwargs[n] for n in out_names]
        for o, m in zip(outs, result if isinstance(result, (tuple, list)) else [result]):
            if o.shape != m.shape or o.stride() != m.stride():
                o.resize_(m.shape).as_strided_(m.shape, m.stride())
        return outs[0] if len(outs) == 1 else tuple(outs)

    return kernel


def device_ops() -> dict[str, int]:
    """Operations the pretend device was asked to run so far: `kernels` (ATen's and Triton's launches,
    memsets, device copies, CUDA-graph launches, as the shims count them) and `library` (cuBLAS/cuDNN
    ops, counted here). On a GPU each is at least one launch: a count a step time cannot go below."""
    import ctypes

    runtime = ctypes.CDLL(os.environ["LD_PRELOAD"].split(":")[0]).pretend_gpu_runtime_ops
    driver = ctypes.CDLL("libcuda.so.1").pretend_gpu_driver_ops
    runtime.restype = driver.restype = ctypes.c_ulonglong
    return {"kernels": runtime() + driver(), "library": _library_calls}


def is_pretend() -> bool:
    """Whether this process's CUDA device is the shims' (so nothing real is overridden)."""
    return torch.cuda.is_available() and "(pretend)" in torch.cuda.get_device_name(0)


def install() -> None:
    """Register the output-only library kernels and let autocast run on the pretend device."""
    global _library, _fake_mode
    if _library is not None:
        return
    if not is_pretend():
        raise SystemExit("pretend_gpu: the pretend CUDA runtime is not loaded (use scripts/pretend_gpu/run); "
                         "refusing to replace a real GPU's kernels")
    import torch.cuda.amp.common as amp_common

    amp_common.amp_definitely_not_available = lambda: False  # autocast asks the driver otherwise
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    from torch._subclasses.fake_tensor import FakeTensorMode

    _fake_mode = FakeTensorMode()
    _library = torch.library.Library("aten", "IMPL")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for name in LIBRARY_OPS:
            base, _, overload = name.partition(".")
            packet = getattr(torch.ops.aten, base, None)
            if packet is not None and hasattr(packet, overload or "default"):
                _library.impl(name, _outputs_only(getattr(packet, overload or "default")), "CUDA")
