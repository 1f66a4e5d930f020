"""Testing aotgrad against eager: `check_against_eager` and the differential fuzzer (`fuzz/`).

`check_against_eager(fn, *args)` compiles `fn`, runs both, and compares outputs and their autograd
metadata, inputs after the call, version counters and gradients. The fuzzer generates programs
(views, mutations, `no_grad` blocks, closures, subclasses, second-order gradients), checks each
against eager, shrinks failures and writes reproducers (`scripts/fuzz.py`).
"""

from .compare import check_against_eager

__all__ = ["check_against_eager"]
