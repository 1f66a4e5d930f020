"""The fuzz shrinker on programs that close over a global (`global W0` in their setup, fuzz_closures):
it used to crash splitting that line as an assignment."""

from __future__ import annotations

from helpers import eager_runs_and_shows

from aotgrad.testing import fuzz
from aotgrad.testing.fuzz.shrink import _clean


def _closing_over_w0(seed: int = 1):
    return next(p for p in (fuzz.generate(seed, i) for i in range(300)) if "global W0" in p.setup)


def test_shrink_program_with_global_in_setup():
    prog = _closing_over_w0()

    still_fails = eager_runs_and_shows("* W0", "render_f")

    assert still_fails(prog)
    small = fuzz.shrink(prog, None, still_fails=still_fails)
    assert still_fails(small), small.source()
    assert small.n_statements() < prog.n_statements()
    assert "global W0" in small.setup and "W0" in small.roots
    assert any(line.startswith("W0 = ") for line in small.setup)


def test_clean_keeps_the_global_and_its_assignment():
    prog = _closing_over_w0()
    cleaned = _clean(prog)
    assert cleaned.setup[0] == "global W0" and "W0" in cleaned.roots
    f, make_inputs = fuzz.materialize(cleaned)
    assert make_inputs()  # runs: W0 still assigned
