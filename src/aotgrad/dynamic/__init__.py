"""Symbolic sizes outside Dynamo: `aot_function(dynamic=True)`, a caller's fake tensors, export.

Takes the signature's leaves and returns fake tensors with symbols and the `ShapeEnv` guards that
decide whether a later call may reuse the compiled code; for subclass arguments, the outer sizes
over the inner tensors' symbols (`SymbolicRun`). Decides which sizes stay symbolic and which
plans need concrete sizes (compiled per shape).
"""
