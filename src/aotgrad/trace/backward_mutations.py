"""An input mutated in both the forward and the backward (seed 000, as torch 2.13 runs it).

A data mutation in the backward is kept in the backward graph as `copy_(input, new value)`
(trace/backward.py); the input reaches the backward as a saved tensor. When the forward mutated
the input too, the run time would copy the forward's value in after the forward and the input saved
for the backward would be a clone of the old value (partition.clone_saved_inputs), so the backward
would write into the clone. Instead the forward graph writes its new value into the input itself
(compile._write_back_in_graph), the input is saved as is, and the backward writes into the caller's
tensor, as eager's does. The backward may then not read the input's value from before the forward
(it is gone): such a program is refused.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from ..errors import BackwardMutationError
from ..plan import Plan
from .state import BACKWARD_MUTATION


def mutated_in_both(plan: Plan) -> set[int]:
    """Primals with a data mutation in the forward and another in the backward."""
    return {k for k, m in enumerate(plan.mutations) if m.in_backward and m.data}


def check_written_in_forward(both: set[int], in_place: frozenset[int]) -> None:
    missing = sorted(both - set(in_place))
    if missing:
        raise BackwardMutationError(
            f"aotgrad: graph input {missing[0]} is mutated in both the forward and the backward, and the forward's "
            "new value cannot be written into it inside the forward graph (it shares memory with another input, "
            "or autograd records its mutation). Mutate it in one of the two passes only."
        )


def check_backward_reads(fw_module: GraphModule, bw_module: GraphModule, num_fw_outputs: int, both: set[int]) -> None:
    """The backward may use an input in `both` only as the destination of its own `copy_`."""
    if not both:
        return
    fw_placeholders = fw_module.graph.find_nodes(op="placeholder")
    targets = {fw_placeholders[k]: k for k in both}
    saved = list(fw_module.graph.output_node().args[0])[num_fw_outputs:]
    bw_placeholders = bw_module.graph.find_nodes(op="placeholder")
    for j, node in enumerate(saved):
        k = targets.get(node)
        if k is None or j >= len(bw_placeholders):
            continue
        for user in bw_placeholders[j].users:
            is_own_copy = (user.target is torch.ops.aten.copy_.default and user.args[0] is bw_placeholders[j]
                           and user.meta.get(BACKWARD_MUTATION))
            if not is_own_copy:
                raise BackwardMutationError(
                    f"aotgrad: graph input {k} is mutated in both the forward and the backward, and the backward "
                    "also reads its value from before the forward's mutation; not supported. Save a .clone() "
                    "of it in the forward instead."
                )
