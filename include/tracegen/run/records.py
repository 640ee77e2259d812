"""A run's record beside the data: `runs/<run_id>/run.json` (its `RunSpec`) and the gate's verdict.

Records are read back only as data: readers rebase them onto the root they were found in and the
connection the reader uses (`RunSpec.rebased`), so a copied or moved root is worked on where it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tracegen.run import PILOT_REPORT, QUESTION_FILE, RUN_FILE
from tracegen.run.spec import RunSpec, RunSpecError
from tracegen.run.stage import ASKING, GOING, STOPPED, run_stage
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

log = logging.getLogger(__name__)

__all__ = ["ASKING", "GOING", "PILOT_REPORT", "QUESTION_FILE", "RUN_FILE", "STOPPED", "gate_verdict", "latest_run",
           "pilot_report", "read_run_record", "run_stage", "stage_of", "stopped_at_gate", "write_run_record"]


def write_run_record(root: OutputRoot, spec: RunSpec) -> str:
    return root.run_files.put(spec.run_id, RUN_FILE, json.dumps(spec.to_json(), indent=2).encode())


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
