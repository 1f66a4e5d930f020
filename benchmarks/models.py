"""Benchmark models shared by the compile-time, run-time and partitioner benchmarks.

Every model has a factory `make_<name>(seed=0)` returning `(module, example_inputs)`, where
`example_inputs` is a tuple to call the module with: `module(*example_inputs)`. Factories are
deterministic for a given seed. `MODELS` maps a short name to its factory, in benchmark order.

The pointwise chain is a plain function (`pointwise_chain`); its factory wraps it in a
parameter-free module (`PointwiseChain`) so all factories share one shape, and its example input
requires grad (there are no parameters to differentiate otherwise). `BenchModel.is_function`
tells a benchmark to compile `pointwise_chain` with `aot_function` instead of the module with
`aot_module`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# MLP: Linear + GELU + LayerNorm blocks


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, width: int = 128, d_out: int = 10, layers: int = 4):
        super().__init__()
        blocks = []
        d = d_in
        for _ in range(layers):
            blocks += [nn.Linear(d, width), nn.GELU(), nn.LayerNorm(width)]
            d = width
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_mlp(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return MLP(), (torch.randn(8, 64),)


# ---------------------------------------------------------------------------------------------
# Transformer: pre-LN blocks in plain torch (matmul attention, softmax, LayerNorm, MLP, residuals)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (d // h) ** -0.5
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, heads, hidden) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)


def make_transformer(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return Transformer(), (torch.randn(2, 16, 64),)


# ---------------------------------------------------------------------------------------------
# CNN: conv + BatchNorm2d (train mode, so running stats are buffer mutations) + ReLU + pooling


class CNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(x.mean(dim=(2, 3)))


def make_cnn(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    mod = CNN()
    mod.train()
    return mod, (torch.randn(4, 3, 16, 16),)


# ---------------------------------------------------------------------------------------------
# Pointwise chain: 200 ops (sin, cos, mul, add, repeated) on one tensor


CHAIN_OPS = 200


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS // 4):
        x = x.sin()
        x = x.cos()
        x = x * 1.01
        x = x + 0.5
    return x


class PointwiseChain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise_chain(x)


def make_pointwise_chain(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return PointwiseChain(), (torch.randn(32, 32, requires_grad=True),)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchModel:
    name: str
    factory: Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]
    # When set, benchmarks compile this function with aot_function rather than the module.
    function: Callable | None = None

    @property
    def is_function(self) -> bool:
        return self.function is not None


BENCH_MODELS: list[BenchModel] = [
    BenchModel("mlp", make_mlp),
    BenchModel("transformer", make_transformer),
    BenchModel("cnn_bn", make_cnn),
    BenchModel("pointwise200", make_pointwise_chain, function=pointwise_chain),
]

MODELS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    m.name: m.factory for m in BENCH_MODELS
}
