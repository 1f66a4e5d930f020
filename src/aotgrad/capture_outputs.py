"""Capture, outputs: what each user output is (graph value, alias of an input or of another output,
view of an intermediate), with view chains expressed in the caller's coordinates.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import torch
import torch.fx
from torch._subclasses.functional_tensor import FunctionalTensor

from . import analysis
from .capture_inputs import _no_storage_coordinates, _overlapping_input, _primal_name, _shifted
from .capture_state import _add_fw_value
from .errors import UnsupportedAliasingError, UnsupportedOutputError
from .plan import (
    AliasOfGraphOutput,
    AliasOfLeaf,
    AliasOfOutput,
    AliasOfPrimal,
    Constant,
    Detach,
    GraphOutput,
    InputItself,
    IntermediateBase,
    SameAs,
    StorageOfLeaf,
    UserOutput,
)
from .trace_modes import elements_per_root_element


def _analyse_outputs(fw, layout, flat_out, user_leaves, bases, shifts, training) -> None:
    """Decide, per user output, where it comes from (plan.OutputSource); add graph outputs for the
    ones the graph must return: plain outputs first, then intermediate bases (upstream's order)."""
    leaf_of: dict[int, int] = {}
    for i, x in enumerate(user_leaves):
        if isinstance(x, torch.Tensor):
            leaf_of.setdefault(id(x), i)
    base_storage = {analysis.storage_id(b): k for k, b in enumerate(bases)}
    for k, b in enumerate(bases):
        if getattr(b, "_aotgrad_read_caller_storage", False):
            base_storage.setdefault(analysis.storage_id(b._aotgrad_input_value), k)
    position_of: dict[int, int] = {}
    pending = []  # views of intermediates: resolved once plain outputs have graph indices
    values = list(flat_out) + _detached_bases(flat_out, leaf_of, base_storage, bases)
    sources: list = [None] * len(values)
    for pos in _bases_first(values):
        o = values[pos]
        if isinstance(o, torch.Tensor) and id(o) in position_of:
            sources[pos] = SameAs(position_of[id(o)])  # returned twice: the same object twice
            continue
        if isinstance(o, torch.Tensor):
            position_of[id(o)] = pos
            if training and id(o) not in leaf_of:
                _refuse_new_leaf(f"output {pos}", o, leaf_of)
        q = position_of.get(id(getattr(o, "_base", None)))
        kept_history = isinstance(o, torch.Tensor) and o.requires_grad and getattr(o._base, "_aotgrad_detached", False)
        if q is not None and not _is_graph_value(sources[q]) and not kept_history:
            # A view of an output we rebuild ourselves (e.g. of a .detach()): rebuild it from that one.
            chain = analysis.view_chain(o, o._base, torch._functionalize_has_metadata_mutation(o._base.elem))
            if chain is not None:
                chain = _chain_in_caller_coordinates(fw, layout, f"output {pos}", o, chain, base_storage, bases, shifts)
                sources[pos] = AliasOfOutput(q, chain)
                continue
        name = f"output {pos}" if pos < len(flat_out) else "the .detach() of an input that an output views"
        source = _classify_output(fw, layout, name, o, leaf_of, base_storage, bases, shifts, training)
        if source is None:
            pending.append(pos)
        sources[pos] = source
    plain_index: dict[int, int] = {}
    for pos, src in enumerate(sources):
        if isinstance(src, tuple):
            o = src[1]
            plain_index[id(o)] = _add_fw_value(fw, o, UserOutput(pos), training and analysis.is_differentiable(o))
            sources[pos] = GraphOutput(plain_index[id(o)])
    chains = {pos: _intermediate_chain(pos, values[pos]) for pos in sorted(pending)}
    # An intermediate base is differentiable only if some view rebuilt from it keeps an autograd path
    # to it: else the compiled Function would connect every input to it, and eager's None grads would
    # become zeros.
    grad_bases = {id(values[pos]._base) for pos, c in chains.items() if c is not None and _keeps_grad_path(c)}
    for pos, chain in chains.items():
        base_grad = training and id(values[pos]._base) in grad_bases
        sources[pos] = _view_of_intermediate(fw, pos, values[pos], chain, plain_index, training, base_grad)
    fw.out_sources = sources


def _detached_bases(flat_out, leaf_of, base_storage, bases) -> list:
    """`.detach()`ed aliases of inputs that the program did not return but whose views it did.

    In eager such a view's `._base` is the detached tensor, shared by all its views; these become
    hidden entries after the user outputs (plan.Plan.out_sources), rebuilt once at run time."""
    hidden: list = []
    returned = {id(o) for o in flat_out}
    for o in flat_out:
        b = getattr(o, "_base", None)
        if not isinstance(b, FunctionalTensor) or id(b) in returned or any(b is h for h in hidden):
            continue
        k = base_storage.get(analysis.storage_id(b))
        if k is None or b is bases[k] or b._base is not None or id(b) in leaf_of:
            continue
        if not b.requires_grad and (b.dtype == bases[k].dtype or bases[k].dtype.to_real() == b.dtype):
            hidden.append(b)
    return hidden


def _bases_first(values) -> list[int]:
    """Positions in the order to classify them: values that are the `._base` of another value first,
    so a view is rebuilt from its base whichever position the base was returned at."""
    base_ids = {id(getattr(o, "_base", None)) for o in values}
    firsts = [pos for pos, o in enumerate(values) if id(o) in base_ids]
    return firsts + [pos for pos in range(len(values)) if pos not in firsts]


def _refuse_new_leaf(name: str, o: torch.Tensor, inputs: dict[int, int]) -> None:
    """A tensor the program made an autograd leaf (`requires_grad_()`, or created with
    requires_grad=True), or a view it so marked, or a view of such a leaf taken before it was
    marked (it requires grad with no grad_fn: fuzz seed 1 program 3321), cannot come back as one:
    refused."""
    base = o._base if isinstance(o, FunctionalTensor) else None
    new_base = base is not None and base.is_leaf and id(base) not in inputs
    if isinstance(o, FunctionalTensor) and o.requires_grad and o.is_leaf and not _marked_view_of_input(o, inputs) and (
            base is None or not base.requires_grad or new_base):
        raise UnsupportedOutputError(
            f"aotgrad: {name} is a leaf tensor created inside the program with requires_grad=True (or a "
            "view the program marked with requires_grad_()); aotgrad can only return tensors computed from "
            "the inputs. Pass it in as an input."
        )


def _marked_view_of_input(o: torch.Tensor, inputs: dict[int, int]) -> bool:
    """A view of an input that does not require grad, which the program marked with requires_grad_():
    rebuilt at run time and marked the same way (`ViewChain.requires_grad`), as eager's leaf."""
    base = getattr(o, "_base", None)
    return (base is not None and id(base) in inputs and not base.requires_grad and o.requires_grad
            and o.is_leaf and o.grad_fn is None)


def _is_graph_value(source) -> bool:
    return isinstance(source, (tuple, GraphOutput, InputItself)) or source is None


def _classify_output(fw, layout, name, o, leaf_of, base_storage, bases, shifts, training):
    """The source of one output, ("plain", o) for a graph output, or None for a view of an
    intermediate (decided later)."""
    if not isinstance(o, torch.Tensor):
        # A symbolic number (a size Dynamo returns across a graph break) is a Constant too: the run
        # time computes it from the symbols it reads off the inputs (Plan.symbol_sources).
        return Constant(o)
    if not isinstance(o, FunctionalTensor):
        return ("plain", o)
    if id(o) in leaf_of:
        return InputItself(leaf_of[id(o)])
    k = base_storage.get(analysis.storage_id(o))
    if k is None:
        return None if o._base is not None else ("plain", o)
    m = fw.mutations[k]
    # A view kept its autograd history through a later detach_() in eager (the trace knows whether it
    # requires grad); rebuilt from the detached tensor it would lose it. So would one rebuilt from
    # another input in the same memory: a version bump makes autograd rebuild that input's history
    # from the detached tensor.
    detached_in_place = any(isinstance(a, Detach) and a.primal == k for a in fw.epilogue) or (
        o.requires_grad and (k in fw.memory_detached or any(
            getattr(t, "_aotgrad_detached", False) for t in (bases[k], o, o._base)))
    )
    if detached_in_place:
        raise UnsupportedAliasingError(
            f"aotgrad: {name} aliases {_primal_name(layout, k)}, which (or a .detach() of it, or an input "
            "sharing its memory) the program detach_()es; "
            "aotgrad cannot tell views taken before the detach from views taken after. Return a .clone()."
        )
    value = getattr(bases[k], "_aotgrad_input_value", None)
    if value is not None and analysis.storage_id(o) == analysis.storage_id(value):
        # an as_strided read of the caller's storage around the input: replay it on the input itself
        chain = analysis.view_chain(o, value, False)
        if chain is None:
            raise UnsupportedAliasingError(f"aotgrad: {name} reads storage around {_primal_name(layout, k)} "
                                           "through as_strided and cannot be rebuilt as a view. Return a .clone().")
        return AliasOfPrimal(k, chain)
    try:
        chain = analysis.view_chain(o, bases[k], m.metadata or m.storage or k in fw.restrided)
    except UnsupportedAliasingError as e:
        raise UnsupportedAliasingError(f"{e} ({name}, a view of {_primal_name(layout, k)})") from None
    if chain is None:
        restrided_view = torch._functionalize_has_metadata_mutation(o.elem) or getattr(o, "_aotgrad_restrided_view", False)
        if m.any or k in fw.restrided or restrided_view:
            raise UnsupportedAliasingError(
                f"aotgrad: {name} aliases {_primal_name(layout, k)}, which the program also mutates (or "
                "restrides the view in place), and it cannot be rebuilt as a view of it. Return a .clone()."
            )
        return ("plain", o)
    if shifts[k] is None and not analysis.replays_on_layout(chain, bases[k], bases[k]._aotgrad_caller_meta):
        raise UnsupportedAliasingError(
            f"aotgrad: {name} is a view of {_primal_name(layout, k)} in the trace, which sees a dense "
            "copy of that input, but not on the input itself (it overlaps itself in memory, e.g. an expand(), "
            "so eager's reshape copies). Pass a .contiguous() input, or return a .clone()."
        )
    if k in fw.relayout and any(step.op is torch.ops.aten.as_strided.default for step in chain.steps):
        raise _no_storage_coordinates(f"{name} (an as_strided view of {_primal_name(layout, k)})")
    if chain.as_strided is not None:
        if k in fw.relayout:
            raise _no_storage_coordinates(f"{name} (a view of {_primal_name(layout, k)})")
        chain = replace(chain, as_strided=_shifted(f"{name}", shifts[k], *chain.as_strided))
    if shifts[k]:
        chain = replace(chain, steps=_steps_in_caller_coordinates(chain.steps, shifts[k], Fraction(1)))
    leaf = getattr(o, "_aotgrad_member_leaf", None)
    if _marked_view_of_input(o, leaf_of):
        chain = replace(chain, requires_grad=True)
    if leaf is not None and isinstance(layout.primal_sources[k], StorageOfLeaf) and not m.storage and _starts_absolute(chain):
        return AliasOfLeaf(leaf, chain)
    return AliasOfPrimal(k, chain)


def _starts_absolute(chain) -> bool:
    """The chain's first op places the view in storage coordinates (any tensor on that storage will do)."""
    if chain.as_strided is not None:
        return True
    return bool(chain.steps) and chain.steps[0].op is torch.ops.aten.as_strided.default


def _chain_in_caller_coordinates(fw, layout, name, o, chain, base_storage, bases, shifts):
    """A chain rebuilding `o` from another output that aliases an input's traced copy: its as_strided
    steps hold absolute offsets in the copy's storage, which the caller's tensor has shifted."""
    k = base_storage.get(analysis.storage_id(o))
    as_strided = chain.as_strided is not None or any(step.op is torch.ops.aten.as_strided.default for step in chain.steps)
    if k is None or not as_strided or analysis.storage_id(o) != analysis.storage_id(bases[k]):
        return chain
    if k in fw.relayout:
        raise _no_storage_coordinates(f"{name} (an as_strided view of {_primal_name(layout, k)})")
    if shifts[k] is None:
        raise _overlapping_input(_primal_name(layout, k))
    if chain.as_strided is not None:
        chain = replace(chain, as_strided=_shifted(name, shifts[k], *chain.as_strided))
    ratio = elements_per_root_element(o._base, bases[k])  # the chain starts from another output
    return replace(chain, steps=_steps_in_caller_coordinates(chain.steps, shifts[k], ratio))


def _steps_in_caller_coordinates(steps, shift: int, ratio: Fraction) -> tuple:
    """As_strided steps recorded on an input's clone (`trace_modes.TraceHooks` rewrote their offsets)
    replayed on the caller's tensor: back to the caller's storage offsets. `shift` counts the input's
    elements; `ratio` is how many elements of the chain's first tensor make one of the input's, and
    changes with `view_as_real` / `view_as_complex` on the way."""
    out = []
    for step in steps:
        if step.op is torch.ops.aten.view_as_real.default:
            ratio *= 2
        elif step.op is torch.ops.aten.view_as_complex.default:
            ratio /= 2
        elif step.op is torch.ops.aten.as_strided.default and len(step.args) >= 3 and step.args[2] is not None:
            size, stride, offset = step.args[:3]
            step = replace(step, args=(size, stride, offset + int(shift * ratio), *step.args[3:]))
        out.append(step)
    return tuple(out)


def _intermediate_chain(pos, o):
    """How to rebuild `o`, a view of a tensor the graph computes, from that tensor (None: return `o`)."""
    base = o._base
    if o.requires_grad and not base.requires_grad and o.grad_fn is not None and not getattr(base, "_aotgrad_detached", False):
        # A view an autograd.Function returned (a higher-order op's, e.g. while_loop's): its history is
        # the Function's backward, not its base's. Returned as computed (as upstream does).
        return None
    if o.requires_grad and not base.requires_grad:
        raise UnsupportedAliasingError(
            f"aotgrad: output {pos} is a view of an intermediate that the program detach_()es after taking "
            "the view; the view keeps its autograd history in eager, a view rebuilt from the detached base "
            "cannot. Return a .clone() of the view."
        )
    return analysis.view_chain(o, base, torch._functionalize_has_metadata_mutation(base.elem))


def _keeps_grad_path(chain) -> bool:
    """A view rebuilt with `chain` is connected to its base in autograd (no step under no_grad, no detach)."""
    return chain.no_grad_steps == 0 and not chain.detach


def _view_of_intermediate(fw, pos, o, chain, plain_index, training, base_grad):
    """A view of a tensor the graph computes: return the base from the graph, rebuild the view."""
    base = o._base
    if chain is None:
        if training and o.requires_grad and o.grad_fn is None:
            raise UnsupportedAliasingError(
                f"aotgrad: output {pos} is a view made under no_grad (an autograd leaf that requires grad) of "
                "an intermediate whose layout the program changed in place, with another dtype (e.g. .real); "
                "aotgrad can neither rebuild it as a view nor return it from the graph as such a leaf. "
                "Return a .clone() of it, or take the view outside no_grad."
            )
        return GraphOutput(_add_fw_value(fw, o, UserOutput(pos), training and analysis.is_differentiable(o)))
    idx = plain_index.get(id(base))
    if idx is None:
        differentiable = base_grad and analysis.is_differentiable(base)
        kind = IntermediateBase(leaf_requires_grad=training and not differentiable and analysis.is_differentiable(base))
        idx = _add_fw_value(fw, base, kind, differentiable)
        plain_index[id(base)] = idx
    return AliasOfGraphOutput(idx, chain)
