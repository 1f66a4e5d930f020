"""The few torch internals whose names moved between releases.

aotgrad pins torch 2.13; the GPU machines used for the CUDA checks (`scripts/cuda_check.py`) carry
an older torch, so the handful of helpers renamed since are looked up here, once."""

from __future__ import annotations

import torch

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13: the same hint, without adding guards

    def optimization_hint(a: torch.SymInt | int, fallback: int | None = None) -> int:
        if isinstance(a, torch.SymInt):
            hint = a.node.hint
            if hint is not None:
                return int(hint)
            if fallback is None:
                raise ValueError(f"no size hint for {a}")
            return fallback
        return int(a)


__all__ = ["optimization_hint"]
