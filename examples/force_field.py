"""Train a machine-learned force field through torch.compile(backend="aotgrad").

The model is an energy MLP over the pairwise distances of 64 atoms (Gaussian radial features per
pair, an MLP per pair, summed). Forces are -dE/dpositions, taken inside the model with
`torch.autograd.grad(..., create_graph=True)`; the loss on energies and forces is then
backpropagated to the weights: a second-order gradient through compiled code.

By default Dynamo traces `autograd.grad` into the graph (`torch._dynamo.config.trace_autograd_ops`,
torch >= 2.13): energy and forces are one graph aotgrad compiles, and its ordinary backward is the
second-order gradient (the fastest way, benchmarks/RESULTS.md). With `--graph-break` Dynamo splits
the model around `autograd.grad` and aotgrad differentiates the compiled energy graph twice
(src/aotgrad/higher_order.py); upstream's torch.compile refuses that ("does not currently support
double backward").

    python examples/force_field.py [--steps 200] [--eager] [--graph-break] [--backend aotgrad_eager]

The targets come from a Morse potential on jittered lattice configurations (synthetic data).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class EnergyMLP(nn.Module):
    """E(pos) = sum over atom pairs of MLP(radial features of |r_i - r_j|); forces = -dE/dpos."""

    def __init__(self, n_atoms: int = 64, n_rbf: int = 16, hidden: int = 64, cutoff: float = 5.0):
        super().__init__()
        i, j = torch.triu_indices(n_atoms, n_atoms, offset=1)
        self.register_buffer("i", i, persistent=False)
        self.register_buffer("j", j, persistent=False)
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_rbf), persistent=False)
        self.width = (cutoff - 0.5) / n_rbf
        self.mlp = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 1))

    def energy(self, pos: torch.Tensor) -> torch.Tensor:
        """pos: (batch, atoms, 3) -> energies (batch,)."""
        diff = pos[:, self.i] - pos[:, self.j]
        d = diff.pow(2).sum(-1).add(1e-6).sqrt()
        rbf = torch.exp(-((d[..., None] - self.centers) / self.width).pow(2))
        return self.mlp(rbf).squeeze(-1).sum(-1)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not pos.requires_grad:
            pos = pos.requires_grad_()
        e = self.energy(pos)
        (g,) = torch.autograd.grad(e.sum(), pos, create_graph=True)
        return e, -g


def force_field_loss(model: nn.Module, pos, e_ref, f_ref, force_weight: float = 10.0) -> torch.Tensor:
    """Energy error per atom, plus the weighted force error."""
    e, f = model(pos)
    n = pos.shape[1]
    return F.mse_loss(e / n, e_ref / n) + force_weight * F.mse_loss(f, f_ref)


def morse_energy(pos: torch.Tensor, r0: float = 1.2, a: float = 1.5, depth: float = 0.1) -> torch.Tensor:
    d = torch.cdist(pos, pos)
    n = pos.shape[1]
    off = ~torch.eye(n, dtype=torch.bool, device=pos.device)
    v = depth * (1 - torch.exp(-a * (d - r0))).pow(2) - depth
    return (v * off).sum((-1, -2)) / 2


def make_data(batch: int, n_atoms: int = 64, seed: int = 0, dtype=torch.float32):
    """Jittered 4x4x4 lattice configurations with Morse energies and forces."""
    g = torch.Generator().manual_seed(seed)
    side = round(n_atoms ** (1 / 3))
    grid = torch.stack(torch.meshgrid(*[torch.arange(side, dtype=torch.float64)] * 3, indexing="ij"), -1)
    lattice = grid.reshape(-1, 3)[:n_atoms] * 1.25
    pos = (lattice + 0.15 * torch.randn(batch, n_atoms, 3, generator=g, dtype=torch.float64)).requires_grad_()
    e = morse_energy(pos)
    (grad,) = torch.autograd.grad(e.sum(), pos)
    return pos.detach().to(dtype), e.detach().to(dtype), (-grad).to(dtype)


def train_step(loss_fn, opt, data) -> torch.Tensor:
    loss = loss_fn(*data)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--backend", default="aotgrad")
    p.add_argument("--eager", action="store_true", help="no torch.compile")
    p.add_argument("--graph-break", action="store_true",
                   help="let Dynamo split the model at autograd.grad (double backward through aotgrad)")
    args = p.parse_args(argv)
    if hasattr(torch._dynamo.config, "trace_autograd_ops"):
        torch._dynamo.config.trace_autograd_ops = not args.graph_break

    torch.manual_seed(0)
    model = EnergyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = lambda pos, e, f: force_field_loss(model, pos, e, f)  # noqa: E731
    if not args.eager:
        loss_fn = torch.compile(loss_fn, backend=args.backend)
    train = [make_data(args.batch, seed=s) for s in range(8)]
    val = make_data(args.batch, seed=100)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = train_step(loss_fn, opt, train[step % len(train)])
        if step == 0:
            print(f"step 0 (compiles): loss {loss.item():.4f}, {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
        elif step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}")
    per_step = (time.perf_counter() - t0) / max(args.steps - 1, 1)
    with torch.enable_grad():
        e, f = model(val[0].clone())
    print(f"{per_step * 1e3:.1f} ms/step; validation: energy MAE {(e - val[1]).abs().mean().item():.4f}, "
          f"force MAE {(f - val[2]).abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
