"""Why aotgrad's measured live peak is above eager's, in one sentence (explain's text and index).

The timelines (explain_memory.py) measure both programs op by op; where aotgrad's peak is the higher
one, the reader of an index of many graphs wants to know why before opening the page. The note says
in which pass the peak is, at which op, and which of the usual causes the numbers point to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .explain_memory import Timeline

__all__ = ["peak_note"]


def peak_note(timelines: Sequence[Timeline], fmt: Callable[[int], str]) -> str | None:
    """None where aotgrad's live peak is at most eager's (or either is missing), else why it is not."""
    by = {t.label: t for t in timelines}
    a, e = by.get("aotgrad"), by.get("eager")
    if a is None or e is None or a.peak <= e.peak:
        return None
    where = f"aotgrad's live peak {fmt(a.peak)} is above eager's {fmt(e.peak)}, in the {a.peak_phase} at op " \
            f"{a.peak_index} ({a.ops[a.peak_index] if a.ops else '-'})"
    if a.peak_phase == "forward":
        why = ("the compiled forward holds values longer than eager does (a graph output, or a value the "
               "backward needs, made before others are freed)")
    elif a.at_backward_start > e.at_backward_start:
        why = (f"the forward leaves {fmt(a.at_backward_start)} for the backward where eager leaves "
               f"{fmt(e.at_backward_start)}: a lower memory_budget recomputes more of it instead")
    else:
        why = (f"the forward leaves less than eager ({fmt(a.at_backward_start)} vs {fmt(e.at_backward_start)}), "
               "so the backward holds recomputed values beside the gradients it makes; the timeline runs the "
               "graph's ops in order, and Inductor's generated code frees and fuses as it schedules")
    return f"{where}: {why}."
