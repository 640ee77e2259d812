"""Making a raise: what the `tracegen_raise_cap` task does, over Airflow's metadata seen through `RaiseView`.

The raise is checked against the run as its first task described it and the servers' context length,
kept as the run's Variable, and then confirmed taken: the run reads a raise once, when its deciding task
(`ask_about_cap`) starts, so a raise written while that task is already running may have been read too
late. The raise waits for the task to finish and keeps the raise only if the run's decision is it.

When the run has asked its reviewer instead (the question waits in Required Actions, `review_cap`), the
raise is the answer: it answers "Continue at the cap typed below" with its cap through Airflow's REST API,
as the user of the operator's API connection (`tracegen.run.api_answer`), having pushed the raise as its
XCom `answering` first, so that `review_cap` records the answer as this raise, by the person who triggered
it (`cap_raise.answered_by_raise`). It does not wait for `review_cap` to resume: that needs a worker slot,
and a raise holding one would only delay it. Airflow takes one answer per question: a reviewer who answered
first wins, and the raise is withdrawn and refused, saying so.

Everything here is refused with `RaiseRefused`, whose message says why and what would be accepted; the
Airflow task (`tasks.raise_cap.raise_from_task`) turns it into a failure without retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tracegen.audit.cap_question import CAP_FIELD, OTHER, AnswerRefused, CapQuestion, decision_of_answer
from tracegen.common.dag_ids import DECIDING_TASK, GENERATE, REVIEW_TASK
from tracegen.run.api_answer import API_CONN_ENV, ASSIGNED_USERS_ENV, AnswerFailed, api_conn_id
from tracegen.run.cap_raise import (
    CapRaise,
    RaiseFacts,
    RaiseRefused,
    check_raise,
    decode,
    encode,
    now_iso,
    served_context,
    variable_key,
)
from tracegen.run.run_spec import RunSpec, RunSpecError

log = logging.getLogger(__name__)
NOT_STARTED = ("none", "scheduled", "queued")
FINISHED = ("success", "skipped", "failed", "upstream_failed", "removed")
# Seconds between the last chunk's look at the Variables and its skip of the question task, with room to spare.
SETTLE_S = 5.0
# A human-in-the-loop task parked until its question is answered (deferred: how providers before Airflow 3.3 wait).
WAITING = ("awaiting_input", "deferred")


class RaiseView(Protocol):
    """What making a raise reads and writes in Airflow's metadata (`tasks.raise_cap.AirflowRaiseView` over the task API)."""

    def run_state(self, run_id: str) -> str | None:
        """The tracegen_generate run's state (lower case), None when Airflow does not know the run."""

    def prepared_run(self, run_id: str) -> Any:
        """The run as its prepare_run handed it over (its `run` XCom), None before that."""

    def servers(self, run_id: str) -> Any:
        """What the run's provision_fleet returned."""

    def deciding_state(self, run_id: str) -> str:
        """The state of the run's `ask_about_cap` (lower case; "none" when it has none yet)."""

    def decided(self, run_id: str) -> Any:
        """What the run's `ask_about_cap` pushed as its XCom `question`: the question asked, or
        {"decided": ...} for a raise it took instead; None when it asked nothing."""

    def review_state(self, run_id: str) -> str:
        """The state of the run's `review_cap` (lower case; "none" when it has none yet)."""

    def answerer(self) -> Any:
        """What answers a question through the REST API (`api_answer.ApiAnswerer`: `answer(...)`, `login`),
        None when the operator configured none. Raises `ConnectionMisconfigured` for a malformed one."""

    def announce(self, raised: CapRaise) -> None:
        """Push `raised` as this task's XCom `answering` (`cap_raise.ANSWERING_KEY`)."""

    def assigned_users(self) -> list[dict[str, str]] | None:
        """Who alone may answer the run's question ({"id", "name"} each: TRACEGEN_QUESTION_ASSIGNED_USERS, as
        `review_cap` poses it), None when anyone Airflow lets answer may."""

    def may_answer(self, user: str) -> bool | None:
        """Whether Airflow lets `user` answer the generate DAG's questions when no users are assigned
        (`api_answer.hitl_permission`); None when that cannot be told here."""

    def facts(self, raised: CapRaise, *, run_cap: int, context_length: int | None) -> RaiseFacts:
        """`RaiseFacts` for an earlier raise, from the raise task it names."""

    def stored(self, key: str) -> str | None:
        """The Variable `key`'s text."""

    def store(self, key: str, text: str, description: str) -> None: ...

    def withdraw(self, key: str) -> None: ...


def request_raise(view: RaiseView, target: str, cap: Any, *, requested_by: str | None, raised_in: str,
                  wait_s: float = 600.0, poll_s: float = 2.0,
                  sleep: Callable[[float], None] = time.sleep) -> CapRaise:
    """Raise the cap of the tracegen_generate run `target` (an Airflow run id) to `cap`, or `RaiseRefused`.

    Refused when the run is not running, has not been prepared yet, or has already decided its cap; the
    cap itself by the one cap rule, above the run's cap (or an earlier raise the run takes) and within the
    servers' context. `requested_by` and `raised_in` come from the raising DagRun, never from the caller's
    say-so: they are what a reader later checks the Variable against (`cap_raise.verify`)."""
    state = view.run_state(target)
    if state not in ("running", "queued"):
        raise RaiseRefused(f"{GENERATE} run {target!r} is {state or 'not found'}: only a running run's cap can "
                           "be raised (a finished one resumes with a new run at the new cap)")
    doc = view.prepared_run(target)
    if not doc:
        raise RaiseRefused(f"run {target!r} has not been prepared yet (its prepare_run has no result): try again "
                           "once it has")
    try:
        spec = RunSpec.from_json(doc, f"run {target!r} as its prepare_run described it")
    except RunSpecError as exc:
        raise RaiseRefused(str(exc)) from None
    key = variable_key(spec.run_id)
    context_length = served_context(view.servers(target))
    earlier = decode(view.stored(key), spec.run_id,
                     lambda r: view.facts(r, run_cap=spec.config.max_tokens, context_length=context_length))
    # The cap first: a cap no run could take is refused as such, whatever moment it arrives at.
    from_cap, new_cap = check_raise(spec, cap, context_length=context_length, earlier=earlier)
    raised = CapRaise(run_id=spec.run_id, cap=new_cap, from_cap=from_cap, requested_by=requested_by,
                      requested_at=now_iso(), raised_in=raised_in)
    if view.deciding_state(target) in NOT_STARTED:
        view.store(key, encode(raised), f"tracegen: raise of run {target}'s max_tokens")
        if _taken(view, target, raised, wait_s=wait_s, poll_s=poll_s, sleep=sleep):
            return raised
        # Read too late: the deciding task decided without it, and may have asked its question instead.
    else:
        _wait_for_deciding(view, target, wait_s=wait_s, poll_s=poll_s, sleep=sleep)
    try:
        return _answer_the_question(view, target, raised, wait_s=wait_s, poll_s=poll_s, sleep=sleep)
    except RaiseRefused:
        if view.stored(key) == encode(raised):
            view.withdraw(key)
        raise


def _answer_the_question(view: RaiseView, target: str, raised: CapRaise, *, wait_s: float, poll_s: float,
                         sleep: Callable[[float], None]) -> CapRaise:
    """The raise as the answer to the question the run asks (module doc), or `RaiseRefused` when there is
    none waiting, the answer would be refused, no API connection is configured, or someone answered first."""
    asked = view.decided(target)
    if not isinstance(asked, dict) or "decided" in asked:
        raise RaiseRefused(f"run {target!r} has already decided its cap ({DECIDING_TASK} has run, or was skipped with "
                           "nothing to ask): start a new run at the new cap, which resumes from the ledger and "
                           "extends the truncated rows")
    question = CapQuestion.from_json(asked)
    try:
        label = question.option_label(OTHER)
        # The one rule for answers (`audit.cap_question.decision_of_answer`), as review_cap will apply it: refused here, before
        # anything is written, rather than there, where it would only be asked again.
        decision_of_answer(question, [label], {CAP_FIELD: raised.cap}, responded_by=raised.requested_by,
               responded_at=raised.requested_at)
    except (StopIteration, AnswerRefused) as exc:
        raise RaiseRefused(f"run {target!r} asks its reviewer, who could not answer {raised.cap:,}: {exc}") from None
    check_respondent(view, target, raised.requested_by)
    review = _wait_for_review(view, target, wait_s=wait_s, poll_s=poll_s, sleep=sleep)
    if review not in WAITING:
        raise RaiseRefused(f"run {target!r} has already decided its cap: its question ({REVIEW_TASK}) is {review}, "
                           "not waiting for an answer; start a new run at the new cap, which resumes from the ledger")
    where = f"answer it in Required Actions ({REVIEW_TASK}) with '{label}' and {raised.cap}"
    try:
        answerer = view.answerer()
    except ValueError as exc:  # ConnectionMisconfigured
        raise RaiseRefused(f"run {target!r} asks its reviewer, and the raise cannot answer: {exc}; {where}") from None
    if answerer is None:
        raise RaiseRefused(f"run {target!r} asks its reviewer, and a raise answers only through the REST API as the "
                           f"user of Airflow connection {api_conn_id()!r} ({API_CONN_ENV}), which is not defined: "
                           f"define it (docs/deployment.md), or {where}")
    view.store(variable_key(raised.run_id), encode(raised), f"tracegen: raise of run {target}'s max_tokens")
    view.announce(raised)
    try:
        answerer.answer(GENERATE, target, REVIEW_TASK, label, {CAP_FIELD: raised.cap})
    except AnswerFailed as exc:
        first = " (someone answered first: the run goes on as they chose)" if exc.status == 409 else ""
        raise RaiseRefused(f"run {target!r} asks its reviewer, and the raise could not answer{first}: {exc}") from None
    log.warning("answered the question of run %r (%s) as %r: '%s' with %d; %s records it as this raise when it "
                "resumes", target, question.subject, answerer.login, label, raised.cap, REVIEW_TASK)
    return raised


def check_respondent(view: RaiseView, target: str, user: str | None) -> None:
    """`RaiseRefused`, naming `user`, unless the person who triggered the raise may answer run `target`'s
    question themselves: one of its assigned users (by id, or by the name the operator gave), or, where none
    are assigned, a user Airflow lets answer it. The raise answers as the API connection's user, whom Airflow
    checks; this checks the person it answers for, so a raise is never a way round who may answer."""
    where = f"answer it in Required Actions ({REVIEW_TASK})"
    if not user:
        raise RaiseRefused(f"run {target!r} asks its reviewer, and this raise names no triggering user, so it cannot "
                           f"answer for anyone: {where}")
    assigned = view.assigned_users()
    if assigned:
        if any(user in (a.get("id"), a.get("name")) for a in assigned):
            return
        names = ", ".join(a.get("id", "?") for a in assigned)
        raise RaiseRefused(f"run {target!r} asks its reviewer, and {user!r}, who triggered this raise, is not one of "
                           f"the users who may answer it ({names}: {ASSIGNED_USERS_ENV}): one of them may raise, or "
                           f"{where}")
    allowed = view.may_answer(user)
    if allowed:
        return
    if allowed is None:
        raise RaiseRefused(f"run {target!r} asks its reviewer, and whether {user!r}, who triggered this raise, may "
                           f"answer it cannot be told from a worker under this auth manager: name who may answer in "
                           f"{ASSIGNED_USERS_ENV}, or {where}")
    raise RaiseRefused(f"run {target!r} asks its reviewer, and {user!r}, who triggered this raise, may not answer "
                       f"{GENERATE}'s questions (Airflow's permission to update its Required Actions): {where}")


def _wait_for_deciding(view: RaiseView, run_id: str, *, wait_s: float, poll_s: float,
                       sleep: Callable[[float], None]) -> str:
    """The deciding task's state once it has finished; a RuntimeError (retried, not refused) after `wait_s`."""
    return _wait_for(view.deciding_state, run_id, FINISHED, wait_s=wait_s, poll_s=poll_s, sleep=sleep,
                     late=f"{DECIDING_TASK} of run {run_id!r} has been {{state}} for {wait_s:.0f} s: whether it took "
                          "the raise is in its log (and in run.json's decisions once it is done)")


def _wait_for_review(view: RaiseView, run_id: str, *, wait_s: float, poll_s: float,
                     sleep: Callable[[float], None]) -> str:
    """The question task's state once it waits for an answer or has finished (it is queued, then poses the
    question, for a moment after the deciding task ends); a RuntimeError after `wait_s`."""
    return _wait_for(view.review_state, run_id, (*WAITING, *FINISHED), wait_s=wait_s, poll_s=poll_s, sleep=sleep,
                     late=f"{REVIEW_TASK} of run {run_id!r} has been {{state}} for {wait_s:.0f} s without asking")


def _wait_for(state_of: Callable[[str], str], run_id: str, until: tuple[str, ...], *, wait_s: float, poll_s: float,
              sleep: Callable[[float], None], late: str) -> str:
    state, deadline = state_of(run_id), time.monotonic() + wait_s
    while state not in until:
        if time.monotonic() > deadline:
            raise RuntimeError(late.format(state=state))
        sleep(poll_s)
        state = state_of(run_id)
    return state


def _taken(view: RaiseView, run_id: str, raised: CapRaise, *, wait_s: float, poll_s: float,
           sleep: Callable[[float], None]) -> bool:
    """Whether the run's deciding task takes the raise just written. Not started yet, it will, unless the
    last chunk of the first fan-out is skipping it on a look at the Variables taken just before the write
    (`tasks.question.settle_when_last`): so look again once such a skip would show. Started, it may
    have read before the write, so wait for it and see whether its decision is this raise."""
    if view.deciding_state(run_id) in NOT_STARTED:
        sleep(SETTLE_S)
        if view.deciding_state(run_id) in NOT_STARTED:
            return True
    _wait_for_deciding(view, run_id, wait_s=wait_s, poll_s=poll_s, sleep=sleep)
    decided = (view.decided(run_id) or {}).get("decided") or {}
    return decided.get("responded_at") == raised.requested_at and decided.get("cap") == raised.cap
