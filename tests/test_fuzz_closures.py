"""The fuzzer's closed-over state (aotgrad.fuzz_closures, `scripts/fuzz.py --closures`): a global
requiring grad, a mutated global without grad, a module switching train/eval between calls."""

from __future__ import annotations

import subprocess
import sys

from aotgrad import fuzz, fuzz_closures


def _closing(monkeypatch, n: int, seed: int = 0) -> list:
    monkeypatch.setattr(fuzz_closures, "PROBABILITY", 1.0)
    return [fuzz.generate(seed, i) for i in range(n)]


def test_every_kind_is_generated(monkeypatch):
    setups = [" ".join(p.setup) for p in _closing(monkeypatch, 40)]
    for tag in ("global W0", "global S0", "global M0"):
        assert any(tag in s for s in setups), tag


def test_module_kind_reproducer_runs_standalone(monkeypatch, tmp_path):
    prog = next(p for p in _closing(monkeypatch, 40) if "global M0" in p.setup)
    path = tmp_path / "repro.py"
    path.write_text(prog.reproducer())
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "matches eager" in res.stdout


def test_fuzz_30_closing_programs(monkeypatch):
    monkeypatch.setattr(fuzz_closures, "PROBABILITY", 1.0)
    summary = fuzz.run(30, 2, shrink_failures=False, out_dir=None)
    assert summary.counts["mismatched"] == 0 and summary.counts["crashed"] == 0, summary.report()
    assert summary.counts["matched"] > 15, summary.report()
