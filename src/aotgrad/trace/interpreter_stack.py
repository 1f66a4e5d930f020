"""Run compilation on a roomy interpreter stack, so CPython does not map and unmap memory per call.

Why: CPython 3.11+ keeps a thread's Python frames in chunks of 16 KiB that it maps with `mmap` and
unmaps as soon as the first frame in a chunk returns. A loop whose calls return across a chunk
boundary therefore maps, faults in and unmaps a chunk on every call. Inductor's scheduler is such a
loop at some stack depths and not at others, so the same graph compiles fast or slow depending on
how deep the caller's stack happened to be. Measured (2-core CPU, GPT-2's compiled AdamW step, one
graph): 670,000 mmap/munmap pairs and 6.3 s of system time when a harness called the compile two
frames deeper, 285,000 and 2.9 s otherwise; compile 14.3-17.1 s against 11.4-12.2 s. Run on a
roomy stack, both callers compiled it in 9.3-9.5 s with 0.6-1.1 s of system time.

The cure: call the work from a frame so large that the interpreter gives it a chunk of its own
(2 MiB). Every frame the work pushes then fits in the rest of that chunk, and nothing is mapped or
unmapped until it returns. The frame's size comes from its code object's declared stack size; the
unused part is never written, so it costs address space, not memory. Elsewhere (other
interpreters, CPython before 3.11, whose frames are heap objects) it is a plain call.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

# Value-stack slots of the big frame: 8 bytes each, 1.1 MB, so CPython allocates a 2 MiB chunk
# (chunk sizes double from 16 KiB) and about 115,000 slots stay free for the frames below it
# (Inductor's deepest stacks use a few thousand).
_FRAME_SLOTS = 140_000


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython" and sys.version_info >= (3, 11):
    _roomy_call = types.FunctionType(
        _call.__code__.replace(co_stacksize=_FRAME_SLOTS, co_name="_roomy_call", co_qualname="_roomy_call"),
        globals(),
        "_roomy_call",
    )
else:
    _roomy_call = _call


def on_roomy_stack(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, with room for every frame it pushes in one interpreter stack chunk."""
    return _roomy_call(fn, args, kwargs)
