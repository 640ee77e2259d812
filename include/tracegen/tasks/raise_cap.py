"""The `tracegen_raise_cap` task's work: a raise made over Airflow's metadata (`run.raise_request`)."""

from __future__ import annotations

import logging
from typing import Any

from tracegen.common.dag_ids import DECIDING_TASK, GENERATE, REVIEW_TASK

log = logging.getLogger(__name__)


class AirflowRaiseView:
    """`run.raise_request.RaiseView` over a running task's view of Airflow (`tasks.api.TaskApi`)."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def run_state(self, run_id: str) -> str | None:
        return self.api.dagrun_state(run_id)

    def prepared_run(self, run_id: str) -> Any:
        from tracegen.common.dag_ids import PREPARE_RUN

        return self.api.xcom_pull(PREPARE_RUN, dag_id=GENERATE, run_id=run_id, key="run")

    def servers(self, run_id: str) -> Any:
        from tracegen.common.dag_ids import PROVISION_FLEET

        return self.api.xcom_pull(PROVISION_FLEET, dag_id=GENERATE, run_id=run_id)

    def deciding_state(self, run_id: str) -> str:
        return self.api.task_state(run_id, DECIDING_TASK) or "none"

    def review_state(self, run_id: str) -> str:
        return self.api.task_state(run_id, REVIEW_TASK) or "none"

    def answerer(self) -> Any:
        from tracegen.run.api_answer import configured_answerer

        return configured_answerer()

    def assigned_users(self) -> list[dict[str, str]] | None:
        from tracegen.review.notify import assigned_users

        return assigned_users()

    def may_answer(self, user: str) -> bool | None:
        from tracegen.run.api_answer import hitl_permission

        return hitl_permission(user, GENERATE)

    def announce(self, raised: Any) -> None:
        from tracegen.run.cap_raise import ANSWERING_KEY

        self.api.xcom_push(ANSWERING_KEY, raised.to_json())

    def decided(self, run_id: str) -> Any:
        from tracegen.common.dag_ids import QUESTION_KEY

        return self.api.xcom_pull(DECIDING_TASK, dag_id=GENERATE, run_id=run_id, key=QUESTION_KEY)

    def facts(self, raised: Any, *, run_cap: int, context_length: int | None) -> Any:
        from tracegen.run.cap_raise import raise_facts

        return raise_facts(self.api.ti, raised, run_cap=run_cap, context_length=context_length)

    def stored(self, key: str) -> str | None:
        return self.api.variable(key)

    def store(self, key: str, text: str, description: str) -> None:
        self.api.set_variable(key, text, description)

    def withdraw(self, key: str) -> None:
        self.api.delete_variable(key)


def raise_from_task(api: Any) -> dict[str, Any]:
    """The `tracegen_raise_cap` task: raise the cap of the run its params name, with this DagRun's triggering
    user and id as who raised it and where (`run.raise_request.request_raise`). Returns the raise: the XCom a reader checks the
    Variable against. Refused with `run.cap_raise.RaiseRefused`."""
    params = api.params
    from tracegen.run.raise_request import request_raise

    raised = request_raise(AirflowRaiseView(api), str(params["run_id"]).strip(), params["max_tokens"],
                           requested_by=api.triggering_user, raised_in=api.run_id)
    log.warning("%s: chunk tasks starting from now generate at max_tokens=%d, and the rows truncated under "
                "%d are extended from their tokens", raised.summary(), raised.cap, raised.from_cap)
    return raised.to_json()
