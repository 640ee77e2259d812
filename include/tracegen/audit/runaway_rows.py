"""Which truncated rows are runaways: their tail loops (`tracegen.audit.runaway`), so no cap finishes them.

Judged on the current truncated rows only (a row that finished is not a runaway whatever its text), read
from their parts: the ledger holds no token ids. A row is judged on its response token ids (what the server
generated: a real server's and the SGLang stand-in's alike are the tokenization of the text, and loop with
it); a row stored without token ids is judged on its text (`runaway.is_runaway_text`, one id per word).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.runaway import is_runaway, is_runaway_text, runaway_score, text_token_ids
from tracegen.store.current import current_mask
from tracegen.store.records import OK, GeneratedRow, unpack_token_ids
from tracegen.store.root import OutputRoot

TAIL_CHARS = 400  # of a runaway's text, shown as its example


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


def judge(row: GeneratedRow) -> Runaway | None:
    """The row as a runaway, or None: it finished, or its tail does not loop."""
    if row.status != OK or row.finish_reason != "length":
        return None
    text = row_text(row)
    if row.has_token_ids:
        ids = unpack_token_ids(row.response_token_ids)
        score = runaway_score(ids)
        if not is_runaway(ids):
            return None
    else:
        units = text_token_ids(text)
        score = runaway_score(units)
        if not is_runaway_text(text):
            return None
    return Runaway(row.index, row.max_tokens, "", round(score, 4), text[-TAIL_CHARS:])


def truncated_current(frame: pd.DataFrame) -> pd.DataFrame:
    """The current truncated rows of a ledger frame (index, max_tokens, part, run_id)."""
    if frame.empty:
        return frame.iloc[0:0]
    cur = current_mask(frame) & (frame["status"] == OK).to_numpy(bool) & \
        (frame["finish_reason"] == "length").to_numpy(bool)
    return frame.loc[cur]


def find_runaways(root: OutputRoot, frame: pd.DataFrame) -> dict[int, Runaway]:
    """The runaways among the current truncated rows of `frame`, by index; reads only their parts."""
    rows = truncated_current(frame)
    out: dict[int, Runaway] = {}
    for part, group in rows.groupby("part", sort=True):
        wanted = {(int(i), int(c)) for i, c in zip(group["index"], group["max_tokens"], strict=True)}
        for row in root.commits.read_part(str(part)):
            if (row.index, row.max_tokens) in wanted and (found := judge(row)) is not None:
                out[row.index] = Runaway(found.index, found.max_tokens, str(part), found.score, found.tail)
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
