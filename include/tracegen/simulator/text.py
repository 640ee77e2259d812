"""Deterministic pseudo-text for the stand-in: one word per token, cheap to produce.

Token i of a completion is word (offset + i) of a fixed shuffled vocabulary, the offset coming from
the sample key. Producing n tokens is one list slice and one join, so hundreds of concurrent 8K-token
completions cost little CPU on a 2-core box. No n-gram recurs within a window shorter than the
vocabulary (4096 words), so ordinary text shows no repetition to a detector looking at its tail; a
runaway sample instead repeats one phrase from its loop onset on, as a model stuck in a loop does.
"""

from __future__ import annotations

import random

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "su", "ta", "vi", "ro", "de", "pa", "qu", "fi", "zo", "ba", "xe", "gu",
    "the", "and", "ion", "ter", "con", "ing", "ver", "pro", "sta", "com", "tra", "res",
)  # fmt: skip


def _vocabulary(size: int = 4096) -> list[str]:
    rng = random.Random(20240607)  # fixed: the text must not change between releases of the stand-in
    words = []
    for _ in range(size):
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return words


_WORDS = _vocabulary()
# Doubled so any window of up to len(_WORDS) words is a single slice.
_RING = _WORDS + _WORDS


def words(digest: int, start: int, count: int, loop: tuple[int, int] | None = None) -> str:
    """`count` words of the completion seeded by `digest`, from token position `start`, space-joined.

    With `loop = (onset, period)`, positions from `onset` on repeat the `period` words that follow
    position `onset`, forever.
    """
    if count <= 0:
        return ""
    if loop is not None and start + count > loop[0]:
        onset, period = loop
        head = words(digest, start, onset - start) if start < onset else ""
        first = max(start, onset)
        phrase = _RING[(digest + onset) % len(_WORDS) :][:period]
        phase = (first - onset) % period
        need = start + count - first
        cycle = phrase * (need // period + 2)
        tail = " ".join(cycle[phase : phase + need])
        return f"{head} {tail}" if head else tail
    n = len(_WORDS)
    offset = (digest + start) % n
    if count <= n:
        return " ".join(_RING[offset : offset + count])
    full, rest = divmod(count, n)
    block = " ".join(_RING[offset : offset + n])
    parts = [block] * full
    if rest:
        parts.append(" ".join(_RING[offset : offset + rest]))
    return " ".join(parts)
