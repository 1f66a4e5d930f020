"""Make the README's screenshot of an `aotgrad.explain` page (`make explain-demo`).

A two-layer GPT-2-shaped model (tied embedding, a step counter buffer mutated in place) is explained
under the min-cut partitioner at memory budget 0.5; the page is written to
`docs/explain_demo.html` (not committed) and headless Chromium screenshots it to
`docs/explain.png`.

    python scripts/explain_screenshot.py [--out docs/explain.png] [--height 2120]
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad.explain.browser import png_stats, screenshot


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 64, heads: int = 4, layers: int = 2, block: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one graph input, reported as a duplicate
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, idx, targets):
        self.steps.add_(1)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/explain.png")
    p.add_argument("--width", type=int, default=1200)
    p.add_argument("--height", type=int, default=2120)
    ns = p.parse_args()
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (4, 32))
    report = aotgrad.explain(TinyGPT(), idx, torch.randint(0, 96, (4, 32)), memory_budget=0.5)
    print(report)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    page = report.save_html(os.path.join(os.path.dirname(ns.out) or ".", "explain_demo.html"))
    screenshot(page, ns.out, (ns.width, ns.height))
    stats = png_stats(ns.out)
    print(f"\nwrote {page} and {ns.out} ({stats.width}x{stats.height}, pixel variance {stats.variance:.0f})")


if __name__ == "__main__":
    main()
