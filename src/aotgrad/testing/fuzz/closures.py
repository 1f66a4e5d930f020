"""Closed-over tensors for the fuzzer's programs (fuzz_programs.generate calls `maybe_close_over`).

Some programs also read a global tensor `W0` that requires grad and that they are not passed
(aot_function lifts it: signature/lifting.py). `make_inputs` rebinds the global to a fresh tensor on every
call, so eager and each compiled call see a new object (the compiled function must follow the
rebinding), and returns it among the roots, so its gradient is compared with eager's.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

PROBABILITY = 0.15


def maybe_close_over(pseed: int, prog: Any, stmt: type) -> Any:
    """`prog` with a closed-over `W0` for a fraction of programs (own random stream: the rest of
    the program is what it was without it)."""
    rng = random.Random(pseed ^ 0xC105ED)
    if rng.random() >= PROBABILITY or not prog.returns:
        return prog
    shape = rng.choice(["()", "(1,)"])
    name = "w_closed"
    use = rng.choice(prog.returns)
    return dataclasses.replace(
        prog,
        setup=("global W0",) + prog.setup + (f"W0 = torch.randn({shape}, generator=g).requires_grad_()",),
        roots=prog.roots + ("W0",),
        body=prog.body + (stmt(f"{name} = {use} * W0"),),
        returns=prog.returns + (name,),
        single=False,
    )
