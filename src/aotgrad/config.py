"""Global switches for aotgrad's `torch.compile` backend.

Set them as module attributes (`aotgrad.config.fallback_to_eager = True`) or for a block with
`aotgrad.config.patch(fallback_to_eager=True)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# When aotgrad cannot compile a graph Dynamo hands it (an op without a fake/meta kernel, an
# unsupported input or mutation...), warn and run that graph eagerly instead of raising.
fallback_to_eager: bool = False

# Backend path only: when Dynamo hands symbolic (dynamic) shapes, trace with them so that a new batch
# size reuses the graph (Dynamo guards the shapes). False: specialize every graph to exact shapes
# (aotgrad compiles once per concrete shape, keyed by its own signature guards).
symbolic_shapes: bool = True

# Backend path only, Inductor compilers: run Inductor's pre-grad passes on the Dynamo graph and its
# joint-graph passes on aotgrad's joint/inference graph (as upstream's Inductor pipeline does).
inductor_graph_passes: bool = True

# Backend path only: keep compiled graphs in an on-disk cache (cache.py) under Inductor's cache
# dir, so a new process compiling the same graph skips capture and partitioning. The environment
# variable AOTGRAD_CACHE=0 turns it off too.
cache: bool = True

_NAMES = ("fallback_to_eager", "symbolic_shapes", "inductor_graph_passes", "cache")


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Temporarily set config values: `with aotgrad.config.patch(fallback_to_eager=True): ...`."""
    module = globals()
    unknown = [k for k in changes if k not in _NAMES]
    if unknown:
        raise AttributeError(f"aotgrad.config has no option(s) {unknown}; options: {list(_NAMES)}")
    old = {k: module[k] for k in changes}
    module.update(changes)
    try:
        yield
    finally:
        module.update(old)
