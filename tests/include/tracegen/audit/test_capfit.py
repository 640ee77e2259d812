"""capfit: predictions from a 4096-capped sample checked against what a higher cap actually does.

Ground truth comes from the stand-in's length model (`tracegen.simulator.lengths.natural_length`, a pure
function of prompt and seed), so the test fits exactly what a pilot against the simulator would see.
Tolerances: the sample of 1,500 has its own noise (sd of the share at 8192 is about 0.4 points), so the
prediction must land within 1.2 points of the sample's actual share at 8192 and within 1.0 point of the
population share (reference-job calibration, ~2.2%); for the 'long' calibration (~13.5% at 8192) within 3 points.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tracegen.audit.capfit import Throughput, cap_table
from tracegen.audit.length_fit import fit_lengths
from tracegen.simulator.lengths import natural_length


def prompts(start: int, n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"fix the failing test in module {i}"}] for i in range(start, start + n)]


def natural(start: int, n: int, model: str = "reference") -> np.ndarray:
    return np.array([natural_length(p, seed=7, model=model) for p in prompts(start, n)])


@pytest.fixture(scope="module")
def population() -> np.ndarray:
    return natural(1_000_000, 30_000)


@pytest.mark.parametrize("sample", range(4))
def test_predicted_truncation_at_8192_from_a_4096_pilot(sample, population):
    lengths = natural(sample * 1500, 1500)
    observed, censored = np.minimum(lengths, 4096), lengths > 4096
    assert 0.14 < censored.mean() < 0.22  # the reference job's regime: ~18% cut at 4096
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
    # The reference job's decision: 8192 is the smallest candidate that meets 5%.
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
    table = cap_table(fit, 8192, candidates=(6144, 8192))
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
    assert np.percentile(observed, 90) == 4096  # what the reference job saw: the cap, not a length
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


# -- measured tails, the runaway floor, honest intervals -------------------------------------------------
# Pilots drawn from the stand-in's laws (`LengthModel.calibrated`: 18% of rows past 4096), one sample per prompt as
# the server draws it; "extended to M" = the truncated rows continued to cap M, so every row's length is known up
# to M. Truth: the law's exact survival.
from tracegen.audit.capfit import CapRow, CapTable  # noqa: E402
from tracegen.audit.runaway import is_runaway_text  # noqa: E402
from tracegen.simulator.lengths import LengthModel, fresh_sample  # noqa: E402
from tracegen.simulator.protocol import plan_request, raw_text  # noqa: E402


def stand_in_pilot(kind: str, seed: int, n: int = 1500, runaway_rate: float = 0.0):
    model = LengthModel(kind=kind, runaway_rate=runaway_rate).calibrated(0.18, 4096)
    drawn = [fresh_sample([seed, i, 7], 11, model, 0, True) for i in range(n)]
    return model, drawn, np.array([d.sample.total for d in drawn])


def measured(total: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    return np.minimum(total, cap), total > cap


def test_rows_up_to_the_measured_cap_are_observed_and_exact():
    _, _, total = stand_in_pilot("logt", 0)
    fit = fit_lengths(*measured(total, 16384), bootstrap=50)
    assert fit.measured_up_to == 16384 and fit.tail_measured
    table = cap_table(fit, 4096, candidates=(8192, 12288, 16384, 32768))
    assert table.measured_up_to == 16384
    for cap in (4096, 8192, 12288, 16384):
        row = table.row(cap)
        assert row.basis == "observed" and row.family_truncation is None
        # Nothing was censored below 16384: Kaplan-Meier is the empirical share, to the row.
        assert row.truncation == pytest.approx((total > cap).mean())
        assert row.expected_tokens_per_row == pytest.approx(np.minimum(total, cap).mean())
        assert row.truncation_low <= row.truncation <= row.truncation_high
    far = table.row(32768)
    assert far.basis == "model" and far.truncation < table.row(16384).truncation
    assert len(far.family_truncation) >= 3
    assert any("measured up to 16384" in n for n in table.notes)
    # The budget-limited pilot measured to 8192: 12288 and 16384 become modelled.
    budget = cap_table(fit_lengths(*measured(total, 8192), bootstrap=50), 4096, candidates=(8192, 12288, 16384))
    assert [r.basis for r in budget.rows] == ["observed", "observed", "model", "model"]
    assert budget.measured_up_to == 8192


def test_a_handful_of_extended_rows_does_not_make_a_measured_cap():
    # 270 rows cut at 4096, of which only 20 (< min_at_risk) were followed to 16384: Kaplan-Meier beyond 4096 would
    # speak for 250 censored rows with 20, so the table stays measured to 4096 and models the rest.
    _, _, total = stand_in_pilot("lognormal", 1)
    cap = np.full(total.size, 4096)
    cap[np.flatnonzero(total > 4096)[:20]] = 16384
    fit = fit_lengths(np.minimum(total, cap), total > cap, bootstrap=20)
    assert fit.censor_caps[0] == 4096 and fit.measured_up_to == 4096 and not fit.tail_measured
    assert cap_table(fit, 4096).row(8192).basis == "model"


def test_runaways_are_a_floor_the_recommendation_does_not_chase():
    model, drawn, total = stand_in_pilot("lognormal", 2, runaway_rate=0.08)
    observed, censored = measured(total, 16384)
    flags = np.zeros(total.size, dtype=bool)
    for i in np.flatnonzero(censored):
        plan = plan_request(drawn[i], 16384, False)
        flags[i] = is_runaway_text(raw_text(plan, plan.target - 1600, plan.target))
    truth = np.array([d.sample.runaway for d in drawn])
    assert (flags == truth).all() and 0.05 < flags.mean() < 0.11  # the detector finds exactly the law's runaways
    table = cap_table(fit_lengths(observed, censored, runaway=flags, bootstrap=50), 4096, threshold=0.05)
    floor = flags.mean()
    assert table.runaway_floor == pytest.approx(floor) and table.to_json()["runaway_floor"] == pytest.approx(floor)
    assert table.fit["runaway_rows"] == flags.sum()
    for r in table.rows:
        assert r.truncation >= floor and r.truncation_low >= floor * 0.5
        assert r.truncation_excluding_runaways == pytest.approx(r.truncation - floor)
    # Every cap leaves more than 5% truncated (the loops), yet a cap is recommended: the smallest whose other rows
    # meet 5%, not the largest the context allows.
    assert all(r.truncation > 0.05 for r in table.rows)
    meeting = [r.cap for r in table.rows if r.truncation - floor <= 0.05]
    assert table.recommended_cap == meeting[0] < 16384
    assert table.required_cap is not None and table.required_cap <= table.recommended_cap
    assert any("loop and stay truncated at any cap" in n for n in table.notes)
    # Without the flags the same rows look like a tail no candidate brings under 5%.
    blind = cap_table(fit_lengths(observed, censored, bootstrap=50), 4096, threshold=0.05)
    assert blind.recommended_cap is None and blind.runaway_floor == 0.0
    # A flag on a row that finished by itself is ignored: it stopped, so it is not a runaway.
    assert fit_lengths(observed, censored, runaway=np.ones(total.size, dtype=bool), bootstrap=0).n_runaway == censored.sum()


def test_loops_stopped_below_the_cap_are_no_cap_the_rows_were_measured_to():
    # A pilot whose truncated rows were all continued until they finished, and whose looping rows were stopped
    # wherever their loop was noticed (the last at 4,095 tokens). No natural row is cut anywhere, so every cap
    # is observed: a stop point is not a cap, and taking the highest for one made the table "measured up to
    # 4,095" and every cap above it modelled, with intervals no cap could meet.
    model, drawn, total = stand_in_pilot("lognormal", 3, runaway_rate=0.05)
    loops = np.array([d.sample.runaway for d in drawn])
    assert loops.sum() >= 30
    stops = np.linspace(1000, 4095, int(loops.sum())).astype(np.int64)
    observed = total.copy()
    observed[loops] = stops
    fit = fit_lengths(observed, loops, runaway=loops, bootstrap=50)
    assert fit.censor_caps == [] and math.isinf(fit.measured_up_to)
    table = cap_table(fit, 4096, candidates=(8192, 16384))
    natural = total[~loops]
    for row in table.rows:
        assert row.basis == "observed"
        assert row.truncation_excluding_runaways == pytest.approx((natural > row.cap).mean() * (1 - loops.mean()),
                                                                  abs=1e-9)


@pytest.mark.parametrize("kind", ["logt", "bimodal"])
def test_modelled_interval_covers_the_truth_beyond_the_measured_cap(kind):
    # Measured to 8192, 16384 modelled (fixed seeds, 8 pilots): the envelope of the tail families covers the truth
    # in at least 7 of 8 (it does in 8 on both laws; a log-normal tail alone covers bimodal in 6, and the
    # log-normal-only method covered logt in 1 of 10 and bimodal in 2 of 10 in bench/capfit_accuracy.py), and the point lands
    # within 2 points.
    covered = 0
    for seed in range(8):
        model, _, total = stand_in_pilot(kind, 20 + seed)
        truth = model.survival(16384)
        row = cap_table(fit_lengths(*measured(total, 8192), bootstrap=100, seed=seed), 4096).row(16384)
        assert row.basis == "model"
        assert abs(row.truncation - truth) <= 0.02, (seed, row.truncation, truth)
        covered += row.truncation_low <= truth <= row.truncation_high
    assert covered >= 7


def test_unmeasured_pilot_the_interval_still_admits_what_it_does_not_know():
    # The bimodal law's long mode starts beyond 4096: a bare 4096 pilot cannot see it. The point is off, but the
    # envelope (whole-sample log-normal and tail families) covers 8192's truth in 19 of these 24 seeds; a log-normal
    # tail alone covers it in none. Asserted at two thirds, below what was measured, over enough seeds that one
    # unlucky draw does not decide it.
    covered = 0
    for seed in range(24):
        model, _, total = stand_in_pilot("bimodal", 20 + seed)
        row = cap_table(fit_lengths(*measured(total, 4096), bootstrap=100, seed=seed), 4096).row(8192)
        assert row.basis == "model"
        covered += row.truncation_low <= model.survival(8192) <= row.truncation_high
    assert covered >= 16, covered


def test_cap_table_json_round_trip_and_old_json():
    _, _, total = stand_in_pilot("lognormal", 3)
    flags = np.zeros(total.size, dtype=bool)
    flags[np.flatnonzero(total > 8192)[:3]] = True
    table = cap_table(fit_lengths(*measured(total, 8192), runaway=flags, bootstrap=20), 4096,
                      throughput=Throughput(1500.0, 7, 900_000))
    data = json.loads(json.dumps(table.to_json(), allow_nan=False))
    assert CapTable.from_json(data) == table
    # A table written before the floor and the measured cap existed still loads, with their defaults.
    old = {k: v for k, v in data.items() if k not in ("runaway_floor", "measured_up_to")}
    old["rows"] = [{k: v for k, v in r.items() if k not in ("truncation_excluding_runaways", "family_truncation")}
                   for r in data["rows"]]
    back = CapTable.from_json(old)
    assert back.runaway_floor == 0.0 and back.measured_up_to is None
    assert back.rows[0] == CapRow(**old["rows"][0]) and back.rows[0].truncation_excluding_runaways is None
    assert back.recommended_cap == table.recommended_cap
    # Keys from a newer version are ignored rather than refused.
    assert CapTable.from_json({**data, "future": 1}).rows == table.rows


def test_a_pilot_where_every_row_finished():
    # Nothing was cut: every cap is observed (0 beyond the longest row), with a Wilson interval rather than the
    # bootstrap's degenerate [0, 0], and the JSON stays strict (no infinity for "measured everywhere").
    _, _, total = stand_in_pilot("lognormal", 4, n=400)
    table = cap_table(fit_lengths(total, np.zeros(total.size, dtype=bool), bootstrap=20), 4096,
                      candidates=(8192, 1 << 20))
    assert table.measured_up_to is None and all(r.basis == "observed" for r in table.rows)
    top = table.row(1 << 20)
    assert top.truncation == 0.0 and top.truncation_low == 0.0 and 0.0 < top.truncation_high < 0.02
    json.dumps(table.to_json(), allow_nan=False)
