"""Two-rank scenarios for tests/test_distributed.py: run in processes spawned by torch.multiprocessing
(gloo on 127.0.0.1, a timeout on the process group), each compiled run compared with the same
strategy uncompiled in the same process. A scenario returns a dict of facts (max differences, graph
counts) or the error it met; `spawn` gathers them per rank, and never waits past its deadline.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the model ------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model(d: int = 16) -> Tiny:
    torch.manual_seed(0)
    return Tiny(d)


def batches(rank: int, steps: int = 3, d: int = 16) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, d, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def train(model: nn.Module, forward, data: list, opt_step=None) -> list[float]:
    """A few SGD-with-momentum steps; the losses (float)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        (opt_step or opt.step)()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def compare(ref_losses, ref_params, losses, params) -> dict:
    return {
        "loss_diff": max(abs(x - y) for x, y in zip(ref_losses, losses)),
        "param_diff": max_diff(ref_params, params),
        "losses": losses,
    }


class CountingBackend:
    """backend="aotgrad", counting the graphs Dynamo (and DDPOptimizer) hands it."""

    def __init__(self, name: str = "aotgrad"):
        import torch._dynamo

        self.inner = torch._dynamo.lookup_backend(name)
        self.graphs = 0

    def __call__(self, gm, example_inputs, **kw):
        self.graphs += 1
        return self.inner(gm, example_inputs, **kw)


# -- scenarios --------------------------------------------------------------------------------------


def scenario_ddp(rank: int, backend: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDPOptimizer wants buckets no smaller than DDP's first one (1 MB): blocks of ~1 MB of
    # parameters (256 wide) and 1 MB buckets split the model into one graph per block or so.
    data = batches(rank, d=256)
    ref = DDP(make_model(256), bucket_cap_mb=1)
    ref_losses = train(ref, ref, data)
    ddp = DDP(make_model(256), bucket_cap_mb=1)
    counting = CountingBackend(backend)
    torch._dynamo.reset()
    compiled = torch.compile(ddp, backend=counting)
    losses = train(ddp, compiled, data)
    out = compare(ref_losses, full_params(ref), losses, full_params(ddp))
    out["graphs"] = counting.graphs
    return out


def _fsdp(reshard: bool, backend: str | None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
        if backend is not None:
            block.compile(backend=backend)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _scenario_fsdp(rank: int, reshard: bool, backend: str) -> dict:
    data = batches(rank)
    ref = _fsdp(reshard, None)
    ref_losses = train(ref, ref, data)
    torch._dynamo.reset()
    model = _fsdp(reshard, backend)
    losses = train(model, model, data)
    return compare(ref_losses, full_params(ref), losses, full_params(model))


def scenario_fsdp_reshard(rank: int, backend: str) -> dict:
    return _scenario_fsdp(rank, True, backend)


def scenario_fsdp_no_reshard(rank: int, backend: str) -> dict:
    return _scenario_fsdp(rank, False, backend)


def scenario_fsdp_compiled_step(rank: int, backend: str) -> dict:
    """FSDP2 (uncompiled) with a compiled AdamW step over its DTensor parameters."""
    data = batches(rank)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _fsdp(True, None)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        losses = []
        for x, y in data:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results.append((losses, full_params(model)))
    return compare(*results[0], *results[1])


def scenario_tensor_parallel(rank: int, backend: str) -> dict:
    """An MLP split with ColwiseParallel / RowwiseParallel, compiled with aotgrad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(7)  # the same batches on every rank: TP replicates the input
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fwd = torch.compile(mlp, backend=backend) if compiled else mlp
        results.append((train(mlp, fwd, data), full_params(mlp)))
    return compare(*results[0], *results[1])


def scenario_funcol(rank: int, backend: str) -> dict:
    """funcol.all_reduce inside a function compiled with backend="aotgrad" (forward and backward
    of the ops around it)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def f(x, w):
        y = funcol.all_reduce(x * 2, "sum", group)
        return (y.detach() * w).sin().sum(), y + 1

    torch.manual_seed(rank)
    x, w = torch.randn(4, 3), torch.randn(3, requires_grad=True)
    ref_loss, ref_y = f(x, w)
    (ref_g,) = torch.autograd.grad(ref_loss, w)
    torch._dynamo.reset()
    counting = CountingBackend(backend)
    loss, y = torch.compile(f, backend=counting, fullgraph=True)(x, w)
    (gw,) = torch.autograd.grad(loss, w)
    return {
        "y_diff": (y - ref_y).abs().max().item(),
        "loss_diff": (loss - ref_loss).abs().item(),
        "grad_diff": (gw - ref_g).abs().max().item(),
        "graphs": counting.graphs,
        "y_sum": ref_y.sum().item(),
    }


def scenario_fsdp_fullgraph(rank: int, backend: str) -> dict:
    """Whether FSDP2's hooks trace into one graph (fullgraph, compiled autograd): in torch 2.13 they
    are wrapped in torch._dynamo.disable, so Dynamo refuses; the error text is reported."""
    model = _fsdp(True, None)
    torch._dynamo.reset()
    x = batches(rank)[0][0]
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    except Exception as e:
        return {"traced": False, "error_type": type(e).__name__, "message": str(e)[:3000]}
    return {"traced": True}


@torch.library.custom_op("aotgrad_dist_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def scenario_fail_on_rank1(rank: int, backend: str) -> dict:
    """Rank 1 compiles a program aotgrad refuses (an op with no derivative, needing a gradient);
    rank 0 compiles a fine one, then waits in a collective rank 1 never joins: the process group's
    timeout ends it."""
    import torch.distributed as dist

    def ok(x):
        return x.sin().cos()

    def refused(x):
        return _twice(x.sin()).cos()

    torch._dynamo.reset()
    fn = refused if rank == 1 else ok
    torch.compile(fn, backend=backend)(torch.randn(3, requires_grad=True))
    dist.all_reduce(torch.ones(1))  # rank 1 never gets here
    return {"reached": True}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


# -- spawning ---------------------------------------------------------------------------------------


def _worker(rank: int, names: list, port: int, out_dir: str, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    results = {}
    try:
        for name in names:  # "scenario@backend"
            t0 = time.perf_counter()
            scenario, backend = name.split("@")
            try:
                results[name] = {"ok": True, **SCENARIOS[scenario](rank, backend)}
            except Exception as e:
                results[name] = {"ok": False, "type": type(e).__name__, "error": str(e)[:4000],
                                 "trace": traceback.format_exc()[-4000:]}
            results[name]["seconds"] = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
                json.dump(results, fh)
    finally:
        dist.destroy_process_group()


def spawn(names: list[str], out_dir: str, *, deadline_s: float = 240, pg_timeout_s: float = 60) -> list[dict]:
    """Run the scenarios `names`, in order, on 2 ranks; per rank {scenario: result}. Ranks still running
    at the deadline are killed (their finished scenarios are still reported)."""
    import torch.multiprocessing as mp

    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = mp.start_processes(_worker, args=(names, free_port(), out_dir, pg_timeout_s), nprocs=WORLD,
                                 join=False, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(1.0, min(5.0, end - time.monotonic()))):
            if time.monotonic() > end:
                break
    except Exception:  # a rank died: what it wrote is still read below
        pass
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join(5)
    out = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path) if os.path.exists(path) else _empty() as fh:
            out.append(json.load(fh))
    return out


class _empty:
    def __enter__(self):
        import io

        return io.StringIO("{}")

    def __exit__(self, *exc):
        return False
