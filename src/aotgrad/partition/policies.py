"""Save/recompute policies for the min-cut partitioner: a policy maps a forward node to a
`CheckpointPolicy` (save, recompute, or leave it to the cut).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy

from .ops import checkpoint_names, is_matmul_like

Policy = Callable[[Node], "CheckpointPolicy | None"]


def save_everything(node: Node) -> CheckpointPolicy | None:
    """Recompute nothing: every forward value the backward reads is saved (views aside)."""
    return CheckpointPolicy.MUST_SAVE


def save_nothing(node: Node) -> CheckpointPolicy | None:
    """Save only graph inputs (and random-op outputs); recompute everything else."""
    return CheckpointPolicy.MUST_RECOMPUTE


def save_matmuls(node: Node) -> CheckpointPolicy | None:
    """Save only matmul / convolution / attention outputs (JAX's `dots_saveable`)."""
    return CheckpointPolicy.MUST_SAVE if is_matmul_like(node) else CheckpointPolicy.MUST_RECOMPUTE


def save_only_these_names(*names: str) -> Policy:
    """Save only values named with `checkpoint_name` in `names`; recompute everything else."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        if wanted.intersection(checkpoint_names(node)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    policy.__name__ = f"save_only_these_names{tuple(names)}"
    return policy


def save_names(*names: str) -> Policy:
    """Never recompute the values named in `names`; the rest is the default min-cut."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        return CheckpointPolicy.MUST_SAVE if wanted.intersection(checkpoint_names(node)) else None

    policy.__name__ = f"save_names{tuple(names)}"
    return policy


def recompute_names(*names: str) -> Policy:
    """Always recompute the values named in `names` (even matmuls); the rest is the default min-cut."""
    wanted = frozenset(names)

    def policy(node: Node) -> CheckpointPolicy | None:
        return CheckpointPolicy.MUST_RECOMPUTE if wanted.intersection(checkpoint_names(node)) else None

    policy.__name__ = f"recompute_names{tuple(names)}"
    return policy


POLICIES: dict[str, Policy | None] = {
    "default": None,
    "save_everything": save_everything,
    "save_all": save_everything,
    "everything_saveable": save_everything,
    "save_nothing": save_nothing,
    "recompute_all": save_nothing,
    "nothing_saveable": save_nothing,
    "save_matmuls": save_matmuls,
    "dots_saveable": save_matmuls,
}


def _resolve_policy(policy: str | Policy | None) -> Policy | None:
    if policy is None or callable(policy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown partition policy {policy!r}; known: {sorted(POLICIES)}") from None


_SAVE_LIKE = {
    CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
}


def _decision(node: Node, policy: Policy | None) -> CheckpointPolicy | None:
    d = policy(node) if policy is not None else None
    if d is None:
        d = node.meta.get("recompute")
    if isinstance(d, bool):  # torch's old boolean form: True = save
        d = CheckpointPolicy.MUST_SAVE if d else CheckpointPolicy.PREFER_RECOMPUTE
    if not isinstance(d, CheckpointPolicy):
        return None
    return _SAVE_LIKE.get(d, d)
