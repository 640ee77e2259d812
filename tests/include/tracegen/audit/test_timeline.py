"""A run over its time from the ledger alone: rates per bin, the running truncation ending at the run's own
figure, loops stopped, a stalled server's blank strip; and every value the charts draw escaped."""

from __future__ import annotations

import pandas as pd
import pytest

from tracegen.audit import charts
from tracegen.audit.gate import wilson_interval
from tracegen.audit.timeline import run_timeline

T0 = 1_800_000_000.0
A, B = "http://a:30000", "http://b:30000/<script>alert(1)</script>"


def _ledger() -> pd.DataFrame:
    """100 s of a run: 10 rows a second, every tenth cut at the cap, one row a second stopped in a loop from
    50 s on; server B commits nothing after 40 s. Plus another run's rows, which are not this run's."""
    rows = []
    for s in range(100):
        for k in range(10):
            finish = "length" if k == 0 else ("loop" if k == 1 and s >= 50 else "stop")
            server = B if k % 2 and s < 40 else A
            rows.append(("run", "ok", finish, 4096, 100, server, T0 + s))
    rows += [("other", "ok", "length", 4096, 100, A, T0 + 50)] * 30
    frame = pd.DataFrame(rows, columns=["run_id", "status", "finish_reason", "max_tokens", "completion_tokens",
                                        "server", "committed_at"])
    frame["committed_at"] = pd.to_datetime(frame["committed_at"], unit="s", utc=True)
    return frame.astype({"run_id": "category", "server": "category", "finish_reason": "category"})


def test_the_timeline_bins_the_runs_commits() -> None:
    t = run_timeline(_ledger(), "run", 4096, now=T0 + 100, bins=10)
    assert t["bins"] == 10 and t["width_s"] == pytest.approx(10.0)
    assert t["rows_per_s"] == [pytest.approx(10.0)] * 10 and t["tokens_per_s"] == [pytest.approx(1000.0)] * 10
    assert t["truncation"][-1] == pytest.approx(0.1) and t["judged"][-1] == 1000
    assert (t["truncation_low"][-1], t["truncation_high"][-1]) == pytest.approx(wilson_interval(100, 1000))
    assert t["loops_stopped"] == [0] * 5 + [10] * 5
    servers = dict(t["servers"])
    assert servers[B] == [pytest.approx(5.0)] * 4 + [0.0] * 6  # stalled: blank from 40 s on
    assert servers[A][-1] == pytest.approx(10.0)


def test_a_run_with_no_commit_has_an_empty_timeline_and_placeholder_charts() -> None:
    t = run_timeline(_ledger(), "not-yet", 4096)
    assert t["bins"] == 0
    assert "nothing committed yet" in charts.time_series(t, [("rows_per_s", "rows/s", "#000")], "rows")
    assert "no server" in charts.server_strips(t)


def test_the_charts_escape_what_they_draw() -> None:
    t = run_timeline(_ledger(), "run", 4096, now=T0 + 100, bins=10)
    svg = str(charts.server_strips(t)) + str(charts.time_series(
        t, [("truncation", "<b>cut</b>", "#c0392b")], 'a "label"', band=("truncation_low", "truncation_high"),
        threshold=0.05, share=True)) + str(charts.time_bars(t, "loops_stopped", "loops")) + str(charts.progress_bar(3, 7))
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "<b>" not in svg and "&#34;label&#34;" in svg
    assert svg.count("<svg") == svg.count("</svg>") == 4
    assert 'aria-valuenow="3" aria-valuemax="7"' in svg
