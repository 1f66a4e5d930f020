"""interpreter_stack.on_roomy_stack: a plain call, except that no call below it maps memory.

The effect is checked by counting page faults (not timing): a loop of calls that return across an
interpreter stack chunk boundary faults a fresh chunk in on every call."""

import resource
import sys

import pytest

from aotgrad.trace.interpreter_stack import on_roomy_stack

CHUNKED_FRAMES = sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


def test_passes_arguments_and_results():
    assert on_roomy_stack(lambda a, b=0, *, c: (a, b, c), 1, c=3) == (1, 0, 3)


def test_propagates_exceptions():
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        on_roomy_stack(boom)


def _leaf():
    return 0


def _faults_at(depth: int, calls: int = 1000) -> int:
    """Minor page faults taken by `calls` calls made `depth` frames below here."""
    if depth:
        return _faults_at(depth - 1, calls)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst_depth_faults(depths: int = 300) -> int:
    # 300 small frames span more than one 16 KiB chunk, so some depth sits on a boundary.
    return max(_faults_at(d) for d in range(depths))


@pytest.mark.skipif(not CHUNKED_FRAMES, reason="frames live in mmap'd chunks only on CPython 3.11+")
def test_calls_across_a_chunk_boundary_stop_faulting():
    assert _worst_depth_faults() >= 900  # the effect exists: about one fault per call at a boundary
    assert on_roomy_stack(_worst_depth_faults) < 100
