"""
### tracegen_rerun_failed — finish what failed, on a schedule

Every hour (`TRACEGEN_RERUN_SCHEDULE` overrides), for each output root with an unfinished run, reads the
ledger and regenerates the rows that failed (transient errors that exhausted their retries) and the rows
never committed in chunks whose task failed, with the config Airflow handed that run (never the record in
the root), on the operator's own fleet (`TRACEGEN_FLEET`), which must still be the fleet the run began with.
A root whose newest run is still queued or running, or that another writer holds a lease on, is left alone:
the log of the task that yields names the holder.
When nothing failed it does nothing, quickly. Output roots are listed in the `tracegen_output_roots`
Airflow Variable (JSON list) or default to the local demo root.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import dag, task

from tracegen import steps
from tracegen.common import dag_ids


@dag(
    dag_id=dag_ids.RERUN_FAILED,
    schedule=os.environ.get("TRACEGEN_RERUN_SCHEDULE", "@hourly"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["tracegen", "maintenance"],
    doc_md=__doc__,
    default_args={"retries": 1, "retry_delay": pendulum.duration(minutes=5)},
)
def tracegen_rerun_failed():
    pending = task(steps.find_unfinished_work, retries=0)()
    task(steps.rerun_unfinished, map_index_template="{{ chunk_label }}").expand(work=pending)


tracegen_rerun_failed()
