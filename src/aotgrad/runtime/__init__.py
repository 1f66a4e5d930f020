"""Stage 5, the run time: generated straight-line Python that runs the compiled graphs.

Takes a `Plan` and the compiled callables; returns `run(leaves)`: prologue (primals from the
caller's leaves), one `autograd.Function` around the compiled forward and backward, and the
epilogue (input mutations, rebuilt views, version bumps) so that outputs, gradients, mutations and
aliasing match eager. `runtime/input_checks.py` holds the per-call checks Dynamo does not guard.
"""
