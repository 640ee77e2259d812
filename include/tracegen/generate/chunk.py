"""One generation task: the pilot sample or one chunk of the run, unless a gate is closed.

The task wrappers (`tracegen.steps`) resolve the fleet and call in here; this module opens the servers'
endpoints and hands the rows to `ChunkEngine`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from tracegen.config import ConfigError, RunConfig
from tracegen.dataset.stored import load_index
from tracegen.fleet import FleetConnection, FleetSpec, provision
from tracegen.fleet.server import ServerHandle, served_context_lengths
from tracegen.generate.engine import (
    DEFAULT_OPTIONS,
    PILOT_CHUNK,
    ChunkEngine,
    ChunkInterrupted,
    ChunkJob,
    ChunkOptions,
    ChunkSummary,
)
from tracegen.generate.gate_watch import PilotGateWatch, continuous_gate
from tracegen.run import plan
from tracegen.run.run_spec import RunSpec
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.claims import Attempt
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)


class GateClosed(RuntimeError):
    """A chunk did not start, or stopped early after committing what finished, because a gate is closed."""


def starting_in_flight(config: RunConfig) -> int:
    """Each server's in-flight limit when a chunk task starts: the auto-tuner's trickle, or the fixed limit."""
    return config.autotune_start_in_flight if config.autotune_in_flight else config.max_in_flight_per_server


@contextmanager
def fleet_endpoints(fleet: FleetSpec, config: RunConfig) -> Iterator[list[ServerEndpoint]]:
    """Endpoints for the HTTP client, valid inside the block (SSH tunnels stay open while it runs).

    Provisioning is idempotent: healthy servers with the same model and flags are reused, so a task
    calling this after the provision step only checks health and opens its tunnels. The pilot and the
    chunks beside it start with the provision step, not after it, so each task checks the cap against the
    servers' context itself before sending anything (`check_served_context`).
    """
    api_key = None
    with FleetConnection(fleet) as connection:
        handles = provision(fleet, connection)
        check_served_context(config, handles, connection.headers())
        if fleet.api_key_conn_id:
            from tracegen.fleet.server import resolve_api_key

            api_key = resolve_api_key(fleet.api_key_conn_id)
        in_flight = starting_in_flight(config)
        yield [ServerEndpoint(h.url, api_key=api_key, max_in_flight=in_flight, name=h.label) for h in handles]


def check_served_context(config: RunConfig, handles: Sequence[ServerHandle],
                         headers: dict[str, str]) -> dict[str, int]:
    """Each server's context length, once the run's cap is known to fit every one of them; `ConfigError`
    naming the server otherwise. Before any request: a request the server refuses for its length is
    recorded as a rejected row, so a cap over the context would fill the ledger with rejections."""
    context_lengths = served_context_lengths(handles, headers)
    for label, context_length in context_lengths.items():
        try:
            config.check_context_length(context_length)
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc}") from None
    return context_lengths


def run_chunk(
    spec: RunSpec,
    *,
    root: OutputRoot,
    chunk: int,
    label: str,
    indices: np.ndarray | Sequence[int],
    fleet: FleetSpec | None = None,
    endpoints: Sequence[ServerEndpoint] | None = None,
    options: ChunkOptions = DEFAULT_OPTIONS,
) -> ChunkSummary:
    """Generate and commit every row of `indices` not done yet for this run's cap, on `endpoints` or on
    the servers of `fleet`, as `options` say (`ChunkOptions`: the stop check, the writer and its lease, the
    attempt's claim, whether the gate's question waits). A stop check's reason stops the chunk early: it
    then raises `ChunkInterrupted` after committing what finished."""
    config = spec.config
    index = load_index(root, config.aws_conn_id)
    job = ChunkJob(config=config, run_id=spec.run_id, model=spec.fleet.model, chunk=chunk, label=label)

    def run(servers: Sequence[ServerEndpoint]) -> ChunkSummary:
        engine = ChunkEngine(job, root=root, dataset=index, servers=servers, options=options)
        return engine.run(np.asarray(indices, dtype=np.int64))

    if endpoints is not None:
        return run(endpoints)
    if fleet is None:
        raise ValueError("run_chunk needs the fleet or the endpoints to send requests to")
    with fleet_endpoints(fleet, config) as servers:
        return run(servers)


def run_pilot(spec: RunSpec, *, fleet: FleetSpec | None = None, endpoints: Sequence[ServerEndpoint] | None = None,
              attempt: Attempt | None = None) -> ChunkSummary | None:
    """Generate the run's pilot sample (None without one); its rows are committed like any other."""
    if spec.config.pilot_size == 0:
        return None
    indices = plan.pilot_indices(spec.config, spec.dataset.n_rows, spec.layout)
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)
    return run_chunk(spec, root=root, chunk=PILOT_CHUNK, label=f"pilot ({indices.size:,} rows)",
                     indices=indices, fleet=fleet, endpoints=endpoints, options=ChunkOptions(attempt=attempt))


def _fold_loose_entries(root: OutputRoot) -> None:
    """Fold the entries committed since the newest snapshot into a new one once there are more than
    COMPACT_OVER, before this task reads the ledger twice (the continuous gate, then its own rows). Without
    it the planner's snapshot ages through the fan-out and every chunk start parses everything committed
    since, so a chunk start grew slower with every chunk done (docs/benchmarks.md, the 913,786-prompt rehearsal).
    Only an optimisation: a compaction that fails is logged, and the task reads the entries instead."""
    try:
        if root.snapshots.compact_loose(COMPACT_OVER) is not None:
            log.info("ledger: folded the entries committed since the last snapshot into a new one")
    except Exception as exc:  # noqa: BLE001 - never fail a chunk over a cache
        log.warning("ledger: could not fold loose entries into a snapshot (%s); reading them instead", exc)


def generate_chunk_work(
    spec: RunSpec,
    work: plan.ChunkWork,
    *,
    alongside_pilot: bool = False,
    fleet: FleetSpec | None = None,
    endpoints: Sequence[ServerEndpoint] | None = None,
    root: OutputRoot | None = None,
    options: ChunkOptions = DEFAULT_OPTIONS,
) -> ChunkSummary:
    """One mapped generation task: what is left of `work`, unless a gate is closed.

    `alongside_pilot`: the chunk runs while the pilot does (so the fleet never waits for the gate); it
    leaves the pilot's rows to the pilot task and stops as soon as `PilotGateWatch` closes. The scheduled
    rerun comes through here too, as its own `writer`, so it applies the run's gates as its chunks do.
    `root`: the run's output root, when the task has opened it already. `options.stop_check`, when given,
    stops the chunk (`GateClosed`, after committing what finished) once it returns a reason: the answer 'stop'.
    """
    config = spec.config
    root = open_root(config.output_uri, config.aws_conn_id) if root is None else root
    _fold_loose_entries(root)
    verdict = continuous_gate(spec, root)
    if verdict is not None:
        raise GateClosed(f"{work.label} not started, the continuous gate is closed: {verdict}")
    indices = np.arange(work.start, work.stop, dtype=np.int64)
    watch = None
    if alongside_pilot:
        watch = PilotGateWatch(spec, root)
        if (closed := watch()) is not None:
            raise GateClosed(f"{work.label} not started: {closed}")
        if config.pilot_size:
            # The pilot task generates these at the same time; both would otherwise send them.
            pilot = plan.pilot_indices(config, spec.dataset.n_rows, spec.layout)
            indices = np.setdiff1d(indices, pilot, assume_unique=True)
    checks = [c for c in (watch, options.stop_check) if c is not None]
    closed: list[str] = []

    def check(truncated: int, judged: int) -> str | None:
        for c in checks:
            if (reason := c(truncated, judged)) is not None:
                closed.append(reason)
                return reason
        return None

    try:
        return run_chunk(spec, root=root, chunk=work.chunk, label=work.label, indices=indices, fleet=fleet,
                         endpoints=endpoints, options=replace(options, stop_check=check if checks else None))
    except ChunkInterrupted as exc:
        if exc.reason in closed:
            raise GateClosed(str(exc)) from None
        raise
