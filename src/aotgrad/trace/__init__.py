"""Stage 2, the trace: one recording session for forward, analysis and backward.

Takes the function and its `InputLayout`; returns `Captured` (plan.py): the joint (or inference)
functional aten graph and its `Plan`: what the program did to each input (data, metadata, `set_`,
storage resize, under `no_grad` or in the backward), where each output comes from (graph output,
the input itself, a view of an input or intermediate), and the epilogue that replays mutations on
the caller's tensors. `trace/capture.py` drives it; `trace/tracer.py` records nodes, `modes.py` holds the
functionalization and refusal rules, `trace/analysis.py` reads facts off the functional tensors.
"""
