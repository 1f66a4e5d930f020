"""aotgrad demo: compile a training step of a small MLP + LayerNorm model and compare with eager.

Prints eager vs aotgrad losses for a few SGD steps and the sizes of the forward/backward graphs.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

import aotgrad


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x) + x)


def count_ops(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" for n in gm.graph.nodes)


def main() -> None:
    torch.manual_seed(0)
    eager_model = MLP()
    compiled_model = copy.deepcopy(eager_model)
    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return gm.forward

        return compiler

    compiled = aotgrad.aot_module(compiled_model, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
    x = torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()

    print(f"{'step':>4}  {'eager loss':>12}  {'aotgrad loss':>12}  {'|diff|':>9}")
    t0 = time.perf_counter()
    for step in range(8):
        for model, opt, name in ((eager_model, opt_e, "e"), (compiled, opt_c, "c")):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if name == "e":
                eager_loss = loss.item()
            else:
                aot_loss = loss.item()
        print(f"{step:>4}  {eager_loss:>12.6f}  {aot_loss:>12.6f}  {abs(eager_loss - aot_loss):>9.2e}")
    elapsed = time.perf_counter() - t0
    fw, bw = graphs["forward"], graphs["backward"]
    saved = len(list(fw.graph.output_node().args[0])) - 1
    print(f"\nforward graph: {count_ops(fw)} ops; backward graph: {count_ops(bw)} ops; "
          f"{saved} values saved for the backward")
    print(f"8 steps (both models, first one compiling) in {elapsed:.2f}s")
    ok = abs(eager_loss - aot_loss) < 1e-4
    print("aotgrad matches eager" if ok else "MISMATCH between aotgrad and eager")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
