"""Tensor subclasses: a stage in front of the plain pipeline.

Takes a call whose arguments or outputs are traceable wrapper subclasses (TwoTensor, DTensor, jagged
NestedTensor, ...); returns a run over the caller's subclasses built from the unchanged plain
pipeline applied to their inner tensors (`wrap.py`), with autograd kept at the subclass level
(`runtime/runner.py`), metadata mutations replayed (`metadata.py`), and higher-order gradients through the
boundary (`higher.py`). A compiler never sees a subclass. The driver (api.py) hands the stage the
plain pipeline as a value.
"""
