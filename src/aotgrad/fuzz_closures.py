"""Closed-over state for the fuzzer's programs (fuzz_programs.generate calls `maybe_close_over`).

A fraction of programs also read state they are not passed (aot_function lifts it: lifting.py), one
of three kinds, each among the roots so its value after the call (and gradient) is compared with
eager's:

* `grad`: a global tensor `W0` that requires grad;
* `mutated`: a global tensor `S0` that does not require grad, updated in place by the program
  (`S0.add_(1)`): the update must happen once per call, not also in the trace;
* `module`: a global module `M0` (`Holder`) whose forward reads a plain tensor attribute and a
  buffer and, in training mode, updates the buffer in place. The module object persists across
  calls and switches between train() and eval() every second `make_inputs` call (a check's eager
  and compiled runs see the same mode; the next check the other), so the compiled function must
  follow the module's mode.

`make_inputs` rebinds the global tensors (and the module's attribute and buffer) to fresh tensors on
every call, so eager and each compiled call see new objects: the compiled function must follow
the rebinding.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn as nn

PROBABILITY = 0.15
KINDS = ("grad", "mutated", "module")


class Holder(nn.Module):
    """A closed-over module for the fuzzer: a plain tensor attribute `t` and a buffer `b`."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(()))
        self.t = torch.ones(())
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.b.add_(1)
            return x * self.t + self.b
        return x * self.t

    @staticmethod
    def next(prev: Holder | None, g: torch.Generator, shape: tuple) -> Holder:
        """The module for one `make_inputs` call: the same object, fresh `t` and `b`, and its mode
        switched every second call."""
        m = prev if prev is not None else Holder()
        m.calls += 1
        m.train((m.calls - 1) // 2 % 2 == 0)
        m.t = torch.randn(shape, generator=g)
        m.b = torch.randn(shape, generator=g)
        return m


def maybe_close_over(pseed: int, prog: Any, stmt: type) -> Any:
    """`prog` with closed-over state for a fraction of programs (own random stream: the rest of
    the program is what it was without it)."""
    rng = random.Random(pseed ^ 0xC105ED)
    if rng.random() >= PROBABILITY or not prog.returns:
        return prog
    shape = rng.choice(["()", "(1,)"])
    use = rng.choice(prog.returns)
    kind = rng.choice(KINDS)
    if kind == "grad":
        setup = ("global W0",) + prog.setup + (f"W0 = torch.randn({shape}, generator=g).requires_grad_()",)
        roots, body = ("W0",), (stmt(f"w_closed = {use} * W0"),)
    elif kind == "mutated":
        op = rng.choice(["add_(1)", "mul_(2)", "sub_(0.5)"])
        setup = ("global S0",) + prog.setup + (f"S0 = torch.randn({shape}, generator=g)",)
        roots, body = ("S0",), (stmt(f"S0.{op}"), stmt(f"w_closed = {use} * S0"))
    else:
        setup = ("global M0", "from aotgrad.fuzz_closures import Holder") + prog.setup + (
            f"M0 = Holder.next(M0 if 'M0' in globals() else None, g, {shape})",)
        roots, body = ("M0.t", "M0.b"), (stmt(f"w_closed = M0({use})"),)
    return dataclasses.replace(
        prog,
        setup=setup,
        roots=prog.roots + roots,
        body=prog.body + body,
        returns=prog.returns + ("w_closed",),
        single=False,
    )
