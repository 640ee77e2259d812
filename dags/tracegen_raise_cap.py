"""
### tracegen_raise_cap — raise the cap of a running run, without stopping it

The reference job's mid-run bump from 4096 to 8192, with nothing to kill. Trigger with the running
`tracegen_generate` run's id and the new `max_tokens`:

- chunk tasks that start from now on generate at the new cap; chunks already running finish at theirs;
- once the first fan-out is done, the run records the raise as its decision (who, when, from which cap)
  and generates what is left at the new cap: the rows truncated under the old one are extended from
  their tokens, never generated again from the prompt.
- while the run's gate question waits (`gate_mode=ask`), the raise is its answer ("Continue at the cap
  typed below" with the new cap), given through Airflow's REST API as the user of the operator's
  `tracegen_api` connection and recorded as made by whoever triggered the raise.

Refused, with the reason in this run's log, when the run is not running, the cap is not above its
current cap or does not fit the servers' context length, the run has already decided its cap (then
start a new run at the new cap: it resumes from the ledger), or its question waits and no `tracegen_api`
connection is defined to answer it.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from tracegen import params, steps
from tracegen.common import dag_ids


@dag(
    dag_id=dag_ids.RAISE_CAP,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen"],
    doc_md=__doc__,
    default_args={"retries": 0},
    params=params.raise_cap_params(),
)
def tracegen_raise_cap():
    task(steps.raise_cap)()


tracegen_raise_cap()
