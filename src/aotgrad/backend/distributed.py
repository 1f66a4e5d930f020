"""torch.distributed glue: which rank a compile failed on.

Under DDP, FSDP2 or tensor parallelism every rank compiles the same program, but a refusal can
happen on one rank only (rank-dependent shapes, data or code paths). The error then says which rank
raised it; the other ranks go on into their next collective and the process group's timeout ends
them, so nothing hangs for longer than that timeout.
"""

from __future__ import annotations

import logging

from ..errors import AotgradError

log = logging.getLogger("aotgrad.distributed")


def rank_label() -> str | None:
    """'rank R of W' in a process that is one rank of an initialized default process group."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover  (torch built without distributed)
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return f"rank {dist.get_rank()} of {dist.get_world_size()}"


def on_rank(err: AotgradError) -> AotgradError:
    """`err` with this process's rank in front of its message (itself outside torch.distributed)."""
    label = rank_label()
    if label is None or label in str(err):
        return err
    log.debug("compile failed on %s", label)
    return type(err)(f"[{label}] {err}")
