"""Where in the user's program a refusal comes from: the source line added to aotgrad's errors.

An `AotgradError` raised while the program is traced (a data-dependent `.item()`, a refused
mutation...) says what aotgrad cannot do; with a model of many layers the user also needs where.
`with_user_line` finds the innermost frame of the user's own code in the traceback of the error (or
of the torch error it replaces: files under torch/ other than torch.nn's modules, aotgrad's own
files and generated code are skipped, as for the graphs' `stack_trace`) and appends it.
"""

from __future__ import annotations

import linecache
import os
import types

from ..errors import AotgradError, DataDependentError, UnsupportedMutationError
from ..node_meta import _is_user_file

__all__ = ["no_grad_view_write_error", "numpy_error", "unallocated_data_error", "user_line", "with_user_line"]

_AOTGRAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
_MARK = "\n  at "


def user_line(tb: types.TracebackType | None) -> str | None:
    """'file:line in function: source' of the innermost user frame in the traceback `tb`."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename
        if not filename.startswith(_AOTGRAD_DIR) and _is_user_file(filename):
            found = (filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    if found is None:
        return None
    filename, lineno, name = found
    text = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno} in {name}" + (f": {text}" if text else "")


def with_user_line(err: AotgradError, cause: BaseException | None = None) -> AotgradError:
    """`err` with the user's source line appended to its message (once), read off the traceback of
    `cause` (or of `err` itself)."""
    msg = str(err.args[0]) if err.args else str(err)
    if _MARK in msg:
        return err
    line = None
    for exc in (cause, err):
        if exc is not None and line is None:
            line = user_line(exc.__traceback__)
    if line is not None:
        err.args = (msg + _MARK + line, *err.args[1:])
    return err


def numpy_error(e: BaseException) -> DataDependentError | None:
    """aotgrad's error for torch's '.numpy() is not supported for tensor subclasses' (the trace's
    tensors are functional wrappers, a subclass the user never made), else None."""
    text = str(e)
    if not (isinstance(e, RuntimeError) and ".numpy()" in text and "tensor subclasses" in text):
        return None
    return DataDependentError(
        "aotgrad: the program calls .numpy() (or another conversion to a NumPy array) on a tensor; aot_function "
        "traces the program with placeholder tensors that hold no values. Use torch operations instead, or "
        "move the conversion out of the compiled function (torch.compile(fn, backend=\"aotgrad\") runs it "
        "eagerly between graphs)."
    )


def unallocated_data_error(e: BaseException) -> DataDependentError | None:
    """aotgrad's error for an op whose kernel reads a tensor argument's values directly (torch's
    "data is not allocated yet": `tensor_split` with its indices as a tensor), else None."""
    if not (isinstance(e, RuntimeError) and "its data is not allocated yet" in str(e)):
        return None
    return DataDependentError(
        "aotgrad: the program calls an op whose kernel reads the values of a tensor argument (e.g. "
        "tensor_split's indices given as a tensor); aot_function traces the program with placeholder tensors "
        "that hold no values. Pass those values as Python ints or lists, or use torch.compile(fn, "
        "backend=\"aotgrad\"), which runs such ops eagerly between graphs."
    )


def no_grad_view_write_error(e: BaseException) -> UnsupportedMutationError | None:
    """aotgrad's error for torch's "A view was created in no_grad mode and is being modified inplace
    with grad mode enabled", raised by the trace (fuzz seed 24 program 7703), else None. Eager raises
    it too, except where the viewed tensor is itself a view of one that requires no grad: the new view
    then belongs to that base, and eager's autograd never sees the write."""
    if not (isinstance(e, RuntimeError) and "created in no_grad mode and is being modified inplace" in str(e)):
        return None
    return UnsupportedMutationError(
        "aotgrad: the program writes in place, with grad mode on, into a view it took under no_grad of a "
        "tensor that requires grad. Eager forbids this, unless that tensor is a view of one that does not "
        "require grad (eager's autograd then does not see the write); aotgrad cannot trace either. Take the "
        "view outside the no_grad block, or make the write under no_grad too."
    )
