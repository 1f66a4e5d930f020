"""The explain HTML page in a real browser (headless Chromium, Debian's chromium-headless-shell,
installed by `make install`): a screenshot is not blank and the parsed DOM holds the SVG charts and
the parameter names. Under CI=true a missing browser fails the test; elsewhere it skips."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.explain.browser import dump_dom, find_browser, png_stats, screenshot


@pytest.fixture(scope="module")
def browser():
    found = find_browser()
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium-headless-shell is missing (make install installs it: apt-get install "
                        "chromium-headless-shell)")
        pytest.skip("chromium-headless-shell not installed (not CI)")
    return found


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return self.norm(torch.relu(self.attn(x)) + x)


def test_report_page_renders_in_chromium(browser, tmp_path):
    torch.manual_seed(0)
    mod = nn.Sequential(Block(), Block())
    report = aotgrad.explain(mod, torch.randn(8, 16), memory_budget=0.5, budget_points=5)
    page = report.save_html(str(tmp_path / "report.html"))
    png = screenshot(page, str(tmp_path / "report.png"), (1200, 900), browser)
    stats = png_stats(png)
    assert (stats.width, stats.height) == (1200, 900)
    assert stats.variance > 100 and stats.distinct_colours > 20, stats  # text, tables, cards: not blank
    dom = dump_dom(page, browser)
    assert '<svg id="memory-timeline"' in dom and '<svg id="budget-curve"' in dom
    assert dom.count("<polyline") >= 3 and 'id="chosen"' in dom
    for name in ("0.attn.weight", "1.norm.bias", "0.steps"):
        assert name in dom, name
    assert "<details>" in dom and "forward graph" in dom


def test_blank_page_fails_the_blankness_check(browser, tmp_path):
    """The check above can fail: a page with nothing on it has no pixel variance."""
    page = tmp_path / "blank.html"
    page.write_text("<!DOCTYPE html><html><body style='background:#fff'></body></html>")
    stats = png_stats(screenshot(str(page), str(tmp_path / "blank.png"), (1200, 900), browser))
    assert stats.variance < 1 and stats.distinct_colours <= 2 and stats.mean > 250
