"""Global switches for aotgrad.

Set them as module attributes (`aotgrad.config.fallback_to_eager = True`) or for a block with
`aotgrad.config.patch(fallback_to_eager=True)`. Assigning a name that is not an option raises
`AttributeError`: a typo must not be silently accepted.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

# Backend path: when aotgrad cannot compile a graph Dynamo hands it (an op without a fake/meta kernel,
# an unsupported input or mutation...), warn and run that graph eagerly instead of raising.
fallback_to_eager: bool = False

# Backend path only: when Dynamo hands symbolic (dynamic) shapes, trace with them so that a new batch
# size reuses the graph (Dynamo guards the shapes). False: specialize every graph to exact shapes
# (aotgrad compiles once per concrete shape, keyed by its own signature guards).
symbolic_shapes: bool = True

# Backend path only, Inductor compilers: run Inductor's pre-grad passes on the Dynamo graph and its
# joint-graph passes on aotgrad's joint/inference graph (as upstream's Inductor pipeline does).
inductor_graph_passes: bool = True

# Backend path only: write an `aotgrad.explain` HTML report per compiled graph, plus an index.html in
# graph order, into this directory (explain/graphs.py). Default: the AOTGRAD_EXPLAIN_DIR variable.
explain_dir: str | None = os.environ.get("AOTGRAD_EXPLAIN_DIR") or None

# Backend path only: keep compiled graphs in an on-disk cache (cache/store.py) under Inductor's cache
# dir, so a new process compiling the same graph skips capture and partitioning. The environment
# variable AOTGRAD_CACHE=0 turns it off too.
cache: bool = True

# aot_function / aot_module path: after this many input signatures of one compiled function, warn
# once, naming the part of the signature that keeps changing (Dynamo's `recompile_limit` analogue).
recompile_limit: int = 8

# aot_function / aot_module path: past this many signatures, stop compiling and run the function
# eagerly for new signatures (warning once); signatures already compiled keep running compiled.
recompile_hard_limit: int = 64

# Inductor compilers: the compiled backward may write into the saved forward intermediates it reads
# last ("donated buffers", as upstream's `torch._functorch.config.donated_buffer`), so a large
# gradient (a language model's logits') takes the saved value's memory instead of new memory beside
# it. Safe under retain_graph=True and saved-tensor hooks (inductor/donation.py).
donated_buffers: bool = True

_NAMES = (
    "fallback_to_eager", "symbolic_shapes", "inductor_graph_passes", "explain_dir", "recompile_limit",
    "recompile_hard_limit", "cache", "donated_buffers",
)


def _unknown(names: list[str]) -> AttributeError:
    return AttributeError(f"aotgrad.config has no option(s) {names}; options: {list(_NAMES)}")


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Temporarily set config values: `with aotgrad.config.patch(fallback_to_eager=True): ...`."""
    module = globals()
    unknown = [k for k in changes if k not in _NAMES]
    if unknown:
        raise _unknown(unknown)
    old = {k: module[k] for k in changes}
    module.update(changes)
    try:
        yield
    finally:
        module.update(old)


def torch_activation_memory_budget() -> float | None:
    """`torch._functorch.config.activation_memory_budget` when the user changed it from its default
    (1.0), else None: the backend passes it to its partitioner unless `memory_budget=` was given."""
    import torch._functorch.config as functorch_config

    budget = functorch_config.activation_memory_budget
    return None if budget == 1.0 else float(budget)


class _ConfigModule(types.ModuleType):
    """Refuses assignments to names that are not options (`aotgrad.config.recompile_limt = 2`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _NAMES and not name.startswith("_"):
            raise _unknown([name])
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _ConfigModule
