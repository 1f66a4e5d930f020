"""Where in the user's program a refusal comes from: the source line added to aotgrad's errors.

An `AotgradError` raised while the program is traced (a data-dependent `.item()`, a refused
mutation...) says what aotgrad cannot do; with a model of many layers the user also needs where.
`with_user_line` finds the innermost frame of the user's own code in the traceback of the error (or
of the torch error it replaces: files under torch/ other than torch.nn's modules, aotgrad's own
files and generated code are skipped, as for the graphs' `stack_trace`) and appends it.
`translated_torch_error` turns the torch errors a trace raises where eager would not (or with
torch-internal wording) into aotgrad's named ones, from one table.
"""

from __future__ import annotations

import linecache
import os
import types

from ..errors import AotgradError, DataDependentError, UnsupportedMutationError
from ..node_meta import _is_user_file

__all__ = ["translated_torch_error", "user_line", "with_user_line"]

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


# torch's RuntimeError raised while the program is traced -> (what its message contains, aotgrad's
# error class, aotgrad's message). Each is a case the trace's placeholder tensors cannot run as
# eager does; torch's own text would point the user at torch internals.
_TRANSLATED: tuple[tuple[tuple[str, ...], type[AotgradError], str], ...] = (
    # the trace's tensors are functional wrappers, a subclass the user never made
    ((".numpy()", "tensor subclasses"), DataDependentError,
     "aotgrad: the program calls .numpy() (or another conversion to a NumPy array) on a tensor; aot_function "
     "traces the program with placeholder tensors that hold no values. Use torch operations instead, or "
     "move the conversion out of the compiled function (torch.compile(fn, backend=\"aotgrad\") runs it "
     "eagerly between graphs)."),
    # a kernel reading a tensor argument's values directly (OpInfo `tensor_split`, indices as a tensor)
    (("its data is not allocated yet",), DataDependentError,
     "aotgrad: the program calls an op whose kernel reads the values of a tensor argument (e.g. "
     "tensor_split's indices given as a tensor); aot_function traces the program with placeholder tensors "
     "that hold no values. Pass those values as Python ints or lists, or use torch.compile(fn, "
     "backend=\"aotgrad\"), which runs such ops eagerly between graphs."),
    # fuzz seed 24 program 7703. Eager raises it too, except where the viewed tensor is itself a view
    # of one that requires no grad: the new view belongs to that base, eager's autograd never sees it.
    (("created in no_grad mode and is being modified inplace",), UnsupportedMutationError,
     "aotgrad: the program writes in place, with grad mode on, into a view it took under no_grad of a "
     "tensor that requires grad. Eager forbids this, unless that tensor is a view of one that does not "
     "require grad (eager's autograd then does not see the write); aotgrad cannot trace either. Take the "
     "view outside the no_grad block, or make the write under no_grad too."),
    # fuzz seed 29 program 566: eager allows it (the write and the view are both under no_grad), but
    # the functional trace applies the write to the view only when the view is next read, by then
    # with grad mode on, which autograd forbids for a view taken under no_grad.
    (("view was created in no_grad mode and its base or another view of its base has been modified "
      "inplace with grad mode enabled",), UnsupportedMutationError,
     "aotgrad: the program reads, with grad mode on, a view it took under no_grad, after writing in place "
     "into that view's base (or another view of it) under no_grad. Eager allows this; aotgrad's functional "
     "trace brings the write into the view when the view is next read, with grad mode on, which autograd "
     "forbids. Take the view outside the no_grad block, or clone it under no_grad before reading it."),
)


def translated_torch_error(e: BaseException) -> AotgradError | None:
    """aotgrad's named error for a torch RuntimeError the trace raised (`_TRANSLATED`), else None."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    for marks, cls, message in _TRANSLATED:
        if all(m in text for m in marks):
            return cls(message)
    return None
