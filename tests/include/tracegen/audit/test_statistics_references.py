"""The audit's own statistics agree with scipy's: the gate's Wilson score interval with
`scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`, and the cap fit's Kaplan-Meier survival (and the
area under it, E[min(L, cap)]) with `scipy.stats.ecdf` of right-censored data.

Ours stay: the Wilson interval is a closed form that scipy computes ~400 times slower (binomtest also works out
a p-value nobody reads) behind an import of scipy.stats the gate does not otherwise pay; the Kaplan-Meier fit
runs on every bootstrap replicate's weights at once, which scipy's does not take.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from tracegen.audit.gate import wilson_interval
from tracegen.audit.length_fit import fit_lengths

GRID = [(k, n) for n in (1, 2, 3, 5, 10, 30, 120, 300, 1000, 10_000, 1_000_000)
        for k in sorted({0, 1, 2, n // 3, n // 2, n - 2, n - 1, n}) if 0 <= k <= n]


@pytest.mark.parametrize("confidence", [0.8, 0.95, 0.99])
def test_the_wilson_interval_is_scipys(confidence):
    for k, n in GRID:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
        lo, hi = wilson_interval(k, n, confidence)
        assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=1e-12), (k, n)
        # Exact at the ends, so a threshold of 0 or 1 is never crossed by rounding.
        assert (lo == 0.0) == (k == 0) and (hi == 1.0) == (k == n), (k, n, lo, hi)


def censored_lengths(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer output lengths (many ties) of a pilot at cap 4096, a third of its rows generated again at 8192,
    and some rows stopped early at random points (right-censored wherever they stopped)."""
    rng = np.random.default_rng(seed)
    natural = np.maximum(1, np.round(rng.lognormal(np.log(1500), 0.9, 3000))).astype(np.int64)
    cap = np.where(rng.random(natural.size) < 1 / 3, 8192, 4096)
    stopped = np.where(rng.random(natural.size) < 0.1, rng.integers(1, 8192, natural.size), cap)
    seen = np.minimum(natural, stopped)
    return seen, natural > stopped


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_kaplan_meier_survival_and_its_area_are_scipys(seed):
    lengths, censored = censored_lengths(seed)
    fit = fit_lengths(lengths, censored, bootstrap=0)
    caps = np.unique(np.concatenate([lengths[lengths <= fit.measured_up_to], [1, 100, 4095, 4096, 4097]]))
    caps = caps[caps <= fit.measured_up_to]
    assert fit.measured_up_to >= 4096 and caps.size > 1000
    surv, emin, _ = fit.predict(caps)
    km = stats.ecdf(stats.CensoredData(uncensored=lengths[~censored], right=lengths[censored])).sf
    np.testing.assert_allclose(surv[0], km.evaluate(caps), rtol=0, atol=1e-12)
    # E[min(L, cap)] = the integral of S from 0 to cap; S steps only at integers, so a sum over them.
    s_at = km.evaluate(np.arange(int(caps.max())))
    area = np.concatenate([[0.0], np.cumsum(s_at)])[caps]
    np.testing.assert_allclose(emin[0], area, rtol=1e-12, atol=1e-9)
