"""OpInfo sweep: torch's `op_db` ops, eager vs `aotgrad.aot_function(f, nop)` (CPU, float32).

The sweep logic lives in tests/opinfo_sweep.py (see its docstring for what is compared and how ops are
classified); benchmarks/opinfo_report.py runs the full sweep as a script.

* `test_common_op[...]`: a representative subset, one test per op, in the default run. An op that
  fails under aotgrad is re-run under upstream `functorch.compile.aot_function`: if upstream fails
  too the test is xfail (with both messages); if upstream passes the test FAILS.
* `test_full_sweep` (`-m long`): every op in op_db through both; prints both pass rates and the ops
  where aotgrad fails but upstream passes, and asserts aotgrad passes at least as many ops.
"""

from __future__ import annotations

import functools
import time

import opinfo_sweep as sweep
import pytest

COMMON_OPS = [
    # elementwise
    "add", "mul", "sub", "div.no_rounding_mode", "neg", "abs", "sin", "exp", "log", "sqrt", "pow",
    "clamp", "where", "masked_fill",
    # matmul family
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "einsum",
    # reductions / scans
    "sum", "mean", "var", "std", "amax", "max.reduction_with_dim", "cumsum", "logsumexp",
    # nn
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.batch_norm",
    "nn.functional.gelu", "nn.functional.relu", "nn.functional.silu", "nn.functional.conv2d",
    "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.embedding",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.pad.constant",
    # indexing
    "index_select", "gather", "scatter", "scatter_add", "index_add", "__getitem__",
    # shape / views
    "cat", "stack", "split", "chunk", "narrow", "select", "unbind", "view", "reshape", "transpose",
    "permute", "expand", "squeeze", "unsqueeze", "flatten",
    # sorting / misc
    "topk", "sort", "tril",
]


@functools.lru_cache(maxsize=1)
def _ops() -> dict:
    return sweep.ops_by_id()


@pytest.mark.parametrize("name", COMMON_OPS)
def test_common_op(name):
    ops = _ops()
    if name not in ops:
        pytest.skip(f"{name} is not in this torch's op_db")
    op = ops[name]
    result = sweep.check_op(op, sweep.aotgrad_compile)
    if result.status == "skip":
        pytest.skip(result.detail)
    if result.status == "pass":
        return
    upstream = sweep.check_op(op, sweep.upstream_compile)
    if upstream.status in ("fail", "error"):
        pytest.xfail(
            f"fails under upstream functorch.compile too: aotgrad [{result.status}] {result.detail}; "
            f"upstream [{upstream.status}] {upstream.detail}"
        )
    pytest.fail(
        f"{name}: aotgrad [{result.status}] ({result.where}) {result.detail} -- upstream: {upstream.status}",
        pytrace=False,
    )


@pytest.mark.long
def test_full_sweep():
    start = time.perf_counter()
    results = sweep.sweep(sweep.get_op_db(), progress=print)
    summary = sweep.summarize(results)
    print()
    print(sweep.format_report(results, summary))
    print(f"\nfull sweep took {time.perf_counter() - start:.0f}s")
    regressions = ", ".join(name for name, _ in summary.regressions)
    assert summary.passed["aotgrad"] >= summary.passed["upstream"], (
        f"aotgrad passes {summary.passed['aotgrad']} ops, upstream {summary.passed['upstream']}; "
        f"aotgrad fails where upstream passes: {regressions}"
    )
