"""Errors aotgrad raises on purpose.

Every refusal is an `AotgradError` whose message names the input or output involved and says what
to change. Catch `AotgradError` to tell "aotgrad does not support this program" apart from bugs.
"""


class AotgradError(RuntimeError):
    """Base class: aotgrad refuses a program rather than risk a wrong result."""


class UnsupportedMutationError(AotgradError):
    """A mutation of an input (forward or backward) that aotgrad cannot reproduce exactly."""


class UnsupportedAliasingError(AotgradError):
    """Inputs or outputs alias each other in a way aotgrad cannot regenerate."""


class UnsupportedInputError(AotgradError):
    """An argument aotgrad cannot pass to a graph (type, layout, subclass...)."""


class UnsupportedOutputError(AotgradError):
    """An output aotgrad cannot return the way eager does."""


class BackwardMutationError(UnsupportedMutationError):
    """The backward pass mutates something aotgrad cannot keep in the backward graph."""


class InplaceOnLeafError(UnsupportedMutationError):
    """Mirrors eager's refusal to mutate a leaf that requires grad."""


class DataDependentError(AotgradError):
    """An op whose result (a Python scalar, or an output size) depends on tensor values."""


class CompilerError(AotgradError):
    """A graph compiler broke its contract (e.g. returned None instead of a callable)."""
