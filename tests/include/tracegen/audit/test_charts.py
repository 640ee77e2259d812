"""The report's charts read at a glance: round axis values, and no label cut off at the chart's edge."""

from __future__ import annotations

import re

import pytest

from tracegen.audit.charts import cap_curve, histogram, round_ticks

CHAR_PX = 7  # the report's 12 px sans-serif digits and commas are at most about 7 px wide


@pytest.mark.parametrize(("lo", "hi", "ticks"), [
    (0, 8448, [0, 2000, 4000, 6000, 8000]),
    (0, 4224, [0, 1000, 2000, 3000, 4000]),
    (0, 33000, [0, 10000, 20000, 30000]),
    (0, 130, [0, 50, 100]),
    (100, 9000, [2000, 4000, 6000, 8000]),
    (5, 5, [5]),
])
def test_axis_values_are_round(lo, hi, ticks) -> None:
    assert round_ticks(lo, hi) == ticks


def _labels_inside(svg: str) -> None:
    width = int(re.search(r'<svg width="(\d+)"', svg).group(1))
    for x, anchor, text in re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)"[^>]*>([^<]*)</text>', svg):
        half = len(text) * CHAR_PX / 2
        left, right = {"middle": (float(x) - half, float(x) + half), "end": (float(x) - 2 * half, float(x)),
                       "start": (float(x), float(x) + 2 * half)}[anchor]
        assert 0 <= left and right <= width, f"label {text!r} at x={x} ({anchor}) leaves the {width} px chart"


def test_no_axis_label_leaves_the_chart() -> None:
    edges = list(range(0, 33_000, 1100))
    _labels_inside(histogram({"edges": edges, "counts": [1] * (len(edges) - 1)}, cap=32_768))
    caps = [8192, 10240, 12288, 16384, 24576, 32768]
    rows = [{"cap": c, "truncation": 0.01, "truncation_low": 0.0, "truncation_high": 0.02} for c in caps]
    _labels_inside(cap_curve({"rows": rows, "threshold": 0.05, "recommended_cap": 8192, "current_cap": 8192}))
