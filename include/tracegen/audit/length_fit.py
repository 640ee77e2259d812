"""Natural output lengths from measurements, for the cap table (`tracegen.audit.capfit`).

A row that finished with ``length`` under cap C only tells us its natural length exceeds C (it is
right-censored), so naive quantiles of observed lengths are wrong (a 1,500-row sample of a 913,786-prompt job at a 4096 cap read P90 = P99 = 4096: the cap, not a
length). The prediction is built from three pieces:

* **Observed, up to the measured cap.** The pilot's truncated rows may be *extended* (continued from their
  token prefix) up to a higher cap. Up to the highest cap the rows were followed to (`measured_up_to`), the
  Kaplan-Meier estimate is the answer (``basis="observed"``): the empirical share where nothing was censored
  earlier, and exact bookkeeping for rows generated under different caps.
* **Runaways, a floor.** Rows flagged as looping (`tracegen.audit.runaway`) would stay truncated at any cap.
  They are a point mass at infinity: truncation(cap) = floor + (1 - floor) x P(a non-looping row passes
  cap). The recommendation does not chase the floor (see `capfit.cap_table`).
* **Modelled, beyond it.** Only beyond the measured cap is the tail extrapolated: several tail families
  (log-normal, gamma, Weibull, log-logistic, generalized Pareto) are fitted by censored maximum likelihood to
  the rows above the tail start (`tail_from`, where about 20 % more rows than at the measured cap remain), each
  giving P(L > cap | L > measured cap). The point prediction takes their median; the interval is the envelope
  of their intervals, so it carries the uncertainty of which law the tail follows, not only sampling noise.
  A single log-normal extrapolated from the pilot's cap is not enough: its bootstrap interval covered the
  truth in 0 of 12 seeds on non-log-normal laws (docs/benchmarks.md, "Cap from measurements").

Sampling noise comes from a bootstrap over rows (multinomial weights over distinct (length, censored, runaway)
values, so a million rows cost no more than a thousand) for the Kaplan-Meier part and the floor, and from the
asymptotic normal law of each family's maximum-likelihood parameters for the tail ratio. `LengthFit.predict`
gives, per cap, the truncation rate and the expected output tokens per row E[min(L, cap)]; the cap table turns
those into time and GPU-hours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import special

from tracegen.audit.tail_families import FAMILIES, TailFit, fit_tail, lognormal_mle, lognormal_sf, tail_data

# The tail families start where this much more of the (non-looping) rows remain than at the measured cap: enough
# rows (~300 of a 1,500-row pilot) for two parameters, near enough to the cap that the body's shape, which
# differs from the tail's on the bimodal and heavy-tailed laws, does not steer the extrapolation.
TAIL_EXTRA_SHARE = 0.2
# A family whose tail log-likelihood is this far below the best one's is left out of the point and the interval:
# a 2-parameter family 6 log-likelihood units worse is rejected by the data (likelihood ratio p ~ 0.0025).
FAMILY_LOGLIK_SLACK = 6.0
# The log-normal of all rows joins the tail families. It is the point prediction
# when the measured tail is short (see TAIL_SPAN; a pilot not extended spans only ~38% to ~18% of rows) and the
# families' shapes diverge beyond it, while the whole sample pins the log-normal's spread (bench/capfit_accuracy.py
# on the stand-in's laws, 10 seeds: worst error at 8192 0.45 / 1.38 / 1.37 points on lognormal / logt / bimodal
# for it, 2.8 / 2.7 / 6.3 for the families' median). Once rows were followed beyond, the tail families' median is
# the better point (logt 0.74 against 0.91 points at 16384 from a pilot measured to 8192, bimodal 0.42 against
# 0.85). Either way the interval is the envelope of all of them.
WHOLE_SAMPLE_LOGNORMAL = True
# "Rows were followed far enough beyond the pilot's cap": survival drops at least this many times over the fitted
# tail. A 4096 pilot of the stand-in's laws, unextended, spans ~2x (38% -> 18%); extended to 8192, 4-11x.
TAIL_SPAN = 4.0
WHOLE_SAMPLE = "lognormal (all rows)"


@dataclass(slots=True)
class LengthFit:
    """Natural lengths fitted from measurements (see the module docstring), with bootstrap replicates."""

    n: int
    n_censored: int
    mu: float  # whole-sample censored log-normal (non-looping rows): the comparison column, not the prediction
    sigma: float
    splice_at: float  # = measured_up_to: Kaplan-Meier up to here, tail families beyond
    censor_caps: list[int]
    confidence_replicates: int
    n_runaway: int = 0
    runaway_floor: float = 0.0
    tail_from: float = 0.0
    # The measured tail spans a TAIL_SPAN-fold drop of survival: the tail families' median is the point (else the
    # whole-sample log-normal).
    tail_measured: bool = False
    # Distinct (value, kind) groups with counts (kind 0 = complete, 1 = truncated, 2 = truncated and looping), and
    # the bootstrap's weights.
    _values: np.ndarray = field(default=None, repr=False)
    _kind: np.ndarray = field(default=None, repr=False)
    _weights: np.ndarray = field(default=None, repr=False)  # shape (1 + B, G): row 0 is the data itself
    _tails: list[TailFit] = field(default_factory=list, repr=False)
    _dropped: dict[str, float] = field(default_factory=dict, repr=False)
    _km_steps: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def measured_up_to(self) -> float:
        return self.splice_at

    def summary(self) -> dict[str, Any]:
        return {
            "model": "kaplan-meier up to the measured cap, runaway floor, envelope of censored tail families beyond",
            "rows": self.n,
            "censored_rows": self.n_censored,
            "runaway_rows": self.n_runaway,
            "runaway_floor": self.runaway_floor,
            "lognormal_median": float(math.exp(self.mu)),
            "lognormal_sigma": float(self.sigma),
            "splice_at": self.splice_at if math.isfinite(self.splice_at) else None,
            "measured_up_to": self.splice_at if math.isfinite(self.splice_at) else None,
            "censor_caps": self.censor_caps,
            "tail_from": self.tail_from,
            "tail_measured": self.tail_measured,
            "point": "median of the tail families" if self.tail_measured else "whole-sample log-normal",
            "tail_families": {t.family: {"params": [float(v) for v in t.theta], "loglik": float(t.loglik)}
                              for t in self._tails},
            "tail_families_rejected": dict(self._dropped),
            "bootstrap_replicates": self.confidence_replicates,
        }

    def point_floor(self) -> float:
        """The runaway floor of the data itself (the bootstrap's replicate 0)."""
        return float(self._floor()[0, 0])

    def family_truncation(self, caps: np.ndarray) -> dict[str, np.ndarray]:
        """Each tail family's point truncation at `caps`, floor included: what the cap table shows beside the
        prediction for caps beyond the measured one (empty when none is)."""
        if not self._tails or not (caps > self.splice_at).any():
            return {}
        floor = self.point_floor()
        s0 = float(self._km(np.array([self.splice_at]))[0][0, 0])
        return {t.family: floor + (1 - floor) * s0 * np.exp(t.log_ratio(caps, self.splice_at, self.tail_from))
                for t in self._tails}

    # -- pieces ---------------------------------------------------------------------------------------------------
    def _floor(self) -> np.ndarray:
        """Share of looping rows per replicate: shape (1 + B, 1)."""
        w = self._weights
        return (w[:, self._kind == 2].sum(axis=1) / w.sum(axis=1))[:, None]

    def _km(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kaplan-Meier S(x) = P(L > x) of the non-looping rows and the integral of S from 0 to x, for every
        replicate: shape (1 + B, len(x))."""
        if self._km_steps is None:
            self._km_steps = self._km_build()
        t, s_after, area_at = self._km_steps
        idx = np.searchsorted(t, x, side="right") - 1
        surv = np.where(idx >= 0, s_after[:, np.maximum(idx, 0)], 1.0)
        t_idx = np.where(idx >= 0, t[np.maximum(idx, 0)], 0.0)
        area = np.where(idx >= 0, area_at[:, np.maximum(idx, 0)] + surv * (x - t_idx), x)
        return surv, area

    def _km_build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The Kaplan-Meier step function once for all replicates: event times, S just after each, area under S up
        to each (the table asks for it a dozen times; over a million rows each build is a large cumsum)."""
        values, kind = self._values, self._kind
        w = np.where(kind == 2, 0.0, self._weights)
        # At-risk weight at the position of each group: everything with value >= it (groups are sorted by value).
        at_risk_from = np.cumsum(w[:, ::-1], axis=1)[:, ::-1]
        ev = np.flatnonzero(kind == 0)
        t = values[ev]
        first = np.searchsorted(values, t, side="left")
        n_risk = at_risk_from[:, first]
        d = w[:, ev]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.where(n_risk > 0, 1.0 - d / np.where(n_risk > 0, n_risk, 1), 1.0)
        s_after = np.cumprod(factor, axis=1)  # S just after each event time
        # Area under S up to each event time: S before t_j times the gap to t_j.
        s_before = np.concatenate([np.ones((w.shape[0], 1)), s_after[:, :-1]], axis=1)
        gaps = np.diff(np.concatenate([[0.0], t]))
        area_at = np.cumsum(s_before * gaps, axis=1)
        return t, s_after, area_at

    def _tail_log_ratio(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """log P(L > x | L > measured cap) for x beyond it: the families' median (len(x),), and each family's
        draws (B, len(x))."""
        m, u = self.splice_at, self.tail_from
        if not self._tails:  # nothing truncated beyond the measured cap to extrapolate
            return np.full(x.size, -745.0), [np.full((max(self._weights.shape[0] - 1, 1), x.size), -745.0)]
        whole = [t for t in self._tails if t.family == WHOLE_SAMPLE]
        if self.tail_measured or not whole:
            point = np.median(np.stack([t.log_ratio(x, m, u) for t in self._tails]), axis=0)
        else:
            point = whole[0].log_ratio(x, m, u)
        return point, [t.log_ratio(x, m, u, draws=True) for t in self._tails]

    def _tail_area(self, x: np.ndarray, log_ratio: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Integral of P(L > t | L > measured cap) over t from the measured cap to each x (trapezoids on a
        geometric grid; the ratio is smooth and decreasing there)."""
        m = self.splice_at
        top = float(max(x.max(), m * (1 + 1e-9)))
        grid = np.unique(np.concatenate([np.geomspace(m, top, 257), x[x > m]]))
        r = np.exp(log_ratio(grid))
        cum = np.concatenate([np.zeros(r.shape[:-1] + (1,)), np.cumsum((r[..., 1:] + r[..., :-1]) / 2 * np.diff(grid),
                                                                        axis=-1)], axis=-1)
        pos = np.searchsorted(grid, np.maximum(x, m))
        return cum[..., pos]

    def predict(self, caps: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(truncation P(L > cap), E[min(L, cap)], whole-sample log-normal truncation) per replicate: shape
        (1 + B, k). Row 0 is the point prediction; beyond the measured cap the replicates take the families in
        turn (their mixture; `interval` gives the envelope the table shows)."""
        x = np.asarray(caps, dtype=np.float64)
        m = self.splice_at
        floor = self._floor()
        s_nr, e_nr = self._km(np.minimum(x, m))
        tail = x > m
        if tail.any():
            s0, area0 = self._km(np.array([m]))
            point_lr, fam_lr = self._tail_log_ratio(x)
            reps = self._weights.shape[0] - 1
            mix = np.empty((reps, x.size))
            for r in range(reps):
                mix[r] = fam_lr[r % len(fam_lr)][r % fam_lr[0].shape[0]]
            log_ratio = np.vstack([point_lr[None, :], mix])
            s_nr = np.where(tail, s0 * np.exp(log_ratio), s_nr)
            # Expected tokens beyond the measured cap: the area under the point's tail curve (replicates included:
            # the table shows only the point's).
            area_point = self._tail_area(x, lambda g: self._tail_log_ratio(g)[0])
            e_nr = np.where(tail, area0 + s0 * area_point[None, :], e_nr)
        surv = floor + (1 - floor) * s_nr
        emin = floor * x[None, :] + (1 - floor) * e_nr
        lsf = floor[0, 0] + (1 - floor[0, 0]) * lognormal_sf(x, self.mu, self.sigma)
        return surv, emin, np.broadcast_to(lsf[None, :], surv.shape)

    def interval(self, caps: np.ndarray | list[int], confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) of the truncation per cap. Up to the measured cap: the Kaplan-Meier bootstrap. Beyond
        it: the envelope, over the tail families the data do not reject, of each family's interval (bootstrap
        of the measured part times draws of the family's parameters), so the width includes the doubt about
        which law the tail follows."""
        x = np.asarray(caps, dtype=np.float64)
        m = self.splice_at
        alpha = (1 - confidence) / 2
        floor = self._floor()
        km_s, _ = self._km(np.minimum(x, m))
        surv_obs = floor + (1 - floor) * km_s
        if surv_obs.shape[0] == 1:
            lo = hi = surv_obs[0].copy()
        else:
            lo = np.quantile(surv_obs[1:], alpha, axis=0)
            hi = np.quantile(surv_obs[1:], 1 - alpha, axis=0)
        # A bootstrap of a share seen in 0, 1 or 2 rows is degenerate (0 rows: every replicate says 0). The Wilson
        # interval of the same share over the rows whose fate at x is known bounds it from below: the wider wins.
        w0 = self._weights[0]
        early = (self._kind == 1)[None, :] & (self._values[None, :] < np.minimum(x, m)[:, None])
        n_known = np.maximum(w0.sum() - (early * w0[None, :]).sum(axis=1), 1.0)
        z = float(special.ndtri(1 - alpha))
        p = surv_obs[0]
        centre = (p + z * z / (2 * n_known)) / (1 + z * z / n_known)
        half = z / (1 + z * z / n_known) * np.sqrt(p * (1 - p) / n_known + z * z / (4 * n_known**2))
        lo, hi = np.minimum(lo, np.maximum(centre - half, 0.0)), np.maximum(hi, np.minimum(centre + half, 1.0))
        tail = x > m
        if tail.any():
            s0, _ = self._km(np.array([m]))
            _, fam_lr = self._tail_log_ratio(x)
            reps = max(self._weights.shape[0] - 1, 1)
            base_f = floor[1:] if floor.shape[0] > 1 else floor
            base_s = s0[1:] if s0.shape[0] > 1 else s0
            lows, highs = [], []
            for lr in fam_lr:
                k = min(reps, lr.shape[0])
                vals = base_f[:k] + (1 - base_f[:k]) * base_s[:k] * np.exp(lr[:k])
                lows.append(np.quantile(vals, alpha, axis=0))
                highs.append(np.quantile(vals, 1 - alpha, axis=0))
            lo = np.where(tail, np.min(lows, axis=0), lo)
            hi = np.where(tail, np.max(highs, axis=0), hi)
        point = self.predict(x)[0][0]
        return np.minimum(lo, point), np.maximum(hi, point)


def fit_lengths(
    lengths: np.ndarray | list[int],
    censored: np.ndarray | list[bool],
    *,
    bootstrap: int = 200,
    seed: int = 0,
    min_at_risk: int = 30,
    runaway: np.ndarray | list[bool] | None = None,
) -> LengthFit:
    """Fit natural output lengths from observed token counts; ``censored[i]`` means row i hit its cap, and
    ``runaway[i]`` (optional) that it hit it looping (`tracegen.audit.runaway`), so no cap would finish it.
    A row that stopped by itself is never a runaway, whatever ``runaway`` says.

    The measured cap is the highest cap non-looping rows were truncated at, provided that at every lower cap that
    truncated rows, at least ``min_at_risk`` rows were followed beyond it (a pilot's truncated rows extended to a
    higher cap; rows generated under a higher cap): Kaplan-Meier needs rows beyond a censoring point to speak
    for the rows censored there."""
    y = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(censored, dtype=bool)
    if y.shape != c.shape or y.ndim != 1:
        raise ValueError(f"lengths and censored must be 1-D of equal length, got {y.shape} and {c.shape}")
    if runaway is None:
        r = np.zeros_like(c)
    else:
        r = np.asarray(runaway, dtype=bool)
        if r.shape != c.shape:
            raise ValueError(f"runaway must be 1-D like censored, got {r.shape} and {c.shape}")
        r = r & c
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap!r}")
    n_unc = int((~c).sum())
    if len(np.unique(y[~c])) < 2:
        raise ValueError(
            f"cannot fit output lengths: {n_unc} complete rows out of {y.size}; need complete rows of at least two "
            "different lengths (every row hit the cap, or there are no rows)"
        )
    y = np.maximum(y, 1)
    # Groups sorted by value; at equal value complete rows come first (a truncated row is still at risk there).
    # One integer key per (value, kind) pair: np.unique on a 1-D key is far faster than on rows.
    keys, counts = np.unique(y * 4 + c.astype(np.int64) + r.astype(np.int64), return_counts=True)
    values, kind = (keys // 4).astype(np.float64), (keys % 4).astype(np.int8)
    counts = counts.astype(np.float64)
    rng = np.random.default_rng(seed)
    boot = rng.multinomial(y.size, counts / counts.sum(), size=bootstrap).astype(np.float64)
    weights = np.vstack([counts[None, :], boot])

    # The whole-sample log-normal of the non-looping rows (the comparison column and the families' start).
    logs = np.log(values)
    unc, cen = kind == 0, kind == 1
    ly, lc = logs[unc], logs[cen]
    start = (float(np.average(ly, weights=counts[unc])), math.log(max(float(np.sqrt(np.cov(ly, aweights=counts[unc])))
                                                                   if ly.size > 1 else 0.5, 0.05)))
    mu, sigma = lognormal_mle(ly, counts[unc], lc, counts[cen], start)

    # Caps that cut natural rows. A looping row is the floor, not a censored natural length: one stopped
    # while it loops ends wherever the stop came (4,095 tokens, say), which is no cap anything was measured to.
    caps = sorted({int(v) for v in values[kind == 1]})
    nr = np.where(kind == 2, 0.0, counts)
    beyond = nr.sum() - np.cumsum(nr)  # non-looping rows with a value above each group's
    if caps:
        measured = float(caps[0])
        for lower, higher in zip(caps, caps[1:], strict=False):
            if beyond[np.searchsorted(values, lower, side="right") - 1] < min_at_risk:
                break
            measured = float(higher)
    else:
        measured = math.inf  # every row finished by itself: nothing beyond is unknown
    fit = LengthFit(
        n=int(y.size), n_censored=int(c.sum()), mu=mu, sigma=sigma, splice_at=measured, censor_caps=caps,
        confidence_replicates=bootstrap, n_runaway=int(r.sum()), runaway_floor=float(r.mean()) if y.size else 0.0,
        _values=values, _kind=kind, _weights=weights,
    )
    _fit_tails(fit, counts, mu, sigma, draws=max(bootstrap, 1), rng=rng)
    return fit


def _fit_tails(fit: LengthFit, counts: np.ndarray, mu: float, sigma: float, draws: int,
               rng: np.random.Generator) -> None:
    """Fit every tail family to the non-looping rows above the tail start; keep those the data do not reject."""
    values, kind, m = fit._values, fit._kind, fit.splice_at
    if not math.isfinite(m):
        return  # every row finished by itself: nothing to extrapolate
    s_m = float(fit._km(np.array([m]))[0][0, 0])
    if s_m <= 0:
        return  # every row followed to the measured cap finished: nothing to extrapolate
    s_all, _ = fit._km(values)
    # Tail start: the largest complete length where at least TAIL_EXTRA_SHARE more rows than at the measured cap
    # remain, so the tail holds complete rows to fit.
    ok = (kind == 0) & (s_all[0] >= min(s_m + TAIL_EXTRA_SHARE, 0.95)) & (values < m)
    u = float(values[ok].max()) if ok.any() else float(values.min()) - 1.0
    u = max(u, 0.5)
    if np.unique(values[(kind == 0) & (values > u)]).size < 3:
        u = 0.5
    fit.tail_from = u
    fit.tail_measured = float(s_all[0][values <= u][-1] if (values <= u).any() else 1.0) >= TAIL_SPAN * s_m
    tails = []
    for fam in FAMILIES:
        t = fit_tail(fam, tail_data(values, kind, counts, u), (mu, sigma), draws, rng)
        if t is not None:
            tails.append(t)
    if tails:
        best = max(t.loglik for t in tails)
        fit._tails = [t for t in tails if t.loglik >= best - FAMILY_LOGLIK_SLACK]
        fit._dropped = {t.family: float(best - t.loglik) for t in tails if t.loglik < best - FAMILY_LOGLIK_SLACK}
    if WHOLE_SAMPLE_LOGNORMAL:
        # The log-normal of all rows, as one more opinion: on a short measured tail it is
        # the steadiest of them (its likelihood is over other rows, so it is not compared with the tail fits').
        t = fit_tail(FAMILIES[0], tail_data(values, kind, counts, 0.5), (mu, sigma), draws, rng)
        if t is not None:
            t.family = WHOLE_SAMPLE
            # Centred on the exact (unbinned) maximum-likelihood fit the comparison column shows.
            exact = np.array([mu, math.log(sigma)])
            t.draws, t.theta = t.draws + (exact - t.theta), exact
            fit._tails.append(t)
