"""A mid-run pivot: an operator raises the cap of a running run from the UI, and the same run goes on.

A team without it raises 4096 to 8192 by killing the job, checking, and relaunching. Here the operator
triggers `tracegen_raise_cap` with the run's id and the new cap, and nothing is killed:

1. The raise is checked against the run as its first task described it (the `RunSpec` in Airflow's
   XCom, never a record read back from the output root) and against the servers' context length, then
   kept as an Airflow Variable named after the run. Airflow's metadata, not the bucket: who may raise a
   cap is who may trigger a DAG and write Variables, not whoever can write to the output root.
2. Each chunk task of the run reads it when it starts and generates at the raised cap; chunks already
   running finish at the cap they started with. Read, a Variable is trusted only as `verify` says: the
   raise task it names succeeded and returned exactly it, and its cap passes the one cap rule
   (`tracegen.common.cap_rule`) against the run's cap and the servers' context length; anything else is
   ignored and logged (`decode`).
3. After the first fan-out, `ask_about_cap` turns it into the run's decision (a `CapDecision` with trigger
   `raise`), recorded in `run.json` and the report like a reviewer's answer. The second fan-out then
   generates what is left at the new cap: the rows truncated under the old cap, extended from their
   token ids (`truncated_policy=extend`; no prefix is paid for twice), and any chunk held back.

A raise is taken this way until the run decides (`ask_about_cap` runs). If the run asked its reviewer
instead, a raise made while the question waits is its answer (`run.raise_request`, answered through the REST
API as the operator's API user): `review_cap` records it by the person who raised (`answered_by_raise`),
once `verify(..., answering=True)` vouches for it. Once the question is answered, the raise task refuses and
says to start a new run, which resumes from the ledger.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from tracegen.audit.cap_question import OTHER, RAISE, CapDecision
from tracegen.common import dag_ids
from tracegen.common.cap_rule import CapRefused, check_cap
from tracegen.run.run_spec import RunSpec, RunSpecError

log = logging.getLogger(__name__)

VARIABLE_PREFIX = "tracegen_cap_raise__"
# The raise task's XCom, pushed before it answers a question that waits: what `review_cap` checks the answer
# against while that task has not yet returned (`verify(..., answering=True)`).
ANSWERING_KEY = "answering"
GENERATE_DAG = dag_ids.GENERATE
RAISE_DAG, RAISE_TASK = dag_ids.RAISE_CAP, dag_ids.RAISE_TASK  # the DAG and task that make a raise


class RaiseRefused(ValueError):
    """A raise the run cannot take; the message says why and what would be accepted."""


@dataclass(frozen=True)
class CapRaise:
    """One raise of a running run's cap: by whom, when, from which cap to which."""

    run_id: str  # the tracegen run id (`RunSpec.run_id`)
    cap: int
    from_cap: int
    requested_by: str | None
    requested_at: str  # ISO 8601, UTC
    raised_in: str  # the Airflow run id of the tracegen_raise_cap run that made it (its log, its result)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CapRaise:
        """Decode a stored raise; anything else is refused, naming `where`. Variables can be edited by
        hand, so the caps are checked by the one cap rule (`tracegen.common.cap_rule`)."""
        if not isinstance(doc, dict):
            raise RaiseRefused(f"{where}: expected a JSON object, got {type(doc).__name__}")
        try:
            raised = cls(**doc)
        except TypeError as exc:
            raise RaiseRefused(f"{where}: {exc}") from None
        for name in ("cap", "from_cap"):
            try:
                check_cap(getattr(raised, name), name=name)
            except CapRefused as exc:
                raise RaiseRefused(f"{where}: {exc}") from None
        if not all(isinstance(v, str) for v in (raised.run_id, raised.requested_at, raised.raised_in)):
            raise RaiseRefused(f"{where}: run_id, requested_at and raised_in must be strings")
        if raised.requested_by is not None and not isinstance(raised.requested_by, str):
            raise RaiseRefused(f"{where}: requested_by must be a string or null")
        return raised

    def summary(self) -> str:
        return (f"{self.requested_by or 'unknown'} raised max_tokens {self.from_cap:,} -> {self.cap:,} at "
                f"{self.requested_at} ({RAISE_DAG} run {self.raised_in})")


def variable_key(run_id: str) -> str:
    """The Airflow Variable holding `run_id`'s raise (run ids are already safe for keys)."""
    return VARIABLE_PREFIX + run_id


def check_raise(spec: RunSpec, cap: Any, *, context_length: int | None, earlier: CapRaise | None) -> tuple[int, int]:
    """(from_cap, cap) for a raise of `spec`'s run to `cap`, or `RaiseRefused` saying what fits.

    The one cap rule (`tracegen.common.cap_rule`), as for a reviewer's answer: only up, as a lower cap is not a
    pivot (the rows done at the higher cap would have to be cut, and their real endings are what the
    dataset is for); a second raise goes up from the first."""
    current = earlier.cap if earlier is not None else spec.config.max_tokens
    how = (f"raised to {current:,} by {earlier.requested_by or 'unknown'} at {earlier.requested_at}"
           if earlier is not None else None)
    try:
        return current, check_cap(cap, name="max_tokens", current=current, current_is=how,
                                   context_length=context_length, hint="to lower a cap, start a new run")
    except CapRefused as exc:
        raise RaiseRefused(str(exc)) from None


def encode(raised: CapRaise) -> str:
    return json.dumps(raised.to_json())


def parse(text: str | None, run_id: str) -> CapRaise | None:
    """The raise stored for `run_id` as written, or None; a malformed one is refused, naming the Variable.
    Not yet trusted: `decode` is how a run reads its raise."""
    if text in (None, ""):
        return None
    where = f"Airflow Variable {variable_key(run_id)}"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RaiseRefused(f"{where}: not JSON ({exc})") from None
    raised = CapRaise.from_json(doc, where)
    if raised.run_id != run_id:
        raise RaiseRefused(f"{where}: names run {raised.run_id!r}, not {run_id!r}")
    return raised


# ---- whether a stored raise is the run's decision ---------------------------------------------------


@dataclass(frozen=True)
class RaiseFacts:
    """What Airflow's metadata, not the Variable, says about a raise of a run."""

    run_cap: int  # the run's cap, as its prepare_run described it
    context_length: int | None  # the servers', as its provision_fleet read them
    raise_state: str | None  # the state of `raise_cap` in the tracegen_raise_cap run the raise names
    record: Any  # what that task returned (its XCom): None unless it succeeded


def verify(raised: CapRaise, facts: RaiseFacts, *, answering: bool = False) -> CapRaise:
    """`raised` when the run may act on it, else `RaiseRefused` naming why.

    A Variable is only where a raise is kept, and anyone who may write Variables may write it. What makes
    it the run's decision is the `tracegen_raise_cap` run it names (`raised_in`): its `raise_cap` task
    must have succeeded and returned exactly this raise. That task checked the cap against the run as
    its prepare_run described it and the servers' context length as provision_fleet read them, and took
    `requested_by` from its own DagRun (the user Airflow authenticated when it was triggered) and
    `requested_at` from its own clock: so by whom and when come from the raising DagRun, never from the
    Variable's say-so. (A task can read another DAG run's task states and XComs, not its triggering user:
    the raise task's result is where Airflow keeps what that DagRun said.) Then the cap is checked again
    by the one cap rule against the run's cap and the servers' context length, as read now.

    Until the raise task has succeeded (it writes the Variable, then checks the run has not decided yet)
    its raise is not taken; `run.raise_request` settles the race with `ask_about_cap`: had that task
    read the Variable in between, its decision is not this raise, and the raise is withdrawn and refused.

    `answering`: read by `review_cap` for an answer given as the raise's user while the raise task may still
    run (it answers, then returns): its XCom `answering` (`facts.record`, pushed before it answered) must be
    this raise, and the task running or succeeded."""
    _, made = _vouching(answering)
    if facts.raise_state not in made:
        raise RaiseRefused(f"it names {RAISE_DAG} run {raised.raised_in!r}, whose {RAISE_TASK} task is "
                           f"{facts.raise_state or 'not found'}, not {' or '.join(made)}: no raise task made it")
    if facts.record != raised.to_json():
        raise RaiseRefused(f"it differs from what {RAISE_DAG} run {raised.raised_in!r} raised "
                           f"({_short(facts.record)}): written by hand")
    try:
        check_cap(raised.cap, name="max_tokens", current=facts.run_cap, context_length=facts.context_length)
    except CapRefused as exc:
        raise RaiseRefused(str(exc)) from None
    if not facts.run_cap <= raised.from_cap < raised.cap:
        raise RaiseRefused(f"it raises from {raised.from_cap:,}, not from the run's cap of {facts.run_cap:,} or "
                           f"an earlier raise below {raised.cap:,}")
    return raised


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


def decode(
    text: str | None, run_id: str, facts: Callable[[CapRaise], RaiseFacts] | None = None, *, answering: bool = False
) -> CapRaise | None:
    """The raise the run `run_id` may act on, or None: none stored, or one that fails `parse` or `verify`,
    which is ignored and logged, naming the Variable and why. Ignored, not failing the task: a Variable
    nobody's raise made is not a decision, and whoever may write Variables must not be able to stop runs.

    `facts(raised)`: what Airflow's metadata says about it; by default read by the task running this (a
    task of the run `run_id`: `airflow_facts`). `answering`: as `verify`'s."""
    key = variable_key(run_id)
    try:
        raised = parse(text, run_id)
        if raised is None:
            return None
        facts = facts or (lambda r: _facts_of_this_run(r, answering=answering))
        return verify(raised, facts(raised), answering=answering)
    except (RaiseRefused, RunSpecError) as exc:
        log.warning("Airflow Variable %s ignored, not a raise this run takes: %s", key, exc)
        return None


def served_context(servers: Any) -> int | None:
    """The servers' context length as `provision_fleet` returned it (the smallest, should they differ)."""
    lengths = [s.get("context_length") for s in servers or [] if isinstance(s, dict)]
    return min((n for n in lengths if type(n) is int and n > 0), default=None)


def raise_facts(ti: Any, raised: CapRaise, *, run_cap: int, context_length: int | None,
                answering: bool = False) -> RaiseFacts:
    """`RaiseFacts` with the state and result of the raise task `raised` names, read through `ti` (an
    Airflow task instance: `get_task_states` and `xcom_pull` across DAGs). `answering`: its XCom
    `answering` instead of its result, read while it runs too (`verify`)."""
    state = dag_ids.task_state(ti, RAISE_DAG, raised.raised_in, RAISE_TASK)
    key, made = _vouching(answering)
    record = (ti.xcom_pull(task_ids=RAISE_TASK, dag_id=RAISE_DAG, run_id=raised.raised_in, key=key,
                           map_indexes=-1) if state in made else None)
    return RaiseFacts(run_cap=run_cap, context_length=context_length, raise_state=state, record=record)


def _vouching(answering: bool) -> tuple[str, tuple[str, ...]]:
    """(the raise task's XCom that vouches for a raise, the states it vouches in): its result once it has
    succeeded; while it answers a question, the `answering` it pushed first, running or succeeded."""
    return (ANSWERING_KEY, ("running", "success")) if answering else ("return_value", ("success",))


def airflow_facts(ti: Any, run_id: str | None = None, *, answering: bool = False) -> Callable[[CapRaise], RaiseFacts]:
    """`facts` for `decode` from Airflow's metadata: the run's cap from its prepare_run, the servers'
    context length from its provision_fleet, and the raise task's state and result. `run_id`: the
    tracegen_generate run's Airflow run id (None: the run `ti` belongs to)."""
    where = {} if run_id is None else {"dag_id": GENERATE_DAG, "run_id": run_id}

    def facts(raised: CapRaise) -> RaiseFacts:
        doc = ti.xcom_pull(task_ids=dag_ids.PREPARE_RUN, key="run", map_indexes=-1, **where)
        spec = RunSpec.from_json(doc, "the run as its prepare_run described it")
        servers = ti.xcom_pull(task_ids=dag_ids.PROVISION_FLEET, map_indexes=-1, **where)
        return raise_facts(ti, raised, run_cap=spec.config.max_tokens, context_length=served_context(servers),
                           answering=answering)

    return facts


def _facts_of_this_run(raised: CapRaise, *, answering: bool = False) -> RaiseFacts:
    """`airflow_facts` read by the task running now; outside a task nothing can vouch for a raise."""
    try:
        from airflow.sdk import get_current_context

        ti = get_current_context()["ti"]
    except Exception as exc:  # noqa: BLE001 - no task context: nothing to check the raise against
        raise RaiseRefused(f"no Airflow task context to check it against ({exc})") from None
    return airflow_facts(ti, answering=answering)(raised)


def at_raised_cap(spec: RunSpec, raised: CapRaise | None) -> RunSpec:
    """The run a chunk task generates for: at the raised cap when a raise above the run's cap is in.

    Not recorded: the run's record takes the raise once, as a decision, when the run decides. The gate
    stays as configured: the continuous gate judges the raised cap like any other."""
    if raised is None or raised.cap <= spec.config.max_tokens:
        return spec
    return replace(spec, config=replace(spec.config, max_tokens=raised.cap))


def current_raise(api: Any, run_id: str) -> CapRaise | None:
    """The operator's raise of run `run_id`'s cap (`tracegen_raise_cap`), as a task reads it now through
    `api` (`tasks.api.TaskApi`), or None. A Variable no raise task made, or whose cap the run cannot
    take, is ignored and logged (`decode`), never trusted and never a reason to fail the run."""
    return decode(api.variable(variable_key(run_id)), run_id)


def at_current_cap(api: Any, spec: RunSpec) -> RunSpec:
    """`at_raised_cap` with the raise as it stands when the task starts; logged when it changes the cap."""
    raised = current_raise(api, spec.run_id)
    at = at_raised_cap(spec, raised)
    if at is not spec:
        log.warning("generating at max_tokens=%d, not %d: %s", at.config.max_tokens, spec.config.max_tokens,
                    raised.summary())
    return at


def as_decision(spec: RunSpec, raised: CapRaise) -> CapDecision:
    """The raise as the run's decision: recorded in `run.json` and the report like a reviewer's answer."""
    return CapDecision(
        trigger=RAISE, option=f"Raised to {raised.cap:,} while running", kind=OTHER, from_cap=spec.config.max_tokens,
        cap=raised.cap, responded_by=raised.requested_by, responded_at=raised.requested_at, timed_out=False,
        verdict={}, cap_rows=[], report_uri="",
    )


def answered_by_raise(decision: CapDecision, raised: CapRaise, answered_as: str) -> CapDecision:
    """The answer a raise gave a question that waited (`run.raise_request`), as the run records it: by the
    person who triggered the raise, not the API user it answered as, and saying so. Still the answer to the
    question (its trigger, its verdict and table), so the report accounts for what was generated meanwhile."""
    return replace(decision, responded_by=raised.requested_by,
                   option=f"Raised to {raised.cap:,} with {RAISE_DAG} (run {raised.raised_in}), answered as "
                          f"{answered_as}")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
