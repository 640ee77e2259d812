"""Planning: index chunks, the pilot sample, and what is left to do — pure functions over the ledger frame.

"Done" is derived from committed ledger rows only (DESIGN §3), for a run with cap C:
- `invalid`: done (the dataset row itself is broken; no cap helps);
- `rejected` under cap C' (context overflow): done when C >= C' (a bigger cap overflows too;
  a smaller one may fit, so it is tried again);
- `ok` with finish `stop`/`tool_calls`: done;
- `ok` with finish `length` under cap C': done when C' >= C, or when the run keeps truncated rows
  (`truncated_policy="keep"`); with "regenerate" it is generated again under C;
- `failed`: never done (retried by a later run).
Everything is vectorised (numpy): 1,000,000 indices plan in well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tracegen.store.records import FAILED, INVALID, OK, REJECTED

TRUNCATED_POLICIES = ("keep", "regenerate")
# Airflow's [core] max_map_length is 1024; stay well below it so reruns and the grid view stay sane.
MAX_MAPPED_CHUNKS = 1000

_NEEDED = ("index", "status", "finish_reason", "max_tokens")


@dataclass(frozen=True, slots=True)
class Chunk:
    """Indices [start, stop) of the dataset, handled by one mapped task."""

    index: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.index < 0 or self.start < 0 or self.stop <= self.start:
            raise ValueError(f"chunk {self.index}: need 0 <= start < stop, got [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def label(self) -> str:
        return f"chunk {self.index:04d} [{self.start}, {self.stop})"

    def indices(self) -> np.ndarray:
        return np.arange(self.start, self.stop, dtype=np.int64)


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def chunks(n_rows: int, chunk_size: int, *, stagger: int = 0, first_size: int | None = None) -> list[Chunk]:
    """The dataset cut into chunks of `chunk_size` rows, with a staggered start when `stagger` > 0.

    `stagger` is how many chunk tasks run at once. The run starts that many together (the first chunks,
    beside the pilot) and then, once the gate passes, that many more together. Tasks started together
    end together: they share every server's queue evenly, so they advance at one rate. Their tails (the
    long rows, after everything is sent) then coincide, and the whole fleet drains each time. So:
    - the first `stagger` chunks hold `first_size` rows (default `chunk_size`), sized by the caller to
      outlast the pilot, so they still feed the fleet while the gate audits;
    - the next `stagger` chunks hold 1/stagger, 2/stagger, ..., all of `chunk_size`, so they end a
      stagger'th of a chunk apart, as do the full chunks that follow them one for one;
    - the rest hold `chunk_size`.
    No chunk is larger than max(chunk_size, first_size).
    """
    n_rows = _check_int("n_rows", n_rows, 0)
    chunk_size = _check_int("chunk_size", chunk_size, 1)
    stagger = _check_int("stagger", stagger, 0)
    first_size = chunk_size if first_size is None else _check_int("first_size", first_size, 1)
    sizes = [first_size] * stagger + [math.ceil(chunk_size * (k + 1) / stagger) for k in range(stagger)]
    out: list[Chunk] = []
    start = 0
    while start < n_rows:
        size = sizes[len(out)] if len(out) < len(sizes) else chunk_size
        out.append(Chunk(len(out), start, min(start + size, n_rows)))
        start += size
    return out


def choose_chunk_size(n_rows: int, target: int, max_chunks: int = 512) -> int:
    """`target`, grown just enough that the dataset splits into at most `max_chunks` chunks."""
    n_rows = _check_int("n_rows", n_rows, 0)
    target = _check_int("target chunk size", target, 1)
    max_chunks = _check_int("max_chunks", max_chunks, 1)
    if max_chunks > MAX_MAPPED_CHUNKS:
        raise ValueError(f"max_chunks={max_chunks} is too close to Airflow's max_map_length (1024); use <= 1000")
    return max(target, math.ceil(n_rows / max_chunks)) if n_rows else target


def pilot_sample(n_rows: int, size: int, seed: int) -> list[int]:
    """A reproducible uniform sample of `size` distinct indices (all of them when size >= n_rows), sorted."""
    n_rows = _check_int("n_rows", n_rows, 0)
    size = _check_int("pilot size", size, 0)
    if size >= n_rows:
        return list(range(n_rows))
    picked = np.random.default_rng(seed).choice(n_rows, size=size, replace=False)
    return np.sort(picked).tolist()


def _check_frame(frame: pd.DataFrame, max_tokens: int, truncated_policy: str) -> None:
    missing = [c for c in _NEEDED if c not in frame.columns]
    if missing:
        raise ValueError(f"ledger frame lacks columns {missing}")
    _check_int("max_tokens", max_tokens, 1)
    if truncated_policy not in TRUNCATED_POLICIES:
        raise ValueError(f"truncated_policy {truncated_policy!r} must be one of {TRUNCATED_POLICIES}")


def done_rows(frame: pd.DataFrame, max_tokens: int, truncated_policy: str) -> np.ndarray:
    """Per ledger row: does this row make its index done for a run with cap `max_tokens`?"""
    _check_frame(frame, max_tokens, truncated_policy)
    status = frame["status"]
    finish = frame["finish_reason"]
    cap = frame["max_tokens"].to_numpy(np.int64)
    ok = (status == OK).to_numpy(bool)
    length = (finish == "length").to_numpy(bool)
    complete = ok & (finish.isin(("stop", "tool_calls"))).to_numpy(bool)
    truncated_done = ok & length & ((truncated_policy == "keep") | (cap >= max_tokens))
    rejected_done = (status == REJECTED).to_numpy(bool) & (cap <= max_tokens)
    invalid = (status == INVALID).to_numpy(bool)
    return complete | truncated_done | rejected_done | invalid


def done_mask(frame: pd.DataFrame, n_rows: int, max_tokens: int, truncated_policy: str) -> np.ndarray:
    """Boolean array over dataset indices [0, n_rows): True where a committed row makes it done."""
    n_rows = _check_int("n_rows", n_rows, 0)
    idx = frame["index"].to_numpy(np.int64) if "index" in frame.columns else np.empty(0, np.int64)
    done = done_rows(frame, max_tokens, truncated_policy)
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        bad = idx[(idx < 0) | (idx >= n_rows)][0]
        raise ValueError(f"ledger holds index {bad}, outside the dataset's {n_rows} rows: wrong dataset?")
    mask = np.zeros(n_rows, dtype=bool)
    mask[idx[done]] = True
    return mask


def remaining(
    frame: pd.DataFrame,
    indices: Chunk | range | Sequence[int] | np.ndarray,
    max_tokens: int,
    truncated_policy: str,
) -> np.ndarray:
    """The subset of `indices` (in their order) that still needs generating under cap `max_tokens`."""
    if isinstance(indices, Chunk):
        wanted = indices.indices()
    elif isinstance(indices, range):
        wanted = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    else:
        wanted = np.asarray(indices, dtype=np.int64)
    done_idx = frame["index"].to_numpy(np.int64)[done_rows(frame, max_tokens, truncated_policy)]
    if wanted.size == 0:
        return wanted
    # A dense mask over [lo, hi] is O(n) and several times faster than np.isin's sort for chunk-shaped input.
    lo, hi = int(wanted.min()), int(wanted.max())
    if lo < 0:
        raise ValueError(f"index {lo} is negative")
    mask = np.zeros(hi - lo + 1, dtype=bool)
    inside = done_idx[(done_idx >= lo) & (done_idx <= hi)]
    mask[inside - lo] = True
    return wanted[~mask[wanted - lo]]


def known_long(frame: pd.DataFrame, todo: np.ndarray) -> np.ndarray:
    """The indices of `todo` with a committed row cut off by a cap (`ok`, finish `length`): they are
    at least that long, so sending them first starts a chunk's stragglers early. Ascending order."""
    todo = np.asarray(todo, dtype=np.int64)
    if todo.size == 0 or len(frame) == 0:
        return np.empty(0, dtype=np.int64)
    truncated = ((frame["status"] == OK) & (frame["finish_reason"] == "length")).to_numpy(bool)
    long_idx = np.unique(frame["index"].to_numpy(np.int64)[truncated])
    return long_idx[np.isin(long_idx, todo)]


def remaining_per_chunk(mask: np.ndarray, plan: Iterable[Chunk]) -> np.ndarray:
    """Rows left in each chunk, from a `done_mask` — chunks with 0 left need no mapped task."""
    plan = list(plan)
    if not plan:
        return np.zeros(0, dtype=np.int64)
    left = np.concatenate(([0], np.cumsum(~mask, dtype=np.int64)))
    starts = np.fromiter((c.start for c in plan), np.int64, len(plan))
    stops = np.fromiter((c.stop for c in plan), np.int64, len(plan))
    if stops.max() > mask.size:
        raise ValueError(f"a chunk ends at {stops.max()}, beyond the mask's {mask.size} rows")
    return left[stops] - left[starts]


def best_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Per index, the row that supersedes the others; export and "current" audits use it.

    Order of preference: a non-failed row over a failed one; a complete row (ok, finish not `length`)
    over an incomplete one — a finished completion is what the drafter needs, even under a lower cap;
    then the higher cap (a row regenerated under 8192 beats its 4096 truncation); then the newest commit.
    One row per index, in the frame's order (sort by "index" if you need index order).
    """
    if frame.empty:
        return frame.copy()
    status = frame["status"]
    not_failed = (status != FAILED).to_numpy(bool)
    complete = ((status == OK) & frame["finish_reason"].isin(("stop", "tool_calls"))).to_numpy(bool)
    cap = frame["max_tokens"].to_numpy(np.int64)
    if "committed_at" in frame.columns:
        when = frame["committed_at"].to_numpy("datetime64[us]").astype(np.int64)
    else:
        when = np.zeros(len(frame), np.int64)
    idx = frame["index"].to_numpy(np.int64)
    # Pack the preferences into one int64 (caps fit in 32 bits) so the sort has three keys, not five.
    rank = (not_failed.astype(np.int64) << 34) | (complete.astype(np.int64) << 33) | np.clip(cap, 0, (1 << 32) - 1)
    order = np.lexsort((when, rank, idx))  # stable; last key is the primary one; ties keep frame order
    sorted_idx = idx[order]
    last_of_group = np.ones(len(order), dtype=bool)
    last_of_group[:-1] = sorted_idx[1:] != sorted_idx[:-1]
    # Taking rows in ascending position is several times faster than a scattered take on string columns.
    return frame.take(np.sort(order[last_of_group])).reset_index(drop=True)
