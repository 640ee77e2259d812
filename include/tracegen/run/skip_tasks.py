"""Skipping other tasks of the running DAG run from inside a task, before they start.

Checked against Airflow 3.3.2 (task SDK 1.3.2). Airflow has no public call for this that fits: the task SDK's
public way (`SkipMixin.skip`, or raising `airflow.sdk.exceptions.DownstreamTasksSkipped`) ends the calling
task by raising, so its return value is never pushed as its XCom, and `SkipMixin.skip` does nothing from a
mapped task (map index other than -1), which is where the last chunk of a fan-out runs. So this sends the
message that exception makes the task runner send (`SkipDownstreamTasks` to the supervisor, which calls the
Execution API's skip), and returns. Both names are private to the task SDK:
`tests/include/tracegen/run/test_skip_tasks.py` fails when either moves or changes shape.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def skip_tasks(*task_ids: str) -> None:
    """Mark tasks of this run skipped before they start, as a branch skips the paths it does not take: the
    Execution API's skip (it leaves a task already running or finished alone). Outside an Airflow task
    (no supervisor to tell) it only logs."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import SkipDownstreamTasks

    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)  # set in a task process only
    if comms is None:
        log.info("not in an Airflow task: nothing to skip (%s)", ", ".join(task_ids))
        return
    comms.send(SkipDownstreamTasks(tasks=[(t, -1) for t in task_ids]))
