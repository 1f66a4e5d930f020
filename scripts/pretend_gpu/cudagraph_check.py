"""CUDA graphs on the pretend H100: does backend="aotgrad" under mode="reduce-overhead" record and
replay the graphs upstream's Inductor backend does, with the same static inputs, and skip the same
graphs? (issue 41, part 3; no values are compared: no kernel computes here.)

    make pretend-gpu && scripts/pretend_gpu/run .venv-cuda/bin/python scripts/pretend_gpu/cudagraph_check.py

Each case runs once per backend from a fresh Dynamo and a fresh cudagraph-tree manager, then reads the
manager: functions it wrapped, graph nodes it recorded, the inputs each node copies in on a replay, and
Inductor's skip counter. The check fails where aotgrad's decisions (which graphs are wrapped, which get CUDA
graphs, how many are skipped) differ from Inductor's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import aotgrad  # noqa: F401  (registers the backend)


@dataclass(frozen=True)
class Reading:
    functions: int  # what the tree manager wrapped (forward and backward graphs each count)
    recorded: tuple[int, ...]  # the wrapped functions (by order of wrapping) with a recorded graph
    nodes: int  # graph nodes recorded in the trees (a function re-recorded counts again)
    copied_in: tuple[int, ...]  # per recorded node, the inputs a replay copies into the graph's own
    # (neither parameters, buffers nor outputs of an earlier graph in the tree)
    skips: int  # graphs Inductor ran without CUDA graphs

    def decisions(self) -> tuple:
        """What must match Inductor's: the graphs wrapped, which of them got CUDA graphs, the skips.
        (Re-recordings and copies differ where the saved values differ: a reading, not a verdict.)"""
        return self.functions, self.recorded, self.skips


def _read() -> Reading:
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    if manager is None:
        return Reading(0, (), 0, (), counters["inductor"]["cudagraph_skips"])
    copied, recorded, todo = [], set(), [n for ns in manager.roots.values() for n in ns]
    while todo:
        node = todo.pop(0)
        copied.append(len(node.non_static_input_idx))
        recorded.add(node.wrapped_function.id.id)
        todo += [c for cs in node.children.values() for c in cs]
    return Reading(len(manager.ids_to_funcs), tuple(sorted(recorded)), len(copied), tuple(copied),
                   counters["inductor"]["cudagraph_skips"])


def _fresh() -> None:
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()  # also resets the tree managers
    cudagraph_trees.reset_cudagraph_trees()
    counters.clear()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)).cuda()


def _step(net: nn.Module, model: Callable, x: torch.Tensor) -> None:
    """Forward, backward, and the gradients dropped as an optimizer's zero_grad(set_to_none=True) does
    (accumulating into a gradient that a replay overwrites is an error under CUDA graphs)."""
    model(x).sum().backward()
    for p in net.parameters():
        p.grad = None


def train(backend: str) -> None:
    """Four training steps at one shape: a forward and a backward, warmed up, recorded, replayed."""
    net = _net()
    model = torch.compile(net, backend=backend, mode="reduce-overhead")
    x = torch.randn(32, 64, device="cuda")
    for _ in range(4):
        _step(net, model, x)


def two_shapes(backend: str) -> None:
    """A second batch size: new graphs, recorded beside the first ones."""
    net = _net()
    model = torch.compile(net, backend=backend, mode="reduce-overhead", dynamic=False)
    for n in (32, 32, 32, 16, 16, 16):
        _step(net, model, torch.randn(n, 64, device="cuda"))


def dynamic_shapes(backend: str) -> None:
    """dynamic=True: one graph pair, recorded once per batch size."""
    net = _net()
    model = torch.compile(net, backend=backend, mode="reduce-overhead", dynamic=True)
    for n in (32, 32, 32, 16, 16, 16, 8, 8, 8):
        _step(net, model, torch.randn(n, 64, device="cuda"))


class _Split(nn.Module):
    """Two graphs with a graph break between them: two forwards, two backwards, one tree."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _net(), nn.Linear(10, 10).cuda()

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


def graph_break(backend: str) -> None:
    net = _Split()
    model = torch.compile(net, backend=backend, mode="reduce-overhead")
    for _ in range(4):
        _step(net, model, torch.randn(32, 64, device="cuda"))


class _Attention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim).cuda(), nn.Linear(dim, dim).cuda()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def attention_bf16(backend: str) -> None:
    """Causal SDPA under bf16 autocast (the flash kernel on sm_90, its logsumexp and RNG outputs)."""
    net = _Attention()
    model = torch.compile(net, backend=backend, mode="reduce-overhead")
    for _ in range(4):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 128, 64, device="cuda")).float().sum()
        loss.backward()
        for p in net.parameters():
            p.grad = None


def inference(backend: str) -> None:
    """No grad: one forward graph."""
    model = torch.compile(_net().eval(), backend=backend, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 64, device="cuda"))


def mutated_input(backend: str) -> None:
    """A graph that mutates its (non-static) input runs without CUDA graphs."""
    @torch.compile(backend=backend, mode="reduce-overhead")
    def f(x, w):
        x.add_(1)
        return (x * w).sum()

    w = torch.randn(64, device="cuda", requires_grad=True)
    for _ in range(3):
        f(torch.randn(64, device="cuda"), w).backward()
        w.grad = None


def cpu_input(backend: str) -> None:
    """A graph with a CPU tensor input runs without CUDA graphs."""
    @torch.compile(backend=backend, mode="reduce-overhead")
    def f(x, scale):
        return (x * scale.cuda()).sin()

    for _ in range(3):
        f(torch.randn(64, device="cuda", requires_grad=True), torch.randn(64)).sum().backward()


CASES: dict[str, Callable[[str], None]] = {f.__name__: f for f in (train, two_shapes, dynamic_shapes, graph_break, attention_bf16, inference,
                                                       mutated_input, cpu_input)}


def main() -> int:
    if "(pretend)" not in torch.cuda.get_device_name(0):
        print("run this on the pretend GPU: scripts/pretend_gpu/run PYTHON scripts/pretend_gpu/cudagraph_check.py")
        return 2
    print(f"CUDA graphs, aotgrad vs Inductor, mode=reduce-overhead — {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}")
    print("| case | backend | functions | with CUDA graphs | nodes | inputs copied in, per node | skips |")
    print("|---|---|---|---|---|---|---|")
    bad = []
    for name, case in CASES.items():
        readings = {}
        for backend in ("aotgrad", "inductor"):
            _fresh()
            try:
                case(backend)
                torch.cuda.synchronize()
            except Exception as e:  # a failure is a reading too: it differs from the other backend's
                print(f"| {name} | {backend} | {type(e).__name__}: {' '.join(str(e).split())[:160]} | | | | |")
                readings[backend] = None
                continue
            r = readings[backend] = _read()
            print(f"| {name} | {backend} | {r.functions} | {list(r.recorded)} | {r.nodes} | {list(r.copied_in)} | "
                  f"{r.skips} |")
        a, i = readings["aotgrad"], readings["inductor"]
        if a is None or i is None or a.decisions() != i.decisions():
            bad.append(name)
    print("same as Inductor: " + ("every case" if not bad else "all but " + ", ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
