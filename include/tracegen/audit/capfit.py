"""What a different ``max_tokens`` would do: a censored fit of natural output lengths, and the cap table.

A row that finished with ``length`` under cap C only tells us its natural length exceeds C (it is
right-censored), so naive quantiles of observed lengths are wrong (the seed's P90 = P99 = 4096 is the cap, not a
length). The fit has two parts:

* below the *splice point* (the lowest cap that censored anything, or where too few rows remain at risk) the
  Kaplan-Meier estimate, which is exact where nothing is censored and handles rows generated under different caps;
* above it, the tail of a log-normal fitted to all rows by censored maximum likelihood, scaled to meet the
  Kaplan-Meier value at the splice point, so a log-normal that misfits the body does not bias the tail.

Intervals come from a bootstrap over rows (multinomial weights over distinct (length, censored) values, so a
million rows cost no more than a thousand). Predictions are per candidate cap: truncation rate, expected output
tokens per row E[min(L, cap)], and, given a measured throughput, ETA and GPU-hours for the remaining rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy import optimize, special

DEFAULT_CANDIDATES = (5120, 6144, 8192, 12288, 16384)
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


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


def _lognormal_sf(x: np.ndarray, mu: np.ndarray, s: np.ndarray) -> np.ndarray:
    return special.ndtr(-(np.log(np.maximum(x, 1e-9)) - mu) / s)


def _lognormal_emin(x: np.ndarray, mu: np.ndarray, s: np.ndarray) -> np.ndarray:
    """E[min(L, x)] for a log-normal: E[L; L < x] + x P(L >= x)."""
    lx = np.log(np.maximum(x, 1e-9))
    return np.exp(mu + s * s / 2) * special.ndtr((lx - mu - s * s) / s) + x * special.ndtr(-(lx - mu) / s)


@dataclass(slots=True)
class LengthFit:
    """A fitted natural-length distribution with bootstrap replicates (see module docstring)."""

    n: int
    n_censored: int
    mu: float
    sigma: float
    splice_at: float
    censor_caps: list[int]
    confidence_replicates: int
    # Distinct (value, censored) groups with counts, and the bootstrap's weights and log-normal parameters.
    _values: np.ndarray = field(repr=False)
    _censored: np.ndarray = field(repr=False)
    _weights: np.ndarray = field(repr=False)  # shape (1 + B, G): row 0 is the data itself
    _mu: np.ndarray = field(repr=False)
    _sigma: np.ndarray = field(repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "model": "kaplan-meier below the splice point, censored log-normal tail above",
            "rows": self.n,
            "censored_rows": self.n_censored,
            "lognormal_median": float(math.exp(self.mu)),
            "lognormal_sigma": float(self.sigma),
            "splice_at": self.splice_at,
            "censor_caps": self.censor_caps,
            "bootstrap_replicates": self.confidence_replicates,
        }

    def _km(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kaplan-Meier S(x) = P(L > x) and integral of S from 0 to x, for every replicate: shape (1 + B, len(x))."""
        values, cens, w = self._values, self._censored, self._weights
        # At-risk weight at the position of each group: everything with value >= it (groups are sorted by value).
        at_risk_from = np.cumsum(w[:, ::-1], axis=1)[:, ::-1]
        ev = np.flatnonzero(~cens)
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
        idx = np.searchsorted(t, x, side="right") - 1
        surv = np.where(idx >= 0, s_after[:, np.maximum(idx, 0)], 1.0)
        t_idx = np.where(idx >= 0, t[np.maximum(idx, 0)], 0.0)
        area = np.where(idx >= 0, area_at[:, np.maximum(idx, 0)] + surv * (x - t_idx), x)
        return surv, area

    def predict(self, caps: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(truncation P(L > cap), E[min(L, cap)], pure log-normal truncation) per replicate: shape (1 + B, k)."""
        x = np.asarray(caps, dtype=np.float64)
        c0 = self.splice_at
        km_s, km_area = self._km(np.minimum(x, c0))
        s0, area0 = self._km(np.array([c0]))
        mu, sg = self._mu[:, None], self._sigma[:, None]
        p_sf = _lognormal_sf(x[None, :], mu, sg)
        p_s0 = _lognormal_sf(np.array([[c0]]), mu, sg)
        ratio = np.where(p_s0 > 0, p_sf / np.maximum(p_s0, 1e-300), 0.0)
        tail = x > c0
        surv = np.where(tail, s0 * ratio, km_s)
        extra = s0 * (_lognormal_emin(x[None, :], mu, sg) - _lognormal_emin(np.array([[c0]]), mu, sg))
        extra = extra / np.maximum(p_s0, 1e-300)
        emin = np.where(tail, area0 + extra, km_area)
        return surv, emin, p_sf


def fit_lengths(
    lengths: np.ndarray | list[int],
    censored: np.ndarray | list[bool],
    *,
    bootstrap: int = 200,
    seed: int = 0,
    min_at_risk: int = 30,
) -> LengthFit:
    """Fit natural output lengths from observed token counts; ``censored[i]`` means row i hit its cap."""
    y = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(censored, dtype=bool)
    if y.shape != c.shape or y.ndim != 1:
        raise ValueError(f"lengths and censored must be 1-D of equal length, got {y.shape} and {c.shape}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap!r}")
    n_unc = int((~c).sum())
    if len(np.unique(y[~c])) < 2:
        raise ValueError(
            f"cannot fit output lengths: {n_unc} complete rows out of {y.size}; need complete rows of at least two "
            "different lengths (every row hit the cap, or there are no rows)"
        )
    y = np.maximum(y, 1)
    # Groups sorted by value; at equal value the censored group comes after (it is still at risk at that value).
    # One integer key per (value, censored) pair: np.unique on a 1-D key is far faster than on rows.
    keys, counts = np.unique(y * 2 + c, return_counts=True)
    values, cens = (keys // 2).astype(np.float64), (keys % 2).astype(bool)
    counts = counts.astype(np.float64)
    rng = np.random.default_rng(seed)
    boot = rng.multinomial(y.size, counts / counts.sum(), size=bootstrap).astype(np.float64)
    weights = np.vstack([counts[None, :], boot])

    logs = np.log(values)
    unc, cen = ~cens, cens
    ly, lc = logs[unc], logs[cen]
    start = (float(np.average(ly, weights=counts[unc])), math.log(max(float(np.sqrt(np.cov(ly, aweights=counts[unc])))
                                                                   if ly.size > 1 else 0.5, 0.05)))
    mus, sigmas = np.empty(len(weights)), np.empty(len(weights))
    for i, w in enumerate(weights):
        mu, sg = _mle(ly, w[unc], lc, w[cen], start)
        mus[i], sigmas[i] = mu, sg
        if i == 0:
            start = (mu, math.log(sg))  # replicates converge in a few steps from the full-data optimum

    caps = sorted({int(v) for v in values[cens]})
    cap_limit = float(caps[0]) if caps else math.inf
    # Splice where Kaplan-Meier stops being trustworthy: the first cap, or where fewer than min_at_risk remain.
    at_risk = np.cumsum(counts[::-1])[::-1]
    ok = (at_risk >= min_at_risk) & (values <= cap_limit)
    splice = float(values[ok].max()) if ok.any() else float(values.min())
    if caps and splice < cap_limit and at_risk[np.searchsorted(values, cap_limit)] >= min_at_risk:
        splice = cap_limit
    return LengthFit(
        n=int(y.size), n_censored=int(c.sum()), mu=mus[0], sigma=sigmas[0], splice_at=splice, censor_caps=caps,
        confidence_replicates=bootstrap, _values=values, _censored=cens, _weights=weights, _mu=mus, _sigma=sigmas,
    )


@dataclass(slots=True)
class CapRow:
    cap: int
    truncation: float
    truncation_low: float
    truncation_high: float
    lognormal_truncation: float
    expected_tokens_per_row: float
    tokens_vs_current: float
    basis: str  # "observed" (Kaplan-Meier, no extrapolation) or "model" (fitted tail)
    meets_threshold: bool
    eta_hours: float | None = None
    gpu_hours: float | None = None
    clipped_to_context: bool = False


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


def cap_table(
    fit: LengthFit,
    current_cap: int,
    *,
    candidates: tuple[int, ...] | list[int] = DEFAULT_CANDIDATES,
    context_length: int | None = None,
    threshold: float = 0.05,
    confidence: float = 0.95,
    throughput: Throughput | None = None,
) -> CapTable:
    """Predictions for the current cap and each candidate; the recommendation is the smallest candidate whose
    point prediction meets ``threshold`` (its interval is shown beside it so a reader can judge the margin)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence!r}")
    if context_length is not None and context_length <= 0:
        raise ValueError(f"context_length must be positive, got {context_length!r}")
    notes: list[str] = []
    caps = sorted({int(current_cap), *(int(c) for c in candidates)})
    clipped: set[int] = set()
    if context_length is not None:
        over = [c for c in caps if c > context_length]
        if over:
            notes.append(f"caps {over} exceed the context length {context_length} and are clipped to it")
            clipped.add(int(context_length))
        caps = sorted({min(c, int(context_length)) for c in caps})
    surv, emin, lsf = fit.predict(caps)
    alpha = (1 - confidence) / 2
    lo = np.quantile(surv[1:], alpha, axis=0) if surv.shape[0] > 1 else surv[0]
    hi = np.quantile(surv[1:], 1 - alpha, axis=0) if surv.shape[0] > 1 else surv[0]
    cur_tokens = float(fit.predict([current_cap])[1][0, 0])
    rows = []
    for j, cap in enumerate(caps):
        e = float(emin[0, j])
        eta = gpu = None
        if throughput is not None:
            tokens = throughput.rows_remaining * e
            gpu = tokens / throughput.tokens_per_s_per_gpu / 3600.0
            eta = gpu / throughput.n_gpus
        rows.append(
            CapRow(
                cap=cap, truncation=float(surv[0, j]), truncation_low=float(lo[j]), truncation_high=float(hi[j]),
                lognormal_truncation=float(lsf[0, j]), expected_tokens_per_row=e,
                tokens_vs_current=e / cur_tokens if cur_tokens else math.nan,
                basis="observed" if cap <= fit.splice_at else "model",
                meets_threshold=bool(surv[0, j] <= threshold), eta_hours=eta, gpu_hours=gpu,
                clipped_to_context=cap in clipped,
            )
        )
    meeting = [r for r in rows if r.meets_threshold]
    best = meeting[0] if meeting else None
    required = _required_cap(fit, threshold, context_length)
    if best is None:
        notes.append(
            f"no candidate cap meets {threshold:.1%}"
            + (f"; the model needs about {required}" if required else "; not reachable within the context length")
        )
    return CapTable(
        current_cap=int(current_cap), threshold=threshold, confidence=confidence, rows=rows,
        recommended_cap=best.cap if best else None, recommended_truncation=best.truncation if best else None,
        required_cap=required, fit=fit.summary(), throughput=asdict(throughput) if throughput else None,
        notes=notes,
    )


def _required_cap(fit: LengthFit, threshold: float, context_length: int | None, step: int = 1024) -> int | None:
    """Smallest multiple of ``step`` whose predicted truncation meets ``threshold`` (None beyond the limit)."""
    limit = context_length if context_length is not None else 1 << 20
    grid = np.arange(step, limit + step, step, dtype=np.int64)
    grid = np.minimum(grid, limit)
    surv = fit.predict(grid)[0][0]
    ok = np.flatnonzero(surv <= threshold)
    return int(grid[ok[0]]) if ok.size else None
