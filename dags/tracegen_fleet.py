"""
### tracegen_fleet — start, inspect or stop the SGLang servers without generating

Servers are long-lived infrastructure: a generation run reuses healthy servers that already serve the
same model and flags. Use this DAG to warm the fleet before a run (`action=start`), to see what each GPU
is doing (`status`), or to free the GPUs (`stop`: each server's process group gets SIGTERM, then SIGKILL
after a grace period — never a pattern kill).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task

from tracegen import params, steps
from tracegen.common import dag_ids


@dag(
    dag_id=dag_ids.FLEET,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen", "fleet"],
    doc_md=__doc__,
    default_args={"retries": 0},
    params={
        "action": Param("status", type="string", enum=["start", "status", "stop"], title="Action",
                        description="start: launch (or reuse) one server per GPU and wait for health; "
                        "status: report each server; stop: stop every server by process group."),
        "fleet": Param(params.default_fleet_source(), **params.FLEET_PARAM),
    },
)
def tracegen_fleet():
    task(steps.fleet_action)()


tracegen_fleet()
