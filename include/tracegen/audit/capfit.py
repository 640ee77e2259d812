"""What a different ``max_tokens`` would do: the cap table, from natural lengths fitted to the measurements
(`tracegen.audit.length_fit`, where the method is described).

Per candidate cap: the predicted truncation with its interval, the expected output tokens per row
E[min(L, cap)] and, given a measured throughput, the ETA and GPU-hours of the remaining rows; and the
recommendation, the smallest candidate meeting the threshold once the runaway floor is set aside.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from tracegen.audit.length_fit import LengthFit

# The caps the table weighs, as multiples of the run's cap: at 4096: 5120, 6144, 8192, 12288 and
# 16384. Relative, so a pilot at 8192 is shown 10240-32768 rather than caps it has already passed, and a run
# whose lengths are scaled down (the 913,786-prompt rehearsal, `make rehearsal`) gets the same ladder scaled.
CANDIDATE_RATIOS = (1.25, 1.5, 2.0, 3.0, 4.0)


def candidate_caps(cap: int) -> tuple[int, ...]:
    """The candidate caps above `cap`: `CANDIDATE_RATIOS` times it, whole tokens."""
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap!r}")
    return tuple(sorted({int(round(cap * r)) for r in CANDIDATE_RATIOS} - {int(cap)}))


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


@dataclass(slots=True)
class CapRow:
    cap: int
    truncation: float
    truncation_low: float
    truncation_high: float
    lognormal_truncation: float  # the whole-sample log-normal (plus the runaway floor), for comparison
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
    caps, clipped = _caps_to_weigh(int(current_cap), candidates, context_length, notes)
    rows = _rows(fit, caps, int(current_cap), clipped, threshold, confidence, throughput)
    meeting = [r for r in rows if r.meets_threshold]
    best = meeting[0] if meeting else None
    required = _required_cap(fit, threshold, context_length)
    floor = fit.point_floor()
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


def _caps_to_weigh(current_cap: int, candidates: tuple[int, ...] | list[int] | None, context_length: int | None,
                   notes: list[str]) -> tuple[list[int], set[int]]:
    """The table's caps, sorted, the current one included (candidates default to `candidate_caps`), with caps
    over the context length clipped to it; and the caps that stand for clipped ones."""
    if candidates is None:
        candidates = candidate_caps(current_cap)
    caps = sorted({current_cap, *(int(c) for c in candidates)})
    clipped: set[int] = set()
    if context_length is not None:
        over = [c for c in caps if c > context_length]
        if over:
            notes.append(f"caps {over} exceed the context length {context_length} and are clipped to it")
            clipped.add(int(context_length))
        caps = sorted({min(c, int(context_length)) for c in caps})
    return caps, clipped


def _rows(fit: LengthFit, caps: list[int], current_cap: int, clipped: set[int], threshold: float,
          confidence: float, throughput: Throughput | None) -> list[CapRow]:
    surv, emin, lsf = fit.predict(caps + [current_cap])
    lo, hi = fit.interval(caps, confidence)
    floor = fit.point_floor()
    cur_tokens = float(emin[0, -1])
    families = fit.family_truncation(np.asarray(caps, dtype=np.float64))
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
    return rows


def _required_cap(fit: LengthFit, threshold: float, context_length: int | None, step: int = 1024) -> int | None:
    """Smallest multiple of ``step`` whose predicted truncation, less the runaway floor, meets ``threshold``
    (None beyond the limit)."""
    limit = context_length if context_length is not None else 1 << 20
    grid = np.arange(step, limit + step, step, dtype=np.int64)
    grid = np.minimum(grid, limit)
    surv = fit.predict(grid)[0][0] - fit.point_floor()
    ok = np.flatnonzero(surv <= threshold)
    return int(grid[ok[0]]) if ok.size else None
