"""Which rows an export writes: each index's current row (`store.current`), if it is OK and, unless asked
for, not truncated; runaways left out as the newest run's `runaway_policy` says. And the order they are
written in, a batch at a time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.runaway_rows import find_runaways
from tracegen.store.current import current_mask
from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import CUT, OK
from tracegen.store.root import OutputRoot

# What an export reads of each ledger row: supersession's columns (`current_mask`), the part and run a row is
# read back from, and the runaway score, so judging truncated rows for loops (include_truncated) reads only
# the parts of rows committed before the ledger kept the score (`find_runaways`), not every truncated row's.
EXPORT_COLUMNS = ("index", "status", "finish_reason", "max_tokens", "run_id", "part", "runaway_score", "loop_judge",
                  "committed_at")


@dataclass(frozen=True)
class Choice:
    """The rows an export writes, and what it leaves out and why."""

    best: pd.DataFrame  # the chosen ledger rows, one per index, in index order
    ledger_figures: dict[str, int]  # the whole ledger's, for the manifest
    policy: str  # the newest run's runaway_policy
    runaways: list[int]  # indices of truncated rows whose tail loops (judged only with include_truncated)
    left_out_truncated: int
    left_out_runaway: int


def choose_rows(root: OutputRoot, policy: str, include_truncated: bool) -> Choice:
    """Each index's current row, if it is OK and, unless asked for, not truncated; runaways left out as
    `policy` says. The ledger's frame is dropped on return: memory while writing follows a batch."""
    frame = ledger_rows(root, EXPORT_COLUMNS)
    # One mask over the ledger's rows, then one copy of the chosen rows in index order: memory holds the
    # ledger's columns and the chosen rows, never a chain of filtered copies.
    chosen = current_mask(frame) if len(frame) else np.zeros(0, dtype=bool)
    chosen &= (frame["status"] == OK).to_numpy(bool)
    # Rows stopped in a loop go with the truncated ones: no ending to train on, and runaways to the policy.
    truncated = chosen & frame["finish_reason"].isin(CUT).to_numpy(bool)
    left_out_truncated = 0 if include_truncated else int(truncated.sum())
    runaways: list[int] = []
    if include_truncated and truncated.any():
        # Truncated rows whose tail loops: no cap finishes them. Judged only when truncated rows are
        # exported (otherwise they are left out with the rest). 'keep' exports them; 'drop' does not, nor
        # 'resample' the ones whose fresh sample looped again.
        runaways = sorted(find_runaways(root, frame))
        if policy != "keep":
            chosen &= ~np.isin(frame["index"].to_numpy(np.int64), runaways)
    left_out_runaway = len(runaways) if policy != "keep" else 0
    if not include_truncated:
        chosen &= ~truncated
    positions = np.flatnonzero(chosen)
    index_col = frame["index"].to_numpy(np.int64)
    positions = positions[np.argsort(index_col[positions], kind="stable")]
    best = frame.take(positions).reset_index(drop=True)
    ledger_figures = {
        "superseded_ledger_rows": int(len(frame) - len(np.unique(index_col))) if len(frame) else 0,
        "ledger_rows_for_exported": int(np.isin(index_col, best["index"].to_numpy(np.int64)).sum()),
    }
    return Choice(best, ledger_figures, policy, runaways, left_out_truncated, left_out_runaway)


def batches(best: pd.DataFrame, shard_rows: int, by_part: bool) -> Iterator[pd.DataFrame]:
    """The chosen rows a batch at a time: `shard_rows` consecutive indices (a shard of the messages layout),
    or one part's rows (a trainer layout's file, streamed: memory follows a part, whatever the row count),
    parts in the order of their first index, so a chunk's rows come out in index order."""
    if not by_part:
        for start in range(0, len(best), shard_rows):
            yield best.iloc[start : start + shard_rows]
        return
    codes = best["part"].cat.codes.to_numpy() if isinstance(best["part"].dtype, pd.CategoricalDtype) else \
        pd.factorize(best["part"])[0]
    order = np.argsort(codes, kind="stable")  # best is in index order: each group stays so
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    groups = np.split(order, bounds) if len(order) else []
    groups.sort(key=lambda g: int(best["index"].iat[g[0]]))
    for g in groups:
        yield best.iloc[g]


def conversation_batches(best: pd.DataFrame, shard_rows: int, index: Any) -> Iterator[pd.DataFrame]:
    """Under `turns=chain`: batches of about `shard_rows` chosen rows, each ending where a conversation does
    (a conversation's turns are shaped together), in index order."""
    if not len(best):
        return
    convs = index.conversations(best["index"].to_numpy(np.int64))
    starts = np.flatnonzero(np.diff(convs)) + 1  # positions where a new conversation begins
    begin = 0
    while begin < len(best):
        k = int(np.searchsorted(starts, begin + shard_rows, side="left"))
        end = int(starts[k]) if k < len(starts) else len(best)
        yield best.iloc[begin:end]
        begin = end
