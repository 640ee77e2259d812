"""The scheduled rerun's tasks: which chunks the newest run of each output root left unfinished, as Airflow
knows the run (`run.rerun`), and each of them generated again on the operator's fleet."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tracegen.tasks.outcomes import Refuse, Skip

log = logging.getLogger(__name__)


class AirflowRunsView:
    """`run.rerun.AirflowRuns` over a running task's view of Airflow (`tasks.api.TaskApi`): which `tracegen_generate`
    runs exist, their state, and the run each handed its tasks (the decided run once `apply_decision` ran,
    else `prepare_run`'s)."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def state(self, run_id: str) -> str | None:
        return self.api.dagrun_state(run_id)

    def spec(self, run_id: str) -> Any:
        from tracegen.common import dag_ids
        from tracegen.run.run_spec import RunSpec, RunSpecError

        for task_id in (dag_ids.APPLY_DECISION, dag_ids.PREPARE_RUN):
            doc = self.api.xcom_pull(task_id, dag_id=dag_ids.GENERATE, run_id=run_id, key=dag_ids.DECIDED_RUN_KEY)
            if doc:
                try:
                    return RunSpec.from_json(doc, f"{dag_ids.GENERATE} run {run_id!r}'s {task_id}")
                except RunSpecError as exc:
                    log.warning("%s", exc)
                    return None
        return None


# One mapped task per chunk, bounded well under max_map_length; the next hourly run takes the rest.
MAX_RERUN_CHUNKS = 500


def unfinished_in_roots(api: Any, roots: list[str]) -> list[dict[str, Any]]:
    """Chunks with failed or missing rows in the newest run of each of `roots`, as Airflow knows the run
    (`run.rerun.unfinished_work`), at most `MAX_RERUN_CHUNKS`; [] when all is done."""
    from tracegen.run.rerun import unfinished_work

    airflow = AirflowRunsView(api)
    work: list[dict[str, Any]] = []
    for root in roots:
        if not root.startswith("s3://") and not Path(root.removeprefix("file://")).exists():
            log.info("%s: no output yet", root)
            continue
        work.extend(w.to_json() for w in unfinished_work(root, airflow))
    return work[:MAX_RERUN_CHUNKS]


def rerun_chunk(api, work: dict[str, Any]) -> dict[str, Any]:
    """What is left of one chunk, generated with the config Airflow handed its run, on the operator's fleet
    (TRACEGEN_FLEET): never a fleet or config read back from storage. A fleet that changed since the run
    began is refused, naming both digests. Skipped, naming who, when the root has another
    writer (a live run, another deployment's lease) or the run's gate is closed; it holds the root's lease
    while it writes."""
    from tracegen.fleet import FleetSpecError
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.generate.engine import ChunkOptions
    from tracegen.params import default_fleet_source
    from tracegen.run.rerun import RerunRefused, RerunWork, run_for_rerun
    from tracegen.store.lease import RootHeld
    from tracegen.store.root import open_root

    item = RerunWork.from_json(work)
    api.label(item.label)
    # The spec the rerun generates for is rebased onto this same root and connection.
    root = open_root(item.output_uri)
    # Every task of this rerun run writes as one lease owner: they share the root, others yield to them.
    writer = f"tracegen_rerun_failed run {api.run_id}"
    try:
        spec = run_for_rerun(item, AirflowRunsView(api), root=root, writer=writer)
    except RerunRefused as exc:
        raise Skip(f"{item.label}: {exc}") from None
    try:
        fleet = resolve(spec.fleet, default_fleet_source())
    except FleetSpecError as exc:
        # Not retried: the operator's fleet must change back (or a new run start) before this can succeed.
        raise Refuse(f"{item.label}: {exc}") from None
    try:
        options = ChunkOptions(writer=writer, lease_wait_s=0,
                               attempt=api.attempt())
        summary = generate_chunk_work(spec, item.work, fleet=fleet, root=root, options=options)
    except (RootHeld, GateClosed) as exc:
        raise Skip(f"{item.label}: yields: {exc}") from None
    return summary.to_json()
