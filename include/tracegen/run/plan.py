"""Planning: index chunks, the pilot sample, and what is left to do — pure functions over the ledger frame.

"Done" is derived from committed ledger rows only (docs/architecture.md, "Data invariants"), for a run with cap C:
- `invalid`: done (the dataset row itself is broken; no cap helps);
- `rejected` under cap C' (context overflow): done when C >= C' (a bigger cap overflows too;
  a smaller one may fit, so it is tried again);
- `ok` with finish `stop`/`tool_calls`: done;
- `ok` with finish `length` under cap C': done when C' >= C, or when the run keeps truncated rows
  (`truncated_policy="keep"`); with "extend" it is continued from its token prefix up to C, with
  "regenerate" it is generated again from scratch under C (either way it is not done);
- `failed`: never done (retried by a later run).
Everything is vectorised (numpy): 1,000,000 indices plan in well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tracegen.audit.runaway import scored_runaway
from tracegen.store.records import CHAIN_COMPLETE, COMPLETE, INVALID, LOOP, OK, PLAN_COLUMNS, REJECTED

if TYPE_CHECKING:
    from tracegen.config import RunConfig

# Airflow's [core] max_map_length is 1024; stay well below it so reruns and the grid view stay sane.
MAX_MAPPED_CHUNKS = 1000



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


def _check_frame(frame: pd.DataFrame) -> None:
    """The frame's shape; cap and policy come from a validated `RunConfig` and are not checked again."""
    missing = [c for c in PLAN_COLUMNS if c not in frame.columns and c not in ("runaway_score", "loop_judge")]
    if missing:
        raise ValueError(f"ledger frame lacks columns {missing}")


def scored_runaways(frame: pd.DataFrame) -> np.ndarray:
    """Per ledger row: a runaway, by its kind (finish `loop`: stopped while it looped) or, truncated at its
    cap, by the score the ledger keeps (a frame without the column has only the former). Such a row is never
    continued: its loop would run to any cap."""
    if len(frame) == 0:
        return np.zeros(0, dtype=bool)
    ok = (frame["status"] == OK).to_numpy(bool)
    stopped = ok & (frame["finish_reason"] == LOOP).to_numpy(bool)  # stopped in its loop: a runaway by its kind
    return stopped | (ok & (frame["finish_reason"] == "length").to_numpy(bool) & scored_runaway(frame))


def runaways(frame: pd.DataFrame) -> np.ndarray:
    """Per ledger row: a runaway that still stands for its index, one no other ok row of the index at its cap
    or above replaces (runaway_policy=resample's fresh sample does: that row then decides for the index)."""
    scored = scored_runaways(frame)
    if not scored.any():
        return scored
    idx, cap = frame["index"].to_numpy(np.int64), frame["max_tokens"].to_numpy(np.int64)
    alive = (frame["status"] == OK).to_numpy(bool) & ~scored & np.isin(idx, idx[scored])
    if alive.any():
        best = pd.Series(cap[alive]).groupby(idx[alive]).max()
        replaced = np.nan_to_num(best.reindex(idx[scored]).to_numpy(np.float64), nan=-1.0) >= cap[scored]
        scored = scored.copy()
        scored[np.flatnonzero(scored)[replaced]] = False
    return scored


# The one finish a later turn of a conversation can follow under turns=chain: a tool call's answer would need
# the call's result.
def chain_complete(frame: pd.DataFrame) -> np.ndarray:
    """Per ledger row: one a later turn can follow under `turns=chain` (`ok`, finish `stop`, not a standing
    runaway)."""
    if len(frame) == 0:
        return np.zeros(0, dtype=bool)
    ok = (frame["status"] == OK).to_numpy(bool) & (frame["finish_reason"] == CHAIN_COMPLETE).to_numpy(bool)
    return ok & ~runaways(frame)


def held_turns(frame: pd.DataFrame, n_rows: int, turn_starts: np.ndarray, max_tokens: int,
               truncated_policy: str) -> np.ndarray:
    """Boolean array over prompt rows [0, n_rows): under `turns=chain`, the turns no chunk can generate at this
    cap and policy, as an earlier turn of their conversation is done without being complete (truncated and
    kept, a runaway, invalid, rejected): `generate.chain` holds them, so they are not work for a chunk. A
    raised cap that makes that turn work again, or its fresh sample (runaway_policy=resample), frees them."""
    n_rows = _check_int("n_rows", n_rows, 0)
    idx = frame["index"].to_numpy(np.int64) if "index" in frame.columns else np.empty(0, np.int64)
    stuck = np.zeros(n_rows, dtype=bool)
    stuck[idx[done_rows(frame, max_tokens, truncated_policy)]] = True
    complete = np.zeros(n_rows, dtype=bool)
    complete[idx[chain_complete(frame)]] = True
    stuck &= ~complete
    # Stuck turns counted up to each row, and up to the start of its conversation: a row is held when its
    # conversation has a stuck turn before it.
    before = np.concatenate(([0], np.cumsum(stuck, dtype=np.int64)))  # before[i]: stuck among rows [0, i)
    conv = np.searchsorted(np.asarray(turn_starts, dtype=np.int64), np.arange(n_rows), side="right") - 1
    start = np.asarray(turn_starts, dtype=np.int64)[conv]
    return before[:-1] - before[start] > 0


def done_rows(frame: pd.DataFrame, max_tokens: int, truncated_policy: str) -> np.ndarray:
    """Per ledger row: does this row make its index done for a run with cap `max_tokens`?"""
    _check_frame(frame)
    status = frame["status"]
    finish = frame["finish_reason"]
    cap = frame["max_tokens"].to_numpy(np.int64)
    ok = (status == OK).to_numpy(bool)
    length = (finish == "length").to_numpy(bool)
    complete = ok & (finish.isin(COMPLETE)).to_numpy(bool)
    # A runaway loops until any cap cuts it: it is done at every cap, never continued or generated again
    # by a raised one (runaway_policy=resample gives it its one fresh sample, `generate.resample`).
    runaway = runaways(frame)
    truncated_done = ok & length & ((truncated_policy == "keep") | (cap >= max_tokens))
    rejected_done = (status == REJECTED).to_numpy(bool) & (cap <= max_tokens)
    invalid = (status == INVALID).to_numpy(bool)
    return complete | truncated_done | runaway | rejected_done | invalid


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


def superseded_rows(frame: pd.DataFrame, todo: np.ndarray, max_tokens: int) -> pd.DataFrame:
    """For each index of `todo` with a committed row truncated under a cap below `max_tokens`, the row a
    new one replaces: the one cut at the highest cap (after 4096 -> 8192 -> 16384, the 8192 cut, which
    already holds the 4096 one's tokens). Columns index, max_tokens, part; ascending index.

    Under one cap an index has at most one non-failed row (the ledger invariant), so the cap identifies it,
    but for a runaway row and its fresh sample (runaway_policy=resample): the newer one is the current row,
    told by its segment's name, which starts with its time (`store.spool`).
    """
    todo = np.asarray(todo, dtype=np.int64)
    columns = ["index", "max_tokens", "part"]
    if todo.size == 0 or len(frame) == 0:
        return pd.DataFrame({"index": np.empty(0, np.int64), "max_tokens": np.empty(0, np.int64),
                             "part": pd.Series(dtype="str")})
    cap = frame["max_tokens"].to_numpy(np.int64)
    truncated = ((frame["status"] == OK) & (frame["finish_reason"] == "length")).to_numpy(bool) & (cap < max_tokens)
    truncated &= ~scored_runaways(frame)  # never continued
    rows = frame.loc[truncated & np.isin(frame["index"].to_numpy(np.int64), todo), columns]
    segment = rows["part"].astype(str).str.rsplit("/", n=1).str[-1].str.split("-", n=1).str[-1]
    rows = (rows.assign(_segment=segment).sort_values(["index", "max_tokens", "_segment"], kind="stable")
            .drop_duplicates("index", keep="last").drop(columns="_segment"))
    return rows.astype({"index": np.int64, "max_tokens": np.int64}).reset_index(drop=True)


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


# ---- a run's chunk layout and the work it hands to mapped tasks -------------------------------------

# Rows per chunk when the param leaves it to us: at least this, at least `FLEET_BATCHES_PER_CHUNK` of the
# fleet's batches, and grown for large datasets so the mapped task count stays under MAX_MAPPED_CHUNKS.
TARGET_CHUNK_ROWS = 500
# Chunks started a stagger'th of a chunk apart only keep the fleet fed through each other's tails when
# that stagger outlasts a tail: the longest rows take about three times the mean, so a chunk is four
# fleet batches (its task holds 1/stagger of the fleet's slots for 4 x stagger rounds of rows).
FLEET_BATCHES_PER_CHUNK = 4


@dataclass(frozen=True)
class ChunkWork:
    """One mapped generation task's slice: chunk number and the half-open row range [start, stop)."""

    chunk: int
    start: int
    stop: int
    remaining: int

    @property
    def label(self) -> str:
        return f"chunk {self.chunk:04d} (rows {self.start:,}–{self.stop - 1:,})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ChunkWork:
        return cls(int(doc["chunk"]), int(doc["start"]), int(doc["stop"]), int(doc["remaining"]))


@dataclass(frozen=True)
class ChunkLayout:
    """How a run cuts the dataset into chunks (`chunks`). Part of the run's record, so the scheduled
    rerun of a run's unfinished chunks finds the very chunks the run had.

    Under `turns=chain` a conversation's turns are generated in order, each after the one before is
    committed, so they must be in one chunk (and in one pilot); under `each` they share their history's
    prefix, which one chunk's routing keeps on one server. `stops` holds each chunk's end, moved forward to
    the next conversation's first turn (`whole_conversations`), and under `chain` `pilot` the pilot's whole
    conversations as [start, stop) prompt-row ranges. Both are fixed when the run is prepared, from the
    index's turn table, so no later task needs the table to find them; at most MAX_MAPPED_CHUNKS stops."""

    size: int
    stagger: int = 0  # chunk tasks the run had in flight at once; 0: every chunk `size` rows
    first_size: int | None = None  # rows of each of the first `stagger` chunks (those beside the pilot)
    stops: tuple[int, ...] | None = None  # each chunk's end; None: cut by size alone
    pilot: tuple[tuple[int, int], ...] | None = None  # the pilot's conversations; None: `pilot_sample`'s rows

    def chunks(self, n_rows: int) -> list[Chunk]:
        if self.stops is None:
            return chunks(n_rows, self.size, stagger=self.stagger, first_size=self.first_size)
        if not self.stops or self.stops[-1] != n_rows:
            raise ValueError(f"the run's chunk ends {list(self.stops[-1:])} do not end at its {n_rows} rows")
        starts = (0, *self.stops[:-1])
        return [Chunk(k, a, b) for k, (a, b) in enumerate(zip(starts, self.stops, strict=True))]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"chunk_size": self.size, "chunk_stagger": self.stagger,
                               "first_chunk_size": self.first_size}
        if self.stops is not None:
            doc["chunk_stops"] = list(self.stops)
        if self.pilot is not None:
            doc["pilot_conversations"] = [list(r) for r in self.pilot]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ChunkLayout:
        first = doc.get("first_chunk_size")
        stops, pilot = doc.get("chunk_stops"), doc.get("pilot_conversations")
        return cls(int(doc["chunk_size"]), int(doc.get("chunk_stagger") or 0), None if first is None else int(first),
                   None if stops is None else tuple(int(s) for s in stops),
                   None if pilot is None else tuple((int(a), int(b)) for a, b in pilot))


def whole_conversations(layout: ChunkLayout, n_rows: int, starts: np.ndarray, pilot_size: int,
                        pilot_seed: int, *, whole_pilot: bool = True) -> ChunkLayout:
    """`layout` with every chunk ending where a conversation starts (`starts`: each conversation's first
    prompt row, ascending, from 0), and, with `whole_pilot`, its pilot made of whole conversations. A chunk's
    end moves forward to the next conversation's start, so a conversation longer than a chunk makes its chunk
    larger; a chunk is never empty. The pilot samples conversations with `pilot_seed` until their turns reach
    `pilot_size`; without `whole_pilot` it stays `pilot_sample`'s rows."""
    starts = np.asarray(starts, dtype=np.int64)
    stops: list[int] = []
    for chunk in layout.chunks(n_rows):
        if stops and stops[-1] >= n_rows:
            break
        want = max(chunk.stop, (stops[-1] if stops else 0) + 1)
        k = int(np.searchsorted(starts, want, side="left"))
        stops.append(int(starts[k]) if k < len(starts) else n_rows)
    if not whole_pilot:
        return replace(layout, stops=tuple(stops))
    ends = np.append(starts[1:], n_rows)
    pilot: list[tuple[int, int]] = []
    taken = 0
    for conv in np.random.default_rng(pilot_seed).permutation(len(starts)).tolist():
        if taken >= min(pilot_size, n_rows):
            break
        pilot.append((int(starts[conv]), int(ends[conv])))
        taken += pilot[-1][1] - pilot[-1][0]
    return replace(layout, stops=tuple(stops), pilot=tuple(sorted(pilot)))


def choose_layout(config: RunConfig, n_rows: int, fleet_slots: int | None, stagger: int) -> ChunkLayout:
    """The run's chunks: `config.chunk_size` rows when set; otherwise at least `TARGET_CHUNK_ROWS` and
    `FLEET_BATCHES_PER_CHUNK` of the fleet's batches (`fleet_slots`: requests the whole fleet decodes at
    once, None when unknown), and the first chunks (beside the pilot) twice the pilot so they still run
    when the gate passes, instead of ending with the pilot and idling the fleet while the gate audits and
    the next chunk tasks start."""
    if config.chunk_size:
        return ChunkLayout(config.chunk_size, stagger)
    size = choose_chunk_size(n_rows, max(TARGET_CHUNK_ROWS, FLEET_BATCHES_PER_CHUNK * (fleet_slots or 0)))
    pilot = min(config.pilot_size, n_rows)
    return ChunkLayout(size, stagger, max(size, 2 * pilot))


def chunks_with_work(frame: pd.DataFrame, n_rows: int, layout: ChunkLayout, config: RunConfig,
                     turn_starts: np.ndarray | None = None) -> list[ChunkWork]:
    """The chunks that still hold rows to generate for this config's cap and truncated-row policy. Under
    `turns=chain` (`turn_starts`: each conversation's first prompt row) a turn held by an earlier one that is
    done without being complete is no work (`held_turns`): a chunk of such turns alone would start the fleet
    to generate nothing."""
    done = done_mask(frame, n_rows, config.max_tokens, config.truncated_policy)
    if turn_starts is not None:
        done |= held_turns(frame, n_rows, turn_starts, config.max_tokens, config.truncated_policy)
    cut = layout.chunks(n_rows)
    left = remaining_per_chunk(done, cut)
    return [ChunkWork(c.index, c.start, c.stop, int(n)) for c, n in zip(cut, left, strict=True) if n]


def pilot_indices(config: RunConfig, n_rows: int, layout: ChunkLayout | None = None) -> np.ndarray:
    """The run's pilot sample, the same in every task that asks: under `turns=chain` its whole conversations
    (`layout.pilot`), otherwise `pilot_sample`'s rows."""
    if layout is not None and layout.pilot is not None:
        if not config.pilot_size:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in layout.pilot] or [np.empty(0, np.int64)])
    return np.asarray(pilot_sample(n_rows, min(config.pilot_size, n_rows), config.pilot_seed), dtype=np.int64)
