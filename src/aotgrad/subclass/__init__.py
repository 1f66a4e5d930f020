"""Tensor subclasses: a stage in front of the plain pipeline.

Takes a call whose arguments or outputs are traceable wrapper subclasses (TwoTensor, DTensor, jagged
NestedTensor, ...); returns a run over the caller's subclasses built from the unchanged plain
pipeline applied to their inner tensors (`wrap.py`). A compiler never sees a subclass. The driver
(api.py) hands the stage the plain pipeline as a value.

What each module decides:

- `crossings.py`: the autograd boundary. `_Wrap`/`_Unwrap` flatten and rebuild gradients; an
  incoming gradient is checked against the output's own layout (the "guess"); an argument's gradient
  in other metadata is coerced (`__coerce_same_metadata_as_tangent__`) only where its inner shapes
  differ, so a DTensor `Partial(sum)` gradient of a `Replicate` argument stays eager's (`_Site._fits`);
  a gradient nested less deeply than its argument travels in the first inner tensor of each matching
  part (`gradient_slots`). A plain argument whose gradient is a subclass is passed once per inner
  gradient (`_Spread`/`_Gather`, found by `NeedsGradSpread`).
- `wrap.py`: the `Boundary` (layouts, sites, what each output is), the plain function traced, and the
  mutation rules. Data writes reach the caller's inner tensors (arguments sharing memory through one
  base, as plain ones); a write autograd does not see keeps the history; under `no_grad` an argument
  requiring grad is rebuilt requiring grad; a non-leaf written in grad mode gets eager's new history
  through a hidden output and `runtime._Rebase` (`mark_dirty`; a view's base is rebased by autograd's
  CopySlices), before the outputs viewing it are taken. Refused: arguments requiring grad sharing
  memory with another, one written; writes autograd did not record beside ones it did.
- `runtime.py`: the generated run (`build_run`) and, where the plain run is only its
  autograd.Function, one fused Function (`build_fused_run`: the plain forward's body spliced in).
  A backward write into a subclass buffer bumps the caller's version from a hook on the plain node.
- `metadata.py`: metadata mutations and `detach_()` replayed on the caller's objects below autograd.
- `graphs.py`: the boundary's `detach`es folded out of the graphs before any compiler sees them.
- `trace_rules.py`: ops without a faithful flattened meaning (`requires_grad_()`, `as_strided`)
  refused by a TorchFunctionMode active only in this trace.
- `higher.py`: under `create_graph=True` the boundary's backward runs as Functions of its own
  (`_FlattenGrad`/`_RebuildGrad`, each the other's derivative); the fused run keeps its arguments
  for it. Refused: a call with a spread argument.
- `nested_jagged.py`: the offsets' fake gets a real nested int; integer inner tensors pass
  undetached, so outputs and gradients share the argument's offsets as in eager. A concrete ragged
  size (static tracing) is refused by name.

Symbolic sizes over subclasses are `dynamic/subclasses.py`'s (`SymbolicRun`).
"""
