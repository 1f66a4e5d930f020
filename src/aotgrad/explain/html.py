"""One self-contained HTML page for an `aotgrad.explain` report: inline CSS and SVG, no JavaScript,
nothing fetched. Graphs are collapsed (`<details>`); the charts are drawn here as plain SVG."""

from __future__ import annotations

import html
from typing import Any

from .residuals import _fmt_bytes, _is_matmul_name

__all__ = ["budget_svg", "render_html", "timeline_svg"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1d2430;background:#f4f6f9}
main{max-width:1120px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:17px;margin:26px 0 8px;border-bottom:2px solid #d6dce5;padding-bottom:3px}
.sub{color:#5b6677}
.cards{display:flex;gap:10px;flex-wrap:wrap;margin:14px 0}
.card{background:#fff;border:1px solid #d6dce5;border-radius:8px;padding:8px 12px;flex:1 1 0;min-width:110px}
.card b{display:block;font-size:20px}.card span{color:#5b6677;font-size:12px}
table{border-collapse:collapse;background:#fff;margin:6px 0;font-size:13px}
th,td{border:1px solid #d6dce5;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#e9eef5}td.n{text-align:right;font-variant-numeric:tabular-nums}
a{color:#1d4ed8;text-decoration:none}a:hover{text-decoration:underline}
code,pre{font:12px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre{background:#fff;border:1px solid #d6dce5;padding:8px;overflow:auto;max-height:420px}
details{background:#fff;border:1px solid #d6dce5;border-radius:6px;margin:6px 0;padding:4px 10px}
summary{cursor:pointer;font-weight:600}
.refusal{background:#fde8e8;border:1px solid #e0a0a0;padding:10px;border-radius:6px}
.mut{color:#a33c00;font-weight:600}.ok{color:#5b6677}
svg{background:#fff;border:1px solid #d6dce5;border-radius:6px}
svg text{font:11px system-ui,sans-serif;fill:#1d2430}
"""

_BLUE, _ORANGE, _RED, _GREY = "#2563eb", "#ea7a16", "#d11a2a", "#9aa5b4"


def _e(x: Any) -> str:
    return html.escape(str(x))


def _tbl(head: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td class='n'>{c}</td>" if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>")
    return "".join(out) + "</table>"


# ------------------------------------------------------------------------------------------------
# Charts.
# ------------------------------------------------------------------------------------------------

_W, _H, _L, _R, _T, _B = 1040, 300, 78, 20, 28, 40


def _yticks(top: float, y) -> str:
    out = []
    for i in range(5):
        v = top * i / 4
        out.append(f"<line x1='{_L}' x2='{_W - _R}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#e5e9ef'/>"
                   f"<text x='{_L - 6}' y='{y(v) + 4:.1f}' text-anchor='end'>{_e(_fmt_bytes(int(v)))}</text>")
    return "".join(out)


def timeline_svg(timelines: list) -> str:
    """Live bytes per op; each series' forward is drawn left of the common divider, its backward right."""
    if not timelines:
        return ""
    ref = timelines[0]
    split = ref.backward_start / max(len(ref.live), 1) if ref.live else 0.5
    split = min(max(split, 0.2), 0.8)
    top = max(max(t.peak for t in timelines), 1) * 1.12
    pw = _W - _L - _R
    x_div = _L + split * pw

    def y(v: float) -> float:
        return _T + (_H - _T - _B) * (1 - v / top)

    def x(t, i: float) -> float:
        nf, nb = max(t.backward_start, 1), max(len(t.live) - t.backward_start, 1)
        if i < t.backward_start:
            return _L + split * pw * i / nf
        return x_div + (1 - split) * pw * (i - t.backward_start) / nb

    parts = [f"<svg id='memory-timeline' xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}' "
             f"viewBox='0 0 {_W} {_H}' role='img' aria-label='memory timeline'>", _yticks(top, y)]
    parts.append(f"<line x1='{x_div:.1f}' x2='{x_div:.1f}' y1='{_T - 10}' y2='{_H - _B}' stroke='{_GREY}' "
                 f"stroke-dasharray='4 3'/><text x='{x_div - 6:.1f}' y='{_T - 12}' text-anchor='end'>forward</text>"
                 f"<text x='{x_div + 6:.1f}' y='{_T - 12}'>backward</text>")
    for k, (t, color) in enumerate(zip(timelines, (_BLUE, _ORANGE, "#16a34a"))):
        pts, prev = [], 0
        for i, v in enumerate(t.live):  # a step line: the value holds until the next op
            pts += [f"{x(t, i):.1f},{y(prev):.1f}", f"{x(t, i):.1f},{y(v):.1f}"]
            prev = v
        pts.append(f"{x(t, len(t.live)):.1f},{y(prev):.1f}")
        parts.append(f"<polyline class='series' data-label='{_e(t.label)}' fill='none' stroke='{color}' "
                     f"stroke-width='2' points='{' '.join(pts)}'/>")
        px, py = x(t, t.peak_index), y(t.peak)
        right = px > _W - 260  # labels stack above the peaks, on the side with room
        parts.append(f"<circle class='peak' cx='{px:.1f}' cy='{py:.1f}' r='5' fill='{color}' stroke='#fff'/>"
                     f"<text x='{px + (-8 if right else 8):.1f}' y='{max(py - 8 - 14 * k, 12):.1f}' fill='{color}' "
                     f"text-anchor='{'end' if right else 'start'}'>{_e(t.label)} peak {_e(_fmt_bytes(t.peak))} "
                     f"({t.peak_phase})</text>")
    for k, (t, color) in enumerate(zip(timelines, (_BLUE, _ORANGE))):
        lx = _L + 10 + 210 * k
        parts.append(f"<rect x='{lx}' y='{_H - 18}' width='14' height='4' fill='{color}'/>"
                     f"<text x='{lx + 20}' y='{_H - 13}'>{_e(t.label)} ({len(t.live)} ops)</text>")
    parts.append(f"<text x='{_W - _R}' y='{_H - 13}' text-anchor='end'>op index (forward, then backward) "
                 "&#8594;</text></svg>")
    return "".join(parts)


def _flops(v: float) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{int(v)} FLOP"


def budget_svg(curve: list, chosen) -> str:
    """Saved bytes (y) against the backward's recomputation FLOPs (x), one point per budget."""
    pts = list(curve) + ([chosen] if chosen is not None else [])
    if not pts:
        return ""
    xmax = max(max(p.recompute_flops for p in pts), 1) * 1.08
    top = max(max(p.saved_bytes for p in pts), 1) * 1.15

    def x(v: float) -> float:
        return _L + (_W - _L - _R) * v / xmax

    def y(v: float) -> float:
        return _T + (_H - _T - _B) * (1 - v / top)

    parts = [f"<svg id='budget-curve' xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}' "
             f"viewBox='0 0 {_W} {_H}' role='img' aria-label='memory budget curve'>", _yticks(top, y)]
    for i in range(5):
        v = xmax * i / 4
        anchor = "end" if i == 4 else "middle"
        parts.append(f"<text x='{x(v):.1f}' y='{_H - _B + 15}' text-anchor='{anchor}'>{_e(_flops(v))}</text>")
    if curve:
        line = " ".join(f"{x(p.recompute_flops):.1f},{y(p.saved_bytes):.1f}" for p in curve)
        parts.append(f"<polyline fill='none' stroke='{_BLUE}' stroke-width='1.5' points='{line}'/>")
    groups: dict[tuple, list] = {}
    for p in curve:
        groups.setdefault((p.recompute_flops, p.saved_bytes), []).append(p.budget)
    for (fl, sb), budgets in groups.items():
        label = f"b={budgets[0]:.1f}" if len(budgets) == 1 else f"b={min(budgets):.1f}..{max(budgets):.1f}"
        parts.append(f"<circle class='budget-point' cx='{x(fl):.1f}' cy='{y(sb):.1f}' r='4' fill='{_BLUE}'/>"
                     f"<text x='{x(fl) + 7:.1f}' y='{y(sb) + 14:.1f}'>{label}</text>")
    if chosen is not None:
        cx, cy = x(chosen.recompute_flops), y(chosen.saved_bytes)
        parts.append(f"<circle id='chosen' cx='{cx:.1f}' cy='{cy:.1f}' r='9' fill='none' stroke='{_RED}' "
                     f"stroke-width='3'/><text x='{cx + 12:.1f}' y='{cy - 8:.1f}' fill='{_RED}'>chosen: "
                     f"{_e(_fmt_bytes(chosen.saved_bytes))}</text>")
    parts.append(f"<text x='{_W - _R}' y='{_H - 5}' text-anchor='end'>recomputed in the backward (FLOPs) "
                 f"&#8594;</text><text x='12' y='{_T - 12}'>saved bytes</text></svg>")
    return "".join(parts)


# ------------------------------------------------------------------------------------------------
# The page.
# ------------------------------------------------------------------------------------------------


def _cards(r) -> str:
    cards = []
    res = r.residuals
    if res is not None:
        cards.append((_fmt_bytes(res.saved_bytes), f"saved by aotgrad ({len(res.saved_tensors)} tensors)"))
        cards.append((_fmt_bytes(res.eager_bytes), f"saved by eager ({res.eager_count} storages)"))
    for t in r.timelines:
        cards.append((_fmt_bytes(t.peak), f"{t.label} peak live activations"))
    for g in r.graphs:
        cards.append((str(g.num_ops), f"ops in the {g.kind} graph"))
    return "<div class='cards'>" + "".join(f"<div class='card'><b>{_e(a)}</b><span>{_e(b)}</span></div>"
                                            for a, b in cards) + "</div>"


def _plan_html(r) -> str:
    head = ["input", "shape", "dtype", "requires grad", "what the program did to it"]

    def row(i) -> list[str]:
        cls = "ok" if i.facts == ("read only",) else "mut"
        return [f"<code>{_e(i.name)}</code>", _e(list(i.shape)), _e(i.dtype), "yes" if i.requires_grad else "",
                f"<span class='{cls}'>{_e('; '.join(i.facts))}</span>"]

    touched = [i for i in r.inputs if i.facts != ("read only",)]
    quiet = [i for i in r.inputs if i.facts == ("read only",)]
    out = "<h3>Inputs</h3>"
    if touched:
        out += _tbl(head, [row(i) for i in touched])
    else:
        out += "<p>The program reads its inputs only.</p>"
    if quiet:
        out += (f"<details><summary>{len(quiet)} inputs read only</summary>" + _tbl(head, [row(i) for i in quiet])
                + "</details>")
    rows = [[_e(o.position), _e(o.what)] for o in r.outputs]
    return out + "<h3>Outputs</h3>" + _tbl(["output", "what it is"], rows)


def _source_cell(source: str, path: str) -> str:
    """The user's line, linked to its file (the full path and line in the link's title)."""
    if not source:
        return "-"
    if not path:
        return _e(source)
    file = path.rsplit(":", 1)[0]
    return f"<a href='file://{_e(file)}' title='{_e(path)}'>{_e(source)}</a>"


def _graphs_html(r) -> str:
    out = []
    for g in r.graphs:
        rows = [[f"<code id='{_e(g.kind)}-{_e(n.name)}'>{_e(n.name)}</code>", _e(n.op), _e(n.shape),
                 _source_cell(n.source, n.path), _e(n.module or "-")] for n in g.nodes]
        out.append(f"<details><summary>{_e(g.kind)} graph: {g.num_ops} ops, {g.num_nodes} nodes</summary>"
                   + _tbl(["node", "op", "value", "source line", "module"], rows)
                   + f"<pre>{_e(g.code)}</pre></details>")
    return "".join(out)


def _saved_html(r) -> str:
    res = r.residuals
    if res.inference:
        return "<p>No input requires grad: one inference graph, nothing is saved.</p>"
    head = ["#", "shape", "dtype", "bytes", "produced by", "source", "module"]
    rows = [[f"<a href='#forward-{_e(s.name)}'>{i}</a>", _e("-" if s.shape is None else list(s.shape)),
             _e(s.dtype or "-").replace("torch.", ""), _e(_fmt_bytes(s.nbytes)), f"<code>{_e(s.op)}</code>",
             _e(s.source or "-"), _e(s.module or "-")] for i, s in enumerate(res.residuals)]
    made = [rw for rw, s in zip(rows, res.residuals) if s.op != "input"]
    inputs = [rw for rw, s in zip(rows, res.residuals) if s.op == "input"]
    held = sum(s.nbytes for s in res.residuals if s.op == "input")
    out = f"<p>Activations the forward saves ({len(made)}):</p>" + _tbl(head, made, {0, 3})
    if inputs:
        out += (f"<details><summary>and {len(inputs)} inputs it hands over as they are ({_e(_fmt_bytes(held))}, "
                "held by the caller anyway)</summary>" + _tbl(head, inputs, {0, 3}) + "</details>")
    again = [x for x in res.recomputed if not x.free]
    if again:
        rows = [[f"<a href='#backward-{_e(x.name)}'><code>{_e(x.name)}</code></a>", _e(x.op), _e(x.source or "-"),
                 _e(x.module or "-")] for x in again]
        heavy = sum(_is_matmul_name(x.op) for x in again)
        out += (f"<details><summary>The backward recomputes {len(again)} ops ({heavy} matmul/conv/attention)"
                "</summary>" + _tbl(["node", "op", "source", "module"], rows) + "</details>")
    else:
        out += "<p>The backward recomputes nothing (views and getitems aside).</p>"
    return out + (f"<p><b>Totals</b>: graph {_e(_fmt_bytes(res.saved_bytes))} in {len(res.saved_tensors)} tensors; "
                  f"at run time {_e(_fmt_bytes(res.runtime_bytes))} in {res.runtime_count} storages; eager "
                  f"{_e(_fmt_bytes(res.eager_bytes))} in {res.eager_count} storages.</p>")


def render_html(r) -> str:
    body = [f"<h1>aotgrad.explain: {_e(r.title)}</h1><div class='sub'>partitioner: {_e(r.partitioner or '-')}"
            + (f", memory_budget={_e(r.memory_budget)}" if r.memory_budget is not None
               and "memory_budget" not in r.partitioner else "") + "</div>"]
    if r.refusal:
        body.append(f"<h2>Refused</h2><div class='refusal'>{_e(r.refusal)}</div>")
    else:
        body.append(_cards(r))
        body.append("<h2>1. Plan</h2>" + _plan_html(r))
        body.append("<h2>2. Graphs</h2>" + _graphs_html(r))
        body.append("<h2>3. Saved and recomputed</h2>" + _saved_html(r))
        if r.timelines:
            body.append("<h2>4. Memory timeline</h2><p class='sub'>Live activation bytes after each aten op of one "
                        "forward and one backward, measured (inputs and parameters not counted).</p>"
                        + timeline_svg(r.timelines))
        if r.chosen is not None:
            body.append("<h2>5. Memory budget</h2><p class='sub'>Saved bytes against the backward's recomputation "
                        "for the min-cut plan at budgets 0..1; the red ring is this report's plan.</p>"
                        + budget_svg(r.curve, r.chosen))
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>aotgrad.explain: "
            f"{_e(r.title)}</title><style>{_CSS}</style></head><body><main>{''.join(body)}</main></body></html>\n")
