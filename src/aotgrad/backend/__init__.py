"""The torch.compile backend: Dynamo hands aotgrad one FX graph per region.

Takes a Dynamo graph and its example inputs (fake or real, symbolic sizes); returns the compiled
callable. Decides what Dynamo does not guard (checked per call, `runtime/input_checks.py`), when to
compile per shape (`shapes.py`), and the on-disk cache's place around a compile. `dynamo.py` holds
the backends (`aotgrad`, `aotgrad_eager`, `aotgrad.backend(...)`); `backend/distributed.py` names the rank
in errors.
"""

from .dynamo import aotgrad_backend, aotgrad_eager  # the torch_dynamo_backends entry points

__all__ = ["aotgrad_backend", "aotgrad_eager"]
