"""torch's OpInfo checker (`optests.aot_autograd_check`) over op_db[START:STOP] with aotgrad swapped in,
first sample per op, `dynamic=False` against `dynamic=True`: prints the count of each (static, dynamic)
result pair and every op whose two results differ.

    PYTHONPATH=src python scripts/opinfo_dynamic.py 0 800
"""

from __future__ import annotations

import collections
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import opinfo_swap as swap  # noqa: E402
import opinfo_sweep as sweep  # noqa: E402
import torch  # noqa: E402
import torch.testing._internal.optests.aot_autograd as optests_aot  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402


def check(op, dynamic: bool) -> str:
    with warnings.catch_warnings(), sweep.time_limit(30), swap.swapped("aotgrad"):
        warnings.simplefilter("ignore")
        try:
            torch.manual_seed(0)
            s = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd)))
            op.op(s.input, *s.args, **s.kwargs)
        except Exception:
            return "skip"
        try:
            optests_aot.aot_autograd_check(op.op, (s.input, *s.args), s.kwargs, dynamic, check_gradients="auto")
        except Exception as e:
            return "fail: " + sweep.exc_summary(e)[:150]
    return "pass"


def main(start: int, stop: int) -> None:
    counts: collections.Counter = collections.Counter()
    differ = []
    for op in op_db[start:stop]:
        if sweep.nondeterministic_reason(op) or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        static, dynamic = check(op, False), check(op, True)
        counts[(static[:4], dynamic[:4])] += 1
        if static != dynamic:
            differ.append((op.name, op.variant_test_name, static, dynamic))
    print(dict(counts))
    for row in differ:
        print(row)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
