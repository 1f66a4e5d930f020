"""What the subclass stage refuses while it traces a program over rebuilt subclasses.

Two Python-level calls on a subclass value have no faithful meaning once the program runs over
the subclass's inner tensors, and the fuzzer (`make fuzz SUBCLASS=1`) found silent wrong values
for both, so they are refused by name while the stage traces (`Boundary.plain_function`):

- `requires_grad_()` on a subclass value inside the program: a new autograd leaf at the subclass
  level, which the flattened graphs cannot represent (its inner tensors are no leaves of ours);
- `detach_()` on a subclass value the program computed (views of it taken before keep their history
  in eager; on an argument it is replayed: subclass/metadata.py);
- `as_strided` on a subclass value: storage offsets and strides are absolute coordinates of the
  subclass's own storage, while the trace sees inner tensors that may be clones or other layouts.

A TorchFunctionMode sees these calls before dispatch; it is active only inside the subclass
stage's trace, so plain programs never meet it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import UnsupportedAliasingError, UnsupportedMutationError

_AS_STRIDED = {torch.Tensor.as_strided, torch.as_strided}  # as_strided_: a metadata mutation, refused as such


def _describe(t: torch.Tensor, inputs: dict[int, int]) -> str:
    where = f"subclass input {inputs[id(t)]}" if id(t) in inputs else "a tensor subclass value the program computed"
    return f"{where} ({type(t).__name__} of size {tuple(t.shape)})"


class SubclassTraceRules(TorchFunctionMode):
    """Refuse, by name, calls on subclass values that the plain graphs cannot give as eager does.
    `inputs` maps the id of each rebuilt subclass argument to its position, to name it."""

    def __init__(self, inputs: dict[int, int]):
        super().__init__()
        self.inputs = inputs
        self.detached: set[int] = set()  # inputs the program called detach_() on

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self_arg = args[0] if args else None
        if is_traceable_wrapper_subclass(self_arg):
            if (func is torch.Tensor.requires_grad_ and id(self_arg) not in self.inputs  # inputs: _check_state
                    and (args[1] if len(args) > 1 else kwargs.get("requires_grad", True))):
                raise UnsupportedMutationError(
                    f"aotgrad: the program calls requires_grad_() on {_describe(self_arg, self.inputs)} inside the "
                    "compiled function: a new autograd leaf at the subclass level is not supported. Make it "
                    "require grad before the call and pass it in, or run this part eagerly."
                )
            if func is torch.Tensor.detach_ and id(self_arg) in self.inputs:  # replayed: subclass_metadata
                self.detached.add(self.inputs[id(self_arg)])
            elif func is torch.Tensor.detach_:
                raise UnsupportedMutationError(
                    f"aotgrad: the program calls detach_() on {_describe(self_arg, self.inputs)}: cutting a "
                    "subclass value's history in place is not traced through its inner tensors. Use "
                    "detach() (out of place), or run this part eagerly."
                )
            if func in _AS_STRIDED:
                raise UnsupportedAliasingError(
                    f"aotgrad: the program calls as_strided on {_describe(self_arg, self.inputs)}: absolute "
                    "strides and storage offsets of a subclass are not traced through its inner tensors. "
                    "Use view/reshape/slicing, or run this part eagerly."
                )
        return func(*args, **kwargs)
