"""`python -m aotgrad.explain path/to/script.py:function [--inputs make_inputs] [--html out.html]`.

Loads the script as a module (its `if __name__ == "__main__":` block does not run), takes
`function` (a function, an nn.Module instance, or an nn.Module class / factory called with no
arguments: whichever it is), calls the script's `--inputs` function for the example arguments (a
tuple of positional arguments, or a dict with "args" and "kwargs"), and prints the report; `--html`
also writes the page. The library function is `aotgrad.explain` (explain_report.py).

This module is callable (`aotgrad.explain(...)` works even after `import aotgrad.explain` has made
the package attribute this module).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from typing import Any

import torch

from .explain_report import Report, explain

__all__ = ["Report", "explain", "main"]


def _load(path: str) -> types.ModuleType:
    name = "_aotgrad_explain_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"aotgrad.explain: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec.loader.exec_module(module)
    return module


def _target(module: types.ModuleType, name: str) -> Any:
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"aotgrad.explain: {module.__file__} has no {name!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        obj = obj()
    return obj


def _inputs(module: types.ModuleType, name: str | None) -> tuple[tuple, dict]:
    if name is None:
        return (), {}
    made = _target(module, name)()
    if isinstance(made, dict) and set(made) <= {"args", "kwargs"}:
        return tuple(made.get("args", ())), dict(made.get("kwargs", {}))
    return (tuple(made) if isinstance(made, (tuple, list)) else (made,)), {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aotgrad.explain",
        description="Print what aotgrad's compilation does to a function or module in a script (aotgrad.explain); "
        "--html also writes it as one self-contained page.")
    p.add_argument("target", help="path/to/script.py:function (a function or an nn.Module)")
    p.add_argument("--inputs", help="a function in the script returning the example arguments")
    p.add_argument("--html", help="also write the report as one HTML page here")
    p.add_argument("--memory-budget", type=float, default=None, help="min-cut memory budget in 0..1")
    p.add_argument("--partitioner", choices=["default", "mincut"], default="mincut",
                   help="mincut (what backend='aotgrad' runs) or aot_function's default_partition")
    p.add_argument("--budget-points", type=int, default=11, help="budgets in 0..1 on the min-cut curve (0: none)")
    ns = p.parse_args(argv)
    path, _, name = ns.target.rpartition(":")
    if not path or not name:
        p.error("target must be path/to/script.py:function")
    module = _load(path)
    fn = _target(module, name)
    args, kwargs = _inputs(module, ns.inputs)
    part = None
    if ns.partitioner == "default":
        from .partition import default_partition as part
    report = explain(fn, *args, partition_fn=part, memory_budget=ns.memory_budget, budget_points=ns.budget_points,
                     **kwargs)
    print(report)
    if ns.html:
        report.save_html(ns.html)
        print(f"\nwrote {ns.html}")
    return 1 if report.refusal else 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Report:
        return explain(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
