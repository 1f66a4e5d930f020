"""The package layout: no module over ~800 lines, no import cycle among aotgrad's modules.

Imports inside functions count too: a lazy import that only hides a cycle is still a cycle. The package
`__init__` (the public facade, which imports everything) is left out of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aotgrad

PACKAGE = Path(aotgrad.__file__).parent
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def _imports(path: Path, names: set[str]) -> set[str]:
    """aotgrad modules `path` imports: `from .x import`, `from . import x`, `from aotgrad.x import`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or (node.level == 0 and (node.module or "").split(".")[0] == "aotgrad"):
                parts = (node.module or "").split(".")
                if node.level == 0:
                    parts = parts[1:]
                if parts and parts[0]:
                    out.add(parts[0])
                else:
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "aotgrad" and len(parts) > 1:
                    out.add(parts[1])
    return out & names


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph`, as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_over_the_line_limit():
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert sizes, "found no modules: the test would pass vacuously"
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines (split them along their seams): {too_big}"


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    assert "capture" in graph["api"], "the import scan missed `from .capture import`: fix the test"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle among aotgrad's modules: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
