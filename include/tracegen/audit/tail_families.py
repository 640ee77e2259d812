"""The laws the length fit extrapolates the tail with, and their censored maximum-likelihood fits.

Beyond the measured cap the cap table extrapolates (`tracegen.audit.length_fit`): several two-parameter tail
families (log-normal, gamma, Weibull, log-logistic, generalized Pareto) are fitted to the rows above the tail
start, censored and left-truncated, on binned lengths (`tail_data`), each with draws of its parameters from
their asymptotic normal law for the interval. The whole-sample censored log-normal (`lognormal_mle`) is both
their starting point and the comparison column the table shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# The tail likelihood groups event lengths into at most this many bins (interval-censored, so still exact for
# grouped data): a million rows fit as fast as a thousand, and the loss of information is negligible.
TAIL_BINS = 256


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


def lognormal_mle(y, wy, lc, wc, start: tuple[float, float]) -> tuple[float, float]:
    # (mu, log sigma) is unconstrained, so plain BFGS does; it is also cheaper per step than L-BFGS-B here.
    res = optimize.minimize(_neg_loglik, np.array(start), args=(y, wy, lc, wc), jac=True, method="BFGS",
                            options={"gtol": 1e-6 * max(1.0, float(wy.sum() + wc.sum()))})
    mu, log_s = float(res.x[0]), float(np.clip(res.x[1], math.log(1e-3), math.log(20.0)))
    return mu, math.exp(log_s)


def lognormal_sf(x: np.ndarray, mu: float, s: float) -> np.ndarray:
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
class Family:
    name: str
    logsf: Callable[..., np.ndarray]
    # Start from the whole-sample log-normal (mu, sigma), the tail start u and the mean excess over it.
    start: Callable[[float, float, float, float], tuple[float, float]]


FAMILIES = (
    Family("lognormal", _ln_logsf, lambda mu, s, u, me: (mu, math.log(s))),
    # gamma shape ~ 1/sigma^2 matches the log-variance; the scale then matches the mean.
    Family("gamma", _gamma_logsf,
            lambda mu, s, u, me: (math.log(1 / s**2), mu + s * s / 2 - math.log(1 / s**2))),
    # Weibull shape ~ 1.28/sigma matches the log-sd; the scale then matches the median.
    Family("weibull", _weibull_logsf,
            lambda mu, s, u, me: (math.log(1.28 / s), mu - math.log(math.log(2)) * s / 1.28)),
    # log-logistic: log-sd pi / (beta sqrt 3), median alpha.
    Family("log-logistic", _loglogistic_logsf, lambda mu, s, u, me: (math.log(1.81 / s), mu)),
    Family("generalized-pareto", _gpd_logsf, lambda mu, s, u, me: (0.1, math.log(max(me, 1.0)))),
)


@dataclass(slots=True)
class TailFit:
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


@dataclass(frozen=True, slots=True)
class TailData:
    """The rows a tail family is fitted to: those above the tail start ``u``, their events binned (``edges``,
    ``w_bins``: the weight of each bin) and their censored values with their weights."""

    edges: np.ndarray
    w_bins: np.ndarray
    cens: np.ndarray
    w_cens: np.ndarray
    u: float


def fit_tail(fam: Family, data: TailData, whole: tuple[float, float], draws: int,
             rng: np.random.Generator) -> TailFit | None:
    """Censored, left-truncated (at ``data.u``) maximum likelihood on binned events and censored values,
    started from the whole-sample log-normal (mu, sigma)."""
    edges, w_bins, cens, w_cens, u = data.edges, data.w_bins, data.cens, data.w_cens, data.u
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
    return TailFit(fam.name, theta, theta[None, :] + z @ chol.T, -f0, fam.logsf)


def tail_data(values: np.ndarray, kind: np.ndarray, counts: np.ndarray, u: float) -> TailData:
    """The non-looping rows above u: their events binned, their censored values."""
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
    return TailData(edges, w_bins, values[sel_c], counts[sel_c], u)
