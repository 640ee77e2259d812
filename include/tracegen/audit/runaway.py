"""Runaway detection: does a truncated row's tail repeat itself?

A reasoning model sometimes falls into a loop: it repeats one phrase, sentence or paragraph until the cap cuts
it. Such a row is truncated at any cap, so the cap table counts it as a floor no cap removes
(`tracegen.audit.capfit`) instead of chasing it with a higher cap.

The test is cheap and local: take the last `TAIL_WINDOW` token ids, hash every `NGRAM`-gram, and measure the
share of those n-grams that already occurred earlier in the window (`runaway_score`). A loop of period p
repeats every n-gram after its first period, so it scores about 1 - p / TAIL_WINDOW; natural text, even
repetitive reasoning, re-uses few 8-token sequences. One pass over at most 2,048 ids with numpy: tens of
microseconds a row, whatever the row's length.

Which ids to pass: the row's response token ids, what the server generated (a real server's, and the SGLang
stand-in's, which are a byte-level BPE tokenization of its text and loop when its text loops). A row stored
without token ids is judged on its text instead (`is_runaway_text`): `text_token_ids` makes one id per word
(or CJK character, or other visible character), so the view needs no tokenizer and a loop's period in it is
the loop's own, not one misaligned by a fixed character grid.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

# Ids examined at the end of the row. A loop shows in the window only if it repeats there at least twice, so
# the window bounds the longest loop period detected: about TAIL_WINDOW * (1 - RUNAWAY_THRESHOLD) = 1,024
# tokens, a long paragraph. The stand-in's loops are 8-63 tokens or more (a phrase of its text); a real model's
# are a sentence to a paragraph.
TAIL_WINDOW = 2048
# n-gram length: an 8-token sequence recurring in natural text is rare (a shared identifier or a stock phrase
# now and then); a loop repeats all of them.
NGRAM = 8
# Share of the window's n-grams that must repeat an earlier one. 0.5 = at least two copies of the loop in
# the window; natural text, the stand-in's too, stays far below (see docs/benchmarks.md, "Cap from
# measurements", for the false positive and negative rates measured on the stand-in).
RUNAWAY_THRESHOLD = 0.5
# Fewer ids than this say nothing about a loop: score 0.
MIN_TOKENS = 4 * NGRAM

# Odd 64-bit multipliers for the n-gram hash (fixed: the score is a pure function of the ids).
_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                  0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                 dtype=np.uint64)


def runaway_score(token_ids: Sequence[int] | np.ndarray, *, window: int = TAIL_WINDOW, ngram: int = NGRAM) -> float:
    """Share (0..1) of the tail's n-grams that repeat an earlier n-gram of the tail (the last `window` ids)."""
    if ngram < 1 or ngram > len(_MULT):
        raise ValueError(f"ngram must be within 1..{len(_MULT)}, got {ngram!r}")
    if window < 2 * ngram:
        raise ValueError(f"window must be at least 2 * ngram = {2 * ngram}, got {window!r}")
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    ids = ids[-window:]
    if ids.size < max(MIN_TOKENS, 2 * ngram):
        return 0.0
    ids = ids.astype(np.uint64, copy=False)
    m = ids.size - ngram + 1
    # Multiply-and-add hash of each n-gram; uint64 arithmetic wraps, which is what a hash wants.
    h = np.zeros(m, dtype=np.uint64)
    for k in range(ngram):
        h += (ids[k : k + m] + np.uint64(1)) * _MULT[k]
        h ^= h >> np.uint64(29)
    distinct = np.unique(h).size
    return float((m - distinct) / m)


def scored_runaway(scores: np.ndarray | pd.Series) -> np.ndarray:
    """Per ledger row: its stored `runaway_score` says its tail loops (NaN, a row not judged, says no). The
    rule planning, the tail measurement and the pivot read, so that a runaway, which no cap finishes, is
    never continued."""
    return np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0) >= RUNAWAY_THRESHOLD


def is_runaway(token_ids: Sequence[int] | np.ndarray) -> bool:
    """True when the tail of `token_ids` loops (`runaway_score` >= `RUNAWAY_THRESHOLD`). Meant for rows that
    hit their cap; a row that stopped by itself is not a runaway whatever its text."""
    return runaway_score(token_ids) >= RUNAWAY_THRESHOLD


# The text view's units: a word (letters, digits, underscores), one CJK character, or one other visible
# character; whitespace separates units and is not one.
_UNIT = re.compile(r"[^\W\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]+|\S")
_CHARS_PER_UNIT = 16  # generous: the tail of the text that surely holds the last `last` units
_MASK = (1 << 63) - 1


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
