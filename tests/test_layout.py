"""The package layout: folders import only downwards, no module over ~800 lines, no import cycle.

`ALLOWED` is the table ARCHITECTURE.md prints: which folder (or top-level module) may import which.
Imports inside functions count too: a lazy import that only hides a back-import is still one. A new
import that the table does not allow fails here; change the table only when the new direction is a
design decision (and say so in ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import aotgrad

PACKAGE = Path(aotgrad.__file__).parent
MAX_LINES = 800
BASE = {"errors", "config", "plan", "observe", "node_meta", "torch_compat"}

# unit -> the units it may import (besides itself). "base" is the modules in BASE.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "signature": {"base"},
    "dynamic": {"base", "signature"},
    "trace": {"base", "signature"},
    "partition": {"base", "trace"},
    "higher_order": {"base", "trace", "partition"},
    "compile": {"base", "signature", "trace", "partition", "higher_order"},
    "runtime": {"base", "signature", "compile"},
    "subclass": {"base", "signature", "dynamic", "trace", "higher_order", "runtime"},
    "api": {"base", "signature", "dynamic", "trace", "partition", "compile", "runtime", "subclass"},
    "export": {"base", "signature", "dynamic", "trace", "api"},
    "inductor": {"base", "dynamic", "trace", "compile", "api"},
    "cache": {"base", "signature", "higher_order", "compile", "runtime", "api", "inductor"},
    "explain": {"base", "dynamic", "partition", "compile", "api", "inductor"},
    "backend": {"base", "signature", "dynamic", "trace", "partition", "compile", "runtime", "api", "inductor",
                "cache", "explain"},
    "testing": {"base", "signature", "compile", "api"},
}


def package_sources(root: Path = PACKAGE) -> dict[str, str]:
    """Dotted module name (relative to the package, '' for its __init__) -> source."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return module == "" or any(m.startswith(module + ".") for m in sources)


def imports_of(module: str, source: str, sources: dict[str, str]) -> set[str]:
    """The package's modules `module` imports (relative or `aotgrad.`-absolute, lazy ones too)."""
    package = module if _is_package(module, sources) else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "aotgrad":
                target = node.module.partition(".")[2]
            else:
                continue
            names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            found = [n for n in names if n in sources]  # `from . import x` of a module x
            out.update(found or [target])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("aotgrad."):
                    out.add(a.name.partition(".")[2])
    return {m for m in out if m in sources and m != module}


def unit_of(module: str) -> str | None:
    """The layer a module belongs to; None for the facade (`aotgrad/__init__`), which imports all."""
    if module == "":
        return None
    head = module.split(".")[0]
    return "base" if head in BASE else head


def violations(sources: dict[str, str]) -> list[str]:
    """Every import the ALLOWED table does not allow, as 'importer -> imported'."""
    bad = []
    for module, source in sources.items():
        unit = unit_of(module)
        if unit is None:
            continue
        for target in sorted(imports_of(module, source, sources)):
            other = unit_of(target)
            if other is not None and other != unit and other not in ALLOWED.get(unit, set()):
                bad.append(f"{module} ({unit}) -> {target} ({other})")
    return bad


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in `graph`, as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
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


def test_every_unit_is_in_the_table():
    units = {unit_of(m) for m in package_sources()} - {None}
    assert {"signature", "trace", "partition", "compile", "runtime", "backend"} <= units, units
    assert units <= set(ALLOWED), f"folders missing from ALLOWED: {units - set(ALLOWED)}"


def test_the_table_is_layered():
    """The table itself has no cycle, so there is an order from the base up."""
    assert _cycle(ALLOWED) is None


def test_folders_import_only_what_the_table_allows():
    sources = package_sources()
    assert "trace.capture" in imports_of("api", sources["api"], sources), "the scan missed api's imports: fix it"
    assert not violations(sources), "imports against ARCHITECTURE.md's table:\n" + "\n".join(violations(sources))


def test_a_planted_back_import_is_caught():
    sources = package_sources()
    for module, planted in [
        ("trace.capture", "from ..backend.dynamo import backend\n"),  # relative, module-level
        ("signature.inputs", "def f():\n    from aotgrad.cache import store\n"),  # absolute, lazy
        ("partition.default", "from .. import api\n"),  # `from .. import module`
    ]:
        bad = violations({**sources, module: sources[module] + planted})
        assert len(bad) == 1 and bad[0].startswith(module), (module, bad)


def test_no_module_over_the_line_limit():
    sizes = {m or "__init__": len(s.splitlines()) for m, s in package_sources().items()}
    assert len(sizes) > 50, "found too few modules: the test would pass vacuously"
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines (split them along their seams): {too_big}"


def test_no_import_cycle_between_modules():
    sources = package_sources()
    graph = {m: imports_of(m, s, sources) for m, s in sources.items() if m}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle among aotgrad's modules: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
