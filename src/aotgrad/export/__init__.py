"""Export: one functional graph a caller runs itself (`aot_export_module`, `aot_export_joint_simple`).

Takes a module or function and example inputs; returns the graph and its `GraphSignature` (which
inputs are parameters, buffers, user inputs; which outputs are mutated buffers, user outputs,
gradients). `pre_dispatch.py` keeps grad-mode calls and control flow (`pre_dispatch=True`).
"""
