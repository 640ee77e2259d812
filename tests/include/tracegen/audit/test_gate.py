"""gate.decide(): the Wilson rule, its edge cases, and reasons a person can act on."""

from __future__ import annotations

import pytest

from tracegen.audit.gate import (
    NOT_WEIGHED,
    PASS,
    STOP,
    WARN,
    CapSuggestion,
    GateInputs,
    GateRule,
    decide,
    wilson_interval,
)


def test_seed_pilot_stops_with_an_actionable_reason():
    d = decide(GateInputs(269, 1500, GateRule(0.05), max_tokens=4096, suggestion=CapSuggestion(8192, 0.021)))
    assert d.verdict == STOP and d.blocks
    assert d.reason == ("truncation 17.9% > 5.0% at max_tokens=4096 (269 of 1,500 rows; 95% CI 16.1%–20.0%); "
                        "smallest cap meeting 5.0%: 8192 (predicted 2.1%)")
    assert "max_tokens=8192" in d.action
    assert d.ci_low == pytest.approx(0.1607, abs=5e-4) and d.ci_high == pytest.approx(0.1995, abs=5e-4)


def test_wilson_matches_hand_computation():
    # 10 of 100 at 95%: centre (0.1 + 1.96²/200) / (1 + 1.96²/100), textbook interval 0.0552–0.1744.
    lo, hi = wilson_interval(10, 100)
    assert lo == pytest.approx(0.0552, abs=1e-4) and hi == pytest.approx(0.1744, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_clear_pass():
    d = decide(GateInputs(20, 1500, GateRule(0.05)))
    assert d.verdict == PASS and not d.blocks and d.ci_high < 0.05


def test_tiny_samples_do_not_decide_on_noise():
    # 1 of 10 is 10% against a 5% threshold, but the interval (1.8%–40%) straddles it.
    assert decide(GateInputs(1, 10, GateRule(0.05))).verdict == WARN
    # 0 of 10 looks perfect, but the upper bound (27.8%) is far above 5%.
    d = decide(GateInputs(0, 10, GateRule(0.05)))
    assert d.verdict == WARN and "inconclusive" in d.reason and "pilot" in d.action
    # Evidence strong enough even in a small sample: 8 of 10 truncated cannot be below 5%.
    assert decide(GateInputs(8, 10, GateRule(0.05))).verdict == STOP


def test_large_sample_straddling_the_threshold():
    below = decide(GateInputs(70, 1500, GateRule(0.05)))  # 4.7%, CI 3.7–5.9%
    assert below.verdict == PASS and "min_sample" in below.reason
    above = decide(GateInputs(80, 1500, GateRule(0.05)))  # 5.3%, CI 4.3–6.6%: not proven above, not below
    assert above.verdict == WARN and "about" in above.action
    # The same 4.7% in a sample under min_sample stays inconclusive.
    assert decide(GateInputs(14, 299, GateRule(0.05))).verdict == WARN


def test_zero_rows():
    d = decide(GateInputs(0, 0, GateRule(0.05), max_tokens=4096))
    assert d.verdict == WARN and d.rate is None and "no completed rows" in d.reason
    assert "errors" in d.action


@pytest.mark.parametrize(
    ("truncated", "total", "verdict"),
    [(0, 1500, PASS), (0, 50, WARN), (1, 1500, STOP), (1, 5, STOP)],
)
def test_threshold_zero(truncated, total, verdict):
    # Threshold 0: any truncated row is proof of truncation; none needs a sample large enough to trust.
    assert decide(GateInputs(truncated, total, GateRule(0.0))).verdict == verdict


@pytest.mark.parametrize(("truncated", "total"), [(0, 10), (10, 10), (1500, 1500), (3, 7)])
def test_threshold_one_always_passes(truncated, total):
    assert decide(GateInputs(truncated, total, GateRule(1.0))).verdict == PASS


def test_all_truncated():
    d = decide(GateInputs(1500, 1500, GateRule(0.05), max_tokens=4096))
    assert d.verdict == STOP and d.rate == 1.0 and d.ci_high == 1.0
    assert "no candidate cap" in d.reason and "raise max_tokens" in d.action


@pytest.mark.parametrize(
    ("counts", "rule", "message"),
    [
        ((5, 4), (0.05,), "cannot exceed total"),
        ((-1, 4), (0.05,), "truncated must be a non-negative integer"),
        ((1, 4.0), (0.05,), "total must be a non-negative integer"),
        ((1, 4), (5,), "threshold must be a share"),
        ((1, 4), (-0.1,), "threshold must be a share"),
        ((1, 4), ("5%",), "threshold must be a share"),
        ((1, 4), (0.05, 1.0), "confidence"),
        ((1, 4), (0.05, 0.95, -1), "min_sample must be a non-negative integer"),
    ],
)
def test_bad_input(counts, rule, message):
    with pytest.raises(ValueError, match=message):
        decide(GateInputs(*counts, GateRule(*rule)))


def test_a_stop_carries_the_cap_that_would_fix_it():
    d = decide(GateInputs(269, 1500, GateRule(0.05), max_tokens=4096, suggestion=CapSuggestion(8192, 0.02)))
    assert (d.truncated, d.total, d.suggested_cap) == (269, 1500, 8192)
    assert d.to_json()["blocks"] is True


def test_a_running_gate_without_a_cap_table_says_where_the_caps_are_weighed() -> None:
    # The gates that judge counts while chunks run weigh no caps: saying "no candidate cap is predicted to meet
    # 5%" there contradicted the report's recommendation of 8192.
    d = decide(GateInputs(60, 300, GateRule(0.05), max_tokens=4096, suggestion=NOT_WEIGHED))
    assert d.verdict == STOP and "no candidate cap" not in d.reason + d.action
    assert "the run's report has the cap table" in d.reason and "cap table" in d.action
    weighed = decide(GateInputs(60, 300, GateRule(0.05), max_tokens=4096))
    assert "no candidate cap is predicted to meet 5.0%" in weighed.reason
