"""Stage 3, the partition: split the joint graph into a forward and a backward.

Takes the joint graph; returns the forward graph (which also returns the saved values) and the
backward graph. Decides what the forward saves for the backward: what the backward needs
(`default.py`), or a size-aware min-cut that recomputes cheap values under a memory budget or a
policy (`mincut.py`, with op costs in `ops.py`, policies in `policies.py`, the budget menu in
`budget.py`, row splits in `split.py`).
"""
