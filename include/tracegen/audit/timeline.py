"""A run over its time, from the ledger alone: what its commits say, bin by bin, from its first commit to now.

Every ledger row carries the time its part was committed, its server, its finish reason and its tokens, so the
run's history needs no other record: rows and completion tokens per second, the running truncation at the run's
cap with its 95% interval (the gate's figure and rule, `gate.wilson_interval`), the rows stopped in a loop, and
each server's rows per second (a server that stalls or is quarantined commits nothing: its row goes blank).

Vectorised over the frame's arrays (one pass of `bincount`s): a 913,786-row ledger costs tens of milliseconds.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.gate import wilson_interval
from tracegen.store.records import LOOP, OK

BINS = 60  # points on each chart: enough to see a drift, few enough to hover one
# What the timeline reads of each ledger row.
TIMELINE_COLUMNS = ("committed_at", "status", "finish_reason", "max_tokens", "completion_tokens", "server")


def commit_seconds(frame: pd.DataFrame) -> np.ndarray:
    """Each row's commit time in epoch seconds (NaN where unknown)."""
    # Through a Timedelta, not astype(int64): the datetime unit (ns or us) depends on how it was read.
    stamps = pd.to_datetime(frame["committed_at"], utc=True, errors="coerce")
    return ((stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(dtype=np.float64)


def judged_at_cap(frame: pd.DataFrame, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(completed at the cap, cut at it) as masks over a run's rows: the run's own truncation, as the
    progress view and the gate read it."""
    ok = ((frame["status"] == OK).to_numpy() & (frame["max_tokens"].to_numpy() == cap))
    return ok, ok & (frame["finish_reason"] == "length").to_numpy()


def run_timeline(frame: pd.DataFrame, run_id: str, cap: int, now: float | None = None,
                 bins: int = BINS) -> dict[str, Any]:
    """The run's rows of `frame` in at most `bins` equal bins of commit time, from its first commit to `now`
    (or its last commit). Rates are per second of each bin; the truncation is the running figure at each
    bin's end. Servers are those that committed rows, by their URL (rows without a server left out)."""
    mine = (frame["run_id"] == run_id).to_numpy() if len(frame) else np.zeros(0, bool)
    rows = frame.loc[mine, list(TIMELINE_COLUMNS)]
    seconds = commit_seconds(rows) if len(rows) else np.zeros(0)
    known = ~np.isnan(seconds)
    if not known.any():
        return {"start": None, "width_s": None, "bins": 0}
    seconds, rows = seconds[known], rows[known] if not known.all() else rows
    t0 = float(seconds.min())
    t1 = max(float(seconds.max()), now if now is not None else -math.inf)
    # No more bins than commits: a run's first minutes, a few parts each, would read as a comb of empty bins.
    bins = max(1, min(bins, int(np.unique(seconds).size)))
    width = max((t1 - t0) / bins, 1.0)
    n = max(1, min(bins, math.ceil((t1 - t0) / width)))
    at = np.minimum(((seconds - t0) // width).astype(np.int64), n - 1)

    ok_all = (rows["status"] == OK).to_numpy()
    tokens = np.where(ok_all, rows["completion_tokens"].to_numpy(dtype=np.float64), 0.0)
    judged, cut = judged_at_cap(rows, cap)
    cum_judged = np.cumsum(np.bincount(at, weights=judged, minlength=n)).astype(np.int64)
    cum_cut = np.cumsum(np.bincount(at, weights=cut, minlength=n)).astype(np.int64)
    truncation, low, high = [], [], []
    for k, of in zip(cum_cut.tolist(), cum_judged.tolist(), strict=True):
        lo, hi = wilson_interval(k, of) if of else (None, None)
        truncation.append(k / of if of else None)
        low.append(lo)
        high.append(hi)
    loops = (rows["finish_reason"] == LOOP).to_numpy()

    codes, names = pd.factorize(rows["server"], sort=True)  # a missing server: code -1, left out
    has = codes >= 0
    per_server = np.bincount(codes[has] * n + at[has], minlength=len(names) * n).reshape(len(names), n)
    servers = [(str(name), (per_server[i] / width).round(4).tolist()) for i, name in enumerate(names) if name]
    return {
        "start": t0, "width_s": width, "bins": n,
        "rows_per_s": (np.bincount(at, minlength=n) / width).round(4).tolist(),
        "tokens_per_s": (np.bincount(at, weights=tokens, minlength=n) / width).round(2).tolist(),
        "truncation": truncation, "truncation_low": low, "truncation_high": high,
        "judged": cum_judged.tolist(),
        "loops_stopped": np.bincount(at, weights=loops, minlength=n).astype(np.int64).tolist(),
        "servers": servers,
    }
