"""What a running task of tracegen's DAGs reads from Airflow and tells it, behind one object.

`tracegen.steps` builds a `TaskApi` from the task context and hands it down; the modules below take it and
never read the context themselves. It holds the task's identity (which try of which task), its params and
its DagRun's conf and triggering user, and Airflow's metadata a task may read and write: XComs, Variables,
other tasks' and runs' states, and skipping tasks of this run. Airflow is imported when a method is called,
so importing this module costs nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from tracegen.common import dag_ids

log = logging.getLogger(__name__)


class TaskApi:
    """One running task's view of Airflow (`ctx`: the task context, `airflow.sdk.get_current_context()`)."""

    def __init__(self, ctx: dict[str, Any]) -> None:
        self.ctx = ctx
        self.ti = ctx.get("ti")

    @classmethod
    def current(cls) -> TaskApi:
        from airflow.sdk import get_current_context

        return cls(get_current_context())

    # -- the task itself

    @property
    def run_id(self) -> str:
        return self.ctx["run_id"]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.ctx.get("params") or {})

    @property
    def conf(self) -> dict[str, Any]:
        """The DagRun's conf, as triggered ({} outside a DagRun)."""
        conf = getattr(self.ctx.get("dag_run"), "conf", None)
        return conf if isinstance(conf, dict) else {}

    @property
    def triggering_user(self) -> str | None:
        return getattr(self.ctx.get("dag_run"), "triggering_user_name", None)

    @property
    def task_key(self) -> str:
        """This task instance as `get_task_states` names it: `task_id`, `_map_index` appended when mapped."""
        return f"{self.ti.task_id}_{self.ti.map_index}"

    def label(self, text: str) -> None:
        """The name the grid shows for this (mapped) task instance: `map_index_template` renders it."""
        self.ctx["chunk_label"] = text

    def attempt(self):
        """This task's try, for the chunk's claim (`store.claims`): a newer try of a chunk always wins over
        an older one still running on another worker."""
        from tracegen.store.claims import Attempt

        ti = self.ti
        task_id, map_index = getattr(ti, "task_id", "task"), getattr(ti, "map_index", -1)
        task = task_id if not isinstance(map_index, int) or map_index < 0 else f"{task_id}[{map_index}]"
        tried = getattr(ti, "try_number", None)
        return Attempt(f"{getattr(ti, 'dag_id', '?')}/{task}", tried if isinstance(tried, int) else None)

    # -- XComs

    def xcom_pull(self, task_ids: str, **kwargs: Any) -> Any:
        return self.ti.xcom_pull(task_ids=task_ids, **kwargs)

    def xcom_push(self, key: str, value: Any) -> None:
        self.ti.xcom_push(key=key, value=value)

    # -- Variables

    def variable(self, key: str) -> str | None:
        from airflow.sdk import Variable

        return Variable.get(key, default=None)

    def set_variable(self, key: str, text: str, description: str) -> None:
        from airflow.sdk import Variable

        Variable.set(key, text, description=description)

    def delete_variable(self, key: str) -> None:
        from airflow.sdk import Variable

        Variable.delete(key)

    # -- other tasks and runs

    def task_states(self, task_ids: list[str], *, run_id: str | None = None,
                    dag_id: str = dag_ids.GENERATE) -> dict[str, str | None]:
        """Lower-case states of the task instances of `task_ids` in one run (this one by default), keyed
        as `get_task_states` keys them (`task_id`, or `task_id_<map_index>` for a mapped one)."""
        run_id = self.run_id if run_id is None else run_id
        found = (self.ti.get_task_states(dag_id=dag_id, run_ids=[run_id], task_ids=task_ids) or {}).get(run_id)
        return {key: dag_ids.state_name(state) for key, state in (found or {}).items()}

    def task_state(self, run_id: str, task_id: str, *, dag_id: str = dag_ids.GENERATE) -> str | None:
        return dag_ids.task_state(self.ti, dag_id, run_id, task_id)

    def dagrun_state(self, run_id: str, *, dag_id: str = dag_ids.GENERATE) -> str | None:
        """The DagRun's lower-case state, None when Airflow knows no such run."""
        try:
            return str(self.ti.get_dagrun_state(dag_id, run_id)).removeprefix("DagRunState.").lower()
        except Exception as exc:  # noqa: BLE001 - the API answers an unknown run with an error, not a state
            log.info("state of %s run %r: %s", dag_id, run_id, exc)
            return None

    def skip(self, *task_ids: str) -> None:
        """Mark tasks of this run skipped before they start (`tracegen.run.skip_tasks`)."""
        from tracegen.run.skip_tasks import skip_tasks

        skip_tasks(*task_ids)
