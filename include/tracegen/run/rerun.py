"""What the scheduled rerun finds left of an output root's newest run: chunks holding failed or
never-committed rows, each to be generated again with the config its run was meant to have.

Two rules keep the rerun from being a second writer beside a live run, and from taking orders from the
root it reads:
- **Airflow says which runs exist and what they are.** The root's `runs/` listing only proposes run ids;
  a run counts only when Airflow knows it (`AirflowRuns.state`), and its config, fleet reference, cap and
  decisions are the ones Airflow handed its tasks (`AirflowRuns.spec`, from XCom), never the `run.json`
  beside the data. A planted record is therefore ignored, and so is a real run of another dataset.
- **A live run owns its root.** A root whose newest run is queued or running in Airflow (generating, at
  its question, held by the continuous gate) is left alone, and so is a root someone holds a fresh lease
  on (`store.lease`: another deployment, a rerun already at work, a run whose scheduler died with it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from tracegen.common import locations
from tracegen.dataset.stored import chain_turn_starts
from tracegen.run import plan
from tracegen.run.run_record import recorded_airflow_run, stopped_at_gate
from tracegen.run.run_spec import RunSpec
from tracegen.store.lease import fresh_holders, lease_ttl_s, owner_digest
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)

# DagRun states in which a run may still write: it owns its root (a run at its question is `running`).
LIVE_STATES = ("queued", "running")


class AirflowRuns(Protocol):
    """What Airflow's metadata says of `tracegen_generate` runs (`tasks.rerun.AirflowRunsView` over the task API)."""

    def state(self, run_id: str) -> str | None:
        """The DagRun's state ('queued', 'running', 'success', 'failed'), or None: Airflow knows no such run."""

    def spec(self, run_id: str) -> RunSpec | None:
        """The run as Airflow handed it to its tasks (decided, when it decided its cap), or None."""


@dataclass(frozen=True)
class RerunWork:
    """One chunk of one run, in one output root: the scheduled rerun's mapped work item."""

    output_uri: str
    run_id: str
    work: plan.ChunkWork

    @property
    def label(self) -> str:
        return f"{self.run_id} {self.work.label}"

    def to_json(self) -> dict[str, Any]:
        return {"output_uri": self.output_uri, "run_id": self.run_id, "work": self.work.to_json()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RerunWork:
        return cls(str(doc["output_uri"]), str(doc["run_id"]), plan.ChunkWork.from_json(doc["work"]))


def same_root(a: str, b: str) -> bool:
    """Whether two output URIs name one root (`/x/`, `file:///x` and `/x` do; so do `s3://b/p/` and `s3://b/p`)."""
    return _canonical(a) == _canonical(b)


def _canonical(uri: str) -> str:
    uri = uri.strip()
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        uri = unquote(parsed.path)
    if uri.startswith("/"):
        return "file://" + os.path.normpath(uri)
    return uri.rstrip("/")


@dataclass(frozen=True)
class RootRun:
    """The newest run of a root as Airflow knows it, and its DagRun state."""

    spec: RunSpec
    state: str

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def newest_known_run(root: OutputRoot, output_uri: str, airflow: AirflowRuns) -> RootRun | None:
    """The newest run of this root that Airflow knows, with the spec Airflow handed it: the root only
    proposes run ids. Runs Airflow does not know, or that read another dataset than the one bound to this
    root, are skipped, named. A known run of the same dataset recorded under another root is this root's
    when it was copied or moved here: it is worked on where it is now."""
    bound = (root.run_files.dataset() or {}).get("fingerprint")
    newest: RootRun | None = None
    for run_id in root.run_files.runs():
        key = _airflow_key(root, run_id)
        state = airflow.state(key)
        spec = airflow.spec(key) if state is not None else None
        if spec is None or spec.run_id != run_id:
            log.warning("%s: runs/%s is not a tracegen_generate run Airflow knows (as %r); ignored", output_uri,
                        run_id, key)
            continue
        if spec.dataset.fingerprint != bound:
            log.warning("%s: runs/%s is run %s of another dataset (%s, this root holds %s); ignored", output_uri,
                        run_id, spec.run_id, spec.dataset.fingerprint, bound)
            continue
        if not same_root(spec.config.output_uri, output_uri):
            log.info("%s: run %s wrote to %s; this root is a copy of it", output_uri, run_id, spec.config.output_uri)
        if newest is None or spec.created_at > newest.spec.created_at:
            newest = RootRun(spec, state)
    return newest


def _airflow_key(root: OutputRoot, run_id: str) -> str:
    """The id to ask Airflow about the run stored as `runs/<run_id>/`: the record's `airflow_run_id` (the
    stored id is its file-safe form) or the stored id itself. Only a key: the run Airflow returns for it
    must be the one stored under `run_id`, or it is not this record's run."""
    return recorded_airflow_run(root, run_id) or run_id


def root_owner(root: OutputRoot, newest: RootRun | None, writer: str | None = None) -> str | None:
    """Who owns the root now, so the rerun must not write: the newest run while Airflow has it queued or
    running, or the holder of a fresh lease of another owner than `writer` (the lease owner the asking
    task writes as: the other tasks of its own rerun run share the root with it). None: nobody."""
    if newest is not None and newest.live:
        return f"run {newest.spec.run_id} is {newest.state} in Airflow"
    ours = None if writer is None else owner_digest(writer)
    holders = [h for h in fresh_holders(root.storage, lease_ttl_s()) if h.digest != ours]
    if holders:
        return "a writer holds a lease on it: " + "; ".join(h.describe() for h in holders[:3])
    return None


def unfinished_work(output_uri: str, airflow: AirflowRuns, aws_conn_id: str = "aws_default") -> list[RerunWork]:
    """Chunks of the newest run of `output_uri` that still hold failed or never-committed rows; none while
    the root is owned by a live writer.

    A run held at its gate (stopped, or waiting for the reviewer's answer) is not finished by the
    scheduler: finishing it would spend the GPU-days the gate exists to save. A run the reviewer let go
    on is finished at the cap they chose (Airflow handed it to its second fan-out). A root outside the
    operator's write prefixes (`tracegen.common.locations`) is left alone, said in the log: the roots come from a
    Variable, which is not the operator's alone.
    """
    refused = _outside_prefixes(output_uri)
    if refused is not None:
        log.error("%s", refused)
        return []
    root = open_root(output_uri, aws_conn_id)
    newest = newest_known_run(root, output_uri, airflow)
    if newest is None:
        return []
    owner = root_owner(root, newest)
    if owner is not None:
        log.info("%s: left alone, %s", output_uri, owner)
        return []
    spec = newest.spec.rebased(output_uri, aws_conn_id)
    if stopped_at_gate(root, spec):
        log.info("%s: newest run %s stopped at the gate; nothing to rerun", output_uri, spec.run_id)
        return []
    # Parts lost or cut short since they were committed: retire them, so their rows are work again and this
    # rerun regenerates them (the entries and parts stay, as the record of what was lost).
    damaged = root.repair.verify_parts(deep=False)
    for damage in damaged:
        log.warning("%s: retiring damaged part %s (%s)", output_uri, damage.part, damage.problem)
    root.repair.retire(damaged)
    frame = root.snapshots.frame(compact_over=COMPACT_OVER)
    work = plan.chunks_with_work(frame, spec.dataset.n_rows, spec.layout, spec.config, chain_turn_starts(root))
    log.info("%s: run %s has %d chunks with %d rows left", output_uri, spec.run_id, len(work),
             sum(w.remaining for w in work))
    return [RerunWork(output_uri, spec.run_id, w) for w in work]


def run_for_rerun(item: RerunWork, airflow: AirflowRuns, aws_conn_id: str = "aws_default", *,
                  root: OutputRoot | None = None, writer: str | None = None) -> RunSpec:
    """The run a rerun task generates for, as Airflow knows it, rebased onto the item's root. Raises
    `RerunRefused` naming why when it no longer may: Airflow does not know it, or the root has an owner.
    `root`: the item's output root, when the task has opened it already. `writer`: the lease owner the
    task writes as, whose leases (its sibling tasks') do not make the root another's."""
    refused = _outside_prefixes(item.output_uri)
    if refused is not None:
        raise RerunRefused(refused)
    root = open_root(item.output_uri, aws_conn_id) if root is None else root
    newest = newest_known_run(root, item.output_uri, airflow)
    if newest is None or newest.spec.run_id != item.run_id:
        raise RerunRefused(f"{item.output_uri}: run {item.run_id} is no longer the newest run Airflow knows there")
    owner = root_owner(root, newest, writer)
    if owner is not None:
        raise RerunRefused(f"{item.output_uri}: {owner}")
    return newest.spec.rebased(item.output_uri, aws_conn_id)


def _outside_prefixes(output_uri: str) -> str | None:
    """Why the rerun may not write into `output_uri` (outside the operator's write prefixes), or None."""
    try:
        locations.check(output_uri, access=locations.WRITE, name="tracegen_output_roots")
    except locations.LocationRefused as exc:
        return f"{exc}; not rerun"
    return None


class RerunRefused(RuntimeError):
    """The rerun yields: the message says to whom."""
