"""The fuzzer's caller-autocast mode (`make fuzz AUTOCAST=1`): every program is called, and its
backward run, inside the caller's `torch.autocast("cpu", dtype=torch.bfloat16)`.

So each program's matmuls are cast where eager casts them, its own `no_grad` and autocast regions
nest inside the caller's state, and the backward takes aotgrad's re-traced path
(`signature/ambient.retrace_under_autocast`), on the first call and the cached one.

Autocast's cast cache is turned off on both sides: eager casts a leaf once per region and adds its
uses' gradients in bfloat16, aotgrad casts it per use and adds them in float32 (a known gap,
`test_leaf_cast_once_per_region`, upstream's too), which would otherwise be most of what a run finds. With `--order 2` the second gradients are
compared at a bfloat16 rounding (fuzz/order2.py): aotgrad casts a value used twice once, and its
second backward adds the uses' gradients in bfloat16 (`test_second_order_through_a_value_cast_twice`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from .check import Outcome
from .check import check_program as check_plain
from .programs import Program


@contextlib.contextmanager
def callers_autocast() -> Iterator[None]:
    """bfloat16 autocast on the CPU with its cast cache off, as the program's caller."""
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        torch.set_autocast_cache_enabled(cache)


def check_program(prog: Program, *, backend: str | None = None, check: Callable = check_plain, **kwargs) -> Outcome:
    """`check` (the plain check, or another mode's) run inside `callers_autocast`."""
    with callers_autocast():
        return check(prog, backend=backend, **kwargs)
