"""Supersession: which of an index's ledger rows is its *current* row, the one rule plan, audit, status
and export all read.

Several ledger rows may exist for one dataset index (failed attempts then a success; a row cut at 4096 and
its continuation at 8192; a runaway and its fresh sample). Per index the current row is, in order of
preference: a non-failed row over a failed one; a complete row (ok, finished by `stop` or `tool_calls`)
over an incomplete one, since a finished completion is what the drafter needs even under a lower cap; then
the higher cap (a row extended or regenerated under 8192 beats its 4096 truncation); then the newest
commit; then the later row in the frame. The other rows are superseded: kept in the ledger as history,
counted, never mixed in.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracegen.store.records import COMPLETE, FAILED, OK


def current_mask(frame: pd.DataFrame) -> np.ndarray:
    """Boolean mask selecting each index's current row. Vectorised over integer codes: a million ledger
    rows take well under a second (string columns are factorised once, never compared row by row)."""
    n = len(frame)
    if n == 0:
        return np.zeros(0, dtype=bool)
    index = frame["index"].to_numpy(dtype=np.int64)
    status = _codes_equal(frame["status"], (FAILED,))
    not_failed = (~status).astype(np.int8)
    complete = (_codes_equal(frame["status"], (OK,)) & _codes_equal(frame["finish_reason"], COMPLETE)).astype(np.int8)
    cap = frame["max_tokens"].to_numpy(dtype=np.int64)
    newest = commit_order(frame["committed_at"]) if "committed_at" in frame.columns else np.zeros(n, np.int64)
    # lexsort's last key is primary; the frame position breaks the remaining ties (later rows are newer).
    order = np.lexsort((np.arange(n), newest, cap, complete, not_failed, index))
    sorted_index = index[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = sorted_index[:-1] != sorted_index[1:]
    mask = np.zeros(n, dtype=bool)
    mask[order[last]] = True
    return mask


def current_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Each index's current row, in the frame's order (sort by "index" for index order)."""
    if frame.empty:
        return frame.copy()
    return frame.loc[current_mask(frame)].reset_index(drop=True)


def commit_order(col: pd.Series) -> np.ndarray:
    """Integer codes that sort like the commit times (ISO strings sort lexically; datetimes natively)."""
    if pd.api.types.is_datetime64_any_dtype(col):
        # Through the tz-naive UTC values: numpy has no tz-aware datetime and warns on the conversion.
        naive = col.dt.tz_convert("UTC").dt.tz_localize(None) if col.dt.tz is not None else col
        return naive.to_numpy().astype("datetime64[ns]").astype(np.int64)
    codes, _ = pd.factorize(col, sort=True)  # missing -> -1: sorts as oldest
    return codes


def _codes_equal(col: pd.Series, values: tuple[str, ...]) -> np.ndarray:
    codes, uniques = pd.factorize(col, use_na_sentinel=True)
    wanted = [i for i, u in enumerate(uniques) if u in values]
    return np.isin(codes, wanted)
