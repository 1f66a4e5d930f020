"""What a compile did, for people: `aotgrad.explain` as text and one HTML page.

Takes a function or module and example inputs; compiles copies with the `nop` compiler and returns a
`Report` read off what the pipeline produced: the plan, the graphs with source lines
(`explain/residuals.py`), saved values against eager's, a memory timeline (`memory.py`) and the budget
curve; `html.py` renders it, `graphs.py` writes a page per Dynamo graph (`config.explain_dir`),
`cli.py` is `python -m aotgrad.explain`. Nothing in the pipeline imports this folder.

The package is callable (`aotgrad.explain(...)` works even after `import aotgrad.explain` has made
the package attribute this module).
"""

import sys
import types
from typing import Any

from .report import Report, explain

__all__ = ["Report", "explain"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Report:
        return explain(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
