"""capfit: predictions from a 4096-capped sample checked against what a higher cap actually does.

Ground truth comes from the stand-in's length model (`tracegen.simulator.lengths.natural_length`, a pure
function of prompt and seed), so the test fits exactly what a pilot against the simulator would see.
Tolerances: the sample of 1,500 has its own noise (sd of the share at 8192 is about 0.4 points), so the
prediction must land within 1.2 points of the sample's actual share at 8192 and within 1.0 point of the
population share (seed calibration, ~2.2%); for the 'long' calibration (~13.5% at 8192) within 3 points.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tracegen.audit.capfit import Throughput, cap_table, fit_lengths
from tracegen.simulator.lengths import natural_length


def prompts(start: int, n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"fix the failing test in module {i}"}] for i in range(start, start + n)]


def natural(start: int, n: int, model: str = "seed") -> np.ndarray:
    return np.array([natural_length(p, seed=7, model=model) for p in prompts(start, n)])


@pytest.fixture(scope="module")
def population() -> np.ndarray:
    return natural(1_000_000, 30_000)


@pytest.mark.parametrize("sample", range(4))
def test_predicted_truncation_at_8192_from_a_4096_pilot(sample, population):
    lengths = natural(sample * 1500, 1500)
    observed, censored = np.minimum(lengths, 4096), lengths > 4096
    assert 0.14 < censored.mean() < 0.22  # the seed's regime: ~18% cut at 4096
    table = cap_table(fit_lengths(observed, censored, seed=sample), 4096)
    row = table.row(8192)
    actual_sample = (lengths > 8192).mean()
    actual_population = (population > 8192).mean()
    assert abs(row.truncation - actual_sample) <= 0.012, (row, actual_sample)
    assert abs(row.truncation - actual_population) <= 0.010, (row, actual_population)
    assert row.truncation_low <= row.truncation <= row.truncation_high
    assert row.basis == "model"
    # Expected output tokens per row at 8192 within 3% of the sample's actual mean of min(L, 8192).
    assert row.expected_tokens_per_row == pytest.approx(np.minimum(lengths, 8192).mean(), rel=0.03)
    # The seed's decision: 8192 is the smallest candidate that meets 5%.
    assert table.recommended_cap in (6144, 8192)


def test_interval_covers_the_population_share(population):
    truth = (population > 8192).mean()
    covered = 0
    for sample in range(6):
        lengths = natural(100_000 + sample * 1500, 1500)
        row = cap_table(fit_lengths(np.minimum(lengths, 4096), lengths > 4096, seed=sample), 4096).row(8192)
        covered += row.truncation_low <= truth <= row.truncation_high
    assert covered >= 5  # a 95% interval; 5 of 6 leaves room for one miss


def test_heavier_calibration():
    lengths = natural(0, 1500, model="long")
    population = natural(500_000, 20_000, model="long")
    table = cap_table(fit_lengths(np.minimum(lengths, 4096), lengths > 4096), 4096)
    assert abs(table.row(8192).truncation - (population > 8192).mean()) <= 0.03
    assert abs(table.row(16384).truncation - (population > 16384).mean()) <= 0.03
    assert table.recommended_cap in (12288, 16384)


def test_observed_caps_are_exact():
    lengths = natural(0, 1500)
    observed, censored = np.minimum(lengths, 4096), lengths > 4096
    table = cap_table(fit_lengths(observed, censored, bootstrap=50), 4096, candidates=(1000, 3000, 8192))
    # At and below the cap nothing is censored: Kaplan-Meier is the empirical share, to the row.
    assert table.row(4096).truncation == pytest.approx(censored.mean())
    assert table.row(3000).truncation == pytest.approx((lengths > 3000).mean())
    assert table.row(1000).truncation == pytest.approx((lengths > 1000).mean())
    assert table.row(3000).basis == "observed" and table.row(8192).basis == "model"
    assert table.row(4096).expected_tokens_per_row == pytest.approx(observed.mean())
    assert table.row(1000).expected_tokens_per_row == pytest.approx(np.minimum(lengths, 1000).mean())
    assert table.row(4096).tokens_vs_current == pytest.approx(1.0)


def test_rows_under_two_caps_after_a_pivot():
    # Half the rows were regenerated at 8192 after the pivot: their lengths are known up to 8192.
    lengths = natural(0, 3000)
    cap = np.where(np.arange(3000) % 2 == 0, 4096, 8192)
    observed, censored = np.minimum(lengths, cap), lengths > cap
    fit = fit_lengths(observed, censored)
    assert fit.censor_caps == [4096, 8192]
    table = cap_table(fit, 8192)
    assert abs(table.row(8192).truncation - (lengths > 8192).mean()) <= 0.01
    assert abs(table.row(6144).truncation - (lengths > 6144).mean()) <= 0.015


def test_cap_table_arithmetic_context_and_recommendation():
    lengths = natural(0, 1500)
    fit = fit_lengths(np.minimum(lengths, 4096), lengths > 4096, bootstrap=50)
    tp = Throughput(tokens_per_s_per_gpu=1500.0, n_gpus=7, rows_remaining=900_000)
    table = cap_table(fit, 4096, context_length=10_000, throughput=tp, threshold=0.05)
    caps = [r.cap for r in table.rows]
    assert caps == [4096, 5120, 6144, 8192, 10_000]
    assert table.row(10_000).clipped_to_context
    assert any("context length 10000" in n for n in table.notes)
    for r in table.rows:
        assert r.gpu_hours == pytest.approx(900_000 * r.expected_tokens_per_row / 1500.0 / 3600.0)
        assert r.eta_hours == pytest.approx(r.gpu_hours / 7)
    truncs = [r.truncation for r in table.rows]
    assert truncs == sorted(truncs, reverse=True)
    tokens = [r.expected_tokens_per_row for r in table.rows]
    assert tokens == sorted(tokens)
    meeting = [r.cap for r in table.rows if r.truncation <= 0.05]
    assert table.recommended_cap == meeting[0]
    assert table.recommended_truncation == table.row(meeting[0]).truncation
    assert table.required_cap is not None and table.required_cap % 1024 == 0 or table.required_cap == 10_000
    assert fit.predict([table.required_cap])[0][0, 0] <= 0.05
    # Nothing meets a 0% threshold: the table says so instead of recommending.
    strict = cap_table(fit, 4096, threshold=0.0, context_length=16384)
    assert strict.recommended_cap is None and strict.required_cap is None
    assert any("no candidate cap meets" in n for n in strict.notes)
    assert table.to_json()["rows"][0]["cap"] == 4096


def test_naive_quantiles_are_wrong_but_the_fit_is_not():
    lengths = natural(0, 1500)
    observed = np.minimum(lengths, 4096)
    assert np.percentile(observed, 90) == 4096  # what the seed saw: the cap, not a length
    fit = fit_lengths(observed, lengths > 4096, bootstrap=0)
    true_p90 = np.percentile(lengths, 90)
    assert math.exp(fit.mu + 1.2816 * fit.sigma) == pytest.approx(true_p90, rel=0.1)


def test_bad_input():
    with pytest.raises(ValueError, match="complete rows"):
        fit_lengths([4096, 4096, 4096], [True, True, True])
    with pytest.raises(ValueError, match="complete rows"):
        fit_lengths([], [])
    with pytest.raises(ValueError, match="equal length"):
        fit_lengths([1, 2, 3], [False, False])
    with pytest.raises(ValueError, match="tokens_per_s_per_gpu"):
        Throughput(0, 1, 1)
    with pytest.raises(ValueError, match="n_gpus"):
        Throughput(10.0, 0, 1)
    fit = fit_lengths([10, 20, 30, 40], [False, False, False, True], bootstrap=5)
    with pytest.raises(ValueError, match="confidence"):
        cap_table(fit, 40, confidence=1.0)
    with pytest.raises(KeyError, match="not in the table"):
        cap_table(fit, 40).row(123)
