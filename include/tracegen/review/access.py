"""Airflow's side of the review pages: who may see them, and what Airflow's metadata DB says about the runs.

Mounted plugin apps are NOT authenticated by the api-server, so every route requires an Airflow user
allowed to see plugin views and to read the runs of `tracegen_generate` (the DAG every report belongs to),
checked with Airflow's own user resolution (bearer token or the UI's session cookie) and authorization.
Airflow is imported lazily: plugin modules are loaded in every task process, and the api-server's security
module costs seconds to import there for nothing.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tracegen.common import dag_ids
from tracegen.config import ConfigError

# The DAG whose runs write runs/<run_id>/: access to a report is read access to it.
GENERATE_DAG = dag_ids.GENERATE
RAISE_CAP_DAG = dag_ids.RAISE_CAP
MAX_CONF_RUNS = 500  # newest DAG runs whose conf is read for output roots (one indexed query)

_bearer = HTTPBearer(auto_error=False)


async def require_airflow_access(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Airflow's own authentication and authorization for plugin views (401 / 403 otherwise)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import get_user, requires_access_view

    user = await get_user(request, None, bearer)
    requires_access_view(AccessView.PLUGINS)(request, user)
    request.state.tracegen_user = user


def require_dag_read(request: Request, dag_id: str = GENERATE_DAG) -> None:
    """403 unless the user may read the runs of `dag_id`: plugin access alone must not open every DAG's
    reports (an auth manager may scope DAG access per user or team)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=dag_id)(request, request.state.tracegen_user)


@dataclass(frozen=True)
class AirflowRun:
    """What Airflow's metadata DB says about one `tracegen_generate` run: its state, the output root its
    conf names (checked by the `Uri` rule; `root_problem` says why it was refused), its conf (for the
    "trigger again" hint), whether `prepare_run` finished (then it wrote `run.json`) and when it was queued."""

    run_id: str
    state: str | None
    output_uri: str | None
    conf: dict[str, Any]
    prepared: bool = False
    root_problem: str | None = None
    queued_at: str | None = None  # ISO time, UTC


def conf_output_root(conf: Any) -> tuple[str | None, str | None]:
    """(root, problem): the output root a run's conf names, validated by RunConfig's rule for the field.
    Only `output_uri` is taken from the conf: never a connection, a fleet or anything else."""
    from tracegen.config import rule_of

    if not isinstance(conf, dict) or "output_uri" not in conf:
        return None, None
    value = conf["output_uri"]
    try:
        rule_of("output_uri").check("output_uri", value)
    except ConfigError as exc:
        return None, f"the run's conf names an output root the review pages refuse: {exc}"
    return value.strip(), None


def airflow_runs(run_id: str | None = None, limit: int = MAX_CONF_RUNS) -> list[AirflowRun]:
    """`tracegen_generate` runs from the metadata DB, newest first (or the one `run_id`)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = select(DagRun.run_id, DagRun.state, DagRun.conf, DagRun.queued_at).where(DagRun.dag_id == GENERATE_DAG)
    query = query.where(DagRun.run_id == run_id) if run_id is not None else query.order_by(DagRun.id.desc())
    with create_session() as session:
        rows = session.execute(query.limit(limit)).all()
        prepared = set(session.scalars(select(TaskInstance.run_id).where(
            TaskInstance.dag_id == GENERATE_DAG, TaskInstance.task_id == dag_ids.PREPARE_RUN,
            TaskInstance.state == "success", TaskInstance.run_id.in_([r.run_id for r in rows]))))
    out = []
    for r in rows:
        conf = r.conf if isinstance(r.conf, dict) else {}
        uri, problem = conf_output_root(conf)
        queued = r.queued_at.isoformat() if r.queued_at is not None else None
        out.append(AirflowRun(r.run_id, None if r.state is None else str(r.state), uri, conf,
                              r.run_id in prepared, problem, queued))
    return out


def refused_answer(airflow_run_id: str) -> dict[str, Any] | None:
    """The last answer `review_cap` refused for the run (its XCom `refused_answer`: who, what, why), if any."""
    import json

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = (select(XComModel).where(XComModel.dag_id == GENERATE_DAG, XComModel.run_id == airflow_run_id,
                                     XComModel.task_id == dag_ids.REVIEW_TASK,
                                     XComModel.key == dag_ids.REFUSED_ANSWER_KEY)
             .order_by(XComModel.timestamp.desc()).limit(1))
    with create_session() as session:
        row = session.scalars(query).first()
        value = None if row is None else XComModel.deserialize_value(row)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def airflow_run_path(airflow_run_id: str) -> str:
    """The run's page in the Airflow UI."""
    return f"/dags/{GENERATE_DAG}/runs/{urllib.parse.quote(airflow_run_id, safe='')}"


def required_actions_path(airflow_run_id: str) -> str:
    """The Airflow UI page where the run's open question is answered."""
    return airflow_run_path(airflow_run_id) + "/tasks/review_cap/required_actions"
