"""Kernels one training step of a GPU-suite model asks of the pretend H100, aotgrad vs Inductor, and
the Inductor code each ran, to diff kernel lists (issue 41: where aotgrad launches more).

    scripts/pretend_gpu/run .venv-cuda/bin/python scripts/pretend_gpu/kernels.py resnet50 [--size mid] [--dump DIR]

Each backend compiles the model (bf16 autocast), runs two untimed steps, then one forward+backward
whose device operations are counted (pretend_gpu.device_ops). `--dump DIR` writes every module
Inductor loaded to DIR/BACKEND/N.py. Works in an older checkout too (copy this folder there), whose
gpu_models took `tiny: bool` instead of a size.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import os
import sys

import torch

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(TOP, "benchmarks"))

import gpu_models  # noqa: E402
import pretend_gpu  # noqa: E402


def _suite_model(name: str, size: str):
    gen = torch.Generator().manual_seed(0)
    builder = gpu_models.MODELS[name]
    takes_tiny = "tiny" in inspect.signature(gpu_models.resnet50).parameters  # the older signature
    return builder(size == "tiny" if takes_tiny else size, torch.device("cuda"), 1, gen)


def count(sm, backend: str, dump: str | None) -> dict[str, int]:
    from torch._inductor import codecache

    torch._dynamo.reset()
    codes: list[str] = []
    load = codecache.PyCodeCache.load_by_key_path

    def keep(key, path, *args, **kwargs):
        with open(path) as f:
            codes.append(f.read())
        return load(key, path, *args, **kwargs)

    be = importlib.import_module("aotgrad.backend").aotgrad_backend if backend == "aotgrad" else backend
    model = copy.deepcopy(sm.module)
    compiled = torch.compile(model, backend=be)
    codecache.PyCodeCache.load_by_key_path = keep
    try:
        for _ in range(3):  # the last of three: compiled, warmed up
            before = pretend_gpu.device_ops()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(*sm.batches[0])
            loss.backward()
            torch.cuda.synchronize()
            after = pretend_gpu.device_ops()
            for p in model.parameters():
                p.grad = None
    finally:
        codecache.PyCodeCache.load_by_key_path = load
    if dump:
        os.makedirs(os.path.join(dump, backend), exist_ok=True)
        for i, code in enumerate(codes):
            with open(os.path.join(dump, backend, f"{i}.py"), "w") as f:
                f.write(code)
    return {k: after[k] - before[k] for k in after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(gpu_models.MODELS))
    p.add_argument("--size", default="full", choices=["full", "mid", "tiny"])
    p.add_argument("--dump", help="write the Inductor modules here, one folder per backend")
    args = p.parse_args()
    sm = _suite_model(args.model, args.size)
    sm.module.cuda().train()
    for backend in ("aotgrad", "inductor"):
        ops = count(sm, backend, args.dump)
        print(f"{args.model} ({args.size}) {backend}: kernels {ops['kernels']}, library {ops['library']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
