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
* *operational* breakdowns (per chunk, per server, errors) count every ledger row (every attempt is evidence
  about a server), restricted to ``run_id`` when one is given.
* *pivot* figures (``pivot_summary``) count the ok rows that replaced a row truncated under a lower cap:
  extended from its tokens, or generated again; restricted to ``run_id`` when one is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tracegen.store.current import current_mask
from tracegen.store.layout import MEASURE_CHUNK
from tracegen.store.records import (
    EXTENDED,
    FAILED,
    FALLBACK_REGENERATED,
    INVALID,
    LEDGER_COLUMNS,
    LEDGER_DEFAULTS,
    OK,
    REGENERATED,
    REJECTED,
    STATUSES,
)

# The bucket edges a team's hand analysis of 1,500 sampled rows used (at 4096: 18% truncated) (under 100, under 500, ... over 3000).
BUCKET_EDGES = (100, 500, 1000, 2000, 3000, 4000)
PROMPT_EDGES = (1000, 2000, 4000, 8000, 16000, 32000)
HISTOGRAM_BINS = 64
TOP_CATEGORIES = 30
TOP_MESSAGES = 10


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


def _rate(num: int | float, den: int | float) -> float | None:
    return float(num) / float(den) if den else None


class _Coded:
    """A string column as integer codes plus labels. Factorising once is far cheaper than comparing a million
    Python strings (pandas 3 stores strings in Arrow; object arrays would copy them all)."""

    def __init__(self, col: pd.Series, missing: str = "(none)") -> None:
        codes, uniques = pd.factorize(col, use_na_sentinel=True)
        self.labels = [str(u) for u in uniques] + [missing]
        self.codes = np.where(codes < 0, len(uniques), codes).astype(np.int64)
        self.missing = len(uniques)

    def code(self, value: str | None) -> int:
        if value is None:
            return self.missing
        try:
            return self.labels.index(value, 0, self.missing)
        except ValueError:
            return -2  # matches nothing

    def eq(self, value: str | None) -> np.ndarray:
        return self.codes == self.code(value)

    def isin(self, values: tuple[str, ...] | list[str]) -> np.ndarray:
        return np.isin(self.codes, [self.code(v) for v in values])


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
        out.append({"label": label, "lo": int(lo), "hi": int(hi), "count": int(c), "share": _rate(int(c), total)})
    # Complete rows at >= cap exist only when older rows ran under a higher cap.
    above = int(counts[-1])
    if above:
        out.append({"label": f"≥{cap} (complete)", "lo": int(cap), "hi": None, "count": above,
                    "share": _rate(above, total)})
    hit = int(truncated.sum())
    out.append({"label": "hit cap (length)", "lo": int(cap), "hi": None, "count": hit, "share": _rate(hit, total)})
    return out


def _group_table(codes: np.ndarray, labels: list[Any], cols: dict[str, np.ndarray],
                 limit: int | None = None) -> pd.DataFrame:
    """Per-group sums of ``cols`` (plus a ``rows`` count) keyed by label; bincount beats groupby here."""
    k = len(labels)
    sums = {name: np.bincount(codes, weights=v, minlength=k)[:k] for name, v in cols.items()}
    sums["rows"] = np.bincount(codes, minlength=k)[:k]
    g = pd.DataFrame(sums, index=pd.Index(labels, dtype=object))
    g = g[g["rows"] > 0]
    if not g.index.is_unique:  # e.g. a server recorded as "" and one missing: both read "(none)"
        g = g.groupby(level=0, sort=False).sum()
    if limit is not None and len(g) > limit:
        g = g.sort_values("rows", ascending=False)
        head, tail = g.iloc[:limit], g.iloc[limit:]
        other = tail.sum().to_frame().T
        other.index = ["(other)"]
        g = pd.concat([head, other])
    return g


def _top_messages(frame: pd.DataFrame, mask: np.ndarray) -> list[dict[str, Any]]:
    if not mask.any():
        return []
    sub = frame.loc[mask, ["status", "error"]]  # only error rows: few enough for string operations
    # Digits vary per request (ids, ports, token counts); folding them groups the same failure together.
    msg = sub["error"].fillna("(no message)").astype(str).str.slice(0, 300).str.replace(r"\d+", "N", regex=True)
    counts = pd.DataFrame({"status": sub["status"].to_numpy(), "message": msg.to_numpy()}).value_counts()
    return [
        {"status": str(s), "message": str(m), "count": int(c)} for (s, m), c in counts.head(TOP_MESSAGES).items()
    ]


def _validate(frame: pd.DataFrame) -> None:
    """The frame's shape; the cap is a validated `RunConfig.max_tokens` and is not checked again."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"audit needs a pandas DataFrame of ledger rows, got {type(frame).__name__}")
    missing = [c for c in LEDGER_COLUMNS if c not in frame.columns and c not in LEDGER_DEFAULTS]
    if missing:
        raise ValueError(f"ledger frame is missing columns {missing}; expected tracegen.store.records.LEDGER_COLUMNS")
    unknown = set(frame["status"].unique()) - set(STATUSES)
    if unknown:
        raise ValueError(f"ledger frame has unknown status values {sorted(map(str, unknown))}")


def audit(frame: pd.DataFrame, max_tokens: int, *, run_id: str | None = None) -> AuditResult:
    """Audit a ledger frame for a run whose cap is ``max_tokens``.

    ``run_id`` restricts the operational breakdowns (chunks, servers, errors) to that run's rows; the dataset
    figures (current rows, tokens, truncation) always describe the whole ledger as export would see it.
    """
    _validate(frame)
    cap = int(max_tokens)
    frame = frame.reset_index(drop=True)
    status = _Coded(frame["status"])
    finish = _Coded(frame["finish_reason"])
    row_cap = frame["max_tokens"].to_numpy(dtype=np.int64)
    tokens_all = frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64)
    is_ok = status.eq(OK)
    is_len = is_ok & finish.eq("length")

    cur = current_mask(frame)
    n_cur = int(cur.sum())
    cur_ok = cur & is_ok
    cur_len = cur & is_len
    cur_tokens = tokens_all[cur_ok]
    cur_trunc = is_len[cur_ok]

    rows = {
        "ledger_rows": len(frame),
        "indices": n_cur,
        "current_rows": n_cur,
        "superseded_rows": len(frame) - n_cur,
        "current_by_status": {s: int((cur & status.eq(s)).sum()) for s in STATUSES},
        "current_ok_at_cap": int((cur_ok & (row_cap == cap)).sum()),
        "current_ok_at_lower_cap": int((cur_ok & (row_cap < cap)).sum()),
        "current_ok_at_higher_cap": int((cur_ok & (row_cap > cap)).sum()),
        # Rows truncated under a lower cap are done for that cap but due for regeneration at this one.
        "truncated_under_lower_cap": int((cur_len & (row_cap < cap)).sum()),
        "superseded_truncated": int((~cur & is_len).sum()),
        "superseded_failed": int((~cur & status.eq(FAILED)).sum()),
    }

    reasoning = frame["reasoning_tokens"].fillna(0).to_numpy(dtype=np.int64)[cur_ok]
    answer = cur_tokens - reasoning
    tokens = _quantiles(cur_tokens)
    tokens.update(
        {
            "sum": int(cur_tokens.sum()),
            "reasoning_sum": int(reasoning.sum()),
            "answer_sum": int(answer.sum()),
            "reasoning_mean": float(reasoning.mean()) if reasoning.size else None,
            "answer_mean": float(answer.mean()) if answer.size else None,
            "reasoning_share": _rate(int(reasoning.sum()), int(cur_tokens.sum())),
        }
    )

    fr = np.bincount(finish.codes[cur_ok], minlength=len(finish.labels))
    finish_reasons = {finish.labels[i]: int(c) for i in np.argsort(-fr, kind="stable") if (c := fr[i])}

    cut_reasoning = frame["cut_in_reasoning"].fillna(False).to_numpy(dtype=bool)
    at_cap = cur_ok & (row_cap == cap)
    n_trunc = int(cur_len.sum())
    truncation = {
        "ok_rows": int(cur_ok.sum()),
        "truncated": n_trunc,
        "rate": _rate(n_trunc, int(cur_ok.sum())),
        # The gate's input: what this cap does to rows generated under it.
        "at_cap_rows": int(at_cap.sum()),
        "at_cap_truncated": int((at_cap & is_len).sum()),
        "at_cap_rate": _rate(int((at_cap & is_len).sum()), int(at_cap.sum())),
        "cut_in_reasoning": int((cur_len & cut_reasoning).sum()),
        "cut_in_answer": int((cur_len & ~cut_reasoning).sum()),
        "truncated_under_lower_cap": rows["truncated_under_lower_cap"],
        # Rows generated under a higher cap (the tail measurement) that ran past this one: complete or
        # not, this cap alone would have cut them, so the gate counts them truncated (`gate_counts`).
        "past_cap": int((cur_ok & (row_cap > cap) & (tokens_all > cap)).sum()),
    }

    # Prompt length and category breakdowns over current ok rows.
    sub_cols = {
        "truncated": cur_trunc.astype(np.int64),
        "cut_in_reasoning": (cut_reasoning[cur_ok] & cur_trunc).astype(np.int64),
        "completion_tokens": cur_tokens,
    }
    prompt = frame["prompt_tokens"].fillna(0).to_numpy(dtype=np.int64)[cur_ok]
    pedges = np.array(PROMPT_EDGES)
    pbin = np.searchsorted(pedges, prompt, side="right")
    plabels = [f"<{PROMPT_EDGES[0]}"] + [f"{a}–{b - 1}" for a, b in zip(PROMPT_EDGES[:-1], PROMPT_EDGES[1:], strict=True)]
    plabels.append(f"≥{PROMPT_EDGES[-1]}")
    by_prompt = []
    if cur_tokens.size:
        g = _group_table(pbin, plabels, sub_cols)
        for key, r in g.iterrows():
            by_prompt.append(_breakdown_row("prompt_tokens", str(key), r))
    by_category = []
    if cur_tokens.size:
        cats = _Coded(frame["category"])
        g = _group_table(cats.codes[cur_ok], cats.labels, sub_cols, limit=TOP_CATEGORIES)
        for key, r in g.sort_values("rows", ascending=False).iterrows():
            by_category.append(_breakdown_row("category", str(key), r))

    # Operational breakdowns over every ledger row of this run.
    scope = np.ones(len(frame), dtype=bool) if run_id is None else _Coded(frame["run_id"]).eq(run_id)
    by_chunk, by_server = _operational(frame, scope, status, is_ok, is_len, tokens_all)

    err_mask = scope & status.isin([FAILED, REJECTED])
    errors = {
        "failed_rows": int((scope & status.eq(FAILED)).sum()),
        "rejected_rows": int((scope & status.eq(REJECTED)).sum()),
        "current_failed": rows["current_by_status"][FAILED],
        "current_rejected": rows["current_by_status"][REJECTED],
        "top_messages": _top_messages(frame, err_mask),
    }
    inv_mask = scope & status.eq(INVALID)
    invalid = {"rows": int(inv_mask.sum()), "top_messages": _top_messages(frame, inv_mask)}

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
    if n_cur == 0:
        notes.append("the ledger has no rows yet")
    return AuditResult(
        max_tokens=cap,
        rows=rows,
        tokens=tokens,
        histogram=_histogram(cur_tokens, cap),
        finish_reasons=finish_reasons,
        truncation=truncation,
        buckets=_buckets(cur_tokens, cur_trunc, cap),
        by_prompt_length=by_prompt,
        by_category=by_category,
        by_chunk=by_chunk,
        by_server=by_server,
        errors=errors,
        invalid=invalid,
        run_id=run_id,
        notes=notes,
        pivot=pivot_summary(frame, run_id=run_id),
    )


def pivot_summary(frame: pd.DataFrame, *, run_id: str | None = None) -> dict[str, Any]:
    """What the pivot did: the ok rows (of `run_id`, or of every run) that replaced a row truncated under
    a lower cap, and the tokens that cost.

    An extended row paid only for its new tokens (``completion_tokens - prefix_tokens``); its prefix is what
    regenerating it would have paid again (``tokens_saved``). A regenerated row paid all its tokens.
    """
    n = len(frame)
    pivot = _Coded(frame["pivot"] if "pivot" in frame.columns else pd.Series([None] * n, dtype=object))
    prefix = (frame["prefix_tokens"].fillna(0).to_numpy(dtype=np.int64) if "prefix_tokens" in frame.columns
              else np.zeros(n, dtype=np.int64))
    tokens = frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64) if n else np.zeros(0, np.int64)
    ok = _Coded(frame["status"]).eq(OK) if n else np.zeros(0, dtype=bool)
    if run_id is not None and n:
        ok &= _Coded(frame["run_id"]).eq(run_id)
    finished = ~_Coded(frame["finish_reason"]).eq("length") if n else np.zeros(0, dtype=bool)
    ext, regen, fallback = ok & pivot.eq(EXTENDED), ok & pivot.eq(REGENERATED), ok & pivot.eq(FALLBACK_REGENERATED)
    new = int((tokens - prefix)[ext].sum())
    again = int(tokens[regen | fallback].sum())
    # Rows extended by the pilot's tail measurement (`generate.measure`), before any cap was chosen: the
    # same mechanism, but not the pivot's doing, so the lines saying what the pivot did name them apart.
    measured = ext & (frame["chunk"].to_numpy(dtype=np.int64) == MEASURE_CHUNK) if n else ext
    return {
        "extended": int(ext.sum()),
        "extended_measuring": int(measured.sum()),
        "extended_finished": int((ext & finished).sum()),  # the rest were cut again at their new cap
        "extended_new_tokens": new,
        "regenerated": int(regen.sum()),
        "fallback_regenerated": int(fallback.sum()),  # extend asked for, but the row had no token ids
        "regenerated_tokens": again,
        "tokens_spent": new + again,
        "tokens_saved": int(prefix[ext].sum()),
    }


def pivot_text(p: dict[str, Any]) -> str | None:
    """One line saying what the pivot did, for logs, status and the report (None: no pivot rows)."""
    if not p or not (p["extended"] or p["regenerated"] or p["fallback_regenerated"]):
        return None
    parts = []
    if p["extended"]:
        measuring = p.get("extended_measuring") or 0
        who = (f" ({measuring:,} of them by the pilot's tail measurement, {p['extended'] - measuring:,} by the "
               "pivot to the chosen cap)" if measuring else "")
        parts.append(f"{p['extended']:,} rows extended from their tokens{who} ({p['extended_finished']:,} now "
                     f"finish), {p['extended_new_tokens']:,} new tokens spent, {p['tokens_saved']:,} saved "
                     "against regenerating them")
    if p["regenerated"]:
        parts.append(f"{p['regenerated']:,} rows regenerated")
    if p["fallback_regenerated"]:
        parts.append(f"{p['fallback_regenerated']:,} rows regenerated because they had no token ids")
    if p["regenerated"] or p["fallback_regenerated"]:
        parts.append(f"{p['regenerated_tokens']:,} tokens spent regenerating")
    return "; ".join(parts)


def _breakdown_row(name: str, key: str, r: pd.Series) -> dict[str, Any]:
    n = int(r["rows"])
    return {
        name: key,
        "rows": n,
        "truncated": int(r["truncated"]),
        "truncation_rate": _rate(int(r["truncated"]), n),
        "cut_in_reasoning": int(r["cut_in_reasoning"]),
        "mean_completion_tokens": float(r["completion_tokens"]) / n if n else None,
    }


def _operational(
    frame: pd.DataFrame,
    scope: np.ndarray,
    status: _Coded,
    is_ok: np.ndarray,
    is_len: np.ndarray,
    tokens_all: np.ndarray,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not scope.any():
        return [], []
    latency = frame["latency_s"].fillna(0.0).to_numpy(dtype=np.float64)
    cols = {
        "ok": is_ok[scope].astype(np.int64),
        "failed": status.eq(FAILED)[scope].astype(np.int64),
        "rejected": status.eq(REJECTED)[scope].astype(np.int64),
        "invalid": status.eq(INVALID)[scope].astype(np.int64),
        "truncated": is_len[scope].astype(np.int64),
        "latency_ok": np.where(is_ok, latency, 0.0)[scope],
        "tokens_ok": np.where(is_ok, tokens_all, 0)[scope],
    }
    chunk_codes, chunk_labels = pd.factorize(frame["chunk"].to_numpy(dtype=np.int64)[scope], sort=True)
    chunks = _group_table(chunk_codes, [int(c) for c in chunk_labels], cols)
    by_chunk = []
    for key, r in chunks.iterrows():
        ok = int(r["ok"])
        by_chunk.append(
            {
                "chunk": int(key),
                "rows": int(r["rows"]),
                "ok": ok,
                "failed": int(r["failed"]),
                "rejected": int(r["rejected"]),
                "invalid": int(r["invalid"]),
                "truncated": int(r["truncated"]),
                "truncation_rate": _rate(int(r["truncated"]), ok),
                "mean_latency_s": _rate(float(r["latency_ok"]), ok),
            }
        )

    srv = _Coded(frame["server"])
    server_labels = [label or "(none)" for label in srv.labels]
    servers = _group_table(srv.codes[scope], server_labels, cols)
    # Latency quantiles per server over ok rows only (failed rows carry no useful latency).
    ok_scope = is_ok & scope
    okf = pd.DataFrame({"server": np.asarray(server_labels, dtype=object)[srv.codes[ok_scope]],
                        "lat": latency[ok_scope]})
    lat_q = okf.groupby("server")["lat"].quantile([0.5, 0.9]).unstack() if len(okf) else pd.DataFrame()
    fleet_err = _rate(int(servers["failed"].sum() + servers["rejected"].sum()), int(servers["rows"].sum())) or 0.0
    fleet_ok = int(servers["ok"].sum())
    fleet_trunc = _rate(int(servers["truncated"].sum()), fleet_ok) or 0.0
    fleet_p50 = float(okf["lat"].median()) if len(okf) else 0.0
    by_server = []
    for key, r in servers.iterrows():
        n, ok = int(r["rows"]), int(r["ok"])
        errs = int(r["failed"] + r["rejected"])
        err_rate = errs / n if n else 0.0
        trunc_rate = _rate(int(r["truncated"]), ok)
        p50 = float(lat_q.loc[key, 0.5]) if key in lat_q.index else None
        p90 = float(lat_q.loc[key, 0.9]) if key in lat_q.index else None
        flags = []
        # A server is flagged only when it is clearly worse than the fleet, not on a handful of rows.
        if n >= 20 and err_rate > max(0.05, 3 * fleet_err):
            flags.append(f"error rate {err_rate:.1%} vs fleet {fleet_err:.1%}")
        if trunc_rate is not None and ok >= 50:
            se = math.sqrt(max(fleet_trunc * (1 - fleet_trunc), 1e-9) / ok)
            if trunc_rate > fleet_trunc + 4 * se and trunc_rate > 1.5 * fleet_trunc:
                flags.append(f"truncation {trunc_rate:.1%} vs fleet {fleet_trunc:.1%}")
        if p50 is not None and ok >= 20 and fleet_p50 > 0 and p50 > 2 * fleet_p50:
            flags.append(f"median latency {p50:.1f}s vs fleet {fleet_p50:.1f}s")
        by_server.append(
            {
                "server": str(key),
                "rows": n,
                "ok": ok,
                "errors": errs,
                "error_rate": err_rate,
                "truncated": int(r["truncated"]),
                "truncation_rate": trunc_rate,
                "latency_p50_s": p50,
                "latency_p90_s": p90,
                "tokens_per_s_per_request": _rate(float(r["tokens_ok"]), float(r["latency_ok"])),
                "flags": flags,
            }
        )
    return by_chunk, by_server


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
    cur = current_mask(frame) & _Coded(frame["status"]).eq(OK)
    is_length = _Coded(frame["finish_reason"]).eq("length")
    under_cap = frame["max_tokens"].to_numpy(dtype=np.int64) < max_tokens
    tokens = frame["completion_tokens"] if "completion_tokens" in frame.columns else pd.Series(0, index=frame.index)
    past_cap = tokens.fillna(0).to_numpy(dtype=np.int64) > max_tokens
    judged = cur & ~(is_length & under_cap)
    return int((judged & (is_length | past_cap)).sum()), int(judged.sum())


def censoring_arrays(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, censored) of current ok rows, for the censored length fit: a ``length`` row's natural length
    is only known to exceed its own cap, which may differ row to row after a cap change."""
    cur = current_mask(frame) & _Coded(frame["status"]).eq(OK)
    lengths = frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64)[cur]
    censored = _Coded(frame["finish_reason"]).eq("length")[cur]
    return lengths, censored
