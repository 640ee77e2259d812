"""Cap table accuracy: the pilot measured beyond its cap against the log-normal-only extrapolation.

For every stand-in length law (`tracegen.simulator.lengths.LAWS`, except `fixed`, which has no tail), alone and
with 5% runaway samples (the law's `runaway_rate`), calibrated so 18% of rows pass 4096
(`LengthModel.calibrated`), and for `--seeds` seeds each (plus, unless `--stand-in-only`, the gamma,
Weibull and Lomax laws from scipy, same calibration, without text and so without runaways):

1. a pilot of `--pilot` rows at cap 4096: one stand-in sample per prompt (`fresh_sample`, the draw the server
   makes), so lengths, runaways and text are the stand-in's own;
2. its truncated rows extended to the measured cap: 16384 (the largest candidate), and a budget-limited variant
   to 8192 only, where 16384 is modelled;
3. rows still truncated there checked for loops by `tracegen.audit.runaway` on the stand-in's text at the cap,
   tokenized as the stand-in tokenizes text (`text_token_ids`; the stand-in's response ids carry no loop: see
   that module), not the law's runaway flag;
4. the cap table (`fit_lengths` + `cap_table`), its truncation at 8192 and 16384 against the truth, the law's
   exact survival (`LengthModel.survival`).

The baseline, in the same process, is the log-normal-only method on the same pilot without extension: the
Kaplan-Meier estimate up to 4096, then a log-normal fitted to all rows by censored maximum likelihood and
scaled to meet it, with its bootstrap interval (copied below from `tracegen.audit.capfit` as it was). The new
method on the unextended pilot is printed too: what a run with `measure_tail=never` gets.

Cost of the measurement: new tokens the extension generates (sum over truncated rows of min(L, measured cap)
- 4096), in tokens and as a share of a run of 913,786 rows at the recommended cap (the law's exact
E[min(L, cap)] times the rows).

    .venv/bin/python bench/capfit_accuracy.py [--seeds 10] [--pilot 1500] [--bootstrap 200]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np
from scipy import integrate, optimize, special, stats

from tracegen.audit.capfit import cap_table
from tracegen.audit.length_fit import fit_lengths
from tracegen.audit.runaway import is_runaway, runaway_score, text_token_ids
from tracegen.simulator.lengths import LAWS, LengthModel, fresh_sample
from tracegen.simulator.protocol import plan_request, raw_text

PILOT_CAP = 4096
CAPS = (8192, 16384)
RUN_ROWS = 913_786
SIM_SEED = 11


# -- the log-normal-only method (tracegen.audit.capfit at commit aa56f31, condensed) ---------------------------
def _ln_nll(theta, y, wy, lc, wc):
    mu, log_s = theta
    s = math.exp(log_s)
    z, zc = (y - mu) / s, (lc - mu) / s
    return -(-(wy * (0.5 * z * z + log_s)).sum() + (wc * special.log_ndtr(-zc)).sum())


def legacy_truncation(lengths, censored, caps, bootstrap, seed, confidence=0.95):
    """(point, low, high) per cap: KM to the first cap, log-normal tail scaled to meet it, bootstrap interval."""
    y, c = np.maximum(np.asarray(lengths), 1), np.asarray(censored, dtype=bool)
    keys, counts = np.unique(y * 2 + c, return_counts=True)
    values, cens = (keys // 2).astype(float), (keys % 2).astype(bool)
    rng = np.random.default_rng(seed)
    weights = np.vstack([counts[None, :], rng.multinomial(y.size, counts / counts.sum(), size=bootstrap)])
    logs = np.log(values)
    c0 = float(values[cens].min())
    out = []
    start = np.array([np.log(np.median(y)), math.log(0.6)])
    for w in weights.astype(float):
        res = optimize.minimize(_ln_nll, start, args=(logs[~cens], w[~cens], logs[cens], w[cens]), method="BFGS")
        mu, s = res.x[0], math.exp(res.x[1])
        s0 = w[values > c0].sum() / w.sum() + w[(values == c0) & cens].sum() / w.sum()  # no censoring below c0
        ratio = special.ndtr(-(np.log(caps) - mu) / s) / special.ndtr(-(math.log(c0) - mu) / s)
        out.append(s0 * ratio)
    out = np.array(out)
    a = (1 - confidence) / 2
    return out[0], np.quantile(out[1:], a, axis=0), np.quantile(out[1:], 1 - a, axis=0)


# -- one pilot ------------------------------------------------------------------------------------------------------
@dataclass
class Pilot:
    total: np.ndarray  # natural lengths (runaways: the law's max_length)
    runaway: np.ndarray  # the law's flag (ground truth, used only to score the detector)
    drawn: list


class ScipyLaw:
    """A law the stand-in does not have (scipy's gamma, Weibull, Lomax), with the stand-in's interface for this
    benchmark: its exact survival and a pilot of natural lengths. It has no text, so no runaways."""

    runaway_rate = 0.0

    def __init__(self, dist) -> None:
        self.dist = dist

    def calibrated(self, share: float, at: float) -> ScipyLaw:
        scale = optimize.brentq(lambda sc: self.dist(scale=sc).sf(at) - share, 1.0, 1e7)
        return ScipyLaw(lambda scale=scale, d=self.dist: d(scale=scale))

    def survival(self, x: float) -> float:
        return float(self.dist().sf(x))


def pilot(model, seed: int, n: int) -> Pilot:
    if isinstance(model, ScipyLaw):
        total = np.maximum(np.ceil(model.dist().rvs(n, random_state=np.random.default_rng(seed))), 1).astype(np.int64)
        return Pilot(total, np.zeros(n, dtype=bool), [])
    drawn = [fresh_sample([seed, 1000 + i, 7], SIM_SEED, model, 0, True) for i in range(n)]
    return Pilot(np.array([d.sample.total for d in drawn]), np.array([d.sample.runaway for d in drawn]), drawn)


def detect(p: Pilot, measured: int) -> tuple[np.ndarray, float]:
    """Runaway flags of rows still truncated at `measured`, from their text's tail; seconds spent detecting."""
    flags = np.zeros(p.total.size, dtype=bool)
    spent = 0.0
    if not p.drawn:  # a law without text (ScipyLaw): nothing to read
        return flags, spent
    for i in np.flatnonzero(p.total > measured):
        plan = plan_request(p.drawn[i], measured, False)
        # The tail is all the detector reads: ~1,600 words are more than its 2,048-id window.
        text = raw_text(plan, max(0, plan.target - 1600), plan.target)
        t = time.perf_counter()
        flags[i] = is_runaway(text_token_ids(text))
        spent += time.perf_counter() - t
    return flags, spent


def exact_emin(model, cap: int) -> float:
    """E[min(L, cap)] = integral of the law's survival from 0 to cap."""
    grid = np.unique(np.concatenate([np.geomspace(1, cap, 400), [cap]]))
    s = np.array([model.survival(float(x)) if x > 0 else 1.0 for x in grid])
    return float(integrate.trapezoid(s, grid) + 1.0)


def detector_rates(models: dict[str, LengthModel], seeds: int, n: int) -> dict[str, tuple[int, int, int, int]]:
    """(runaway rows, missed, natural rows, flagged) over rows truncated at each cap, by the law's own flag."""
    out = {}
    for cap in (PILOT_CAP, 8192, 16384):
        rr = miss = nat = fp = 0
        for model in models.values():
            if model.runaway_rate == 0 or isinstance(model, ScipyLaw):
                continue
            for seed in range(seeds):
                p = pilot(model, 100 + seed, n)
                for i in np.flatnonzero(p.total > cap):
                    plan = plan_request(p.drawn[i], cap, False)
                    flag = is_runaway(text_token_ids(raw_text(plan, max(0, plan.target - 1600), plan.target)))
                    if p.runaway[i]:
                        rr += 1
                        miss += not flag
                    else:
                        nat += 1
                        fp += flag
        out[cap] = (rr, miss, nat, fp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--pilot", type=int, default=1500)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--stand-in-only", action="store_true", help="leave out the gamma, Weibull and Lomax laws")
    args = ap.parse_args()

    models = {}
    for law in LAWS:
        if law == "fixed":
            continue
        for rate in (0.0, 0.05):
            models[law + (f" +{rate:.0%} runaway" if rate else "")] = LengthModel(
                kind=law, runaway_rate=rate).calibrated(0.18, PILOT_CAP)
    if not args.stand_in_only:
        # Laws beyond the stand-in's: shapes as a model's lengths might have (a gamma of shape 2,
        # a Weibull of shape 1.2, a Lomax of tail index 3: from light to power-law tails).
        models["gamma(2) [scipy, no text]"] = ScipyLaw(lambda scale=1.0: stats.gamma(2.0, scale=scale))
        models["weibull(1.2) [scipy, no text]"] = ScipyLaw(lambda scale=1.0: stats.weibull_min(1.2, scale=scale))
        models["lomax(3) [scipy, no text]"] = ScipyLaw(lambda scale=1.0: stats.lomax(3.0, scale=scale))
        for k in [k for k in models if "scipy" in k]:
            models[k] = models[k].calibrated(0.18, PILOT_CAP)
    variants = {"measured to 16384": 16384, "measured to 8192": 8192, "not measured (4096)": PILOT_CAP}
    print(f"{args.pilot}-row pilot at {PILOT_CAP}, {args.seeds} seeds per law, laws calibrated to 18% past "
          f"{PILOT_CAP}; truth: the law's exact survival; intervals: nominal 95%; errors in points (pp)")
    t_start = time.perf_counter()
    summary = {}
    det_time, det_rows = 0.0, 0
    for name, model in models.items():
        truth = np.array([model.survival(c) for c in CAPS])
        res: dict[str, list] = {v: [] for v in [*variants, "baseline: log-normal only"]}
        costs, run_tokens, det_err = [], [], []
        for seed in range(args.seeds):
            p = pilot(model, seed, args.pilot)
            for label, measured in variants.items():
                observed = np.minimum(p.total, measured)
                censored = p.total > measured
                flags, spent = detect(p, measured)
                det_time += spent
                det_rows += int(censored.sum())
                det_err.append(int((flags != (p.runaway & censored)).sum()))
                table = cap_table(fit_lengths(observed, censored, runaway=flags, bootstrap=args.bootstrap, seed=seed),
                                  PILOT_CAP, candidates=CAPS)
                rows = [table.row(c) for c in CAPS]
                res[label].append((np.array([r.truncation for r in rows]), np.array([r.truncation_low for r in rows]),
                                   np.array([r.truncation_high for r in rows]), [r.basis for r in rows]))
                if label == "measured to 16384":
                    extra = int((np.minimum(p.total, measured) - PILOT_CAP)[p.total > PILOT_CAP].sum())
                    rec = table.recommended_cap or CAPS[-1]
                    costs.append(extra)
                    run_tokens.append(RUN_ROWS * exact_emin(model, rec))
            pt, lo, hi = legacy_truncation(np.minimum(p.total, PILOT_CAP), p.total > PILOT_CAP, np.array(CAPS),
                                           args.bootstrap, seed)
            res["baseline: log-normal only"].append((pt, lo, hi, ["model", "model"]))
        print(f"\n{name}: truth {truth[0]:.2%} at 8192, {truth[1]:.2%} at 16384; detector errors "
              f"{sum(det_err)} rows over {args.seeds} seeds x {len(variants)} measured caps")
        print(f"  {'method':28s} {'|err| 8192 med/max':>19s} {'|err| 16384 med/max':>20s} {'cover 8192':>11s} "
              f"{'cover 16384':>12s}  basis 8192/16384")
        for label, rs in res.items():
            pts = np.array([r[0] for r in rs])
            err = np.abs(pts - truth) * 100
            cov = np.array([(r[1] <= truth) & (truth <= r[2]) for r in rs]).mean(axis=0)
            basis = "/".join(rs[0][3])
            print(f"  {label:28s} {np.median(err[:, 0]):8.2f} / {err[:, 0].max():5.2f}   "
                  f"{np.median(err[:, 1]):8.2f} / {err[:, 1].max():5.2f}   {cov[0]:10.0%} {cov[1]:12.0%}  {basis}")
            summary.setdefault(label, []).append((err, cov))
        c, rt = np.array(costs), np.array(run_tokens)
        print(f"  measuring to 16384: {np.median(c):,.0f} new tokens (median; max {c.max():,.0f}) = "
              f"{np.median(c / rt):.3%} of a {RUN_ROWS:,}-row run at the recommended cap "
              f"({np.median(rt) / 1e9:.2f} G tokens)")
    print(f"\nover all {len(models)} laws x {args.seeds} seeds:")
    for label, items in summary.items():
        err = np.concatenate([e for e, _ in items])
        cov = np.array([c for _, c in items]).mean(axis=0)
        base = np.concatenate([e for e, _ in summary["baseline: log-normal only"]])
        print(f"  {label:28s} worst |err| {err[:, 0].max():5.2f} pp at 8192, {err[:, 1].max():5.2f} pp at 16384; "
              f"median {np.median(err[:, 0]):.2f} / {np.median(err[:, 1]):.2f} "
              f"(baseline's median / this: {np.median(base[:, 0]) / max(np.median(err[:, 0]), 1e-9):.1f}x, "
              f"{np.median(base[:, 1]) / max(np.median(err[:, 1]), 1e-9):.1f}x); "
              f"coverage {cov[0]:.0%} / {cov[1]:.0%}")
    rates = detector_rates(models, args.seeds, args.pilot)
    for cap, (rr, miss, nat, fp) in rates.items():
        print(f"detector at cap {cap}: {miss}/{rr} runaway rows missed, {fp}/{nat} natural truncated rows flagged "
              f"(laws with 5% runaways, {args.seeds} seeds x {args.pilot} rows)")
    if det_rows:
        print(f"detector time: {det_time / det_rows * 1e6:.0f} us per row (text ids + score)")
    x = np.arange(16384) % 151_643
    t = time.perf_counter()
    for _ in range(1000):
        runaway_score(x)
    print(f"runaway_score on a 16,384-id row: {(time.perf_counter() - t) * 1e3:.0f} ms per 1,000 rows")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
