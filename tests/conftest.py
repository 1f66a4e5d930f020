"""Test-suite settings: the on-disk cache off, every random input seeded.

aotgrad's on-disk cache (cache.py) is off for the suite, so a test's result never depends on what an
earlier run left on disk; tests/test_cache.py turns it on, in a temporary cache directory, where it
tests the cache itself.
"""

import os
import random

import pytest
import torch

os.environ.setdefault("AOTGRAD_CACHE", "0")


@pytest.fixture(autouse=True)
def _seed_random_inputs():
    """Every test starts from the same random state (torch, Python's random; numpy's if present), so
    an input made with torch.randn and no generator is the same on every run and in every order."""
    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy

        numpy.random.seed(0)
    except ImportError:
        pass
