"""A run's record beside the data: `runs/<run_id>/run.json` (its `RunSpec`) and the gate's verdict.

Records are read back only as data: readers rebase them onto the root they were found in and the
connection the reader uses (`RunSpec.rebased`), so a copied or moved root is worked on where it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tracegen.config import legacy_run_id, safe_run_id, stored_as
from tracegen.run import PILOT_REPORT, QUESTION_FILE, RUN_FILE
from tracegen.run.run_spec import RunSpec, RunSpecError
from tracegen.run.stage import ASKING, GOING, STOPPED, run_stage
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageError, StorageKeyError

log = logging.getLogger(__name__)

__all__ = ["ASKING", "GOING", "PILOT_REPORT", "QUESTION_FILE", "RUN_FILE", "STOPPED", "RunRecordTaken",
           "create_run_record", "gate_verdict", "latest_run", "pilot_report", "read_run_record", "recorded_airflow_run",
           "run_stage", "stage_of", "stopped_at_gate", "stored_run_id", "write_run_record"]


class RunRecordTaken(RunSpecError):
    """`runs/<run_id>/` already holds another run's record; it is left as it is."""


def write_run_record(root: OutputRoot, spec: RunSpec) -> str:
    """Replace the run's record (its decided form, by the run itself): `create_run_record` writes the first."""
    return root.run_files.put(spec.run_id, RUN_FILE, _encoded(spec))


def _encoded(spec: RunSpec) -> bytes:
    return json.dumps(spec.to_json(), indent=2).encode()


def create_run_record(root: OutputRoot, spec: RunSpec) -> str:
    """Write a run's first record, never over another run's: created exclusively (`Storage.create`), so of two
    runs racing for one `runs/<run_id>/` one writes and the other is refused. A record already there is this
    run's again (a retried or cleared first task) only when it names the same Airflow run; then it is replaced.
    Anything else raises `RunRecordTaken` naming both runs, and the record stays byte for byte."""
    key = f"runs/{spec.run_id}/{RUN_FILE}"
    data = _encoded(spec)
    if root.run_files.create(spec.run_id, RUN_FILE, data):
        return root.storage.uri_for(key)
    where = root.storage.uri_for(key)
    try:
        doc = json.loads(root.run_files.get(spec.run_id, RUN_FILE))
    except (StorageError, ValueError) as exc:
        raise RunRecordTaken(f"{where} exists and cannot be read as a run record ({exc}); it is left as it is. "
                             f"Run {spec.airflow_run_id or spec.run_id!r} is not stored over it") from None
    named = doc.get("airflow_run_id") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("run_id") != spec.run_id or named != spec.airflow_run_id:
        other = named if isinstance(named, str) else (doc.get("run_id") if isinstance(doc, dict) else None)
        raise RunRecordTaken(
            f"{where} is the record of Airflow run {other!r}, not of Airflow run {spec.airflow_run_id!r} "
            f"(both are stored as {spec.run_id!r}); it is left as it is: trigger this run again under another "
            "run id")
    return root.run_files.put(spec.run_id, RUN_FILE, data)


def recorded_airflow_run(root: OutputRoot, run_id: str) -> str | None:
    """The Airflow run id `runs/<run_id>/run.json` names, as written; None without a readable one. Only a
    key to look a run up by: whoever acts on it checks it against Airflow."""
    try:
        doc = json.loads(root.run_files.get(run_id, RUN_FILE))
    except (StorageError, ValueError):
        return None
    named = doc.get("airflow_run_id") if isinstance(doc, dict) else None
    return named if isinstance(named, str) and 0 < len(named) <= 250 else None


def stored_run_id(root: OutputRoot, airflow_run_id: str) -> str:
    """Where the Airflow run `airflow_run_id`'s files are in `root`: under `safe_run_id`'s id, or, for a run
    stored before ids carried a hash, under the cleaned id alone when the record there names exactly this
    run (`config.stored_as`). `safe_run_id`'s id when neither holds it: where a new run is stored.
    `ConfigError` for an id with no usable characters."""
    new = safe_run_id(airflow_run_id)
    old = legacy_run_id(airflow_run_id)
    if old is None or root.storage.list(f"runs/{new}/"):
        return new
    return old if stored_as(old, airflow_run_id, recorded_airflow_run(root, old)) else new


def read_run_record(root: OutputRoot, run_id: str, aws_conn_id: str = "aws_default") -> RunSpec:
    """The run's spec as stored, rebased onto `root`. Raises `StorageKeyError` when the run has
    no record, `RunSpecError` naming the file when it is not one."""
    where = root.storage.uri_for(f"runs/{run_id}/{RUN_FILE}")
    raw = root.run_files.get(run_id, RUN_FILE)
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise RunSpecError(f"{where}: not JSON ({exc})") from None
    spec = RunSpec.from_json(doc, where)
    if spec.run_id != run_id:
        raise RunSpecError(f"{where}: names run {spec.run_id!r}, not the run it is stored under")
    return spec.rebased(root.storage.uri, aws_conn_id)


def latest_run(root: OutputRoot, aws_conn_id: str = "aws_default") -> RunSpec | None:
    """The newest run of an output root: the one whose cap and policy define "finished" for it.

    A run whose record cannot be read is skipped with a warning naming it, so one damaged record does
    not block every tool over the root."""
    specs = []
    for run_id in root.run_files.runs():
        try:
            specs.append(read_run_record(root, run_id, aws_conn_id))
        except StorageKeyError:
            continue  # a run that failed before planning wrote nothing to finish
        except RunSpecError as exc:
            log.warning("skipping run %s: %s", run_id, exc)
    return max(specs, key=lambda s: s.created_at, default=None)


def pilot_report(root: OutputRoot, run_id: str) -> dict[str, Any] | None:
    """The pilot audit's report, or None while the gate has not ruled."""
    try:
        return json.loads(root.run_files.get(run_id, PILOT_REPORT))
    except StorageKeyError:
        return None


def gate_verdict(report: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(verdict, reason) of a pilot report: ('stop' | 'pass' | ..., why), or (None, None) without one."""
    verdict = (report or {}).get("verdict") or {}
    return verdict.get("verdict"), verdict.get("reason")


def stage_of(root: OutputRoot, spec: RunSpec) -> str:
    """`run_stage` of a run whose spec (and decisions) the caller trusts, with the root's question and
    pilot report."""
    try:
        root.run_files.get(spec.run_id, QUESTION_FILE)
        asked = True
    except StorageKeyError:
        asked = False
    verdict = None if asked or spec.decisions else gate_verdict(pilot_report(root, spec.run_id))[0]
    return run_stage(gate_mode=spec.config.gate_mode, pilot_verdict=verdict, question_asked=asked,
                     last_decision_continues=spec.decisions[-1].continues if spec.decisions else None)


def stopped_at_gate(root: OutputRoot, spec: RunSpec) -> bool:
    """Is this run held at its gate (stopped, or waiting for the reviewer)? Its rows left are then not
    work for anyone but the reviewer."""
    return stage_of(root, spec) != GOING
