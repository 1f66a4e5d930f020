"""Gradients of gradients: the differentiable backward used under `create_graph=True`.

Takes the pristine forward and backward graphs a compile kept; returns `HigherOrder`, which
computes gradients as `B(saved, tangents)` with every saved value rebound to its recomputation from
the primals, both compiled by aotgrad again, so higher orders come by recursion. Decides what is
refused (values computed under `no_grad`, mutated inputs requiring grad, ...). Sits above trace and
partition; compile and the run time call it.
"""
