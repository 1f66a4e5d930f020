"""Stage 1, the signature: what one call is.

Takes the caller's arguments (a pytree of tensors and other values, closed-over tensors, a module's
parameters and buffers) and returns an `InputLayout` (plan.py): one primal per distinct tensor,
duplicates collapsed, mutated inputs sharing a storage merged into a synthetic base, plus the
signature key and the generated guard that recognises a later call with the same key. Decides what
is guarded per call (sizes, strides, dtypes, grad mode, autocast, subclass layouts, module state).
"""
