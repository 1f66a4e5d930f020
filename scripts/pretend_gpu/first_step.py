"""Cold first step of a GPU-suite model on the pretend H100: each run a fresh process with an empty
Inductor cache (import and model build not timed; compile and one training step with fused AdamW,
bf16 autocast, timed), the backends taking turns (issue 41: where aotgrad's first step goes).

    scripts/pretend_gpu/run .venv-cuda/bin/python scripts/pretend_gpu/first_step.py vit [--repeats 2]

Works in an older checkout too (copy this folder there). The times are this CPU's compile time, not
a GPU's first step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(name: str, backend: str) -> None:
    sys.path[:0] = [os.path.join(TOP, "benchmarks"), os.path.join(TOP, "src")]
    import gpu_suite
    import torch
    from gpu_models import MODELS

    device = torch.device("cuda")
    torch.manual_seed(0)
    sm = MODELS[name]("full", device, 1, torch.Generator().manual_seed(0))
    trainer = gpu_suite.Trainer(sm, sm.module.to(device).train(), backend, device, torch.bfloat16, None)
    t0 = time.perf_counter()
    trainer.step(sm.batches[0])
    torch.cuda.synchronize()
    print(f"first step {time.perf_counter() - t0:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backends", default="aotgrad,inductor")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.model, args.child)
    times: dict[str, list[float]] = {b: [] for b in args.backends.split(",")}
    for r in range(args.repeats):
        for b in (list(times) if r % 2 == 0 else list(times)[::-1]):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                launch = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")  # the pretend kernels
                out = subprocess.run([sys.executable, launch, os.path.abspath(__file__), args.model, "--child", b],
                                     env=env, capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("first step")]
            if out.returncode or not lines:
                sys.exit(f"{b} failed:\n{out.stderr[-3000:]}")
            times[b].append(float(lines[-1].split()[-1]))
            print(f"{args.model} {b}: {times[b][-1]:.1f} s", flush=True)
    means = {b: sum(t) / len(t) for b, t in times.items()}
    print(" ".join(f"{b} mean {m:.1f} s" for b, m in means.items()))
    if "aotgrad" in means and "inductor" in means:
        print(f"aotgrad ÷ inductor {means['aotgrad'] / means['inductor']:.2f}")


if __name__ == "__main__":
    main()
