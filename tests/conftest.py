"""Test-suite settings.

aotgrad's on-disk cache (cache.py) is off for the suite, so a test's result never depends on what an
earlier run left on disk; tests/test_cache.py turns it on, in a temporary cache directory, where it
tests the cache itself.
"""

import os

os.environ.setdefault("AOTGRAD_CACHE", "0")
