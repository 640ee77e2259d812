"""The loop judge: does a response's token ids end in a loop? One rule, applied while a row streams (`LoopWatch`)
and after the fact to a row cut at its cap (`tracegen.audit.runaway.is_runaway`, which replays the watch over
the row's ids), so the two can never disagree.

**The rule.** The response loops at period p when the last `p + MARGIN` n-grams (`NGRAM` ids each) are copies:

- **nothing new lately**: at most `NOVEL_RECENT` of the last `RECENT` n-grams are novel (never seen before in the
  history the watch keeps, `HISTORY` ids);
- **a period**: at least half of the stretch's n-grams (four in five once p is 32 or more) occurred within
  p (+ a sixteenth) ids before, and at most `MISALIGNED` of them occurred only at a distance that is no
  multiple of p (a near-variant word recurs a whole number of periods back);
- **no fresh cells**: at most `NOVEL_PER_COPY` novel n-grams per period's worth of the stretch. A table, a
  listing or records of one shape repeat most of their n-grams, but each row brings a name, a path, a number
  of its own (a token never seen brings `NGRAM` novel n-grams); a loop brings nothing new, and a loop's
  near-variants (a word swapped for one of a few others) stop being new once each has come once;
- **more than two copies**: the stretch is a period plus `MARGIN` long, so a block written out twice (a file
  given again, a test run repeated) is not a loop: the stretch reaches back into the first copy, whose
  n-grams are new.

p is tried from the distances between the last `RECENT` n-grams and their previous occurrences (the
commonest `CANDIDATES` of them, smallest first), any from 1 to `MAX_PERIOD` ids. A loop is therefore stopped
once it has run two periods plus `MARGIN` + `NGRAM` ids past its onset, plus up to one judging step: within
two periods + 512 ids. Near loops whose variants keep coming for the first time wait until they stop being
new. Measured on real text (`tracegen.simulator.real_text`) and the stand-in's set (`loop_cases`):
docs/benchmarks.md, "Online loop stop".

**Cost.** A watch keeps the last `HISTORY` ids (uint32) and the sorted keys of their n-grams; ids fed between
judging points (every `judge_every` response ids) wait in a list. At a judging point the new n-grams are looked
up in the sorted keys (novel or not) and merged in; only when the recent n-grams are nearly all seen before
does the full rule run (a sort of the history's n-grams, about a millisecond at the full history). A judging
point whose recent novelty could not fall to the bar by the next one is skipped: novelty falls by one n-gram
per id at most. The verdict depends only on the ids, never on how the stream was chunked.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# This judge's version, kept with every score it gives (the ledger's `loop_judge`): a score an earlier rule gave
# is judged again (`audit.runaway_rows`), never trusted, and planning does not take it for a runaway.
LOOP_JUDGE = 1
NGRAM = 8
# The longest period judged: a block of some 150 lines of code or data.
MAX_PERIOD = 8_192
# Ids past two whole periods a loop must run before it is judged one: the third copy's first stretch. More than
# any copy's novelty bound, so the stretch of a block written just twice always holds its first copy's new n-grams.
MARGIN = 384
RECENT = 256
NOVEL_RECENT = 12
NOVEL_PER_COPY = 4
NOVEL_SHARE = 0.05
MISALIGNED = 0.05
WITHIN_SHORT, WITHIN_LONG, LONG_FROM = 0.5, 0.8, 32
CANDIDATES = 8
# Ids a watch keeps: two of the longest periods, the margin, and a judging step.
HISTORY = 2 * MAX_PERIOD + MARGIN + NGRAM + 256
_ONSET_GAP = 4 * NGRAM


@dataclass(frozen=True, slots=True)
class LoopRule:
    """The judge's knobs that are not its definition; `DEFAULT_RULE` is the one the client and the audit use."""

    # Response ids between judgements: a loop runs up to this many ids past the point it could be seen.
    judge_every: int = 64
    # The longest period judged (ids); the history kept is sized from it.
    max_period: int = MAX_PERIOD

    def __post_init__(self) -> None:
        if self.judge_every < 1:
            raise ValueError(f"judge_every must be >= 1, got {self.judge_every!r}")
        if not 1 <= self.max_period <= MAX_PERIOD:
            raise ValueError(f"max_period must be within 1..{MAX_PERIOD}, got {self.max_period!r}")

    @property
    def history(self) -> int:
        return 2 * self.max_period + MARGIN + NGRAM + max(256, self.judge_every)


DEFAULT_RULE = LoopRule()


@dataclass(frozen=True, slots=True)
class LoopVerdict:
    at_token: int  # response ids seen when the watch fired (a multiple of the rule's judge_every)
    onset: int  # estimated response token where the loop began (negative: inside the prefix)
    period: int  # the loop's period in ids
    score: float  # share of the stretch's n-grams that repeat at the period (>= WITHIN_SHORT)


def judge(ids: np.ndarray, *, max_period: int = MAX_PERIOD) -> tuple[int, float, int] | None:
    """The rule at the end of `ids` (the history: at most `HISTORY` ids): (period, score, onset index in
    `ids`) when they end in a loop, else None."""
    keys = gram_keys(ids, NGRAM)
    m = keys.size
    if m < 2 * NGRAM:
        return None
    prev = _previous_occurrences(keys)
    recent = prev[-RECENT:]
    if int(np.count_nonzero(recent < 0)) > NOVEL_RECENT:
        return None
    distance = (np.arange(m - recent.size, m) - recent)[recent >= 0]
    distance = distance[distance <= max_period]
    if distance.size == 0:
        return None
    values, counts = np.unique(distance, return_counts=True)
    for period in np.sort(values[np.argsort(-counts, kind="stable")[:CANDIDATES]]).tolist():
        verdict = _loops_at(prev, int(period))
        if verdict is not None:
            score, onset = verdict
            return int(period), score, onset
    return None


def _loops_at(prev: np.ndarray, p: int) -> tuple[float, int] | None:
    """(score, onset) when the n-grams whose previous occurrences are `prev` end in a loop of period `p`."""
    m = prev.size
    stretch = p + MARGIN
    if m < stretch + p:
        return None
    seen = prev[m - stretch :] >= 0
    distance = np.arange(m - stretch, m) - prev[m - stretch :]
    slack = max(2, p // 16)
    within = seen & (distance <= p + slack)
    phase = distance % p
    aligned = seen & (within | (phase <= slack) | (p - phase <= slack))
    if np.count_nonzero(within) < (WITHIN_LONG if p >= LONG_FROM else WITHIN_SHORT) * stretch:
        return None
    if np.count_nonzero(seen & ~aligned) > MISALIGNED * stretch:
        return None
    novel = stretch - int(np.count_nonzero(seen))
    if novel > NOVEL_SHARE * stretch or novel > NOVEL_PER_COPY * stretch / p:
        return None
    return float(np.count_nonzero(aligned) / stretch), _loop_start(prev, p) - p


def _loop_start(prev: np.ndarray, period: int) -> int:
    """Where the loop's first repetition starts: scanning back from the end, the first run of `_ONSET_GAP`
    n-grams none of which recurs about a whole number of periods back ends the text before the loop."""
    slack = max(2, period // 16)
    distance = np.arange(prev.size) - prev
    phase = distance % period
    # A loop's n-gram recurs a copy or two back (a near-variant's, where that variant last came); one of its block
    # that only recurs from far back was text from before the loop that the loop happened to repeat.
    in_step = (prev >= 0) & (distance <= 3 * period + slack) & ((phase <= slack) | (period - phase <= slack))
    fresh = np.flatnonzero(~in_step)
    if fresh.size < _ONSET_GAP:
        return 0
    runs = np.flatnonzero(fresh[_ONSET_GAP - 1 :] - fresh[: fresh.size - _ONSET_GAP + 1] == _ONSET_GAP - 1)
    return int(fresh[runs[-1] + _ONSET_GAP - 1]) + 1 if runs.size else 0


class LoopWatch:
    """Watches one response's ids as they stream (`feed`); returns a `LoopVerdict` once the response loops.

    `prefix_ids` are the ids generated before this request (a continuation's earlier output): they fill the
    history first, so a loop that began before the continuation is seen at its first judging point."""

    def __init__(self, prefix_ids: Sequence[int] = (), *, rule: LoopRule = DEFAULT_RULE) -> None:
        self.rule = rule
        self._ids = np.zeros(0, dtype=np.uint32)  # the history: the last ids, prefix first
        self._keys = np.zeros(0, dtype=np.uint64)  # sorted n-gram keys of the history (ids judged so far)
        self._novel = np.zeros(0, dtype=bool)  # the last RECENT n-grams: novel when taken in
        self._pending: list[int] = []
        self._fed = 0  # response ids fed
        self._verdict: LoopVerdict | None = None
        prefix = prefix_ids.tolist() if isinstance(prefix_ids, np.ndarray) else list(prefix_ids)
        self._prefix = len(prefix)
        self._take(prefix)
        self._next = rule.judge_every  # the next judging point (response ids) worth judging

    @property
    def verdict(self) -> LoopVerdict | None:
        return self._verdict

    def feed(self, new_ids: Sequence[int]) -> LoopVerdict | None:
        """Take the next response ids; the verdict once the response loops (then on every later call), else None."""
        if self._verdict is not None:
            return self._verdict
        if isinstance(new_ids, np.ndarray):
            new_ids = new_ids.tolist()  # Python ints, whatever the array's dtype
        self._pending.extend(new_ids)
        self._fed += len(new_ids)
        if self._next > self._fed:  # most calls: a few ids, no judging point reached
            return None
        # Judging points are multiples of judge_every, judged in order on the ids up to them: the same points
        # whatever the chunking, so a stream fed one id at a time and all at once get the same verdict.
        step = self.rule.judge_every
        while self._next <= self._fed:
            at = self._next
            upto = len(self._pending) - (self._fed - at)
            self._take(self._pending[:upto])
            del self._pending[:upto]
            novel = int(np.count_nonzero(self._novel))
            if novel > NOVEL_RECENT:
                # Novelty among the recent n-grams falls by one per id at most: no point fires before it can.
                self._next = at + max(1, -(-(novel - NOVEL_RECENT) // step)) * step
                continue
            self._next = at + step
            found = judge(self._ids, max_period=self.rule.max_period)
            if found is not None:
                period, score, onset = found
                start = self._prefix + at - self._ids.size  # absolute index of _ids[0]
                self._verdict = LoopVerdict(at_token=at, onset=start + onset - self._prefix, period=period,
                                            score=round(score, 4))
                return self._verdict
        return None

    def _take(self, ids: list[int]) -> None:
        """Append `ids` to the history: their n-grams looked up in the history's sorted keys (novel or not),
        then merged in; the history cut back to `rule.history` ids when it has grown a quarter past it."""
        if not ids:
            return
        try:
            # array("I") refuses what is not an integer in 0..2**32-1 in C, without a pass over the ids in Python.
            new = np.frombuffer(array("I", ids), dtype=np.uint32)
        except OverflowError:
            raise ValueError("token ids must be integers in 0..2**32-1") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
        joined = np.concatenate([self._ids[-(NGRAM - 1):], new]) if self._ids.size else new
        keys = gram_keys(joined, NGRAM)
        if keys.size:
            found = np.searchsorted(self._keys, keys)
            inside = found < self._keys.size
            known = np.zeros(keys.size, dtype=bool)
            known[inside] = self._keys[found[inside]] == keys[inside]
            order = np.argsort(keys, kind="stable")  # equal keys in position order: the first one leads
            ranked = keys[order]
            repeated_here = np.zeros(keys.size, dtype=bool)
            repeated_here[order[1:][ranked[1:] == ranked[:-1]]] = True
            novel = ~known & ~repeated_here
            self._novel = np.concatenate([self._novel, novel])[-RECENT:]
            self._keys = np.insert(self._keys, found[order], ranked)  # equal insertion points in sorted order
        self._ids = np.concatenate([self._ids, new])
        history = self.rule.history
        if self._ids.size > history + history // 4:
            self._ids = self._ids[-history:].copy()
            self._keys = np.sort(gram_keys(self._ids, NGRAM))


def _previous_occurrences(keys: np.ndarray) -> np.ndarray:
    """For every n-gram (its key), the index of its previous occurrence, or -1."""
    order = np.argsort(keys, kind="stable")  # equal keys stay in position order
    prev = np.full(keys.size, -1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


# Odd 64-bit constants of the polynomial hash behind `gram_keys` (any odd base is invertible mod 2**64, which
# lets a prefix sum give every n-gram's hash in O(1) whatever n).
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def gram_keys(token_ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """A 64-bit key for every n-gram of `token_ids`: a polynomial hash through a prefix sum, O(len) whatever n."""
    ids = np.asarray(token_ids)
    ids = ids.astype(np.uint64, copy=False) if ids.dtype.kind in "iu" else np.asarray(token_ids, dtype=np.uint64)
    m = ids.size - n + 1
    if n < 1 or m < 1:
        return np.zeros(0, dtype=np.uint64)
    x = (ids + np.uint64(1)) * _MIX
    x ^= x >> np.uint64(31)
    powers, inverse = _powers(ids.size)
    prefix = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(x * powers[: ids.size], dtype=np.uint64)])
    return (prefix[n:] - prefix[:m]) * inverse[:m]


_POWERS = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64))


def _powers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """BASE**j and BASE**-j for j < at least `size`: computed once for the longest sequence hashed so far (a
    watch hashes its tail at every judging point; the two products were half of that work)."""
    global _POWERS
    if _POWERS[0].size < size:
        size = max(size, HISTORY + HISTORY // 4 + NGRAM)
        _POWERS = (np.cumprod(np.full(size, _BASE, dtype=np.uint64)) * _BASE_INV,
                   np.cumprod(np.full(size, _BASE_INV, dtype=np.uint64)) * _BASE)
    return _POWERS
