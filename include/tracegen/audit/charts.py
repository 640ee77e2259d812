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


# ---- the live views: a run over its time (`audit.timeline`) -----------------------------------------------

LIVE_HEIGHT = 170


def progress_bar(done: int, total: int) -> Markup:
    """Rows done of the dataset as a bar, with its figures for assistive technology and on hover."""
    share = done / total if total else 1.0
    w, h = 1200, 22  # the page's width: the bar's label stays the size of the text around it
    return Markup('<svg class="progress" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="progressbar" '
                  'aria-label="rows done" aria-valuemin="0" aria-valuenow="{done}" aria-valuemax="{total}">'
                  '<title>{done:,} of {total:,} rows done ({share})</title>'
                  '<rect x="0" y="0" width="{w}" height="{h}" rx="4" fill="#eaeef2"/>'
                  '<rect class="done" x="0" y="0" width="{bw:.1f}" height="{h}" rx="4" fill="#2e8b57"/>'
                  '<text x="{tx}" y="15" text-anchor="middle" fill="#1f2328">{share}</text></svg>'
                  ).format(w=w, h=h, done=done, total=total, share=pct(share), bw=w * min(share, 1.0), tx=w // 2)


def _elapsed(seconds: float) -> tuple[float, str]:
    """The unit an elapsed span reads in: (seconds per unit, its name)."""
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    return (60.0, "min") if seconds >= 120 else (1.0, "s")


def _time_axis(parts: list[Markup], span: float, sx: Any, ml: int, mt: int, pw: int, ph: int) -> None:
    unit, name = _elapsed(span)
    parts.append(Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#334"/>').format(ml, mt + ph, ml + pw, mt + ph))
    for v in round_ticks(0, span / unit, 7):
        parts.append(Markup('<text x="{:.1f}" y="{}" text-anchor="middle">{:g}</text>').format(sx(v * unit), mt + ph + 16,
                                                                                             round(v, 2)))
    parts.append(Markup('<text x="{}" y="{}" text-anchor="end">{} since the first commit</text>')
                 .format(ml + pw, mt + ph + 30, name))


def time_series(timeline: dict[str, Any], series: list[tuple[str, str, str]], label: str,
                band: tuple[str, str] | None = None, threshold: float | None = None, share: bool = False) -> Markup:
    """Lines over the run's time: each of `series` is (timeline key, name, colour), values per bin (None: no
    point). `band` names the keys of an interval drawn under the first line; `threshold` a dashed level.
    `share`: the values are shares (axis in %)."""
    n = timeline.get("bins") or 0
    if n == 0:
        return Markup('<p class="muted">nothing committed yet</p>')
    w, h, ml, mb, mt, mr = WIDTH, LIVE_HEIGHT, 56, 36, 12, 16
    pw, ph = w - ml - mr, h - mb - mt
    width = timeline["width_s"]
    span = n * width
    values = [v for key, _, _ in series for v in timeline[key] if v is not None]
    if band:
        values += [v for v in timeline[band[1]] if v is not None]
    top = max([*values, threshold or 0.0, 0.0]) * 1.1 or 1.0

    def sx(t: float) -> float:
        return ml + t / span * pw

    def sy(v: float) -> float:
        return mt + ph - min(v, top) / top * ph

    def mid(i: int) -> float:
        return sx((i + 0.5) * width)

    parts = [Markup('<svg class="chart" viewBox="0 0 {} {}" width="{}" height="{}" role="img" aria-label="{}">')
             .format(w, h, w, h, label)]
    fmt = (lambda v: pct(v, 0)) if share else (lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}")
    for v in round_ticks(0, top / 1.1, 4):
        parts.append(Markup('<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="#eaeef2"/>')
                     .format(ml, sy(v), ml + pw, sy(v)))
        parts.append(Markup('<text x="{}" y="{:.1f}" text-anchor="end">{}</text>').format(ml - 6, sy(v) + 4, fmt(v)))
    if band:
        lo, hi = timeline[band[0]], timeline[band[1]]
        pts = [i for i in range(n) if lo[i] is not None]
        if pts:
            ring = [f"{mid(i):.1f},{sy(hi[i]):.1f}" for i in pts] + [f"{mid(i):.1f},{sy(lo[i]):.1f}" for i in reversed(pts)]
            parts.append(Markup('<polygon class="band" points="{}" fill="#4a7bd0" fill-opacity="0.18"/>')
                         .format(" ".join(ring)))
    if threshold is not None:
        parts.append(Markup('<line class="threshold" x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="#c0392b" '
                            'stroke-dasharray="5 4"/>').format(ml, sy(threshold), ml + pw, sy(threshold)))
        parts.append(Markup('<text x="{}" y="{:.1f}" text-anchor="end" fill="#c0392b">threshold {}</text>')
                     .format(ml + pw, sy(threshold) - 4, pct(threshold)))
    for key, name, colour in series:
        points = [f"{mid(i):.1f},{sy(v):.1f}" for i, v in enumerate(timeline[key]) if v is not None]
        parts.append(Markup('<polyline class="series" points="{}" fill="none" stroke="{}" stroke-width="2">'
                            '<title>{}</title></polyline>').format(" ".join(points), colour, name))
        # A running share ends at the run's figure so far: said in words. A rate's last bin is not the rate
        # the page states (over its own window), so it gets no such label.
        last = next((v for v in reversed(timeline[key]) if v is not None), None)
        if share and last is not None:
            parts.append(Markup('<text x="{}" y="{}" fill="{}">{}: {}</text>').format(ml + 4, mt + 10, colour, name,
                                                                                   fmt(last)))
    _time_axis(parts, span, sx, ml, mt, pw, ph)
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def time_bars(timeline: dict[str, Any], key: str, label: str, colour: str = "#c0392b") -> Markup:
    """A count per bin of the run's time as bars (the rows stopped in a loop)."""
    n = timeline.get("bins") or 0
    if n == 0:
        return Markup('<p class="muted">nothing committed yet</p>')
    counts = timeline[key]
    w, h, ml, mb, mt, mr = WIDTH, LIVE_HEIGHT - 40, 56, 36, 12, 16
    pw, ph = w - ml - mr, h - mb - mt
    width, top = timeline["width_s"], max(max(counts), 1)
    span = n * width

    def sx(t: float) -> float:
        return ml + t / span * pw

    parts = [Markup('<svg class="chart" viewBox="0 0 {} {}" width="{}" height="{}" role="img" aria-label="{}">')
             .format(w, h, w, h, label),
             Markup('<text x="{}" y="{}" text-anchor="end">{:,}</text>').format(ml - 6, mt + 8, top),
             Markup('<text x="{}" y="{}">{}: {:,} in all</text>').format(ml + 4, mt + 10, label, sum(counts))]
    for i, c in enumerate(counts):
        if c:
            bh = c / top * ph
            parts.append(Markup('<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}">'
                                '<title>{:,}</title></rect>')
                         .format(sx(i * width), mt + ph - bh, max(pw / n - 1, 0.5), bh, colour, c))
    _time_axis(parts, span, sx, ml, mt, pw, ph)
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def server_strips(timeline: dict[str, Any]) -> Markup:
    """Each server's rows per second over the run's time, one strip per server, darker for more: a server
    that stalls (or that the client quarantined) commits nothing, and its strip goes blank from then on."""
    n, servers = timeline.get("bins") or 0, timeline.get("servers") or []
    if n == 0 or not servers:
        return Markup('<p class="muted">no server has committed rows yet</p>')
    row, ml, mt, mr = 16, 220, 4, 16
    w = WIDTH
    pw = w - ml - mr
    h = mt + row * len(servers) + 40
    width = timeline["width_s"]
    span = n * width
    top = max(max(rates) for _, rates in servers) or 1.0

    def sx(t: float) -> float:
        return ml + t / span * pw

    parts = [Markup('<svg class="chart" viewBox="0 0 {} {}" width="{}" height="{}" role="img" '
                    'aria-label="rows per second by server">').format(w, h, w, h)]
    cell = pw / n
    for s, (name, rates) in enumerate(servers):
        y = mt + s * row
        shown = name if len(name) <= 32 else "…" + name[-31:]
        parts.append(Markup('<text x="{}" y="{}" text-anchor="end"><title>{}</title>{}</text>')
                     .format(ml - 6, y + 12, name, shown))
        parts.append(Markup('<rect x="{}" y="{}" width="{}" height="{}" fill="#f6f8fa"/>').format(ml, y, pw, row - 2))
        for i, r in enumerate(rates):
            if r:
                parts.append(Markup('<rect x="{:.1f}" y="{}" width="{:.1f}" height="{}" fill="#4a7bd0" '
                                    'fill-opacity="{:.2f}"><title>{}: {:,.2f} rows/s</title></rect>')
                             .format(ml + i * cell, y, cell + 0.3, row - 2, 0.15 + 0.85 * r / top, name, r))
    _time_axis(parts, span, sx, ml, mt - 4, pw, row * len(servers) + 4)
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)
