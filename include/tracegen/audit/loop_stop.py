"""The online loop stop: judge a response's token ids while they stream, and say when it has fallen into a loop.

The after-the-fact rule (`tracegen.audit.runaway`) judges a truncated row's last `TAIL_WINDOW` ids: it is a
runaway when at least `RUNAWAY_THRESHOLD` of the window's `NGRAM`-grams repeat an earlier one. A `LoopWatch`
applies that same score to the running tail while the row is generated, so the client can abort the request
instead of paying for the loop until the cap. It fires only where the after-the-fact rule would call the tail a
runaway (the verdict's `score` is `runaway_score` of the tail, at or above the threshold), and is stricter in
three ways, all there so that legitimate repetition in agentic output survives:

- **A full window's worth of repetition.** The after-the-fact rule judges a short tail on its own length, so
  300 ids that hold a snippet written three times score 0.6. Online every response starts short, so the watch
  asks for as many repeated n-grams as a full window needs (`RUNAWAY_THRESHOLD * (TAIL_WINDOW - NGRAM + 1)`)
  whatever the tail's length: a loop then fires `period + 1,024` tokens or so after its onset, early or late.
  Two copies of a block (a file written out again, a test run twice) do not reach that, unless the block is
  about 1,000 tokens long and repeats a few n-grams of its own (see the third check).
- **Repetition in whole periods.** A table of near-identical rows, or a list of similar calls, repeats most of
  its 8-grams too, but every row has a cell of its own (a name, a path, a number), so no stretch longer than a
  row recurs. A loop repeats whole periods, near-variants of a word included (they come from a small set, so
  their stretches recur as well). The share of the tail's `NGRAM + min(period, span_cap)`-grams that repeat
  must be at least `span_share` times the 8-gram score.
- **A loop that goes on.** The repetition must reach the end of the tail and span `min_copies` periods from
  its estimated onset: a long block written out twice, back to back, is not a loop of its length.

Cost: a watch keeps the last `history` ids (a uint64 array, about 35 KB) and judges the tail at fixed
response-token counts (every `judge_every`), so the verdict does not depend on how the stream is chunked. Most
judging points are skipped outright: none comes before the tail can hold `REPEATED_NEEDED` repeated n-grams, and
the count rises by one a token at most, so after a tail that repeats c n-grams no point fires for
`REPEATED_NEEDED - c` tokens, about a thousand in natural text; ids fed meanwhile are only appended to a list. A
judged tail gets a cheap upper bound of that count first (its n-grams in 65,536 buckets), `runaway_score` only
when the bound reaches the bar, and the period, whole-period and onset checks only when the score does. Under
0.1 µs a token fed in chunks of 8 or more (`bench/bench_loop_stop.py`; docs/benchmarks.md, "Online loop stop").
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tracegen.audit.runaway import MIN_TOKENS, NGRAM, RUNAWAY_THRESHOLD, TAIL_WINDOW, runaway_score


@dataclass(frozen=True, slots=True)
class LoopRule:
    """The online rule's knobs; `DEFAULT_RULE` is the one the client uses."""

    # Tokens between judgements: bounds the extra tokens a loop runs past the point where it could be seen,
    # and the numpy work (only ever done at a judging point).
    judge_every: int = 64
    # The longer n-grams of the whole-period check are NGRAM + min(period, span_cap) long: longer than a
    # row or record (so its own cell breaks every one: a table row, a call, a JSON record of 20 fields whose
    # id differs), short enough that a long loop's near-variants leave enough of them intact. At 64, records
    # of 150-600 tokens pass for loops; at 512, near loops of 600-800 tokens are stopped late or not at all.
    span_cap: int = 256
    # Share of those longer n-grams that must repeat, as a share of the 8-gram score.
    span_share: float = 0.5
    # Copies of the period the loop must have run to, from its onset to the end of the tail. Two copies of a
    # block of about 1,000 tokens with a few internal repeats (a long test run written out twice) repeat
    # enough n-grams to pass for a loop of that period; a loop goes on.
    min_copies: float = 2.5
    # Ids kept for the onset estimate: a loop fires about 1,024 + period tokens after its onset, so two
    # windows hold its first copy.
    history: int = 2 * TAIL_WINDOW

    def __post_init__(self) -> None:
        if self.judge_every < 1:
            raise ValueError(f"judge_every must be >= 1, got {self.judge_every!r}")
        if self.min_copies < 0:
            raise ValueError(f"min_copies must be >= 0, got {self.min_copies!r}")
        if self.span_cap < 1 or not 0.0 <= self.span_share <= 1.0:
            raise ValueError(f"span_cap must be >= 1 and span_share in [0, 1], got {self.span_cap!r}, {self.span_share!r}")
        if self.history < TAIL_WINDOW:
            raise ValueError(f"history must be >= TAIL_WINDOW = {TAIL_WINDOW}, got {self.history!r}")


DEFAULT_RULE = LoopRule()

# Repeated n-grams a window must hold, whatever the tail's length: the after-the-fact bar on a full window.
REPEATED_NEEDED = math.ceil(RUNAWAY_THRESHOLD * (TAIL_WINDOW - NGRAM + 1))
# Scanning back for a loop's start: a near-variant breaks at most NGRAM + its own length - 1 consecutive
# n-grams; a longer run of fresh n-grams is text from before the loop.
_ONSET_GAP = 4 * NGRAM
# Judging points skipped after a tail whose repetition is plainly in fragments (a quarter of the cost there;
# a loop right after such a stretch is stopped at most this many points later).
_FRAGMENTS_BACKOFF = 4
_BUCKET_BITS = 16  # the cheap bound's buckets: 2,041 n-grams in 65,536 buckets collide about 32 times


@dataclass(frozen=True, slots=True)
class LoopVerdict:
    at_token: int  # response ids seen when the watch fired (a multiple of the rule's judge_every)
    onset: int  # estimated response token where the loop began (negative: inside the prefix)
    period: int  # the loop's period in tokens (the commonest distance between repeated n-grams)
    score: float  # runaway_score of the tail when it fired (>= RUNAWAY_THRESHOLD)


class LoopWatch:
    """Watches one response's ids as they stream (`feed`); returns a `LoopVerdict` once the response loops.

    `prefix_ids` are the ids generated before this request (a continuation's earlier output): they fill the
    window first, so a loop that began before the continuation is seen at its first judging point."""

    def __init__(self, prefix_ids: Sequence[int] = (), *, rule: LoopRule = DEFAULT_RULE) -> None:
        self.rule = rule
        # The last ids, prefix first, at least `history` of them, as one uint64 array (compact: a client holds
        # one watch per request in flight); ids fed since the last judging point wait in a list, which takes
        # a few ids far more cheaply than an array does. _base is the absolute position of _ids[0].
        self._ids = np.zeros(0, dtype=np.uint64)
        self._pending: list[int] = []
        self._base = 0
        self._fed = 0  # response ids fed
        self._verdict: LoopVerdict | None = None
        self._take(prefix_ids.tolist() if isinstance(prefix_ids, np.ndarray) else list(prefix_ids))
        self._prefix = self._ids.size
        self._trim()
        # The next judging point (response ids) that can fire. A tail repeats fewer n-grams than it has, so none
        # fires before the prefix and the response hold REPEATED_NEEDED + NGRAM ids: a third of a natural row's
        # judgements were of tails too short to.
        step = rule.judge_every
        self._next = max(1, -(-(REPEATED_NEEDED + NGRAM - self._prefix) // step)) * step

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
        self._take(self._pending)
        self._pending = []
        # Judging points are multiples of judge_every, judged in order on the ids up to them: the same points
        # whatever the chunking, so a stream fed one id at a time and all at once get the same verdict.
        while self._next <= self._fed:
            self._verdict = self._judge(self._next)
            if self._verdict is not None:
                return self._verdict
        self._trim()
        return None

    def _trim(self) -> None:
        drop = self._ids.size - self.rule.history
        if drop > 0:
            self._ids = self._ids[drop:].copy()
            self._base += drop

    def _take(self, ids: list[int]) -> None:
        # Through an unsigned C array: a fifth of np.array's time on a list of ints, and it refuses negatives.
        try:
            new = np.frombuffer(array("Q", ids), dtype=np.uint64)
        except OverflowError:
            raise ValueError("token ids must be non-negative 64-bit integers") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
        self._ids = np.concatenate([self._ids, new])

    # -- judging --------------------------------------------------------------------------------------
    def _judge(self, at: int) -> LoopVerdict | None:
        """The verdict at judging point `at` (response ids); sets the next judging point worth judging."""
        step = self.rule.judge_every
        end = self._ids.size - (self._fed - at)  # index in _ids just after the judged ids
        tail = self._ids[max(0, end - TAIL_WINDOW) : end]
        # A cheap bound first: n-grams of the tail spread over 2**16 buckets; the occupied buckets are at most
        # its distinct n-grams, so m - occupied bounds the repeated count from above (by a few dozen).
        keys = gram_keys(tail, NGRAM)
        occupied = np.zeros(1 << _BUCKET_BITS, dtype=bool)
        occupied[(keys >> np.uint64(64 - _BUCKET_BITS)).astype(np.intp)] = True
        repeated = keys.size - int(np.count_nonzero(occupied))
        if repeated >= REPEATED_NEEDED:
            score = runaway_score(tail)
            repeated = round(score * keys.size)  # runaway_score is the repeated share of the tail's n-grams
        if repeated < REPEATED_NEEDED:
            # One more id adds one n-gram and drops at most one: the count rises by one a token at most, so
            # no judging point fires before the bar is that many ids away. Natural text repeats a few dozen
            # n-grams a window, so the tail is judged about once every thousand tokens.
            ahead = REPEATED_NEEDED - repeated if tail.size >= MIN_TOKENS else 1
            self._next = at + max(1, -(-ahead // step)) * step
            return None
        self._next = at + step
        # The period: the commonest distance from a tail n-gram back to its previous occurrence in the tail.
        prev = _previous_occurrences(keys)
        inside = prev >= 0
        period = int(np.bincount(np.flatnonzero(inside) - prev[inside]).argmax())
        whole = repeated_share(tail, NGRAM + min(period, self.rule.span_cap)) / score
        if whole < self.rule.span_share:
            if whole < self.rule.span_share / 2:
                # Plainly fragments between fresh cells (a table, records, similar calls): it stays so for a
                # while, and judging it at every point is what costs (about a millisecond each).
                self._next = at + _FRAGMENTS_BACKOFF * step
            return None
        history = self._ids[max(0, end - self.rule.history) : end]
        start = self._base + end - history.size  # absolute position of history[0]
        onset = start + _loop_start(_previous_occurrences(gram_keys(history, NGRAM)), period) - period
        if self._base + end - onset < self.rule.min_copies * period:
            return None
        return LoopVerdict(at_token=at, onset=max(start, onset) - self._prefix, period=period, score=score)


def _previous_occurrences(keys: np.ndarray) -> np.ndarray:
    """For every n-gram (its key), the index of its previous occurrence, or -1."""
    order = np.argsort(keys, kind="stable")  # equal keys stay in position order
    prev = np.full(keys.size, -1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _loop_start(prev: np.ndarray, period: int) -> int:
    """Where the loop's first repetition starts. An n-gram of the loop repeats one a whole number of periods
    before it, within a window (a near-variant's n-grams the last time that variant came; give or take the
    tokens variants add or drop, an eighth of a period). Scanning back from the end, the first run of
    `_ONSET_GAP` n-grams none of which does so ends the text before the loop, repetition of another kind
    included (a table's rows); the next n-gram starts the loop's first repetition, one period after its onset."""
    slack = period // 8
    distance = np.arange(prev.size) - prev
    phase = distance % period
    in_step = (prev >= 0) & (distance <= TAIL_WINDOW) & ((phase <= slack) | (period - phase <= slack))
    fresh = np.flatnonzero(~in_step)
    if fresh.size < _ONSET_GAP:
        return 0
    runs = np.flatnonzero(fresh[_ONSET_GAP - 1 :] - fresh[: fresh.size - _ONSET_GAP + 1] == _ONSET_GAP - 1)
    return int(fresh[runs[-1] + _ONSET_GAP - 1]) + 1 if runs.size else 0


# Odd 64-bit constants of the polynomial hash behind `gram_keys` (any odd base is invertible mod 2**64, which
# lets a prefix sum give every n-gram's hash in O(1) whatever n).
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def gram_keys(token_ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """A 64-bit key for every n-gram of `token_ids`, for any n (`runaway_score`'s hash stops at 8): a
    polynomial hash through a prefix sum, O(len) whatever n."""
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
        size = max(size, 2 * TAIL_WINDOW)
        _POWERS = (np.cumprod(np.full(size, _BASE, dtype=np.uint64)) * _BASE_INV,
                   np.cumprod(np.full(size, _BASE_INV, dtype=np.uint64)) * _BASE)
    return _POWERS


def repeated_share(token_ids: Sequence[int] | np.ndarray, n: int) -> float:
    """Share (0..1) of the n-grams of `token_ids` that repeat an earlier one: `runaway_score`'s quantity for
    any n (the whole-period check needs n-grams a period long)."""
    keys = gram_keys(token_ids, n)
    if keys.size < 2:
        return 0.0
    return float((keys.size - np.unique(keys).size) / keys.size)
