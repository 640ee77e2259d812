"""Runaway detection after the fact: does a truncated row's output end in a loop?

A reasoning model sometimes falls into a loop: it repeats one phrase, sentence, paragraph or block until the cap
cuts it. Such a row is truncated at any cap, so the cap table counts it as a floor no cap removes
(`tracegen.audit.capfit`) instead of chasing it with a higher cap, and it is never continued.

The judge is the online loop stop's (`tracegen.audit.loop_stop`): the row's ids are fed to a `LoopWatch`, and
the row is a runaway when the watch would have stopped it at some judging point. One rule online and after the
fact, so a row the client let through at some cap is not called a runaway later, and one it would have stopped
is. Any period up to 8,192 ids; repetitive text that keeps bringing something new (listings, tables, data
files) is not a loop.

Which ids to pass: the row's response token ids, what the server generated. A row stored without token ids is
judged on its text instead (`is_runaway_text`): `text_token_ids` makes one id per word (or CJK character, or
other visible character), so the view needs no tokenizer and a loop's period in it is the loop's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from tracegen.audit.loop_stop import HISTORY, LOOP_JUDGE, LoopWatch

# A stored score at or above this says the row loops (`runaway_score`: the share of the loop's stretch that
# repeats at its period, 0.0 for a row that does not loop).
RUNAWAY_THRESHOLD = 0.5
# The ids the text view builds: as many as the judge keeps.
TAIL_WINDOW = HISTORY


def runaway_score(token_ids: Sequence[int] | np.ndarray) -> float:
    """The loop judge's score of the row's ids: the verdict's score (>= `RUNAWAY_THRESHOLD`) when they loop,
    0.0 when they do not."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    verdict = LoopWatch().feed(ids.tolist())
    return 0.0 if verdict is None else max(verdict.score, RUNAWAY_THRESHOLD)


def trusted_scores(frame: pd.DataFrame) -> np.ndarray:
    """Per ledger row: its stored `runaway_score` when this judge gave it, NaN otherwise (not judged, or judged
    by an earlier rule, whose scores called listings and data files loops: such a row is judged again)."""
    if "runaway_score" not in frame.columns:
        return np.full(len(frame), np.nan)
    scores = frame["runaway_score"].to_numpy(np.float64, na_value=np.nan)
    judges = frame["loop_judge"].to_numpy(np.int64) if "loop_judge" in frame.columns else np.zeros(len(frame), np.int64)
    return np.where(judges == LOOP_JUDGE, scores, np.nan)


def scored_runaway(frame: pd.DataFrame) -> np.ndarray:
    """Per ledger row: this judge's stored score says its tail loops (NaN, a row not judged or judged by an
    earlier rule, says no). The rule planning, the tail measurement and the pivot read, so that a runaway, which
    no cap finishes, is never continued; a row an earlier rule called one is continued, and the continuation's
    watch, given its ids, stops it at its first judging point if it loops."""
    return np.nan_to_num(trusted_scores(frame), nan=0.0) >= RUNAWAY_THRESHOLD


def is_runaway(token_ids: Sequence[int] | np.ndarray) -> bool:
    """True when `token_ids` end in a loop (the judge's score >= `RUNAWAY_THRESHOLD`). Meant for rows that hit
    their cap; a row that stopped by itself is not a runaway whatever its text."""
    return runaway_score(token_ids) >= RUNAWAY_THRESHOLD


# The text view's units: a word (letters, digits, underscores), one CJK character, or one other visible
# character; whitespace separates units and is not one.
_UNIT = re.compile(r"[^\W\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]+|\S")
_CHARS_PER_UNIT = 16  # generous: the tail of the text that surely holds the last `last` units
_MASK = (1 << 32) - 1  # the judge keeps ids as uint32


def text_token_ids(text: str, *, last: int | None = TAIL_WINDOW) -> np.ndarray:
    """The text view: ids of the text's words, one per word, CJK character or other visible character (a
    hash of it), whatever tokenizer produced the text. A loop repeats the same units, so the detector sees
    it in these ids as in a real tokenizer's; only the last `last` units are built (None: all of them)."""
    if not text:
        return np.zeros(0, dtype=np.int64)
    if last is not None:
        text = text[-last * _CHARS_PER_UNIT :]
    units = _UNIT.findall(text)
    if last is not None:
        units = units[-last:]
    # Python's string hash is salted per process: fine, the score depends only on which units are equal.
    return np.fromiter((hash(u) & _MASK for u in units), dtype=np.int64, count=len(units))


def is_runaway_text(text: str) -> bool:
    """`is_runaway` on the text view (`text_token_ids`): for rows without token ids."""
    return is_runaway(text_token_ids(text))
