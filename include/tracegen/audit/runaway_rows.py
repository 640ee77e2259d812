"""Which truncated rows are runaways: their tail loops (`tracegen.audit.runaway`), so no cap finishes them.

Judged on the current truncated rows only (a row that finished is not a runaway whatever its text). A row is
judged on its response token ids (what the server generated: a real server's and the SGLang stand-in's alike
are the tokenization of the text, and loop with it); a row stored without token ids is judged on its text
(`runaway.is_runaway_text`, one id per word). The chunk engine judges each truncated row once, when it is
generated, and the ledger keeps its score (`runaway_score`); only rows committed before that column existed
are judged here from their parts, which the ledger does not hold, and a few runaways' parts are read for
the end of their text, shown as examples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.loop_stop import LOOP_JUDGE
from tracegen.audit.runaway import RUNAWAY_THRESHOLD, runaway_score, text_token_ids, trusted_scores
from tracegen.store.current import current_mask
from tracegen.store.records import CUT, LOOP, OK, GeneratedRow, unpack_token_ids
from tracegen.store.root import OutputRoot

TAIL_CHARS = 400  # of a runaway's text, shown as its example
TAILS = 3  # runaways whose text's end is read from their parts: the reports show that many examples


@dataclass(frozen=True, slots=True)
class Runaway:
    index: int
    max_tokens: int
    part: str
    score: float
    tail: str  # the end of its text, where the loop shows

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row_text(row: GeneratedRow) -> str:
    """The row's text in generation order: thinking, then the answer."""
    return (row.reasoning_content or "") + (row.content or "")


def score_of(row: GeneratedRow) -> float | None:
    """How much a truncated row's tail loops (`runaway.runaway_score`, on its token ids, or on its text's
    units without them); None for a row that finished, whose tail says nothing."""
    if row.status != OK or row.finish_reason not in CUT:
        return None
    if row.finish_reason == LOOP and row.runaway_score is not None:
        return row.runaway_score  # stopped while it generated: a runaway by its kind (`audit.loop_stop`)
    ids = unpack_token_ids(row.response_token_ids) if row.has_token_ids else text_token_ids(row_text(row))
    return round(runaway_score(ids), 4)


def judge(row: GeneratedRow) -> Runaway | None:
    """The row as a runaway, or None: it finished, or its tail does not loop."""
    trusted = row.runaway_score is not None and (row.loop_judge == LOOP_JUDGE or row.finish_reason == LOOP)
    score = row.runaway_score if trusted else score_of(row)
    if score is None or score < RUNAWAY_THRESHOLD:
        return None
    return Runaway(row.index, row.max_tokens, "", score, row_text(row)[-TAIL_CHARS:])


def truncated_current(frame: pd.DataFrame) -> pd.DataFrame:
    """The current rows of a ledger frame cut at their cap or stopped in a loop (index, max_tokens, part,
    run_id)."""
    if frame.empty:
        return frame.iloc[0:0]
    cur = current_mask(frame) & (frame["status"] == OK).to_numpy(bool) & \
        frame["finish_reason"].isin(CUT).to_numpy(bool)
    return frame.loc[cur]


def find_runaways(root: OutputRoot, frame: pd.DataFrame, *, tails: int = TAILS) -> dict[int, Runaway]:
    """The runaways among the current truncated rows of `frame`, by index, in index order. Rows the ledger
    scored are judged from their score; the parts of the rest are read (entries from before the score), and
    those of the first `tails` runaways for the end of their text (the others' `tail` is "")."""
    rows = truncated_current(frame)
    scores = trusted_scores(rows)
    # A row stopped while it looped is a runaway by its kind, whichever watch stopped it.
    stopped = (rows["finish_reason"] == LOOP).to_numpy(bool)
    if "runaway_score" in rows.columns:
        scores = np.where(stopped, rows["runaway_score"].to_numpy(np.float64, na_value=np.nan), scores)
    scored = ~np.isnan(scores)
    out: dict[int, Runaway] = {
        int(i): Runaway(int(i), int(c), str(p), float(s), "")
        for i, c, p, s in zip(rows["index"][scored], rows["max_tokens"][scored], rows["part"][scored], scores[scored],
                              strict=True) if s >= RUNAWAY_THRESHOLD}
    unscored = rows[~scored]
    for part, group in unscored.groupby("part", sort=True):
        out.update(_judged_in_part(root, str(part), group))
    out = dict(sorted(out.items()))
    shown = [r for r in out.values() if not r.tail][:tails]
    for part in sorted({r.part for r in shown}):
        wanted = [r for r in shown if r.part == part]
        out.update(_judged_in_part(root, part, frame.iloc[0:0], [(r.index, r.max_tokens) for r in wanted]))
    return out


def _judged_in_part(root: OutputRoot, part: str, group: pd.DataFrame,
                    wanted: list[tuple[int, int]] | None = None) -> dict[int, Runaway]:
    """The runaways among one part's rows in `group` (or the (index, cap) pairs `wanted`), read from it."""
    keys = set(wanted) if wanted is not None else {
        (int(i), int(c)) for i, c in zip(group["index"], group["max_tokens"], strict=True)}
    out: dict[int, Runaway] = {}
    for row in root.commits.read_part(part):
        if (row.index, row.max_tokens) in keys and (found := judge(row)) is not None:
            out[row.index] = Runaway(found.index, found.max_tokens, part, found.score, found.tail)
    return out


def runaway_counts(frame: pd.DataFrame, runaways: dict[int, Runaway]) -> dict[str, Any]:
    """How many current ok rows are runaways, by the cap that cut them, and their share: the truncation no
    cap removes."""
    ok = (current_mask(frame) & (frame["status"] == OK).to_numpy(bool)) if len(frame) else np.zeros(0, bool)
    n_ok = int(ok.sum())
    by_cap: dict[str, int] = {}
    for r in runaways.values():
        by_cap[str(r.max_tokens)] = by_cap.get(str(r.max_tokens), 0) + 1
    return {"rows": len(runaways), "ok_rows": n_ok, "share": len(runaways) / n_ok if n_ok else None,
            "by_cap": dict(sorted(by_cap.items(), key=lambda kv: int(kv[0])))}
