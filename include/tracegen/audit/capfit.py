"""What a different ``max_tokens`` would do: natural output lengths from measurements, and the cap table.

A row that finished with ``length`` under cap C only tells us its natural length exceeds C (it is
right-censored), so naive quantiles of observed lengths are wrong (a 1,500-row sample of a 913,786-prompt job at a 4096 cap read P90 = P99 = 4096: the cap, not a
length). The table is built from three pieces:

* **Observed, up to the measured cap.** The pilot's truncated rows may be *extended* (continued from their
  token prefix) up to a higher cap. Up to the highest cap the rows were followed to (`measured_up_to`), the
  Kaplan-Meier estimate is the answer (``basis="observed"``): the empirical share where nothing was censored
  earlier, and exact bookkeeping for rows generated under different caps.
* **Runaways, a floor.** Rows flagged as looping (`tracegen.audit.runaway`) would stay truncated at any cap.
  They are a point mass at infinity: truncation(cap) = floor + (1 - floor) x P(a non-looping row passes
  cap). The recommendation does not chase the floor (see `cap_table`).
* **Modelled, beyond it.** Only beyond the measured cap is the tail extrapolated: several tail families
  (log-normal, gamma, Weibull, log-logistic, generalized Pareto) are fitted by censored maximum likelihood to
  the rows above the tail start (`tail_from`, where about 20 % more rows than at the measured cap remain), each
  giving P(L > cap | L > measured cap). The point prediction takes their median; the interval is the envelope
  of their intervals, so it carries the uncertainty of which law the tail follows, not only sampling noise.
  A single log-normal extrapolated from the pilot's cap is not enough: its bootstrap interval covered the
  truth in 0 of 12 seeds on non-log-normal laws (docs/benchmarks.md, "Cap from measurements").

Sampling noise comes from a bootstrap over rows (multinomial weights over distinct (length, censored, runaway)
values, so a million rows cost no more than a thousand) for the Kaplan-Meier part and the floor, and from the
asymptotic normal law of each family's maximum-likelihood parameters for the tail ratio. Predictions are per
candidate cap: truncation rate, expected output tokens per row E[min(L, cap)], and, given a measured
throughput, ETA and GPU-hours for the remaining rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from scipy import optimize, special

# The caps the table weighs, as multiples of the run's cap: at 4096: 5120, 6144, 8192, 12288 and
# 16384. Relative, so a pilot at 8192 is shown 10240-32768 rather than caps it has already passed, and a run
# whose lengths are scaled down (the 913,786-prompt rehearsal, `make rehearsal`) gets the same ladder scaled.
CANDIDATE_RATIOS = (1.25, 1.5, 2.0, 3.0, 4.0)


def candidate_caps(cap: int) -> tuple[int, ...]:
    """The candidate caps above `cap`: `CANDIDATE_RATIOS` times it, whole tokens."""
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap!r}")
    return tuple(sorted({int(round(cap * r)) for r in CANDIDATE_RATIOS} - {int(cap)}))


_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# The tail families start where this much more of the (non-looping) rows remain than at the measured cap: enough
# rows (~300 of a 1,500-row pilot) for two parameters, near enough to the cap that the body's shape, which
# differs from the tail's on the bimodal and heavy-tailed laws, does not steer the extrapolation.
TAIL_EXTRA_SHARE = 0.2
# The tail likelihood groups event lengths into at most this many bins (interval-censored, so still exact for
# grouped data): a million rows fit as fast as a thousand, and the loss of information is negligible.
TAIL_BINS = 256
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


@dataclass(frozen=True, slots=True)
class Throughput:
    """Measured generation speed, used to turn tokens into time: output tokens/s per GPU, GPUs, rows left."""

    tokens_per_s_per_gpu: float
    n_gpus: int
    rows_remaining: int

    def __post_init__(self) -> None:
        if not (self.tokens_per_s_per_gpu > 0 and math.isfinite(self.tokens_per_s_per_gpu)):
            raise ValueError(f"tokens_per_s_per_gpu must be a positive number, got {self.tokens_per_s_per_gpu!r}")
        if self.n_gpus < 1:
            raise ValueError(f"n_gpus must be at least 1, got {self.n_gpus!r}")
        if self.rows_remaining < 0:
            raise ValueError(f"rows_remaining must be >= 0, got {self.rows_remaining!r}")


# -- the whole-sample log-normal (shown beside the table as `lognormal_truncation`) -------------------------------
def _neg_loglik(theta: np.ndarray, y: np.ndarray, wy: np.ndarray, lc: np.ndarray, wc: np.ndarray):
    """Negative censored log-normal log-likelihood (in log space) and its gradient in (mu, log sigma)."""
    mu, log_s = theta
    s = math.exp(log_s)
    z = (y - mu) / s
    zc = (lc - mu) / s
    log_q = special.log_ndtr(-zc)
    ll = -(wy * (0.5 * z * z + _LOG_SQRT_2PI + log_s)).sum() + (wc * log_q).sum()
    # Inverse Mills ratio phi/Q, computed in log space so deep tails do not overflow.
    h = np.exp(-0.5 * zc * zc - _LOG_SQRT_2PI - log_q)
    g_mu = (wy * z).sum() / s + (wc * h).sum() / s
    g_ls = (wy * (z * z - 1)).sum() + (wc * h * zc).sum()
    return -ll, -np.array([g_mu, g_ls])


def _mle(y, wy, lc, wc, start: tuple[float, float]) -> tuple[float, float]:
    # (mu, log sigma) is unconstrained, so plain BFGS does; it is also cheaper per step than L-BFGS-B here.
    res = optimize.minimize(_neg_loglik, np.array(start), args=(y, wy, lc, wc), jac=True, method="BFGS",
                            options={"gtol": 1e-6 * max(1.0, float(wy.sum() + wc.sum()))})
    mu, log_s = float(res.x[0]), float(np.clip(res.x[1], math.log(1e-3), math.log(20.0)))
    return mu, math.exp(log_s)


def _lognormal_sf(x: np.ndarray, mu: float, s: float) -> np.ndarray:
    return special.ndtr(-(np.log(np.maximum(x, 1e-9)) - mu) / s)


# -- tail families --------------------------------------------------------------------------------------------------
# Each is log S(x) as a function of x and two unconstrained parameters (a, b), broadcasting: the fit needs one
# parameter vector, the interval a few hundred draws at once. `u` is where the tail starts (only the generalized
# Pareto, a law of the excess over it, uses it).
def _ln_logsf(x, a, b, u):
    return special.log_ndtr(-(np.log(x) - a) / np.exp(b))


def _gamma_logsf(x, a, b, u):
    a = np.minimum(a, 30.0)  # shape < e^30: beyond, the optimizer is lost, and exp would overflow
    return np.log(np.maximum(special.gammaincc(np.exp(a), x / np.exp(b)), 1e-300))


def _weibull_logsf(x, a, b, u):
    return -np.exp(np.exp(a) * (np.log(x) - b))


def _loglogistic_logsf(x, a, b, u):
    return -np.logaddexp(0.0, np.exp(a) * (np.log(x) - b))


def _gpd_logsf(x, a, b, u):
    xi = np.clip(a, -0.9, 3.0)
    y = np.maximum(x - u, 0.0) / np.exp(b)
    small = np.abs(xi) < 1e-6
    arg = 1.0 + np.where(small, 1.0, xi) * y
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(arg > 0, -np.log(np.where(arg > 0, arg, 1.0)) / np.where(small, 1.0, xi), -np.inf)
    return np.where(small, -y, out)


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    logsf: Callable[..., np.ndarray]
    # Start from the whole-sample log-normal (mu, sigma), the tail start u and the mean excess over it.
    start: Callable[[float, float, float, float], tuple[float, float]]


FAMILIES = (
    _Family("lognormal", _ln_logsf, lambda mu, s, u, me: (mu, math.log(s))),
    # gamma shape ~ 1/sigma^2 matches the log-variance; the scale then matches the mean.
    _Family("gamma", _gamma_logsf,
            lambda mu, s, u, me: (math.log(1 / s**2), mu + s * s / 2 - math.log(1 / s**2))),
    # Weibull shape ~ 1.28/sigma matches the log-sd; the scale then matches the median.
    _Family("weibull", _weibull_logsf,
            lambda mu, s, u, me: (math.log(1.28 / s), mu - math.log(math.log(2)) * s / 1.28)),
    # log-logistic: log-sd pi / (beta sqrt 3), median alpha.
    _Family("log-logistic", _loglogistic_logsf, lambda mu, s, u, me: (math.log(1.81 / s), mu)),
    _Family("generalized-pareto", _gpd_logsf, lambda mu, s, u, me: (0.1, math.log(max(me, 1.0)))),
)


@dataclass(slots=True)
class _TailFit:
    family: str
    theta: np.ndarray  # (2,) maximum-likelihood parameters
    draws: np.ndarray  # (B, 2) from their asymptotic normal law
    loglik: float
    logsf: Callable[..., np.ndarray]

    def log_ratio(self, x: np.ndarray, at: float, u: float, draws: bool = False) -> np.ndarray:
        """log P(L > x | L > at): shape (len(x),), or (B, len(x)) for the draws."""
        th = self.draws if draws else self.theta[None, :]
        a, b = th[:, 0:1], th[:, 1:2]
        lx, la = self.logsf(x[None, :], a, b, u), self.logsf(np.array([[at]]), a, b, u)
        # Past the end of a bounded law (a generalized Pareto with negative shape) survival is 0, not 0/0.
        with np.errstate(invalid="ignore"):
            out = np.where(np.isneginf(lx) | np.isneginf(la), -745.0, lx - la)
        out = np.minimum(np.nan_to_num(out, nan=-745.0, neginf=-745.0), 0.0)
        return out if draws else out[0]


def _log_interval(ls_a: np.ndarray, ls_b: np.ndarray) -> np.ndarray:
    """log(S(a) - S(b)) from log S(a) >= log S(b)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return ls_a + np.log(-np.expm1(np.minimum(ls_b - ls_a, -1e-300)))


def _fit_tail(fam: _Family, edges: np.ndarray, w_bins: np.ndarray, cens: np.ndarray, w_cens: np.ndarray, u: float,
              whole: tuple[float, float], draws: int, rng: np.random.Generator) -> _TailFit | None:
    """Censored, left-truncated (at u) maximum likelihood on binned events and censored values, started from
    the whole-sample log-normal (mu, sigma)."""
    total = float(w_bins.sum() + w_cens.sum())
    mids = np.concatenate([(edges[:-1] + edges[1:]) / 2, cens])
    excess = float(np.average(mids - u, weights=np.concatenate([w_bins, w_cens])))
    start = fam.start(whole[0], whole[1], u, excess)

    def nll(theta: np.ndarray) -> float:
        a, b = theta
        ls = fam.logsf(edges, a, b, u)
        ll = (w_bins * _log_interval(ls[:-1], ls[1:])).sum()
        if cens.size:
            ll += (w_cens * fam.logsf(cens, a, b, u)).sum()
        ll -= total * fam.logsf(np.array([u]), a, b, u)[0]
        return float(-ll) if np.isfinite(ll) else 1e300

    x0 = np.array(start, dtype=np.float64)
    if not np.isfinite(nll(x0)):
        return None
    res = optimize.minimize(nll, x0, method="Nelder-Mead",
                            options={"xatol": 1e-5, "fatol": 1e-7, "maxiter": 800, "maxfev": 1600})
    theta = res.x
    f0 = nll(theta)
    if not f0 < 1e299:
        return None
    # Observed information by central differences; its inverse is the asymptotic covariance of theta.
    h = 1e-3
    hess = np.empty((2, 2))
    for i in range(2):
        for j in range(i, 2):
            ei, ej = np.eye(2)[i] * h, np.eye(2)[j] * h
            v = (nll(theta + ei + ej) - nll(theta + ei - ej) - nll(theta - ei + ej) + nll(theta - ei - ej)) / (4 * h * h)
            hess[i, j] = hess[j, i] = v
    try:
        cov = np.linalg.inv(hess)
        chol = np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        # A flat direction (the data do not pin a parameter down): spread that way as far as the diagonal says.
        cov = np.diag(1.0 / np.maximum(np.abs(np.diag(hess)), 1e-6))
        chol = np.sqrt(cov)
    z = rng.standard_normal((draws, 2))
    return _TailFit(fam.name, theta, theta[None, :] + z @ chol.T, -f0, fam.logsf)


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
    _tails: list[_TailFit] = field(default_factory=list, repr=False)
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
        lsf = floor[0, 0] + (1 - floor[0, 0]) * _lognormal_sf(x, self.mu, self.sigma)
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

    The measured cap is the highest cap rows were truncated at, provided that at every lower cap that
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
    mu, sigma = _mle(ly, counts[unc], lc, counts[cen], start)

    caps = sorted({int(v) for v in values[kind > 0]})
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
        t = _fit_tail(fam, *_tail_data(values, kind, counts, u), u, (mu, sigma), draws, rng)
        if t is not None:
            tails.append(t)
    if tails:
        best = max(t.loglik for t in tails)
        fit._tails = [t for t in tails if t.loglik >= best - FAMILY_LOGLIK_SLACK]
        fit._dropped = {t.family: float(best - t.loglik) for t in tails if t.loglik < best - FAMILY_LOGLIK_SLACK}
    if WHOLE_SAMPLE_LOGNORMAL:
        # The log-normal of all rows, as one more opinion: on a short measured tail it is
        # the steadiest of them (its likelihood is over other rows, so it is not compared with the tail fits').
        t = _fit_tail(FAMILIES[0], *_tail_data(values, kind, counts, 0.5), 0.5, (mu, sigma), draws, rng)
        if t is not None:
            t.family = WHOLE_SAMPLE
            # Centred on the exact (unbinned) maximum-likelihood fit the comparison column shows.
            exact = np.array([mu, math.log(sigma)])
            t.draws, t.theta = t.draws + (exact - t.theta), exact
            fit._tails.append(t)


def _tail_data(values: np.ndarray, kind: np.ndarray, counts: np.ndarray, u: float):
    """(bin edges, event weight per bin, censored values, their weights) of the non-looping rows above u."""
    sel_ev = (kind == 0) & (values > u)
    sel_c = (kind == 1) & (values > u)
    ev_v, ev_w = values[sel_ev], counts[sel_ev]
    # Bins: event lengths x sit in [x, x + 1); more distinct lengths than TAIL_BINS are grouped at weighted
    # quantiles. The last edge closes the last bin.
    if ev_v.size > TAIL_BINS:
        cw = np.cumsum(ev_w) / ev_w.sum()
        cuts = np.unique(ev_v[np.searchsorted(cw, np.linspace(0, 1, TAIL_BINS + 1)[1:-1])])
        edges = np.unique(np.concatenate([[ev_v[0]], cuts, [ev_v[-1] + 1.0]]))
    else:
        edges = np.concatenate([ev_v, [ev_v[-1] + 1.0]])
    w_bins = np.bincount(np.searchsorted(edges, ev_v, side="right") - 1, weights=ev_w,
                         minlength=edges.size - 1)[: edges.size - 1]
    return edges, w_bins, values[sel_c], counts[sel_c]


@dataclass(slots=True)
class CapRow:
    cap: int
    truncation: float
    truncation_low: float
    truncation_high: float
    lognormal_truncation: float  # the whole-sample log-normal (plus the runaway floor): the method before #17
    expected_tokens_per_row: float
    tokens_vs_current: float
    basis: str  # "observed" (Kaplan-Meier, no extrapolation) or "model" (fitted tail)
    meets_threshold: bool  # truncation excluding the runaway floor meets the threshold (see cap_table)
    eta_hours: float | None = None
    gpu_hours: float | None = None
    clipped_to_context: bool = False
    # Truncation less the runaway floor: what this cap can still change. None in tables written before it existed.
    truncation_excluding_runaways: float | None = None
    # Each tail family's point prediction, for rows beyond the measured cap (None for observed rows).
    family_truncation: dict[str, float] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CapRow:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(slots=True)
class CapTable:
    current_cap: int
    threshold: float
    confidence: float
    rows: list[CapRow]
    recommended_cap: int | None
    recommended_truncation: float | None
    required_cap: int | None
    fit: dict[str, Any]
    throughput: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # Share of rows that loop (truncated at any cap), and the highest cap the table's observed rows reach.
    runaway_floor: float = 0.0
    measured_up_to: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be within [0, 1], got {self.threshold!r}")

    def row(self, cap: int) -> CapRow:
        for r in self.rows:
            if r.cap == cap:
                return r
        raise KeyError(f"cap {cap} is not in the table (caps: {[r.cap for r in self.rows]})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CapTable:
        """A table from `to_json`'s dict, including one written before the runaway floor and the measured cap
        existed (they take their defaults); keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw["rows"] = [CapRow.from_json(r) for r in data.get("rows") or []]
        return cls(**kw)


def cap_table(
    fit: LengthFit,
    current_cap: int,
    *,
    candidates: tuple[int, ...] | list[int] | None = None,
    context_length: int | None = None,
    threshold: float = 0.05,
    confidence: float = 0.95,
    throughput: Throughput | None = None,
) -> CapTable:
    """Predictions for the current cap and each candidate. The recommendation is the smallest candidate whose
    point prediction, less the runaway floor, meets ``threshold``: looping rows stay truncated at any cap, so a
    higher cap would cost tokens without removing them (its interval is shown beside it so a reader can judge
    the margin)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence!r}")
    if context_length is not None and context_length <= 0:
        raise ValueError(f"context_length must be positive, got {context_length!r}")
    notes: list[str] = []
    if candidates is None:
        candidates = candidate_caps(int(current_cap))
    caps = sorted({int(current_cap), *(int(c) for c in candidates)})
    clipped: set[int] = set()
    if context_length is not None:
        over = [c for c in caps if c > context_length]
        if over:
            notes.append(f"caps {over} exceed the context length {context_length} and are clipped to it")
            clipped.add(int(context_length))
        caps = sorted({min(c, int(context_length)) for c in caps})
    surv, emin, lsf = fit.predict(caps + [int(current_cap)])
    lo, hi = fit.interval(caps, confidence)
    floor = float(fit._floor()[0, 0])
    cur_tokens = float(emin[0, -1])
    x = np.asarray(caps, dtype=np.float64)
    families = {}
    if fit._tails and (x > fit.splice_at).any():
        s0 = float(fit._km(np.array([fit.splice_at]))[0][0, 0])
        for t in fit._tails:
            families[t.family] = floor + (1 - floor) * s0 * np.exp(t.log_ratio(x, fit.splice_at, fit.tail_from))
    rows = []
    for j, cap in enumerate(caps):
        e = float(emin[0, j])
        eta = gpu = None
        if throughput is not None:
            tokens = throughput.rows_remaining * e
            gpu = tokens / throughput.tokens_per_s_per_gpu / 3600.0
            eta = gpu / throughput.n_gpus
        observed = cap <= fit.splice_at
        excl = max(float(surv[0, j]) - floor, 0.0)
        rows.append(
            CapRow(
                cap=cap, truncation=float(surv[0, j]), truncation_low=float(lo[j]), truncation_high=float(hi[j]),
                lognormal_truncation=float(lsf[0, j]), expected_tokens_per_row=e,
                tokens_vs_current=e / cur_tokens if cur_tokens else math.nan,
                basis="observed" if observed else "model",
                meets_threshold=bool(excl <= threshold), eta_hours=eta, gpu_hours=gpu,
                clipped_to_context=cap in clipped, truncation_excluding_runaways=excl,
                family_truncation=None if observed or not families else
                {name: float(v[j]) for name, v in families.items()},
            )
        )
    meeting = [r for r in rows if r.meets_threshold]
    best = meeting[0] if meeting else None
    required = _required_cap(fit, threshold, context_length)
    if fit.n_runaway:
        notes.append(
            f"{floor:.1%} of rows ({fit.n_runaway}) loop and stay truncated at any cap: the recommendation "
            "leaves them out (it meets the threshold on the other rows)")
    if any(r.basis == "model" for r in rows):
        notes.append(f"measured up to {int(fit.splice_at)} tokens; truncation beyond it is extrapolated by "
                     f"{len(fit._tails) or 'no'} tail families (interval: their envelope)")
    if best is None:
        notes.append(
            f"no candidate cap meets {threshold:.1%}"
            + (f"; the model needs about {required}" if required else "; not reachable within the context length")
        )
    return CapTable(
        current_cap=int(current_cap), threshold=threshold, confidence=confidence, rows=rows,
        recommended_cap=best.cap if best else None, recommended_truncation=best.truncation if best else None,
        required_cap=required, fit=fit.summary(), throughput=asdict(throughput) if throughput else None,
        notes=notes, runaway_floor=floor, measured_up_to=int(fit.splice_at) if math.isfinite(fit.splice_at) else None,
    )


def _required_cap(fit: LengthFit, threshold: float, context_length: int | None, step: int = 1024) -> int | None:
    """Smallest multiple of ``step`` whose predicted truncation, less the runaway floor, meets ``threshold``
    (None beyond the limit)."""
    limit = context_length if context_length is not None else 1 << 20
    grid = np.arange(step, limit + step, step, dtype=np.int64)
    grid = np.minimum(grid, limit)
    surv = fit.predict(grid)[0][0] - float(fit._floor()[0, 0])
    ok = np.flatnonzero(surv <= threshold)
    return int(grid[ok[0]]) if ok.size else None
