"""The truncation gate: should a run spend GPU-days at this cap? A pure decision over counts.

Rule (Wilson score interval at ``confidence`` on the truncated share p = truncated / total):

1. no rows                                       -> ``warn``  (nothing to judge; look at the errors)
2. lower bound > threshold                       -> ``stop``  (truncation is above the threshold beyond noise)
3. upper bound <= threshold                      -> ``pass``  (truncation is below the threshold beyond noise)
4. the interval straddles the threshold:
   - total >= min_sample and p <= threshold      -> ``pass``  (a big sample sits at or under the threshold; any
                                                               excess it hides is smaller than the interval)
   - otherwise                                   -> ``warn``  (inconclusive: a bigger pilot would settle it)

Over parts that no longer match their ledger entries (``damage``, from ``Repair.verify_parts``) the verdict is
``damaged`` whatever the truncation: those rows count as done in the ledger but cannot be exported, so no
audit of them says ``pass``. The reason names the parts and their rows, then gives the truncation's verdict.

So a handful of rows never stops or passes a run on noise: with 3 of 20 truncated against 5% the interval is
5.2-36%, a stop; with 1 of 20 it is 0.9-24%, a warn, not a pass. ``warn`` does not block (``blocks`` is False):
the caller logs it loudly and the report shows it first. The default min_sample (300) is where the 95% interval
around a 5% rate is about +-2.5 points, i.e. it tells 5% from 2.5% or 7.5%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, asdict, dataclass, replace
from statistics import NormalDist
from typing import Any

PASS, STOP, WARN, DAMAGED = "pass", "stop", "warn", "damaged"
VERDICTS = (PASS, STOP, WARN, DAMAGED)
DAMAGE_NAMED = 5  # damaged parts named in a verdict's reason; the report's notes name every one
DEFAULT_MIN_SAMPLE = 300


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (exact 0 / 1 bounds at k = 0 / k = n): scipy's
    `binomtest(k, n).proportion_ci(method="wilson")` in closed form, without importing scipy.stats."""
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # Rounding can leave a bound a hair off 0 or 1, which would flip a threshold-0 or threshold-1 gate.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The verdict, why, and what to do about it."""

    verdict: str
    reason: str
    action: str
    truncated: int
    total: int
    rate: float | None
    ci_low: float
    ci_high: float
    threshold: float
    confidence: float
    min_sample: int
    max_tokens: int | None = None
    suggested_cap: int | None = None
    suggested_truncation: float | None = None
    damaged_parts: tuple[str, ...] = ()  # parts that no longer match their ledger entries
    damaged_rows: int = 0  # the rows they hold (counted as done, not exportable)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {'/'.join(VERDICTS)}, got {self.verdict!r}")
        if (self.verdict == DAMAGED) != bool(self.damaged_parts):
            raise ValueError(f"verdict {self.verdict!r} with damaged parts {self.damaged_parts!r}")

    @property
    def blocks(self) -> bool:
        """True when the run must not go on to generation."""
        return self.verdict == STOP

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"blocks": self.blocks}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class GateRule:
    """The test a gate applies: the truncated share it tolerates (``threshold``, in [0, 1]), the interval's
    ``confidence``, and the sample size from which a share at or under the threshold passes even when the
    interval reaches past it (``min_sample``)."""

    threshold: float
    confidence: float = 0.95
    min_sample: int = DEFAULT_MIN_SAMPLE

    def __post_init__(self) -> None:
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a share within [0, 1] (0.05 = 5%), got {threshold!r}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must be within (0, 1), got {self.confidence!r}")
        _check_count("min_sample", self.min_sample)


@dataclass(frozen=True, slots=True)
class CapSuggestion:
    """What the cap table says would fix a truncation, quoted in the reason and action only.

    ``cap``/``truncation``: the smallest cap meeting the threshold and its predicted truncation (None: none
    does); ``basis`` says where the suggestion comes from when it was measured rather than predicted
    ("measured: 3.1% of 500 pilot rows run past 8192 ..."), and is quoted instead of the prediction.
    ``weighed=False``: the caller judged counts without a cap table (the running gates); then no cap is
    suggested and the reason says where the caps are weighed, instead of that none meets the threshold.
    """

    cap: int | None = None
    truncation: float | None = None
    basis: str | None = None
    weighed: bool = True


# The running gates' suggestion: they weigh no caps.
NOT_WEIGHED = CapSuggestion(weighed=False)


@dataclass(frozen=True, slots=True)
class GateInputs:
    """What a gate judges: ``truncated`` of ``total`` rows at cap ``max_tokens`` by ``rule``, what the cap
    table suggests, and ``damage`` (``PartDamage`` items: ``part``, ``n_rows``, ``problem``), which makes the
    verdict ``damaged``, naming them."""

    truncated: int
    total: int
    rule: GateRule
    _: KW_ONLY
    max_tokens: int | None = None
    suggestion: CapSuggestion = CapSuggestion()
    damage: Sequence[Any] = ()

    def __post_init__(self) -> None:
        _check_count("truncated", self.truncated)
        _check_count("total", self.total)
        if self.truncated > self.total:
            raise ValueError(f"truncated ({self.truncated}) cannot exceed total ({self.total})")


def decide(inputs: GateInputs) -> GateDecision:
    """Judge ``inputs.truncated`` of ``inputs.total`` rows by ``inputs.rule``; see the module rule."""
    decision = _judge_truncation(inputs)
    damage = inputs.damage
    if not damage:
        return decision
    damage = list(damage)
    parts = tuple(str(d.part) for d in damage)
    rows = sum(d.n_rows or 0 for d in damage)
    named = ", ".join(f"{d.part} ({'?' if d.n_rows is None else f'{d.n_rows:,}'} rows: {d.problem})"
                      for d in damage[:DAMAGE_NAMED])
    more = f" and {len(parts) - DAMAGE_NAMED} more" if len(parts) > DAMAGE_NAMED else ""
    return replace(
        decision, verdict=DAMAGED, damaged_parts=parts, damaged_rows=rows,
        reason=f"{len(parts)} committed part(s) no longer match their ledger entries, {rows:,} rows counted as "
               f"done that cannot be exported: {named}{more}; truncation: {decision.verdict}, {decision.reason}",
        action="`python -m tracegen verify OUTPUT_URI --retire` makes their rows work again, which the "
               f"scheduled rerun (tracegen_rerun_failed) generates; then audit again. Truncation: {decision.action}",
    )


def _judge_truncation(inputs: GateInputs) -> GateDecision:
    truncated, total, max_tokens = inputs.truncated, inputs.total, inputs.max_tokens
    threshold, confidence, min_sample = inputs.rule.threshold, inputs.rule.confidence, inputs.rule.min_sample
    suggested_cap, suggested_truncation = inputs.suggestion.cap, inputs.suggestion.truncation
    suggestion_basis, caps_weighed = inputs.suggestion.basis, inputs.suggestion.weighed
    lo, hi = wilson_interval(truncated, total, confidence)
    rate = truncated / total if total else None
    at = f" at max_tokens={max_tokens}" if max_tokens is not None else ""
    counts = f"({truncated:,} of {total:,} rows; {round(confidence * 100)}% CI {_pct(lo)}–{_pct(hi)})"
    if suggested_cap is not None:
        pred = f" (predicted {_pct(suggested_truncation)})" if suggested_truncation is not None else ""
        if suggestion_basis:
            pred = f" ({suggestion_basis})"
        suggestion = f"smallest cap meeting {_pct(threshold)}: {suggested_cap}{pred}"
        fix = f"trigger again with max_tokens={suggested_cap}{pred}"
    elif not caps_weighed:
        suggestion = "no cap weighed in this check: the run's report has the cap table"
        fix = "choose a cap from the cap table in the run's report"
    else:
        suggestion = f"no candidate cap is predicted to meet {_pct(threshold)}"
        fix = "raise max_tokens as far as the context allows, or accept a higher truncation threshold"

    def make(verdict: str, reason: str, action: str) -> GateDecision:
        return GateDecision(
            verdict=verdict, reason=reason, action=action, truncated=truncated, total=total, rate=rate,
            ci_low=lo, ci_high=hi, threshold=float(threshold), confidence=confidence, min_sample=min_sample,
            max_tokens=max_tokens, suggested_cap=suggested_cap, suggested_truncation=suggested_truncation,
        )

    if total == 0:
        return make(
            WARN,
            f"no completed rows to judge{at}: the truncation gate cannot decide",
            "check the errors section (failed/rejected rows) before spending GPU time; rerun the pilot",
        )
    assert rate is not None
    if lo > threshold:
        return make(
            STOP,
            f"truncation {_pct(rate)} > {_pct(threshold)}{at} {counts}; {suggestion}",
            f"{fix}; or raise the truncation threshold if this much truncation is acceptable",
        )
    if hi <= threshold:
        return make(PASS, f"truncation {_pct(rate)} ≤ {_pct(threshold)}{at} {counts}", "proceed with generation")
    if total >= min_sample and rate <= threshold:
        return make(
            PASS,
            f"truncation {_pct(rate)} ≤ {_pct(threshold)}{at} {counts}; the interval reaches past the threshold "
            f"but {total:,} rows ≥ min_sample {min_sample:,}",
            "proceed with generation; the final audit re-measures truncation on every row",
        )
    gap = abs(rate - threshold)
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    need = math.ceil(z * z * max(rate * (1 - rate), 1e-4) / gap**2) if gap > 0 else None
    size = f"a pilot of about {need:,} rows" if need else "a larger pilot"
    return make(
        WARN,
        f"inconclusive: truncation {_pct(rate)} vs threshold {_pct(threshold)}{at} {counts}; "
        f"the sample cannot tell them apart",
        f"generation proceeds, but {size} would settle it; if truncation matters, {fix}",
    )
