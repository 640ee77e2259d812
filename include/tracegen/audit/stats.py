"""Statistics over the ledger: what a run produced, how much of it was cut at the cap, and where it failed.

The audit reads the ledger frame only (never completion text) and is vectorised so a million ledger rows take
a second or two. Several ledger rows may exist for one dataset index (failed attempts then a success; a row cut
at 4096 and its regeneration at 8192), so every figure says which rows it counts:

* *current* rows: the one row per index that supersedes the others — the row export keeps, by the one rule
  ``tracegen.store.current.current_mask``: a non-failed row over a failed one, then a complete row over an
  incomplete one, then the higher cap, then the newest commit.
  Token distribution, finish reasons, truncation, buckets and the per-prompt-length / per-category breakdowns
  count current rows only, so no index is counted twice.
* *superseded* rows are counted, never mixed in.
* *operational* breakdowns (per chunk, per server, errors: `tracegen.audit.operational`) count every ledger
  row (every attempt is evidence about a server), restricted to ``run_id`` when one is given.
* *pivot* figures (`tracegen.audit.pivot`) count the ok rows that replaced a row truncated under a lower cap:
  extended from its tokens, or generated again; restricted to ``run_id`` when one is given.

The gates' counts (`gate_counts`) and the length fit's input (`censoring_arrays`) are read here too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit import operational
from tracegen.audit.columns import Coded, group_table, rate
from tracegen.audit.pivot import pivot_summary
from tracegen.store.current import current_mask
from tracegen.store.records import FAILED, LEDGER_DEFAULTS, LOOP, OK, STATUSES

# The bucket edges a team's hand analysis of 1,500 sampled rows used (at 4096: 18% truncated) (under 100, under 500, ... over 3000).
BUCKET_EDGES = (100, 500, 1000, 2000, 3000, 4000)
PROMPT_EDGES = (1000, 2000, 4000, 8000, 16000, 32000)
HISTOGRAM_BINS = 64
TOP_CATEGORIES = 30
# The ledger columns `audit` reads: its figures', supersession's (`current_mask`; committed_at orders ties when
# present) and the operational breakdowns'. A frame may lack one LEDGER_DEFAULTS gives a default (an older
# ledger); `attempt` is read by no figure.
AUDIT_COLUMNS = ("index", "status", "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens",
                 "cut_in_reasoning", "max_tokens", "run_id", "chunk", "server", "latency_s", "category", "error",
                 "pivot", "prefix_tokens", "text_joined")


@dataclass(slots=True)
class AuditResult:
    """Everything the audit measured; plain JSON-able values only (the report and the gate read these)."""

    max_tokens: int
    rows: dict[str, Any]
    tokens: dict[str, Any]
    histogram: dict[str, list[int]]
    finish_reasons: dict[str, int]
    truncation: dict[str, Any]
    buckets: list[dict[str, Any]]
    by_prompt_length: list[dict[str, Any]]
    by_category: list[dict[str, Any]]
    by_chunk: list[dict[str, Any]]
    by_server: list[dict[str, Any]]
    errors: dict[str, Any]
    invalid: dict[str, Any]
    run_id: str | None = None
    notes: list[str] = field(default_factory=list)
    pivot: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)


@dataclass(frozen=True, slots=True)
class _Columns:
    """The columns and masks every figure of the audit starts from, computed once."""

    frame: pd.DataFrame
    cap: int
    status: Coded
    finish: Coded
    row_cap: np.ndarray  # the cap each row was generated under
    tokens_all: np.ndarray  # completion tokens of every row
    is_ok: np.ndarray
    is_len: np.ndarray  # ok and cut by its cap
    cut_reasoning: np.ndarray
    cur: np.ndarray  # the current row of each index
    cur_ok: np.ndarray
    cur_len: np.ndarray

    @property
    def cur_tokens(self) -> np.ndarray:
        return self.tokens_all[self.cur_ok]

    @property
    def cur_trunc(self) -> np.ndarray:
        return self.is_len[self.cur_ok]


def _columns(frame: pd.DataFrame, cap: int) -> _Columns:
    status, finish = Coded(frame["status"]), Coded(frame["finish_reason"])
    is_ok = status.eq(OK)
    is_len = is_ok & finish.eq("length")
    cur = current_mask(frame)
    return _Columns(
        frame=frame, cap=cap, status=status, finish=finish, row_cap=frame["max_tokens"].to_numpy(dtype=np.int64),
        tokens_all=frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64), is_ok=is_ok, is_len=is_len,
        cut_reasoning=frame["cut_in_reasoning"].fillna(False).to_numpy(dtype=bool), cur=cur, cur_ok=cur & is_ok,
        cur_len=cur & is_len,
    )


def audit(frame: pd.DataFrame, max_tokens: int, *, run_id: str | None = None) -> AuditResult:
    """Audit a ledger frame for a run whose cap is ``max_tokens``.

    ``run_id`` restricts the operational breakdowns (chunks, servers, errors) to that run's rows; the dataset
    figures (current rows, tokens, truncation) always describe the whole ledger as export would see it.
    """
    _validate(frame)
    cap = int(max_tokens)
    frame = frame.reset_index(drop=True)
    c = _columns(frame, cap)
    rows = _row_counts(c)
    truncation = _truncation(c, rows)
    by_prompt, by_category = _breakdowns(c)
    # Operational breakdowns over every ledger row of this run.
    scope = np.ones(len(frame), dtype=bool) if run_id is None else Coded(frame["run_id"]).eq(run_id)
    by_chunk, by_server = operational.chunks_and_servers(frame, scope, c.status, c.is_ok, c.is_len, c.tokens_all)
    errors, invalid = operational.errors(frame, scope, c.status, rows["current_by_status"])
    return AuditResult(
        max_tokens=cap,
        rows=rows,
        tokens=_token_figures(c),
        histogram=_histogram(c.cur_tokens, cap),
        finish_reasons=_finish_reasons(c),
        truncation=truncation,
        buckets=_buckets(c.cur_tokens, c.cur_trunc, cap),
        by_prompt_length=by_prompt,
        by_category=by_category,
        by_chunk=by_chunk,
        by_server=by_server,
        errors=errors,
        invalid=invalid,
        run_id=run_id,
        notes=_notes(rows, truncation, cap),
        pivot=pivot_summary(frame, run_id=run_id),
    )


def _row_counts(c: _Columns) -> dict[str, Any]:
    n_cur = int(c.cur.sum())
    return {
        "ledger_rows": len(c.frame),
        "indices": n_cur,
        "current_rows": n_cur,
        "superseded_rows": len(c.frame) - n_cur,
        "current_by_status": {s: int((c.cur & c.status.eq(s)).sum()) for s in STATUSES},
        "current_ok_at_cap": int((c.cur_ok & (c.row_cap == c.cap)).sum()),
        "current_ok_at_lower_cap": int((c.cur_ok & (c.row_cap < c.cap)).sum()),
        "current_ok_at_higher_cap": int((c.cur_ok & (c.row_cap > c.cap)).sum()),
        # Rows truncated under a lower cap are done for that cap but due for regeneration at this one.
        "truncated_under_lower_cap": int((c.cur_len & (c.row_cap < c.cap)).sum()),
        "superseded_truncated": int((~c.cur & c.is_len).sum()),
        "superseded_failed": int((~c.cur & c.status.eq(FAILED)).sum()),
    }


def _token_figures(c: _Columns) -> dict[str, Any]:
    cur_tokens = c.cur_tokens
    reasoning = c.frame["reasoning_tokens"].fillna(0).to_numpy(dtype=np.int64)[c.cur_ok]
    answer = cur_tokens - reasoning
    tokens = _quantiles(cur_tokens)
    tokens.update(
        {
            "sum": int(cur_tokens.sum()),
            "reasoning_sum": int(reasoning.sum()),
            "answer_sum": int(answer.sum()),
            "reasoning_mean": float(reasoning.mean()) if reasoning.size else None,
            "answer_mean": float(answer.mean()) if answer.size else None,
            "reasoning_share": rate(int(reasoning.sum()), int(cur_tokens.sum())),
        }
    )
    return tokens


def _finish_reasons(c: _Columns) -> dict[str, int]:
    fr = np.bincount(c.finish.codes[c.cur_ok], minlength=len(c.finish.labels))
    return {c.finish.labels[i]: int(n) for i in np.argsort(-fr, kind="stable") if (n := fr[i])}


def _truncation(c: _Columns, rows: dict[str, Any]) -> dict[str, Any]:
    at_cap = c.cur_ok & (c.row_cap == c.cap)
    n_trunc = int(c.cur_len.sum())
    return {
        "ok_rows": int(c.cur_ok.sum()),
        "truncated": n_trunc,
        "rate": rate(n_trunc, int(c.cur_ok.sum())),
        # The gate's input: what this cap does to rows generated under it.
        "at_cap_rows": int(at_cap.sum()),
        "at_cap_truncated": int((at_cap & c.is_len).sum()),
        "at_cap_rate": rate(int((at_cap & c.is_len).sum()), int(at_cap.sum())),
        "cut_in_reasoning": int((c.cur_len & c.cut_reasoning).sum()),
        "cut_in_answer": int((c.cur_len & ~c.cut_reasoning).sum()),
        "truncated_under_lower_cap": rows["truncated_under_lower_cap"],
        # Rows generated under a higher cap (the tail measurement) that ran past this one: complete or
        # not, this cap alone would have cut them, so the gate counts them truncated (`gate_counts`).
        "past_cap": int((c.cur_ok & (c.row_cap > c.cap) & (c.tokens_all > c.cap)).sum()),
    }


def _breakdowns(c: _Columns) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """By prompt length and by category, over current ok rows."""
    cur_tokens, cur_trunc = c.cur_tokens, c.cur_trunc
    if not cur_tokens.size:
        return [], []
    sub_cols = {
        "truncated": cur_trunc.astype(np.int64),
        "cut_in_reasoning": (c.cut_reasoning[c.cur_ok] & cur_trunc).astype(np.int64),
        "completion_tokens": cur_tokens,
    }
    prompt = c.frame["prompt_tokens"].fillna(0).to_numpy(dtype=np.int64)[c.cur_ok]
    pbin = np.searchsorted(np.array(PROMPT_EDGES), prompt, side="right")
    plabels = [f"<{PROMPT_EDGES[0]}"] + [f"{a}–{b - 1}" for a, b in zip(PROMPT_EDGES[:-1], PROMPT_EDGES[1:], strict=True)]
    plabels.append(f"≥{PROMPT_EDGES[-1]}")
    g = group_table(pbin, plabels, sub_cols)
    by_prompt = [_breakdown_row("prompt_tokens", str(key), r) for key, r in g.iterrows()]
    cats = Coded(c.frame["category"])
    g = group_table(cats.codes[c.cur_ok], cats.labels, sub_cols, limit=TOP_CATEGORIES)
    by_category = [_breakdown_row("category", str(key), r) for key, r in g.sort_values("rows", ascending=False).iterrows()]
    return by_prompt, by_category


def _breakdown_row(name: str, key: str, r: pd.Series) -> dict[str, Any]:
    n = int(r["rows"])
    return {
        name: key,
        "rows": n,
        "truncated": int(r["truncated"]),
        "truncation_rate": rate(int(r["truncated"]), n),
        "cut_in_reasoning": int(r["cut_in_reasoning"]),
        "mean_completion_tokens": float(r["completion_tokens"]) / n if n else None,
    }


def _notes(rows: dict[str, Any], truncation: dict[str, Any], cap: int) -> list[str]:
    notes = []
    if rows["truncated_under_lower_cap"]:
        notes.append(
            f"{rows['truncated_under_lower_cap']:,} current rows were truncated under a cap below {cap}: "
            "they count as truncated here until a run under this cap extends them (or regenerates them, "
            "as its truncated_policy says)."
        )
    if truncation["past_cap"]:
        notes.append(
            f"{truncation['past_cap']:,} current rows were generated under a cap above {cap} (the pilot's "
            f"truncated rows continued to measure the tail) and ran past {cap} tokens: the truncation figures "
            f"here count only rows still cut, but at max_tokens={cap} alone these would have been cut too; "
            "the gate counts them as truncated."
        )
    if rows["current_rows"] == 0:
        notes.append("the ledger has no rows yet")
    return notes


def _validate(frame: pd.DataFrame) -> None:
    """The frame's shape; the cap is a validated `RunConfig.max_tokens` and is not checked again."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"audit needs a pandas DataFrame of ledger rows, got {type(frame).__name__}")
    missing = [c for c in AUDIT_COLUMNS if c not in frame.columns and c not in LEDGER_DEFAULTS]
    if missing:
        raise ValueError(f"ledger frame is missing columns {missing}; the audit reads {AUDIT_COLUMNS}")
    unknown = set(frame["status"].unique()) - set(STATUSES)
    if unknown:
        raise ValueError(f"ledger frame has unknown status values {sorted(map(str, unknown))}")


def _quantiles(values: np.ndarray) -> dict[str, Any]:
    if values.size == 0:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    # "lower" interpolation keeps quantiles at observed token counts (P90 = 4096 reads as "the cap").
    p50, p90, p99 = np.percentile(values, [50, 90, 99], method="lower")
    return {
        "count": int(values.size),
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p90": int(p90),
        "p99": int(p99),
        "min": int(values.min()),
        "max": int(values.max()),
        "p50_lower": int(p50),
    }


def _histogram(values: np.ndarray, cap: int) -> dict[str, list[int]]:
    upper = max(cap, int(values.max()) + 1 if values.size else cap)
    raw = upper / HISTOGRAM_BINS
    # A round bin width (a power of two times 1, 2 or 5 ... close enough) so the cap sits on a bin edge.
    width = max(1, 2 ** math.ceil(math.log2(raw))) if raw > 1 else 1
    n_bins = max(1, math.ceil(upper / width))
    counts = np.bincount(np.minimum(values // width, n_bins - 1), minlength=n_bins) if values.size else np.zeros(n_bins)
    return {"edges": [int(i * width) for i in range(n_bins + 1)], "counts": [int(c) for c in counts]}


def _buckets(tokens: np.ndarray, truncated: np.ndarray, cap: int) -> list[dict[str, Any]]:
    edges = [0, *[e for e in BUCKET_EDGES if e < cap], cap]
    total = tokens.size
    out = []
    complete = tokens[~truncated]
    # Bin i holds [edges[i], edges[i+1]); the extra last bin holds complete rows at >= cap.
    counts = np.bincount(np.searchsorted(np.array(edges[1:]), complete, side="right"), minlength=len(edges))
    for lo, hi, c in zip(edges[:-1], edges[1:], counts[:-1], strict=True):
        label = f"<{hi}" if lo == 0 else f"{lo}–{hi - 1}"
        out.append({"label": label, "lo": int(lo), "hi": int(hi), "count": int(c), "share": rate(int(c), total)})
    # Complete rows at >= cap exist only when older rows ran under a higher cap.
    above = int(counts[-1])
    if above:
        out.append({"label": f"≥{cap} (complete)", "lo": int(cap), "hi": None, "count": above,
                    "share": rate(above, total)})
    hit = int(truncated.sum())
    out.append({"label": "hit cap (length)", "lo": int(cap), "hi": None, "count": hit, "share": rate(hit, total)})
    return out


def gate_counts(frame: pd.DataFrame, max_tokens: int) -> tuple[int, int]:
    """(truncated, judged): what the truncation gate judges at cap `max_tokens`, over the current row of
    each index. The one definition the pilot gate, the continuous gate and the gate watch share.

    A row that finished naturally under a lower cap would finish the same under this one, so it counts
    as complete. A row truncated under a lower cap says nothing about this cap (it was kept, or it is
    about to be generated again), so it is left out rather than counted either way. A row generated under
    a higher cap that ran past this one (the pilot's truncated rows continued to measure the tail,
    `tracegen.generate.measure`) would have been cut here, so it counts as truncated, finished or not:
    measuring the tail never changes what the gate says about the run's cap.
    """
    if len(frame) == 0:
        return 0, 0
    cur = current_mask(frame) & Coded(frame["status"]).eq(OK)
    is_length = Coded(frame["finish_reason"]).eq("length")
    under_cap = frame["max_tokens"].to_numpy(dtype=np.int64) < max_tokens
    tokens = frame["completion_tokens"] if "completion_tokens" in frame.columns else pd.Series(0, index=frame.index)
    past_cap = tokens.fillna(0).to_numpy(dtype=np.int64) > max_tokens
    # A row stopped in its loop is counted apart: no cap would have finished it, so it says nothing about
    # this cap (the cap table's runaway floor and the report count it).
    judged = cur & ~(is_length & under_cap) & ~Coded(frame["finish_reason"]).eq(LOOP)
    return int((judged & (is_length | past_cap)).sum()), int(judged.sum())


def censoring_arrays(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, censored) of current ok rows, for the censored length fit: a ``length`` row's natural length
    is only known to exceed its own cap, which may differ row to row after a cap change."""
    cur = current_mask(frame) & Coded(frame["status"]).eq(OK)
    lengths = frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64)[cur]
    finish = Coded(frame["finish_reason"])
    censored = (finish.eq("length") | finish.eq(LOOP))[cur]  # a loop stopped early would have run on
    return lengths, censored
