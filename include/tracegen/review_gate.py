"""The gate's question in Airflow's Required Actions (gate_mode=ask): a human-in-the-loop task.

What is asked, what the options mean and which answers can be acted on is `tracegen.audit.cap_question`'s;
this is the Airflow side. The task is skipped when no gate held the run back. Otherwise it poses the
run's question (its options are labelled with the run's own caps, so they are set when it runs, not when
the DAG is parsed), waits in AWAITING_INPUT until someone answers in the UI or through the REST API, or
until the run's `gate_question_timeout_minutes` pass (then the default, stop, is taken), and returns the
`CapDecision` as its XCom. An answer the run cannot act on (no cap typed for "another cap", a cap that is
not above the current one or not within the servers' context length: `tracegen.common.cap_rule`) is refused:
the reason goes to the task log and to the XCom `refused_answer`, which the run's "tracegen report" tab
shows above the report, and the same question is asked again. (Airflow keeps a question's text as it was
first posed: asking again cannot rewrite it, so the question says where a refusal's reason appears.)
Who is told that a question waits (e-mail, webhook) and who may answer are the operator's settings:
`tracegen.review.notify`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator

from tracegen.audit.cap_question import CAP_FIELD, STOP_LABEL
from tracegen.common.cap_rule import HIGHEST, LOWEST
from tracegen.common.dag_ids import REFUSED_ANSWER_KEY as REFUSED_KEY
from tracegen.review.notify import assigned_users, question_notifiers


def _cap_param(min_cap: int, max_cap: int) -> Any:
    """The form's cap field. Its range is in the description and checked by the run (`cap_rule`, through
    `audit.cap_question.decision_of_answer`), not the schema: the UI clamps a number field to the schema's bounds when it
    loses focus, so 50000 typed as a typo for 5000 would go out as the largest cap without a word, where
    the run refuses it and says why."""
    from airflow.sdk import Param

    return Param(None, type=["null", "integer"], title="Another cap (max_tokens)",
                 description=f"Only with 'Continue at the cap typed below': the cap to continue at, "
                             f"{min_cap:,} to {max_cap:,} (above the current cap, below the servers' context "
                             "length).")


class CapReviewOperator(HITLOperator):
    """Asks the run's reviewer which cap to continue at, or whether to stop; skipped without a question."""

    template_fields = (*HITLOperator.template_fields, "question")

    def __init__(self, *, question: Any, **kwargs: Any) -> None:
        # The DAG's trigger-form params are not this form's: the reviewer's form has the cap field only.
        kwargs.pop("params", None)
        # Who is told the question waits, and who may answer: the operator's settings, read at parse time
        # (`tracegen.review.notify`); a DAG passing its own keeps them.
        kwargs.setdefault("notifiers", question_notifiers())
        kwargs.setdefault("assigned_users", assigned_users())
        # Parse-time placeholders: every run's question brings its own options (see `_pose`).
        super().__init__(subject="tracegen: the truncation gate's question", options=[STOP_LABEL],
                         defaults=[STOP_LABEL], params={CAP_FIELD: _cap_param(LOWEST, HIGHEST)},
                         **kwargs)
        self.question = question  # CapQuestion.to_json() from the question task, or None

    def execute(self, context: Any) -> Any:
        from airflow.sdk.exceptions import AirflowSkipException

        if not self.question:
            raise AirflowSkipException("nothing to ask: no gate held this run back")
        if "decided" in self.question:
            # An operator raised the cap while the run ran (`tracegen_raise_cap`): decided, nobody to ask.
            from tracegen.audit.cap_question import CapDecision

            decision = CapDecision.from_json(self.question["decided"])
            self.log.info("no question: %s", decision.summary())
            return decision.to_json()
        self._pose()
        self.log.info("asking: %s (answer in Required Actions; unanswered in %s, the run stops)",
                      self.subject, self.response_timeout)
        return super().execute(context)

    def _pose(self):
        """Set the HITL request from this run's question: subject, Markdown body, options, the cap field
        bounded by the servers' context length, the timeout, and stop as the default."""
        from airflow.sdk.definitions.param import ParamsDict

        from tracegen.audit.cap_question import STOP, CapQuestion

        question = CapQuestion.from_json(self.question)
        # The run first: Required Actions lists subjects cut short, and every run's question reads alike.
        self.subject = f"Run {question.run_id}: {question.subject}"
        self.body = (figures_text(question.verdict) + question.body + "\n\nAn answer refused here says why in "
                     "this run's **tracegen report** tab, above the report, and in this task's log.")
        self.options = question.labels
        self.defaults = [question.option_label(STOP)]
        self.multiple = False
        self.params = ParamsDict({CAP_FIELD: _cap_param(question.min_cap, question.max_cap)})
        self.response_timeout = dt.timedelta(minutes=question.timeout_minutes)
        return question

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        from tracegen.audit.cap_question import OTHER, AnswerRefused, decision_of_answer

        question = self._pose()
        if "error" in event:
            return super().execute_complete(context, event)  # raises: the wait itself went wrong
        user = event.get("responded_by_user") or {}
        who = user.get("name") or user.get("id")
        try:
            decision = decision_of_answer(question, event["chosen_options"], event.get("params_input"), responded_by=who,
                              responded_at=event["responded_at"], timed_out=bool(event.get("timedout")))
        except AnswerRefused as exc:
            self.log.error("answer by %s refused, asking again: %s", who, exc)
            context["ti"].xcom_push(key=REFUSED_KEY, value={
                "responded_by": who, "responded_at": str(event.get("responded_at") or ""),
                "chosen_options": event["chosen_options"], "params_input": event.get("params_input"),
                "refused": str(exc)})
            # Writing the request again clears the refused response; the task waits for a new one. Nobody is
            # told again: whoever answered is at the question, and the first notice still points to it.
            self.notifiers = []
            return self.execute(context)
        # The provider's own checks, on the answer as it is acted on (the cap as the integer decided).
        typed = decision.cap if decision.kind == OTHER else None
        super().execute_complete(context, {**event, "params_input": {CAP_FIELD: typed}})
        decision = self._as_raise(decision, user, question.run_id)
        self.log.info("decision: %s", decision.summary())
        return decision.to_json()

    def _as_raise(self, decision: Any, user: dict[str, Any], run_id: str) -> Any:
        """The decision as the raise that gave it, when the answer came from `tracegen_raise_cap` (module
        `run.raise_request`): answered as the API connection's user, for the raise the run's Variable holds,
        whose raise task pushed that raise before answering (`cap_raise.verify`, answering). Anything else
        is an answer by whoever Airflow says answered."""
        from airflow.sdk import Variable

        from tracegen.run.api_answer import answering_login
        from tracegen.run.cap_raise import answered_by_raise, decode, variable_key

        login = answering_login()
        if login is None or login not in (user.get("id"), user.get("name")):
            return decision
        raised = decode(Variable.get(variable_key(run_id), default=None), run_id, answering=True)
        if raised is None or raised.cap != decision.cap:
            self.log.warning("answered as %r, the raise user, but not by a raise this run can vouch for (%s): "
                             "recorded as that user's answer", login,
                             "none" if raised is None else f"it raised to {raised.cap:,}")
            return decision
        return answered_by_raise(decision, raised, login)


def figures_text(verdict: dict[str, Any]) -> str:
    """The gate's truncation figure under the name every page gives it (`audit.figures.AT_CAP`)."""
    from tracegen.audit.figures import AT_CAP, AT_CAP_MEANS, figure

    if not isinstance(verdict.get("truncated"), int) or not isinstance(verdict.get("total"), int):
        return ""
    return f"{AT_CAP}: **{figure(verdict['truncated'], verdict['total'])}** ({AT_CAP_MEANS})\n\n"


# ---- answering without an api-server ----------------------------------------------------------------
# `airflow dags test` (which `make demo` runs) starts no api-server and no scheduler: a question parks
# its task in AWAITING_INPUT and the test loop waits for a response recorded in the metadata DB. These
# two read and answer it in this process, through the REST API's own handler, for a process configured
# for that metadata DB (AIRFLOW_HOME, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN).


def awaiting_answers(dag_id: str) -> list[dict[str, Any]]:
    """The questions of `dag_id`'s runs waiting for an answer: run id, task id, map index, subject, body,
    options and defaults, oldest first."""
    from airflow.models.hitl import HITLDetail
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    query = (select(TaskInstance, HITLDetail).join(HITLDetail, HITLDetail.ti_id == TaskInstance.id)
             .where(TaskInstance.dag_id == dag_id, TaskInstance.state == TaskInstanceState.AWAITING_INPUT,
                    HITLDetail.responded_at.is_(None))
             .order_by(HITLDetail.created_at))
    with create_session() as session:
        return [{"run_id": ti.run_id, "task_id": ti.task_id, "map_index": ti.map_index, "subject": d.subject,
                 "body": d.body, "options": list(d.options), "defaults": list(d.defaults or [])}
                for ti, d in session.execute(query).all()]


def answer_in_process(dag_id: str, run_id: str, task_id: str, option: str, params_input: dict[str, Any], *,
                      user: str, map_index: int = -1) -> dict[str, Any]:
    """Answer a question as `PATCH /api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/
    {map_index}/hitlDetails` does: the same handler (its option checks, the resume of the waiting task),
    called in this process as `user`. Returns the recorded response."""
    import warnings

    from airflow.utils.session import create_session

    # The api-server's modules warn about its own test tooling on import; nothing here uses it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
        from airflow.api_fastapi.core_api.datamodels.hitl import UpdateHITLDetailPayload
        from airflow.api_fastapi.core_api.routes.public.hitl import update_hitl_detail

    with create_session() as session:
        response = update_hitl_detail(
            dag_id=dag_id, dag_run_id=run_id, task_id=task_id, map_index=map_index, session=session,
            update_hitl_detail_payload=UpdateHITLDetailPayload(chosen_options=[option], params_input=params_input),
            user=SimpleAuthManagerUser(username=user, role="admin"),
        )
        return response.model_dump(mode="json")
