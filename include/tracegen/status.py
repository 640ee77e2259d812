"""Progress of an output root (done, left, failed, truncated, rate, ETA, per-run history), computed from the
ledger so it cannot disagree with the data, as a separate progress file and done-index file can.

`python -m tracegen status OUTPUT_URI` prints it; `dataset_status()` returns it as a dict.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.figures import figures_from_ledger, figures_text
from tracegen.audit.pivot import pivot_summary, pivot_text
from tracegen.audit.token_account import account_lines, prefill_line, stopped_line, token_account
from tracegen.run import FINAL_REPORT, PILOT_REPORT, plan
from tracegen.run.run_record import GOING, latest_run, read_run_record, stage_of
from tracegen.run.run_spec import RunSpecError
from tracegen.store.current import current_mask
from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import FAILED, INVALID, OK, REJECTED
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.storage import StorageKeyError

RATE_WINDOW_S = 600.0  # rate and ETA from the last ten minutes of commits of the newest run
SPREAD_SLICES = 5  # the rate window in this many slices: the ETA's range runs from the fastest to the slowest
# What status and the progress view read of each ledger row: "done" (`plan`) and supersession, the counts and
# rates, the truncation figures, and the pivot's (`audit.pivot`, which `chunk` tells the tail measurement's
# rows from the pivot's); the server, for the progress view's timeline (`audit.timeline`); the prompt tokens
# found cached, for what prefill cost (`audit.token_account.prefill_account`).
STATUS_COLUMNS = ("index", "max_tokens", "prompt_tokens", "completion_tokens", "chunk", "prefix_tokens", "text_joined",
                  "status", "finish_reason", "run_id", "pivot", "part", "committed_at", "runaway_score", "while_asking",
                  "server", "cached_tokens")


def dataset_status(output_uri: str, aws_conn_id: str = "aws_default", now: float | None = None) -> dict[str, Any]:
    root = open_root(output_uri, aws_conn_id)
    # The ledger's rows with the columns status reads, strings as codes: bounded memory at any row count
    # (913,786 rows: 594 MiB as the whole frame).
    frame = ledger_rows(root, STATUS_COLUMNS)
    dataset = root.run_files.dataset() or {}
    record = latest_run(root, aws_conn_id)
    out: dict[str, Any] = {"output_uri": root.storage.uri, "dataset": dataset, "ledger_rows": len(frame)}
    if record is None:
        out["runs"] = []
        return out
    n_rows = record.dataset.n_rows
    cap, policy = record.config.max_tokens, record.config.truncated_policy
    # The cheap form of `verify` (sizes, from one listing of the parts): a part deleted or cut short since
    # its commit holds rows no export can write, so they are not done here (as after `verify --retire`).
    damage = root.repair.verify_parts(deep=False)
    usable = frame[~frame["part"].isin({d.part for d in damage})].reset_index(drop=True) if damage else frame
    done = plan.done_mask(usable, n_rows, cap, policy)
    cur = usable[current_mask(usable)] if len(usable) else usable
    status = cur["status"] if len(cur) else pd.Series(dtype=object)
    ok = cur[status == OK] if len(cur) else cur
    # A Categorical column counts its categories absent from these rows too, as zeros: they are not reasons.
    finish = ok["finish_reason"].value_counts().to_dict() if len(ok) else {}
    finish = {k: v for k, v in finish.items() if v}
    truncated = int(finish.get("length", 0))
    rate = _rate(frame, record.run_id, now or time.time())
    left = int((~done).sum())
    out.update(
        {
            "newest_run": record.run_id,
            "max_tokens": cap,
            "truncated_policy": policy,
            "total": n_rows,
            "done": int(done.sum()),
            "left": left,
            "completed": int(len(ok)),
            "failed": int((status == FAILED).sum()),
            "rejected": int((status == REJECTED).sum()),
            "invalid": int((status == INVALID).sum()),
            "truncated": truncated,
            "truncated_rate": truncated / len(ok) if len(ok) else None,
            # The two truncation figures under the names every page uses (`audit.figures`): {name: [count, of]}.
            "truncation_figures": {k: list(v) for k, v in figures_from_ledger(usable, cap).items()},
            "finish_reasons": {str(k): int(v) for k, v in finish.items()},
            "completion_tokens": int(ok["completion_tokens"].sum()) if len(ok) else 0,
            "prompt_tokens": int(ok["prompt_tokens"].sum()) if len(ok) else 0,
            "rows_per_s": rate,
            "eta_s": left / rate if rate else None,
            # Every run's pivots: the rows that replaced a row truncated under a lower cap, and their cost.
            "pivot": pivot_summary(usable),
            # Where every generated token went (`audit.token_account`).
            "token_account": token_account(usable),
            "runs": _history(root, frame),
            # Parts that no longer match their ledger entries: named, with the rows they hold (not done).
            "damaged": [{"part": d.part, "entry": d.entry, "rows": d.n_rows, "problem": d.problem} for d in damage],
            "damaged_rows": sum(d.n_rows or 0 for d in damage),
        }
    )
    return out


def run_progress(root: OutputRoot, record: Any, now: float | None = None,
                 frame: pd.DataFrame | None = None) -> dict[str, Any]:
    """One run's live progress from the ledger (the review pages' progress view, `status --watch`): rows done
    of the dataset at the run's cap and policy, this run's commit rate in rows and completion tokens per
    second over the last RATE_WINDOW_S, its truncation so far (rows cut at its cap among its completed rows,
    with the gate's 95% Wilson interval), the dataset's two truncation figures at its cap (`audit.figures`),
    and the ETA at the current rate, with its range at the window's slowest and fastest slice.
    `frame`: the ledger as `ledger_rows(root, STATUS_COLUMNS)` read it, when the caller has it already."""
    from tracegen.audit.gate import wilson_interval
    from tracegen.audit.timeline import judged_at_cap

    now = time.time() if now is None else now
    frame = ledger_rows(root, STATUS_COLUMNS) if frame is None else frame
    n_rows = record.dataset.n_rows
    cap, policy = record.config.max_tokens, record.config.truncated_policy
    done = int(plan.done_mask(frame, n_rows, cap, policy).sum()) if n_rows else 0
    mine = frame[(frame["run_id"] == record.run_id).to_numpy()] if len(frame) else frame
    judged, cut_mask = judged_at_cap(mine, cap) if len(mine) else (np.zeros(0, bool), np.zeros(0, bool))
    n_ok, cut = int(judged.sum()), int(cut_mask.sum())
    low, high = wilson_interval(cut, n_ok) if n_ok else (None, None)
    rows_s, tokens_s, spread = _recent_rates(mine, now, _generating_since(record, now))
    left = n_rows - done
    return {
        "run_id": record.run_id, "max_tokens": cap, "truncated_policy": policy, "total": n_rows, "done": done,
        "left": left, "generated_by_run": int(len(mine)), "completed_by_run": n_ok,
        "truncated": cut, "truncation_rate": cut / n_ok if n_ok else None,
        "truncation_low": low, "truncation_high": high, "threshold": record.config.truncation_threshold,
        "rows_per_s": rows_s, "tokens_per_s": tokens_s, "window_s": RATE_WINDOW_S,
        "eta_s": left / rows_s if rows_s and left else (0.0 if left == 0 else None),
        # [at the fastest slice, at the slowest] (None: the slowest committed nothing); None without slices.
        "eta_range_s": [left / spread[1], left / spread[0] if spread[0] else None] if spread and left else None,
        # From this frame: reading the ledger again for them would cost the page a second read.
        "truncation_figures": {k: list(v) for k, v in figures_from_ledger(frame, cap).items()},
    }


def _generating_since(record: Any, now: float) -> float:
    """Where the rate window starts: RATE_WINDOW_S ago, or at the run's last decision when it is more recent.
    Until a reviewer answers, the run's chunks wait; counting that wait as generating time would make the
    rate after the answer look slow and the ETA long."""
    since = now - RATE_WINDOW_S
    for decision in record.decisions:
        try:
            answered = pd.Timestamp(decision.responded_at)
        except (TypeError, ValueError, AttributeError):
            continue
        if answered.tzinfo is not None:
            since = max(since, answered.timestamp())
    return since


def _recent_rates(mine: pd.DataFrame, now: float, since: float
                  ) -> tuple[float | None, float | None, tuple[float, float] | None]:
    """(rows/s, completion tokens/s, (slowest, fastest) rows/s of the window's slices) committed by one run's
    rows since `since`: over the time from the window's first commit, or from `since` itself when a decision
    started the generation it measures. The slices need a whole window of generating behind them."""
    if not len(mine) or "committed_at" not in mine.columns:
        return None, None, None
    from tracegen.audit.timeline import commit_seconds

    seconds = commit_seconds(mine)
    recent = seconds >= since  # NaN compares False
    if not recent.any():
        return None, None, None
    start = since if since > now - RATE_WINDOW_S else float(np.nanmin(seconds[recent]))
    span = max(now - start, 1.0)
    tokens = float(mine["completion_tokens"].to_numpy()[recent].sum())
    spread = None
    if now - start >= RATE_WINDOW_S * (1 - 1 / SPREAD_SLICES):
        width = (now - start) / SPREAD_SLICES
        slices = np.minimum(((seconds[recent] - start) // width).astype(np.int64), SPREAD_SLICES - 1)
        per_s = np.bincount(slices, minlength=SPREAD_SLICES) / width
        spread = (float(per_s.min()), float(per_s.max()))
    return float(recent.sum()) / span, tokens / span, spread


def _rate(frame: pd.DataFrame, run_id: str, now: float) -> float | None:
    """Rows per second committed by `run_id` over the last RATE_WINDOW_S (None when it is not running)."""
    if not len(frame) or "committed_at" not in frame.columns:
        return None
    mine = frame[frame["run_id"] == run_id]
    stamps = pd.to_datetime(mine["committed_at"], utc=True, errors="coerce").dropna()
    if stamps.empty:
        return None
    # Through a Timedelta, not astype(int64): the datetime unit (ns or us) depends on how it was read.
    seconds = ((stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy()
    recent = seconds[seconds >= now - RATE_WINDOW_S]
    if recent.size == 0:
        return None
    span = max(now - recent.min(), 1.0)
    return float(np.count_nonzero(seconds >= now - RATE_WINDOW_S)) / span


def _history(root: OutputRoot, frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for run_id in root.run_files.runs():
        mine = frame[frame["run_id"] == run_id] if len(frame) else frame
        try:
            record = read_run_record(root, run_id)
            cap, created, stage = record.config.max_tokens, record.created_at, stage_of(root, record)
        except (StorageKeyError, RunSpecError):
            cap, created, stage = None, None, None
        ok = mine[mine["status"] == OK] if len(mine) else mine
        pivot = pivot_summary(mine) if len(mine) else {}
        rows.append(
            {
                "run_id": run_id,
                "created_at": created,
                "max_tokens": cap,
                "rows": int(len(mine)),
                "ok": int(len(ok)),
                "length": int((ok["finish_reason"] == "length").sum()) if len(ok) else 0,
                "failed": int((mine["status"] == FAILED).sum()) if len(mine) else 0,
                "extended": pivot.get("extended", 0),
                "regenerated": pivot.get("regenerated", 0) + pivot.get("fallback_regenerated", 0),
                "verdict": _verdict(root, run_id),
                "stage": stage,
            }
        )
    return sorted(rows, key=lambda r: r["created_at"] or 0)


def _verdict(root: OutputRoot, run_id: str) -> str | None:
    for name in (FINAL_REPORT, PILOT_REPORT):
        try:
            doc = json.loads(root.run_files.get(run_id, name))
        except StorageKeyError:
            continue
        return (doc.get("verdict") or {}).get("verdict")
    return None


DAMAGE_LISTED = 20  # damaged parts named one per line; `verify` lists them all


def _damage_lines(s: dict[str, Any]) -> list[str]:
    damaged = s.get("damaged") or []
    if not damaged:
        return []
    lines = [f"DAMAGED:     {len(damaged):,} committed parts no longer match their ledger entries: their "
             f"{s['damaged_rows']:,} rows are not counted as done and cannot be exported"]
    for d in damaged[:DAMAGE_LISTED]:
        rows = "?" if d["rows"] is None else f"{d['rows']:,}"
        lines.append(f"  {d['part']}: {d['problem']} ({rows} rows)")
    if len(damaged) > DAMAGE_LISTED:
        lines.append(f"  ... and {len(damaged) - DAMAGE_LISTED:,} more (`python -m tracegen verify` lists them all)")
    lines.append(f"  `python -m tracegen verify {s['output_uri']} --retire` makes them work again for the rerun")
    return lines


def format_status(s: dict[str, Any]) -> str:
    lines = [f"output root: {s['output_uri']}"]
    ds = s.get("dataset") or {}
    if ds:
        info = ds.get("info", {})
        lines.append(f"dataset:     {info.get('uri', '?')} ({info.get('rows', '?'):,} rows, {ds.get('fingerprint', '')[:19]})")
    if "newest_run" not in s:
        lines.append("no runs yet")
        return "\n".join(lines)
    pct = 100 * s["done"] / s["total"] if s["total"] else 100.0
    lines += [
        f"newest run:  {s['newest_run']} (max_tokens={s['max_tokens']}, truncated rows: {s['truncated_policy']})",
        f"done:        {s['done']:,} / {s['total']:,} ({pct:.1f}%), {s['left']:,} left",
        *_damage_lines(s),
        f"rows:        {s['completed']:,} completed, {s['failed']:,} failed, {s['rejected']:,} rejected, "
        f"{s['invalid']:,} invalid",
        "finish:      " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["finish_reasons"].items())),
        "truncated:   " + (figures_text({k: tuple(v) for k, v in s["truncation_figures"].items()})
                           if s["truncated_rate"] is not None else "-"),
        f"tokens:      {s['completion_tokens']:,} completion, {s['prompt_tokens']:,} prompt",
        "pivot:       " + (pivot_text(s["pivot"]) or "none (no row replaced one truncated under a lower cap)"),
        "generated:   " + "; ".join(f"{n:,} {what} ({share})" for what, n, share in account_lines(s["token_account"])),
        *(["loops:       " + line] if (line := stopped_line(s["token_account"])) else []),
        *(["prefill:     " + line] if (line := prefill_line(s["token_account"])) else []),
        "rate:        " + (f"{s['rows_per_s']:.2f} rows/s over the last {RATE_WINDOW_S / 60:.0f} min"
                           if s["rows_per_s"] else "idle (no commits in the last 10 min)"),
        "ETA:         " + (f"{s['eta_s'] / 3600:.1f} h" if s["eta_s"] else ("done" if s["left"] == 0 else "-")),
        "runs:",
    ]
    for r in s["runs"]:
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["created_at"])) if r["created_at"] else "?"
        lines.append(
            f"  {r['run_id']}  {created}  max_tokens={r['max_tokens']}  rows {r['rows']:,}  ok {r['ok']:,}  "
            f"length {r['length']:,}  failed {r['failed']:,}  "
            + (f"extended {r['extended']:,}  " if r["extended"] else "")
            + (f"regenerated {r['regenerated']:,}  " if r["regenerated"] else "")
            + f"verdict {r['verdict'] or '-'}"
            + (f"  ({r['stage']})" if r.get("stage") not in (None, GOING) else "")
        )
    return "\n".join(lines)
