"""Train the demo's GPT-2 on 2 ranks under DDP and FSDP2, eager vs aotgrad vs upstream Inductor.

    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py      # make demo-distributed
    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py --strategies fsdp2 --steps 10

gloo on CPU, NCCL when CUDA is present (one GPU per rank). Each strategy trains the same model (same
seed, weights; each rank its own batches) three ways:

- DDP: `torch.compile(DDP(model) + loss)`; DDPOptimizer splits the graph at bucket boundaries;
- FSDP2: activation checkpointing per block (`checkpoint_wrapper`), `fully_shard` per block and on
  the root, each block compiled with `block.compile(backend=...)`;

and in the compiled variants AdamW's `step()` compiled too (FSDP2's parameters are DTensors, which
aotgrad flattens into their local tensors: subclass_wrap.py). Rank 0 prints a progress bar and,
per strategy, `make demo`'s table (trainer.report): compile time, median step time, saved activations
(rank 0), losses (mean over the ranks) vs eager. `--bench` (benchmarks/distributed_bench.py) runs
aotgrad and inductor taking turns step by step in each rank and writes JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Each rank compiling with its own pool of Inductor compile workers oversubscribes a small machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import trainer  # noqa: E402
from train_gpt2 import gpt2_logits, make_gpt2  # noqa: E402

STRATEGIES = ("ddp", "fsdp2")


def parser():
    p = trainer.parser(__doc__.splitlines()[0], steps=20, batch=4, seq=64, lr=1e-3)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP bucket size (DDPOptimizer splits there)")
    p.add_argument("--pg-timeout", type=float, default=300, help="process-group timeout, seconds")
    p.add_argument("--bench", default=None, metavar="OUT.json",
                   help="aotgrad and inductor taking turns step by step; write step times and memory here")
    return p


def setup() -> torch.device:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", 300))))
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    return torch.device("cpu")


def build(strategy: str, variant: str, args, device):
    """(loss_fn(x, y), model, optimizer step, note): the strategy applied, compiled per variant."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = make_gpt2(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                      n_positions=max(args.seq_len, 16)).to(device)
    backend = None if variant == "eager" else variant
    note = ""
    if strategy == "ddp":
        wrapped = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        loss_fn = trainer.LossModule(wrapped, gpt2_logits)
        if backend:
            loss_fn = torch.compile(loss_fn, backend=backend)
    else:
        blocks = model.transformer.h
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])
            fully_shard(blocks[i])
            if backend:
                blocks[i].compile(backend=backend)
        fully_shard(model)
        loss_fn = trainer.LossModule(model, gpt2_logits)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = opt.step
    if backend and args.compile_optimizer:
        step = torch.compile(opt.step, backend=backend)
    return loss_fn, model, opt, step, note


def mean_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def saved_bytes(loss_fn, x, y) -> int:
    """Distinct storages saved for the backward in one forward, parameters and the batch left out."""
    return trainer.count_saved_bytes(loss_fn, x, y, [x, y])


class Run:
    """One variant of one strategy, stepping when asked."""

    def __init__(self, strategy, variant, args, device, batches):
        self.name, self.batches, self.device = variant, batches, device
        self.loss_fn, self.model, self.opt, self.step_fn, self.note = build(strategy, variant, args, device)
        self.result = trainer.RunResult(variant)
        self.peak_bytes = None

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = self.loss_fn(x, y)
        loss.backward()
        self.step_fn()
        self.opt.zero_grad(set_to_none=True)
        value = mean_over_ranks(loss.item(), self.device)  # also a sync point of the ranks
        self.result.step_times.append(time.perf_counter() - t0)
        self.result.losses.append(value)

    def finish(self) -> None:
        x, y = self.batches[0]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        self.result.saved_bytes = saved_bytes(self.loss_fn, x, y)
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated() - base


def train_strategy(strategy: str, args, device, batches, rank: int) -> dict:
    variants = [v for v in args.variants.split(",") if v]
    results = {}
    for v in variants:
        try:
            torch._dynamo.reset()  # one variant at a time: no compiled code shared between them
            run = Run(strategy, v, args, device, batches)
            if rank == 0 and run.note:
                print(f"   note: {run.note}", flush=True)
            bar = trainer.ProgressBar(args.steps, f"{strategy}/{v}") if rank == 0 else None
            with trainer._cache_for(args.cold):
                for i in range(args.steps):
                    run.step(i)
                    if bar:
                        bar.update(i, trainer.step_detail(run.result.losses[-1], run.result.step_times[-1]))
                run.finish()
            results[v] = run.result
        except Exception as e:  # report it (with the rank) and go on with the other variants
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"\n[rank {rank}] {strategy}/{v}: FAILED: {msg}", flush=True)
            results[v] = trainer.RunResult(v, error=msg)
        dist.barrier()
    return results


def bench_strategy(strategy: str, args, device, batches) -> dict:
    """aotgrad and inductor built side by side, taking turns one step each (another first each step),
    with an eager run of the same strategy alongside (its losses are the reference)."""
    torch._dynamo.reset()
    runs = [Run(strategy, v, args, device, batches) for v in ("aotgrad", "inductor", "eager")]
    for i in range(args.steps):
        order = runs[:2] if i % 2 == 0 else runs[1::-1]
        for r in order + runs[2:]:
            r.step(i)
    out = {}
    for r in runs:
        r.finish()
        out[r.name] = {"median_step_s": r.result.median_step, "compile_s": r.result.compile_time,
                       "losses": r.result.losses, "saved_bytes": r.result.saved_bytes,
                       "peak_bytes": r.peak_bytes, "note": r.note}
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("PG_TIMEOUT", str(args.pg_timeout))
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cold:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    tokens = trainer.load_tokens()
    batches = [(x.to(device), y.to(device))
               for x, y in trainer.make_batches(tokens, args.steps, args.batch_size, args.seq_len, args.seed + rank)]
    strategies = [s for s in args.strategies.split(",") if s]
    if rank == 0:
        n = sum(p.numel() for p in make_gpt2(n_layer=args.layers, n_embd=args.width,
                                              n_head=max(1, args.width // 64),
                                              n_positions=max(args.seq_len, 16)).parameters())
        print(f"GPT-2 ({args.layers} layers, {args.width} wide): {n / 1e6:.2f}M parameters; {world} ranks "
              f"({dist.get_backend()}, {device.type}); {args.steps} steps of {args.batch_size}x{args.seq_len} "
              f"tokens per rank; AdamW lr {args.lr}; torch {torch.__version__}, {torch.get_num_threads()} "
              "threads per rank", flush=True)
    trainer.warm_up([v for v in ("aotgrad", "inductor") if v in args.variants])
    ok = True
    bench: dict = {}
    with contextlib.ExitStack():
        for s in strategies:
            if args.bench:
                bench[s] = bench_strategy(s, args, device, batches)
                continue
            if rank == 0:
                print(f"\n== {s} ==", flush=True)
            results = train_strategy(s, args, device, batches, rank)
            if rank == 0:
                ok &= trainer.report(results, args.tolerance, args.final_tolerance,
                                     min(args.early_steps, args.steps))
    if args.bench and rank == 0:
        with open(args.bench, "w") as fh:
            json.dump({"world": world, "device": device.type, "steps": args.steps, "results": bench}, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
