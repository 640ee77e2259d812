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

Cost: the window's repeated-n-gram count (the quantity `runaway_score` computes with numpy) is kept exactly
and incrementally, a few dict operations per token on packed n-gram keys, and judged every `judge_every`
tokens; the numpy checks run only once that count reaches the bar, which natural text does not. About half a
microsecond per token and 0.3 MB per watch (`bench/bench_loop_stop.py`, docs/benchmarks.md, "Online loop
stop"). Judging points are fixed response-token counts, so the verdict does not depend on how the stream is
chunked.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tracegen.audit.runaway import NGRAM, RUNAWAY_THRESHOLD, TAIL_WINDOW, runaway_score


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
# Bits per id in the packed n-gram key: room for any tokenizer's vocabulary (Qwen3's is 151,936 ids).
_ID_BITS = 24
_KEY_MASK = (1 << (_ID_BITS * NGRAM)) - 1


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
        self._prefix = len(prefix_ids)
        self._seen = 0  # response ids fed
        self._verdict: LoopVerdict | None = None
        # Compact on purpose: a client holds one watch per request in flight. ids[k] is the id at absolute
        # position base + k (prefix first); prev[k] is the absolute start of the previous occurrence, within
        # the window, of the n-gram starting at base + k (-1: none); succ[k] says a later n-gram names that
        # one as its previous occurrence. The last `history` positions are kept.
        self._base = 0
        self._ids = array("q")
        self._prev = array("q")
        self._succ = bytearray()
        # The window's n-grams (packed keys, oldest first) and each key's latest start in the window.
        self._keys: deque[int] = deque()
        self._last: dict[int, int] = {}
        self._key = 0  # the last NGRAM ids, packed
        self._grams = 0  # n-grams started so far (absolute)
        self._repeated = 0  # n-grams of the current window whose previous occurrence is in the window
        self._pending: list[int] = []
        self._absorb(_as_list(prefix_ids))

    @property
    def verdict(self) -> LoopVerdict | None:
        return self._verdict

    def feed(self, new_ids: Sequence[int]) -> LoopVerdict | None:
        """Take the next response ids; the verdict once the response loops (then on every later call), else None."""
        if self._verdict is not None:
            return self._verdict
        self._pending.extend(_as_list(new_ids))
        step = self.rule.judge_every
        # Judge at every multiple of judge_every the new ids reach, in order: the same points whatever the
        # chunking, so a stream fed one id at a time and all at once get the same verdict.
        while len(self._pending) >= step - self._seen % step:
            take = step - self._seen % step
            block, self._pending = self._pending[:take], self._pending[take:]
            self._absorb(block)
            self._seen += take
            self._verdict = self._judge()
            if self._verdict is not None:
                self._pending = []
                return self._verdict
        return None

    # -- incremental repeated-n-gram count ----------------------------------------------------------------
    def _absorb(self, block: list[int]) -> None:
        if block and (min(block) < 0 or max(block) >> _ID_BITS):
            raise ValueError(f"token ids must be within 0..{(1 << _ID_BITS) - 1}")
        ids, prev, succ, keys, last, base = self._ids, self._prev, self._succ, self._keys, self._last, self._base
        n, key, repeated = NGRAM, self._key, self._repeated
        in_window = TAIL_WINDOW - n + 1  # n-grams of a full window
        end = base + len(ids)  # ids seen so far (absolute)
        ids.extend(block)
        for x in block:
            # The last n ids packed into one int: an exact n-gram key, rolled on in O(1).
            key = ((key << _ID_BITS) | x) & _KEY_MASK
            end += 1
            g = end - n  # the n-gram this id completes starts here
            if g < 0:
                continue
            # The window is the last TAIL_WINDOW ids (runaway_score's ids[-window:]). As it slides by one, its
            # oldest n-gram leaves: it is no one's previous occurrence any more, and the n-gram counted
            # because of it stops counting.
            if len(keys) == in_window:
                old, old_key = g - in_window, keys.popleft()
                if last[old_key] == old:
                    del last[old_key]
                if succ[old - base]:
                    repeated -= 1
            p = last.get(key, -1)
            last[key] = g
            keys.append(key)
            prev.append(p)
            succ.append(0)
            if p >= 0:
                succ[p - base] = 1
                repeated += 1
        self._key, self._repeated = key, repeated
        self._grams = max(0, end - n + 1)
        self._trim()

    def _trim(self) -> None:
        keep = self.rule.history
        drop = len(self._ids) - keep
        if drop < TAIL_WINDOW // 2:  # trim in steps: amortized O(1) per id
            return
        self._base += drop
        del self._ids[:drop], self._prev[:drop], self._succ[:drop]

    # -- judging --------------------------------------------------------------------------------------
    def _judge(self) -> LoopVerdict | None:
        if self._repeated < REPEATED_NEEDED:
            return None
        tail = np.frombuffer(self._ids[-TAIL_WINDOW:], dtype=np.int64)
        score = runaway_score(tail)
        if score < RUNAWAY_THRESHOLD:
            return None
        period = self._period()
        span = NGRAM + min(period, self.rule.span_cap)
        if repeated_share(tail, span) < self.rule.span_share * score:
            return None
        onset = self._onset(period)
        if self._base + len(self._ids) - onset < self.rule.min_copies * period:
            return None
        return LoopVerdict(at_token=self._seen, onset=onset - self._prefix, period=period, score=score)

    def _window_grams(self) -> tuple[np.ndarray, np.ndarray]:
        """(start positions, previous-occurrence positions) of the current window's n-grams."""
        end = self._base + len(self._ids)
        first = max(end - TAIL_WINDOW, self._base)
        pos = np.arange(first, self._grams, dtype=np.int64)
        prev = np.frombuffer(self._prev[first - self._base : self._grams - self._base], dtype=np.int64)
        return pos, prev

    def _period(self) -> int:
        pos, prev = self._window_grams()
        inside = prev >= pos[0]
        return int(np.bincount(pos[inside] - prev[inside]).argmax())

    def _onset(self, period: int) -> int:
        """Absolute position where the loop began: scanning back from the end, the first run of `_ONSET_GAP`
        n-grams none of which repeats one within a window before it ends the text before the loop; the next
        n-gram starts the loop's first repetition, one period after its onset."""
        recurs = np.frombuffer(self._prev[: self._grams - self._base], dtype=np.int64) >= 0
        fresh = np.flatnonzero(~recurs)
        start = self._base
        if fresh.size:
            # fresh positions followed by _ONSET_GAP - 1 more fresh ones in a row: a gap of text before the loop
            runs = np.flatnonzero(fresh[_ONSET_GAP - 1 :] - fresh[: fresh.size - _ONSET_GAP + 1] == _ONSET_GAP - 1)
            if runs.size:
                start = self._base + int(fresh[runs[-1] + _ONSET_GAP - 1]) + 1
        return max(self._base, start - period)


def _as_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    # Python ints: numpy ones would wrap in the packed key's shifts.
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


# Odd 64-bit constants of the polynomial hash behind `repeated_share` (any odd base is invertible mod 2**64,
# which lets a prefix-sum give every n-gram's hash in O(1) whatever n).
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def repeated_share(token_ids: Sequence[int] | np.ndarray, n: int) -> float:
    """Share (0..1) of the n-grams of `token_ids` that repeat an earlier one, for any n (`runaway_score`
    fixes n at most 8; the whole-period check needs n-grams a period long)."""
    ids = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    m = ids.size - n + 1
    if n < 1 or m < 2:
        return 0.0
    x = (ids + np.uint64(1)) * _MIX
    x ^= x >> np.uint64(31)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(ids.size, _BASE, dtype=np.uint64)) * _BASE_INV  # BASE**j
        inverse = np.cumprod(np.full(m, _BASE_INV, dtype=np.uint64)) * _BASE  # BASE**-j
        prefix = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(x * powers, dtype=np.uint64)])
        keys = (prefix[n:] - prefix[:m]) * inverse
    return float((m - np.unique(keys).size) / m)
