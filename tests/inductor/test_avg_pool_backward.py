"""Ceil-mode average-pool backwards that count padding run as aten kernels (inductor/avg_pool_backward.py).

Inductor's lowering divides a window that runs past the padded input by the whole kernel, where
eager divides by the part inside: HuggingFace EfficientNet's global `AvgPool2d(hidden_dim,
ceil_mode=True)` got gradients 1e-5 of eager's under plain Inductor and under aotgrad, and the
sweep's efficientnet row blamed both backends. The canary checks that plain Inductor still does
this, so the detour is still needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import aotgrad  # noqa: F401  (registers the backend)

ROUTED = "runs as an aten kernel"

# (pool, input shape): EfficientNet's global pool at 32 px and at 224 px, a strided ceil-mode pool
# with and without padding, a 3-d and a 1-d one, and Funnel Transformer's pooling of an odd-length sequence
# (plain Inductor: the last position's gradient is half of eager's).
OVERHANGING = [
    (torch.nn.AvgPool2d(320, ceil_mode=True), (2, 3, 1, 1)),
    (torch.nn.AvgPool2d(1280, ceil_mode=True), (2, 3, 7, 7)),
    (torch.nn.AvgPool2d(3, 2, ceil_mode=True), (2, 3, 6, 6)),
    (torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True), (2, 3, 6, 6)),
    (torch.nn.AvgPool3d(3, 2, ceil_mode=True), (2, 3, 6, 6, 6)),
    (torch.nn.AvgPool2d((2, 1), (2, 1), ceil_mode=True), (2, 1, 7, 8)),  # Funnel's pooling, odd length
    (torch.nn.AvgPool1d(3, 2, ceil_mode=True), (2, 3, 8)),  # decomposed into the 2-d backward
]


def _run(fn, x, weights):
    x = x.detach().requires_grad_()
    out = fn(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("pool,shape", OVERHANGING, ids=lambda p: str(p) if isinstance(p, tuple) else type(p).__name__)
def test_overhanging_ceil_mode_windows_get_eagers_gradient(pool, shape, caplog):
    x = torch.randn(shape)
    weights = torch.randn_like(pool(x))
    expected = _run(pool, x, weights)
    torch._dynamo.reset()
    with caplog.at_level(logging.DEBUG, logger="aotgrad.inductor"):
        got = _run(torch.compile(pool, backend="aotgrad"), x, weights)
    for name, e, g in zip(("output", "grad"), expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(ROUTED in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("pool", [torch.nn.AvgPool2d(3, 2, 1), torch.nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False)],
                         ids=["no-ceil-mode", "no-padding-counted"])
def test_pools_inductor_divides_right_keep_its_kernel(pool, caplog):
    x = torch.randn(2, 3, 5, 5)
    weights = torch.randn_like(pool(x))
    expected = _run(pool, x, weights)
    torch._dynamo.reset()
    with caplog.at_level(logging.DEBUG, logger="aotgrad.inductor"):
        got = _run(torch.compile(pool, backend="aotgrad"), x, weights)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    assert not any(ROUTED in r.getMessage() for r in caplog.records)


def test_channels_last_input_keeps_its_layout():
    """The custom op promises `empty_like(input)`; aten's CPU kernel may return another layout."""
    pool = torch.nn.AvgPool2d(3, 2, ceil_mode=True)
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    weights = torch.randn_like(pool(x))
    expected = _run(pool, x, weights)
    torch._dynamo.reset()
    got = _run(torch.compile(pool, backend="aotgrad"), x, weights)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    assert got[1].stride() == expected[1].stride()


def test_dynamic_sizes_are_routed_too():
    pool = torch.nn.AvgPool2d(3, 2, ceil_mode=True)
    torch._dynamo.reset()
    compiled = torch.compile(pool, backend="aotgrad", dynamic=True)
    for size in (6, 8):
        x = torch.randn(2, 3, size, size)
        weights = torch.randn_like(pool(x))
        torch.testing.assert_close(_run(compiled, x, weights)[1], _run(pool, x, weights)[1], rtol=1e-5, atol=1e-6)


def test_canary_plain_inductor_still_divides_overhanging_windows_by_the_whole_kernel():
    """If this fails, torch fixed its lowering: `avg_pool_backward.route_to_aten` can go."""
    pool = torch.nn.AvgPool2d(1280, ceil_mode=True)
    x = torch.randn(2, 3, 7, 7)
    weights = torch.randn_like(pool(x))
    _, expected = _run(pool, x, weights)
    torch._dynamo.reset()
    _, got = _run(torch.compile(pool, backend="inductor"), x, weights)
    ratio = (got.norm() / expected.norm()).item()
    assert ratio == pytest.approx(49 / 1280**2, rel=1e-3), ratio


_CACHED = textwrap.dedent("""
    import torch, aotgrad
    pool = torch.nn.AvgPool2d(3, 2, ceil_mode=True)
    torch.manual_seed(0)
    x, weights = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 3, 3)
    grads = []
    for fn in (pool, torch.compile(pool, backend="aotgrad")):
        leaf = x.clone().requires_grad_()
        (fn(leaf) * weights).sum().backward()
        grads.append(leaf.grad)
    stats = aotgrad.cache_stats()
    print("right" if torch.allclose(*grads, atol=1e-6) else "wrong", stats["hits"], stats["stores"], flush=True)
""")


def test_a_cache_hit_in_a_new_process_runs_the_routed_op(tmp_path):
    """The stored Inductor code calls `aotgrad::avg_pool2d_backward`: `import aotgrad` registers it."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "AOTGRAD_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", _CACHED], capture_output=True, text=True, timeout=600, env=env)
            for _ in range(2)]
    (cold, warm) = [run.stdout.split() for run in runs]
    assert cold[0] == "right" and int(cold[2]) >= 1, runs[0].stdout + runs[0].stderr[-2000:]
    assert warm[0] == "right" and int(warm[1]) >= 1, runs[1].stdout + runs[1].stderr[-2000:]
