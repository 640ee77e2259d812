"""Answering the gate's question through Airflow's REST API, as the user an operator configured.

A task cannot answer a human-in-the-loop question itself: Airflow 3.3 resumes a task waiting in
AWAITING_INPUT only when a user's answer arrives through the Core API (`PATCH .../hitlDetails`) or its
timeout passes, and a task's own token (the Execution API's) is scoped to that task. So `tracegen_raise_cap`,
to make a raise the answer to a question that waits, answers through the Core API as a user: the one in
the Airflow connection TRACEGEN_API_CONN names (default `tracegen_api`):

- host: the api-server's URL (`http://airflow-apiserver:8080`), or a host name with schema, port and extra
  `path` (a UI served under a prefix), as for the webhook notifier (`tracegen.common.http_connection`);
- login / password: a user the auth manager issues a token to at `/auth/token` (the simple auth manager's
  and FAB's). It needs permission to answer the DAG's questions and, when TRACEGEN_QUESTION_ASSIGNED_USERS
  limits who may answer, to be one of them.

Airflow records that user as who answered; the run records the person who triggered the raise
(`run.cap_raise.answered_by_raise`). A connection, never the output root: nothing a run's conf can name
decides whose credentials answer. No connection: a raise while a question waits is refused, saying so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from tracegen.common.http_connection import ConnectionMisconfigured, http_url
from tracegen.common.locations import shown_location
from tracegen.common.tls import tls_for

API_CONN_ENV = "TRACEGEN_API_CONN"
# Names the users who alone may answer the gate's question (`review.notify.assigned_users` reads it); a raise
# answers only for one of them.
ASSIGNED_USERS_ENV = "TRACEGEN_QUESTION_ASSIGNED_USERS"
DEFAULT_API_CONN = "tracegen_api"
# A token and one PATCH; an api-server slower than this is reported, not waited on.
TIMEOUT_S = 30.0


class AnswerFailed(RuntimeError):
    """The api-server did not take the answer; `status` is its HTTP status (None: not reached)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def api_conn_id() -> str:
    return os.environ.get(API_CONN_ENV, "").strip() or DEFAULT_API_CONN


@dataclass(frozen=True)
class ApiAnswerer:
    """Answers questions through one api-server as one user."""

    base_url: str
    login: str
    password: str = field(repr=False)
    conn_id: str = DEFAULT_API_CONN

    @classmethod
    def from_connection(cls, conn: Any, conn_id: str) -> ApiAnswerer:
        """`ConnectionMisconfigured` (naming the field) for a connection that cannot answer."""
        url = http_url(conn).rstrip("/")
        if not (conn.login or "").strip() or not conn.password:
            raise ConnectionMisconfigured("no login or no password: the user the raise answers as")
        return cls(base_url=url, login=conn.login.strip(), password=conn.password, conn_id=conn_id)

    def answer(self, dag_id: str, run_id: str, task_id: str, option: str, params_input: dict[str, Any], *,
               map_index: int = -1) -> dict[str, Any]:
        """Answer the question of `task_id` in `dag_id`'s run `run_id` with `option` and `params_input`, as
        the Required Actions form does. Returns what Airflow recorded (responded_by, responded_at, ...);
        `AnswerFailed` otherwise: 409 when someone answered first, 403 when this user may not answer."""
        import httpx

        path = (f"/api/v2/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
                f"{quote(task_id, safe='')}/{map_index}/hitlDetails")
        try:
            with httpx.Client(base_url=self.base_url, timeout=TIMEOUT_S, follow_redirects=False,
                              verify=tls_for(self.base_url)) as client:
                token = client.post("/auth/token", json={"username": self.login, "password": self.password})
                if token.status_code not in (200, 201) or "access_token" not in _json(token):
                    raise AnswerFailed(f"{self.where}: /auth/token refused user {self.login!r}: HTTP "
                                       f"{token.status_code} {token.text[:200]!r}", token.status_code)
                response = client.patch(path, json={"chosen_options": [option], "params_input": params_input},
                                        headers={"Authorization": f"Bearer {_json(token)['access_token']}"})
        except httpx.HTTPError as exc:
            raise AnswerFailed(f"{self.where}: not reached ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            detail = _json(response).get("detail", response.text[:300])
            raise AnswerFailed(f"{self.where}: answering as {self.login!r} was refused: HTTP "
                               f"{response.status_code} {detail}", response.status_code)
        return _json(response)

    @property
    def where(self) -> str:
        return f"the api-server at {shown_location(self.base_url)} (connection {self.conn_id!r})"


def _json(response: Any) -> dict[str, Any]:
    try:
        doc = response.json()
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def configured_answerer() -> ApiAnswerer | None:
    """The answerer the operator's connection describes; None when there is no such connection.
    `ConnectionMisconfigured` for one that is malformed, naming the connection."""
    conn_id = api_conn_id()
    try:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(conn_id)
    except Exception:  # noqa: BLE001 - the SDK raises its own not-found types; absent is the common case
        return None
    try:
        return ApiAnswerer.from_connection(conn, conn_id)
    except ConnectionMisconfigured as exc:
        raise ConnectionMisconfigured(f"Airflow connection {conn_id!r}: {exc}") from None


def hitl_permission(user: str, dag_id: str) -> bool | None:
    """Whether Airflow lets `user` answer `dag_id`'s questions when they name no assigned users: the Core API's
    hitlDetails route asks the auth manager for PUT on the DAG's HITL detail (`is_authorized_dag` with
    `DagAccessEntity.HITL_DETAIL`). None when that cannot be told from a worker: only the simple auth manager's
    users (and their roles) are in the configuration every component reads; FAB's and others' are in the
    api-server's user store."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    manager = conf.getimport("core", "auth_manager")  # as `airflow.api_fastapi.app.get_auth_manager_cls` reads it
    if not (isinstance(manager, type) and issubclass(manager, SimpleAuthManager)):
        return None
    if conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False):
        return True  # every signed-in user is an admin
    known = next((u for u in manager.get_users() if u.username == user), None)
    if known is None:
        return False
    return manager().is_authorized_dag(method="PUT", access_entity=DagAccessEntity.HITL_DETAIL,
                                       details=DagDetails(id=dag_id), user=known)


def answering_login() -> str | None:
    """The user the raise answers as (the connection's login), None when none is configured or it is
    malformed: whoever answered as anyone else answered for themselves."""
    try:
        answerer = configured_answerer()
    except ConnectionMisconfigured:
        return None
    return answerer.login if answerer is not None else None
