"""The steps of a generation run as plain functions: prepare, generate a chunk, audit and report.

The DAGs (through `tracegen.steps`) and the CLI call these; nothing here imports Airflow, so every
step runs in a test or a shell without a scheduler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tracegen import plan
from tracegen.config import RunConfig
from tracegen.fleet import FleetConnection, FleetSpec, provision
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.ledger import Ledger
from tracegen.store.storage import StorageKeyError, open_storage

log = logging.getLogger(__name__)

DATASET_INDEX_KEY = "dataset/index.json"
RUN_FILE = "run.json"  # runs/<run_id>/run.json: the config and fleet the run's rows were meant to have
PILOT_REPORT = "pilot-report.json"  # runs/<run_id>/pilot-report.json: the gate's verdict on the pilot
# Rows per chunk when the param leaves it to us: at least this, at least `FLEET_BATCHES_PER_CHUNK` of the
# fleet's batches, and grown for large datasets so the mapped task count stays under plan's limit (far
# below max_map_length).
TARGET_CHUNK_ROWS = 500
# Chunks started a stagger'th of a chunk apart only keep the fleet fed through each other's tails when
# that stagger outlasts a tail: the longest rows take about three times the mean, so a chunk is four
# fleet batches (its task holds 1/stagger of the fleet's slots for 4 x stagger rounds of rows).
FLEET_BATCHES_PER_CHUNK = 4
# Planner and audit reads fold the ledger into a Parquet snapshot once this many entries are not in one
# yet, so every later read (each chunk task's resume) costs one GET instead of thousands.
COMPACT_OVER = 200
# Rows the continuous gate judges: enough for a tight interval, few enough to read in any chunk task.
CONTINUOUS_GATE_SAMPLE = 20_000


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


def open_ledger(config: RunConfig) -> Ledger:
    return Ledger(open_storage(config.output_uri, aws_conn_id=config.aws_conn_id))


def dataset_index(config: RunConfig, ledger: Ledger, *, build: bool = False):
    """The dataset's row index, stored in the output root so mapped tasks never rescan the dataset."""
    from tracegen.dataset.reader import DatasetIndex, build_index

    storage = ledger.storage
    if not build:
        return DatasetIndex.from_bytes(storage.get(DATASET_INDEX_KEY))
    try:
        index = DatasetIndex.from_bytes(storage.get(DATASET_INDEX_KEY))
    except StorageKeyError:
        index = None
    if index is None or index.source_uri != config.dataset_uri:
        index = build_index(
            config.dataset_uri, cache_uri=storage.uri_for("cache"), aws_conn_id=config.aws_conn_id
        )
        # Refuse a second dataset before writing anything that describes it.
        ledger.bind_dataset(index.fingerprint, {"uri": config.dataset_uri, "rows": index.n_rows})
        storage.put(DATASET_INDEX_KEY, index.to_bytes())
    else:
        ledger.bind_dataset(index.fingerprint, {"uri": config.dataset_uri, "rows": index.n_rows})
    return index


@dataclass(frozen=True)
class ChunkLayout:
    """How a run cuts the dataset into chunks (`plan.chunks`). Stored in runs/<run_id>/run.json, so the
    scheduled rerun of a run's unfinished chunks finds the very chunks the run had."""

    size: int
    stagger: int = 0  # chunk tasks the run had in flight at once; 0: every chunk `size` rows
    first_size: int | None = None  # rows of each of the first `stagger` chunks (those beside the pilot)

    def chunks(self, n_rows: int) -> list[plan.Chunk]:
        return plan.chunks(n_rows, self.size, stagger=self.stagger, first_size=self.first_size)

    def to_json(self) -> dict[str, Any]:
        return {"chunk_size": self.size, "chunk_stagger": self.stagger, "first_chunk_size": self.first_size}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ChunkLayout:
        # Records written before staggering have only "chunk_size": their chunks were all that size.
        first = doc.get("first_chunk_size")
        return cls(int(doc["chunk_size"]), int(doc.get("chunk_stagger") or 0), None if first is None else int(first))


def fleet_slots(fleet: FleetSpec) -> int | None:
    """Requests the whole fleet decodes at once, when its flags say (`--max-running-requests`); without
    the flag each SGLang server sizes its batch from KV memory at start-up, which a plan cannot know."""
    per_server = fleet.max_running_requests
    return None if per_server is None else per_server * len(fleet.servers())


def choose_layout(config: RunConfig, n_rows: int, fleet: FleetSpec, stagger: int) -> ChunkLayout:
    """The run's chunks: `config.chunk_size` rows when set; otherwise at least `TARGET_CHUNK_ROWS` and
    `FLEET_BATCHES_PER_CHUNK` of the fleet's batches, and the first chunks (beside the pilot) twice the
    pilot so they still run when the gate passes, instead of ending with the pilot and idling the fleet
    while the gate audits and the next chunk tasks start."""
    if config.chunk_size:
        return ChunkLayout(config.chunk_size, stagger)
    slots = fleet_slots(fleet) or 0
    size = plan.choose_chunk_size(n_rows, max(TARGET_CHUNK_ROWS, FLEET_BATCHES_PER_CHUNK * slots))
    pilot = min(config.pilot_size, n_rows)
    return ChunkLayout(size, stagger, max(size, 2 * pilot))


def prepare_run(config: RunConfig, run_id: str, fleet: FleetSpec, *, stagger: int = 0) -> list[ChunkWork]:
    """Index the dataset, bind it to the output root, store the run's config, and list chunks with work left.

    `stagger`: chunk tasks in flight at once (see `plan.chunks`); 0 for equal chunks."""
    ledger = open_ledger(config)
    index = dataset_index(config, ledger, build=True)
    layout = choose_layout(config, index.n_rows, fleet, stagger)
    record = {"run_id": run_id, "created_at": time.time(), **layout.to_json(),
              "config": config.to_json(), "fleet": fleet.to_dict()}
    ledger.put_run_file(run_id, RUN_FILE, json.dumps(record, indent=2).encode())
    work = chunks_with_work(ledger.frame(compact_over=COMPACT_OVER), index.n_rows, layout, config)
    log.info(
        "plan: %d rows, chunks of %d (the first %d of %s, then %d staggered), %d chunks with work left "
        "(%d rows to generate at max_tokens=%d)",
        index.n_rows, layout.size, layout.stagger, layout.first_size or layout.size, layout.stagger, len(work),
        sum(w.remaining for w in work), config.max_tokens,
    )
    return work


def chunks_with_work(frame, n_rows: int, layout: ChunkLayout, config: RunConfig) -> list[ChunkWork]:
    """The chunks that still hold rows to generate for this config's cap and truncated-row policy."""
    done = plan.done_mask(frame, n_rows, config.max_tokens, config.truncated_policy)
    cut = layout.chunks(n_rows)
    left = plan.remaining_per_chunk(done, cut)
    return [ChunkWork(c.index, c.start, c.stop, int(n)) for c, n in zip(cut, left, strict=True) if n]


def pilot_indices(config: RunConfig, n_rows: int) -> np.ndarray:
    return np.asarray(plan.pilot_sample(n_rows, min(config.pilot_size, n_rows), config.pilot_seed), dtype=np.int64)


def continuous_gate(config: RunConfig) -> str | None:
    """Why a chunk must not start (the running truncation rate is over the threshold with confidence),
    or None. Catches a bad cap even when the pilot was skipped."""
    from tracegen.audit import gate

    if config.gate_mode != "stop":
        return None
    # Judged over the current rows of a fixed random sample of the dataset, not just this run's rows:
    # after a pivot this run's own rows are mostly the long tail regenerated from a lower cap, which says
    # little about the cap on its own. A sample keeps a chunk task's memory independent of dataset size.
    ledger = open_ledger(config)
    n_rows = dataset_index(config, ledger).n_rows
    sample = plan.pilot_sample(n_rows, min(n_rows, CONTINUOUS_GATE_SAMPLE), config.pilot_seed + 1)
    truncated, judged = gate_counts(ledger.plan_frame(sample), config.max_tokens)
    decision = gate.decide(truncated, judged, config.truncation_threshold, max_tokens=config.max_tokens)
    return decision.reason if decision.verdict == "stop" else None


class PilotGateWatch:
    """Stop check for a chunk that runs beside the pilot, called with the rows the chunk has finished.

    Those chunks keep the fleet busy while the pilot's stragglers finish and the gate audits (DESIGN §8:
    the barrier otherwise idles every GPU), but they must not spend GPU time the gate would refuse:
    - the pilot report's verdict, once there, rules: stop closes the watch, anything else opens it for good;
    - until then the chunk's own rows are judged by the gate's test, stricter (99% confidence, at least
      the gate's minimum sample, since it is repeated every poll), so a chunk that runs before the pilot
      (a single-process `airflow dags test` runs tasks one at a time, in no fixed order) stops after a
      gate's worth of rows, not a chunk's.
    """

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config, self.run_id = config, run_id
        self._settled = config.gate_mode != "stop"
        self.closed: str | None = None  # why the gate stopped the run, once it has

    def __call__(self, truncated: int = 0, judged: int = 0) -> str | None:
        from tracegen.audit import gate

        if self._settled:
            return self.closed
        try:
            pilot = json.loads(open_ledger(self.config).get_run_file(self.run_id, PILOT_REPORT))
        except StorageKeyError:
            pilot = None  # the gate has not ruled yet
        if pilot is not None:
            self._settled = True
            verdict = pilot.get("verdict") or {}
            if verdict.get("verdict") == "stop":
                self.closed = f"the pilot gate stopped the run: {verdict.get('reason')}"
            return self.closed
        if judged < gate.DEFAULT_MIN_SAMPLE:
            return None
        own = gate.decide(truncated, judged, self.config.truncation_threshold, confidence=0.99,
                          max_tokens=self.config.max_tokens)
        if own.verdict == "stop":
            self._settled = True
            self.closed = f"this chunk's own rows close the gate before the pilot's verdict: {own.reason}"
        return self.closed


def starting_in_flight(config: RunConfig) -> int:
    """Each server's in-flight limit when a chunk task starts: the auto-tuner's trickle, or the fixed limit."""
    return config.autotune_start_in_flight if config.autotune_in_flight else config.max_in_flight_per_server


@contextmanager
def fleet_endpoints(fleet: FleetSpec, config: RunConfig) -> Iterator[list[ServerEndpoint]]:
    """Endpoints for the HTTP client, valid inside the block (SSH tunnels stay open while it runs).

    Provisioning is idempotent: healthy servers with the same model and flags are reused, so a task
    calling this after the provision step only checks health and opens its tunnels.
    """
    api_key = None
    with FleetConnection(fleet) as connection:
        handles = provision(fleet, connection)
        if fleet.api_key_conn_id:
            from tracegen.fleet.server import resolve_api_key

            api_key = resolve_api_key(fleet.api_key_conn_id)
        in_flight = starting_in_flight(config)
        yield [ServerEndpoint(h.url, api_key=api_key, max_in_flight=in_flight, name=h.label) for h in handles]


def run_chunk(
    config: RunConfig,
    run_id: str,
    fleet: FleetSpec,
    *,
    chunk: int,
    label: str,
    indices: np.ndarray | Sequence[int],
    spool_dir: str | None = None,
    endpoints: Sequence[ServerEndpoint] | None = None,
    stop_check: Callable[[int, int], str | None] | None = None,
) -> dict[str, Any]:
    """Generate and commit every row of `indices` not done yet for this run's cap. Returns a small summary.

    `stop_check` (polled while generating) may stop the chunk early; it then raises `ChunkInterrupted`
    after committing what finished."""
    from tracegen.generate.engine import ChunkEngine

    ledger = open_ledger(config)
    index = dataset_index(config, ledger)

    def run(servers: Sequence[ServerEndpoint]) -> dict[str, Any]:
        engine = ChunkEngine(
            config=config, run_id=run_id, chunk=chunk, label=label, ledger=ledger, dataset=index,
            servers=servers, model=fleet.model_name, spool_dir=spool_dir, stop_check=stop_check,
        )
        return engine.run(np.asarray(indices, dtype=np.int64)).to_json()

    if endpoints is not None:
        return run(endpoints)
    with fleet_endpoints(fleet, config) as servers:
        return run(servers)


class GateClosed(RuntimeError):
    """A chunk did not start, or stopped early after committing what finished, because a gate is closed."""


def generate_chunk_work(
    config: RunConfig,
    run_id: str,
    fleet: FleetSpec,
    work: ChunkWork,
    *,
    alongside_pilot: bool = False,
    endpoints: Sequence[ServerEndpoint] | None = None,
) -> dict[str, Any]:
    """One mapped generation task: what is left of `work`, unless a gate is closed.

    `alongside_pilot`: the chunk runs while the pilot does (so the fleet never waits for the gate); it
    leaves the pilot's rows to the pilot task and stops as soon as `PilotGateWatch` closes.
    """
    from tracegen.generate.engine import ChunkInterrupted

    verdict = continuous_gate(config)
    if verdict is not None:
        raise GateClosed(f"{work.label} not started, the continuous gate is closed: {verdict}")
    indices = np.arange(work.start, work.stop, dtype=np.int64)
    watch = None
    if alongside_pilot:
        watch = PilotGateWatch(config, run_id)
        if (closed := watch()) is not None:
            raise GateClosed(f"{work.label} not started: {closed}")
        if config.pilot_size:
            # The pilot task generates these at the same time; both would otherwise send them.
            pilot = pilot_indices(config, dataset_index(config, open_ledger(config)).n_rows)
            indices = np.setdiff1d(indices, pilot, assume_unique=True)
    try:
        return run_chunk(config, run_id, fleet, chunk=work.chunk, label=work.label, indices=indices,
                         endpoints=endpoints, stop_check=watch)
    except ChunkInterrupted as exc:
        if watch is not None and watch.closed == exc.reason:
            raise GateClosed(str(exc)) from None
        raise


@dataclass(frozen=True)
class ReportOutcome:
    """Where a report went and what it decided; small enough for an XCom."""

    verdict: str | None
    reason: str | None
    action: str | None
    json_uri: str
    html_uri: str
    summary: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gate_counts(frame, max_tokens: int) -> tuple[int, int]:
    """(truncated, judged) for a gate at cap `max_tokens`, over the current row of each index.

    A row that finished naturally under a lower cap would finish the same under this one, so it
    counts as complete. A row truncated under a lower cap and kept (`truncated_policy=keep`) says
    nothing about this cap, so it is left out rather than counted either way.
    """
    from tracegen.audit.stats import current_mask
    from tracegen.store.records import OK

    if len(frame) == 0:
        return 0, 0
    cur = current_mask(frame) & (frame["status"].to_numpy(dtype=object) == OK)
    is_length = frame["finish_reason"].to_numpy(dtype=object) == "length"
    under_cap = frame["max_tokens"].to_numpy(dtype=np.int64) < max_tokens
    judged = cur & ~(is_length & under_cap)
    return int((judged & is_length).sum()), int(judged.sum())


def audit_and_report(
    config: RunConfig,
    run_id: str,
    *,
    name: str,
    indices: np.ndarray | None = None,
    n_gpus: int = 1,
    tokens_per_s_per_gpu: float | None = None,
    context_length: int | None = None,
) -> ReportOutcome:
    """Audit the ledger (all of it, or only `indices`), decide the gate, write `runs/<run_id>/<name>.{json,html}`."""
    from tracegen.audit import capfit, gate, report
    from tracegen.audit.stats import audit, censoring_arrays

    ledger = open_ledger(config)
    full = ledger.frame(compact_over=COMPACT_OVER)
    frame = full
    if indices is not None:
        frame = full[np.isin(full["index"].to_numpy(dtype=np.int64), indices)].reset_index(drop=True)
    result = audit(frame, config.max_tokens, run_id=run_id)

    table = None
    lengths, censored = censoring_arrays(frame)
    try:
        fit = capfit.fit_lengths(lengths, censored, bootstrap=100)
    except ValueError as exc:
        log.warning("no cap table: %s", exc)
    else:
        remaining = _rows_remaining(config, ledger, full)
        throughput = None
        if tokens_per_s_per_gpu and tokens_per_s_per_gpu > 0:
            throughput = capfit.Throughput(tokens_per_s_per_gpu, max(1, n_gpus), remaining)
        table = capfit.cap_table(
            fit, config.max_tokens, context_length=context_length or config.context_length or None,
            threshold=config.truncation_threshold, throughput=throughput,
        )

    truncated, judged = gate_counts(frame, config.max_tokens)
    decision = gate.decide(
        truncated, judged, config.truncation_threshold, max_tokens=config.max_tokens,
        suggested_cap=table.recommended_cap if table else None,
        suggested_truncation=table.recommended_truncation if table else None,
    )
    examples = _example_rows(ledger, frame)
    meta = {"run_id": run_id, "report": name, "config": config.to_json(), "scope_rows": int(
        frame["index"].nunique()) if len(frame) else 0}
    report_json, html = report.render_report(result, table, decision, meta, examples)
    json_uri = ledger.put_run_file(run_id, f"{name}.json", json.dumps(report_json, indent=2).encode())
    html_uri = ledger.put_run_file(run_id, f"{name}.html", html.encode())
    summary = report.summary_text(result, table, decision)
    log.info("%s report: %s\n%s", name, html_uri, summary)
    return ReportOutcome(decision.verdict, decision.reason, decision.action, json_uri, html_uri, summary)


def _rows_remaining(config: RunConfig, ledger: Ledger, frame) -> int:
    try:
        n_rows = dataset_index(config, ledger).n_rows
    except StorageKeyError:
        return 0
    return int((~plan.done_mask(frame, n_rows, config.max_tokens, config.truncated_policy)).sum())


def _example_rows(ledger: Ledger, frame, per_outcome: int = 3) -> dict[str, list[dict[str, Any]]]:
    """A few full rows per outcome (truncated in thinking / in answer, errors), read from their parts."""
    from tracegen.store.records import OK

    if len(frame) == 0 or "part" not in frame.columns:
        return []
    status = frame["status"].to_numpy(dtype=object)
    length = (status == OK) & (frame["finish_reason"].to_numpy(dtype=object) == "length")
    thinking = frame["cut_in_reasoning"].fillna(False).to_numpy(dtype=bool)
    picks = {
        "truncated_in_thinking": np.flatnonzero(length & thinking)[:per_outcome],
        "truncated_in_answer": np.flatnonzero(length & ~thinking)[:per_outcome],
        "error": np.flatnonzero(status != OK)[:per_outcome],
    }
    wanted: dict[str, set[int]] = {}
    for rows in picks.values():
        for i in rows:
            wanted.setdefault(frame["part"].iat[i], set()).add(int(frame["index"].iat[i]))
    by_index: dict[tuple[str, int], dict[str, Any]] = {}
    for part, idx in wanted.items():
        for row in ledger.read_part(part):
            if row.index in idx:
                by_index[(part, row.index)] = row.to_json()
    examples: dict[str, list[dict[str, Any]]] = {}
    for outcome, rows in picks.items():
        examples[outcome] = [
            by_index[key] for i in rows if (key := (frame["part"].iat[i], int(frame["index"].iat[i]))) in by_index
        ]
    return examples


# ---- scheduled reruns -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """runs/<run_id>/run.json: what a run was meant to produce."""

    run_id: str
    created_at: float
    layout: ChunkLayout
    config: RunConfig
    fleet: dict[str, Any]


def read_run_record(ledger: Ledger, run_id: str) -> RunRecord:
    doc = json.loads(ledger.get_run_file(run_id, RUN_FILE))
    return RunRecord(doc["run_id"], float(doc["created_at"]), ChunkLayout.from_json(doc),
                     RunConfig.from_params(doc["config"]), doc["fleet"])


def latest_run(ledger: Ledger) -> RunRecord | None:
    """The newest run of an output root: the one whose cap and policy define "finished" for it."""
    records = []
    for run_id in ledger.runs():
        try:
            records.append(read_run_record(ledger, run_id))
        except StorageKeyError:
            continue  # a run that failed before planning wrote nothing to finish
    return max(records, key=lambda r: r.created_at, default=None)


def stopped_at_gate(ledger: Ledger, run_id: str) -> bool:
    try:
        pilot = json.loads(ledger.get_run_file(run_id, PILOT_REPORT))
    except StorageKeyError:
        return False
    verdict = pilot.get("verdict") or {}
    return verdict.get("verdict") == "stop" and pilot.get("run", {}).get("config", {}).get("gate_mode") == "stop"


def unfinished_work(output_uri: str, aws_conn_id: str = "aws_default") -> list[dict[str, Any]]:
    """Chunks of the newest run of `output_uri` that still hold failed or never-committed rows.

    A run the gate stopped is not finished by the scheduler: finishing it would spend the GPU-days
    the gate exists to save. Its operator triggers a new run with a better cap instead.
    """
    ledger = Ledger(open_storage(output_uri, aws_conn_id=aws_conn_id))
    record = latest_run(ledger)
    if record is None:
        return []
    if stopped_at_gate(ledger, record.run_id):
        log.info("%s: newest run %s stopped at the gate; nothing to rerun", output_uri, record.run_id)
        return []
    try:
        n_rows = dataset_index(record.config, ledger).n_rows
    except StorageKeyError:
        return []
    work = chunks_with_work(ledger.frame(compact_over=COMPACT_OVER), n_rows, record.layout, record.config)
    log.info("%s: run %s has %d chunks with %d rows left", output_uri, record.run_id, len(work),
             sum(w.remaining for w in work))
    return [{"output_uri": output_uri, "run_id": record.run_id, **w.to_json()} for w in work]
