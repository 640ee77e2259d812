"""The report's three plots as inline SVG: the completion-token histogram, the finish-reason bars and the
predicted truncation by cap.

The geometry is computed here, so the SVG is built in code rather than in a template. Each element is a
`Markup` format string whose arguments `Markup.format` escapes, numbers and labels alike (a finish reason is
whatever the server sent): a chart is marked safe only once every part of it was escaped.
"""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup

from tracegen.audit.formats import pct

WIDTH = 680


def round_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """At most `most` round values (1, 2, 2.5 or 5 times a power of ten apart) from `lo` to `hi`: axis
    labels a reader takes in at a glance (2,000, not 2,112)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) // step) + 1)]


def histogram(hist: dict[str, list[int]], cap: int) -> Markup:
    edges, counts = hist["edges"], hist["counts"]
    if not counts or not any(counts):
        return Markup('<p class="muted">no completed rows</p>')
    # The right margin holds half of the last axis label ("32,768" is about 40 px wide).
    w, h, ml, mb, mt, mr = WIDTH, 220, 50, 30, 12, 28
    pw, ph = w - ml - mr, h - mb - mt
    x0, x1 = edges[0], edges[-1]
    top = max(counts)

    def sx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * pw

    parts = [Markup('<svg width="{}" height="{}" role="img" aria-label="histogram of completion tokens">')
             .format(w, h)]
    for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True):
        bh = c / top * ph
        color = "#c0392b" if lo >= cap else "#4a7bd0"
        parts.append(Markup('<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}">'
                            "<title>{}–{}: {:,}</title></rect>")
                     .format(sx(lo), mt + ph - bh, max(sx(hi) - sx(lo) - 1, 0.5), bh, color, lo, hi - 1, c))
    parts.append(Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#334"/>').format(ml, mt + ph, ml + pw, mt + ph))
    for v in round_ticks(x0, x1):
        parts.append(Markup('<text x="{:.1f}" y="{}" text-anchor="middle">{:,}</text>').format(sx(v), h - 10, int(v)))
    parts.append(Markup('<text x="{}" y="{}" text-anchor="end">{:,}</text>').format(ml - 6, mt + 8, top))
    parts.append(Markup('<text x="{}" y="{}" text-anchor="end">0</text>').format(ml - 6, mt + ph))
    cx = sx(cap)
    parts.append(Markup('<line x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}" stroke="#c0392b" stroke-dasharray="4 3" '
                        'stroke-width="2"/>').format(cx, mt, cx, mt + ph))
    parts.append(Markup('<text x="{:.1f}" y="{}" text-anchor="end" fill="#c0392b">cap {:,}</text>')
                 .format(cx - 4, mt + 10, cap))
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def finish_bars(items: list[tuple[str, int]]) -> Markup:
    if not items:
        return Markup('<p class="muted">none</p>')
    total = sum(c for _, c in items) or 1
    top = max(c for _, c in items) or 1
    w, row, ml = WIDTH, 24, 130
    colors = {"stop": "#2e8b57", "length": "#c0392b", "tool_calls": "#4a7bd0"}
    parts = [Markup('<svg width="{}" height="{}" role="img" aria-label="finish reasons">')
             .format(w, row * len(items) + 6)]
    for i, (name, c) in enumerate(items):
        bw = c / top * (w - ml - 160)
        y = 3 + i * row
        parts.append(Markup('<text x="{}" y="{}" text-anchor="end">{}</text>').format(ml - 8, y + 15, name))
        parts.append(Markup('<rect x="{}" y="{}" width="{:.1f}" height="{}" fill="{}"/>')
                     .format(ml, y + 2, max(bw, 1), row - 6, colors.get(name, "#889")))
        parts.append(Markup('<text x="{:.1f}" y="{}">{:,} ({})</text>').format(ml + bw + 6, y + 15, c, pct(c / total)))
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def cap_curve(cap_table: dict[str, Any]) -> Markup:
    rows = cap_table["rows"]
    if len(rows) < 2:
        return Markup("")
    w, h, ml, mb, mt, mr = WIDTH, 240, 50, 32, 12, 28  # the right margin: half of the last cap's label
    pw, ph = w - ml - mr, h - mb - mt
    caps = [r["cap"] for r in rows]
    c0, c1 = min(caps), max(caps)
    ymax = max(max(r["truncation_high"] for r in rows), cap_table["threshold"]) * 1.1 or 0.01

    def sx(c: float) -> float:
        return ml + (c - c0) / (c1 - c0) * pw

    def sy(p: float) -> float:
        return mt + ph - min(p, ymax) / ymax * ph

    band = [f"{sx(r['cap']):.1f},{sy(r['truncation_high']):.1f}" for r in rows]
    band += [f"{sx(r['cap']):.1f},{sy(r['truncation_low']):.1f}" for r in reversed(rows)]
    line = " ".join(f"{sx(r['cap']):.1f},{sy(r['truncation']):.1f}" for r in rows)
    thr = cap_table["threshold"]
    parts = [Markup('<svg width="{}" height="{}" role="img" aria-label="predicted truncation by cap">').format(w, h),
             Markup('<polygon points="{}" fill="#4a7bd0" fill-opacity="0.18"/>').format(" ".join(band)),
             Markup('<polyline points="{}" fill="none" stroke="#4a7bd0" stroke-width="2"/>').format(line),
             Markup('<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="#c0392b" stroke-dasharray="5 4"/>')
             .format(ml, sy(thr), ml + pw, sy(thr)),
             Markup('<text x="{}" y="{:.1f}" text-anchor="end" fill="#c0392b">threshold {}</text>')
             .format(ml + pw, sy(thr) - 4, pct(thr)),
             Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#334"/>').format(ml, mt + ph, ml + pw, mt + ph),
             Markup('<text x="{}" y="{}" text-anchor="end">{}</text>').format(ml - 6, mt + 8, pct(ymax, 0)),
             Markup('<text x="{}" y="{}" text-anchor="end">0%</text>').format(ml - 6, mt + ph)]
    for r in rows:
        rec = r["cap"] == cap_table["recommended_cap"]
        cur = r["cap"] == cap_table["current_cap"]
        fill = "#2e8b57" if rec else ("#c0392b" if cur else "#4a7bd0")
        parts.append(Markup('<circle cx="{:.1f}" cy="{:.1f}" r="{}" fill="{}"><title>{}: {}</title></circle>')
                     .format(sx(r["cap"]), sy(r["truncation"]), 5 if rec or cur else 3, fill, r["cap"],
                             pct(r["truncation"])))
        parts.append(Markup('<text x="{:.1f}" y="{}" text-anchor="middle">{:,}</text>').format(sx(r["cap"]), h - 12,
                                                                                             r["cap"]))
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)
