"""runaway_policy=resample: one fresh sample for each runaway row (a truncated row whose tail loops).

A looping row is truncated at any cap, so no cap choice finishes it; under `resample` it is generated
once more from scratch under the same cap, after the run's fan-outs, and the fresh sample replaces it
(a complete row supersedes a truncated one; between two truncated rows under one cap, the newer commit
does). A fresh sample that loops again is not resampled again: the export then leaves it out as under
`drop`. A row is resampled under the cap that cut it (a pilot row the tail measurement took past the
run's cap keeps that cap). Resampling keeps only samples that did not loop, which is its point: a loop is a decoding
failure, not a long completion; the report counts how many were resampled so the share is visible.

The fresh rows go through the chunk engine (spool, commit, resume) under their own chunk number,
`RESAMPLE_CHUNK`. It is the one place an index gets a second non-failed row under the same cap: what
plan and export read is still one current row per index (`store.current`). Which rows are runaways is
judged on their parts (`audit.runaway_rows`), so this reads the parts holding truncated rows once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.runaway_rows import Runaway, find_runaways
from tracegen.dataset.stored import load_index
from tracegen.fleet import FleetSpec
from tracegen.generate.chunk import fleet_endpoints
from tracegen.generate.engine import DEFAULT_OPTIONS, ChunkEngine, ChunkJob, ChunkOptions
from tracegen.generate.thinking import TEMPLATE_KWARGS
from tracegen.run import RESAMPLE_CHUNK
from tracegen.run.run_spec import RunSpec
from tracegen.sglang.client import SGLangClient
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.records import FAILED, RESAMPLED, GeneratedRow
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)


def resampled_indices(frame: pd.DataFrame) -> set[int]:
    """Indices that already have a fresh sample (a non-failed row of the resample chunk, any run)."""
    if frame.empty:
        return set()
    mine = (frame["chunk"] == RESAMPLE_CHUNK).to_numpy(bool) & (frame["status"] != FAILED).to_numpy(bool)
    return set(frame["index"].to_numpy(np.int64)[mine].tolist())


def to_resample(root: OutputRoot, frame: pd.DataFrame) -> dict[int, Runaway]:
    """The current runaway rows that have had no fresh sample yet."""
    done = resampled_indices(frame)
    return {i: r for i, r in find_runaways(root, frame).items() if i not in done}


class _Resampler(ChunkEngine):
    """The chunk engine generating `rows` afresh, though the ledger counts them done (they are truncated
    under the run's cap), once each: rows resampled by an earlier attempt are left out, after the spool
    an interrupted attempt left has been committed."""

    def __init__(self, rows: dict[int, Runaway], job: ChunkJob, **kw: Any) -> None:
        super().__init__(job, **kw)
        self.rows = rows

    def _remaining(self, indices: np.ndarray) -> np.ndarray:
        self._known_long, self._superseded = np.empty(0, dtype=np.int64), {}
        done = resampled_indices(self.root.snapshots.frame())
        return np.asarray([i for i in indices.tolist() if i not in done], dtype=np.int64)

    async def _complete(self, client: SGLangClient, row: Any) -> GeneratedRow:
        result = await super()._complete(client, row)
        source = self.rows.get(result.index)
        if source is not None and result.status != FAILED:
            kept = {k: v for k, v in (result.provenance or {}).items() if k == TEMPLATE_KWARGS}
            result.provenance = {"action": RESAMPLED, "policy": "resample", "runaway_score": source.score,
                                 "supersedes": {"part": source.part, "index": source.index,
                                                "max_tokens": source.max_tokens}, **kept}
        return result


def resample_runaways(
    spec: RunSpec,
    *,
    fleet: FleetSpec | None = None,
    endpoints: Sequence[ServerEndpoint] | None = None,
    root: OutputRoot | None = None,
    options: ChunkOptions = DEFAULT_OPTIONS,
) -> dict[str, Any]:
    """Generate one fresh sample for each runaway row not resampled yet, under the run's cap. Returns
    what it did (rows, how many fresh samples finished, loop again, tokens). `root`: the run's output
    root, when the task has opened it already."""
    config = spec.config
    if config.runaway_policy != "resample":
        return {"rows": 0, "reason": f"runaway_policy={config.runaway_policy}"}
    root = open_root(config.output_uri, config.aws_conn_id) if root is None else root
    frame = root.snapshots.frame(compact_over=COMPACT_OVER)
    rows = to_resample(root, frame)
    if not rows:
        return {"rows": 0, "reason": "no runaway row left to resample"}
    # Each under the cap that cut it (a pilot row the tail measurement took past the run's cap keeps its
    # measure cap): a fresh sample under a lower cap would not supersede it (the higher cap wins between
    # two truncated rows), and the row's cut would move.
    by_cap: dict[int, dict[int, Runaway]] = {}
    for i, r in rows.items():
        by_cap.setdefault(max(r.max_tokens, config.max_tokens), {})[i] = r
    log.info("resampling %d runaway rows once each (caps %s)", len(rows), sorted(by_cap))

    def run(servers: Sequence[ServerEndpoint]) -> list[Any]:
        summaries = []
        for cap, group in sorted(by_cap.items()):
            job = ChunkJob(config=replace(config, max_tokens=cap), run_id=spec.run_id, model=spec.fleet.model,
                           chunk=RESAMPLE_CHUNK, label=f"resampling {len(group):,} runaway rows at {cap:,}")
            engine = _Resampler(group, job, root=root, dataset=load_index(root, config.aws_conn_id), servers=servers,
                                options=options)
            summaries.append(engine.run(np.asarray(sorted(group), dtype=np.int64)))
        return summaries

    if endpoints is not None:
        summaries = run(endpoints)
    elif fleet is not None:
        with fleet_endpoints(fleet, config) as servers:
            summaries = run(servers)
    else:
        raise ValueError("resample_runaways needs the fleet or the endpoints to send requests to")
    frame = root.snapshots.frame()
    again = to_resample(root, frame)  # rows whose fresh sample failed: the next attempt sends them
    looped = len(find_runaways(root, frame).keys() & rows.keys())  # fresh samples that loop are not resampled
    finished = sum(v for s in summaries for k, v in s.finish_reasons.items() if k != "length")
    tokens = sum(s.completion_tokens for s in summaries)
    log.info("resampled %d runaway rows: %d finished, %d loop again; %s tokens", len(rows), finished, looped,
             f"{tokens:,}")
    return {"rows": len(rows), "generated": sum(s.generated for s in summaries), "finished": finished,
            "loop_again": looped, "left": len(again), "tokens": tokens}
