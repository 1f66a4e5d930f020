"""The C++ overlap check of `input_checks`, against a brute-force answer, call after call (the
check remembers the last call's order of ranges; a stale order must never hide an overlap)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from aotgrad.runtime import input_checks


def _overlap(tensors, extents) -> bool:
    ranges = [(t.data_ptr(), t.data_ptr() + e) for t, e in zip(tensors, extents) if e > 0]
    return any(a < d and c < b for k, (a, b) in enumerate(ranges) for c, d in ranges[:k])


@pytest.fixture(scope="module")
def check():
    return input_checks.compile_disjoint_ranges_kernel(5)  # Inductor's C++ toolchain, as other tests


def test_overlap_check_agrees_with_brute_force(check):
    rng = random.Random(0)
    storages = [torch.zeros(16) for _ in range(3)]
    seen = {True: 0, False: 0}
    for _ in range(3000):
        tensors, extents = [], []
        for _ in range(5):
            base = rng.choice(storages)
            start, length = rng.randrange(16), rng.choice([0, 1, 2, 4])
            view = base[start:start + length]
            tensors.append(view)
            extents.append(input_checks.byte_extent(view))
        expected = _overlap(tensors, extents)
        try:
            check(torch.tensor(extents, dtype=torch.int64), *tensors)
            found = False
        except RuntimeError:
            found = True
        assert found == expected, (extents, [t.data_ptr() for t in tensors])
        seen[expected] += 1
    assert min(seen.values()) > 300  # both answers exercised


def test_byte_extent_spans_first_to_last_element():
    x = torch.zeros(4, 6)
    assert input_checks.byte_extent(x) == 24 * 4
    assert input_checks.byte_extent(x[:, 1:3]) == (1 + 3 * 6 + 1) * 4  # rows 0-3, columns 1-2
    assert input_checks.byte_extent(x.t()) == 24 * 4
    assert input_checks.byte_extent(x[:0]) == 0
    assert input_checks.byte_extent(torch.zeros(()).expand(3, 3)) == 4


def test_sizes_check_rejects_other_sizes_strides_and_dtypes():
    assert input_checks.tensor_guards_check_sizes()
    compiled_for = [torch.zeros(2, 3), torch.zeros(5)]
    check = input_checks._SizesCheck(compiled_for, [0, 1])
    assert not check.check([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(5)])  # before it is built
    assert check.check([torch.ones(2, 3), torch.ones(5)])
    assert check.check([torch.ones(2, 3), torch.ones(5)])
    assert not check.check([torch.ones(3, 2).t(), torch.ones(5)])  # same sizes, other strides
    assert not check.check([torch.ones(2, 3), torch.ones(6)])
    assert not check.check([torch.ones(2, 3), torch.ones(5, dtype=torch.float64)])
    assert not check.check([torch.ones(2, 3), torch.ones(10)[::2]])


def test_overlap_check_builds_without_probing_the_cpus_vector_instruction_sets(tmp_path):
    """Inductor's first C++ build in a process probes avx512/avx2 with a test program each (8-12 s on
    2 cores); a GPU run never asks for them otherwise, so the probe was most of a ResNet-50's first
    step beyond Inductor's on the pretend H100 (16 s of 55). The check is scalar code: built without
    it. A fresh process, a fresh Inductor cache: the probe's cache must stay empty."""
    code = (
        "import torch\n"
        "from torch._inductor import cpu_vec_isa\n"
        "from aotgrad.runtime import input_checks\n"
        "kernel = input_checks._build_disjoint_ranges_kernel(3)\n"
        "assert kernel is not None  # built, and it found the overlap its self-test shows it\n"
        "print('probed', cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "probed 0" in out.stdout, out.stdout
