"""The report's measurement and runaway section: what it says, and that model text cannot become markup."""

from __future__ import annotations

from tracegen.audit import measure_report

TAIL = {"mode": "auto", "trigger": "over <b>", "run_cap": 4096, "cap": 8192, "reason": "budget",
        "indices": [1, 2, 3], "budget_tokens": 20_000, "budget_source": "param", "worst_case_tokens": 12_288,
        "pilot_tokens": 40_000, "candidates": [5120, 6144, 8192],
        "outcome": {"rows": 3, "measured": 3, "finished": 2, "still_truncated": 1, "failed_or_rejected": 0,
                    "new_tokens": 5_000, "prefix_tokens_reused": 12_288, "budget_share": 0.25, "pilot_share": 0.125,
                    "past_cap": {"5120": 2, "8192": 1}}}
TABLE = {"rows": [{"cap": 4096, "basis": "observed"}, {"cap": 8192, "basis": "observed"},
                  {"cap": 16384, "basis": "model"}]}


def test_the_section_says_what_was_measured_what_it_cost_and_escapes_model_text():
    sec = measure_report.section(
        TAIL, runaways={"rows": 1, "ok_rows": 10, "share": 0.1, "by_cap": {"8192": 1}, "whole_scope": True},
        runaway_examples=[{"index": 2, "max_tokens": 8192, "score": 0.9, "tail": "<script>alert(1)</script> loop"}],
        runaway_policy="drop", cap_table=TABLE)
    assert sec["observed_up_to"] == 8192 and sec["runaway"]["policy"] == "drop"
    html = measure_report.html(sec)
    assert "<script>" not in html and "&lt;script&gt;" in html and "over &lt;b&gt;" in html
    assert "5,000 new tokens (25.0% of the 20,000-token budget" in html
    assert "<b>observed</b> up to 8,192" in html and "left out of the export" in html
    lines = measure_report.summary_lines(sec)
    assert lines[0].startswith("tail measured to 8,192: 3 truncated pilot rows continued, 2 finished")
    assert "runaways" in lines[1] and "10.0%" in lines[1]


def test_nothing_measured_says_why():
    tail = {**TAIL, "cap": None, "reason": "measure_tail=never", "outcome": None}
    html = measure_report.html(measure_report.section(tail, cap_table=None))
    assert "The tail was not measured: measure_tail=never" in html
    assert measure_report.section(None) is None and measure_report.html(None) == ""
