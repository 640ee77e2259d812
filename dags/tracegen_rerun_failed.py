"""
### tracegen_rerun_failed — finish what failed, on a schedule

Every hour, for each output root with an unfinished run, reads the ledger and regenerates the rows
that failed (transient errors that exhausted their retries) and the rows never committed in chunks
whose task failed, with the config those rows were meant to have (the run's record, `runs/<run_id>/run.json`), on the
operator's own fleet (`TRACEGEN_FLEET`), which must still be the fleet the run recorded.
When nothing failed it does nothing, quickly. Output roots are listed in the `tracegen_output_roots`
Airflow Variable (JSON list) or default to the local demo root.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from tracegen import steps


@dag(
    dag_id="tracegen_rerun_failed",
    schedule="@hourly",
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
