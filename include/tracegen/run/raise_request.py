"""Making a raise: what the `tracegen_raise_cap` task does, over Airflow's metadata seen through `RaiseView`.

The raise is checked against the run as its first task described it and the servers' context length,
kept as the run's Variable, and then confirmed taken: the run reads a raise once, when its deciding task
(`ask_about_cap`) starts, so a raise written while that task is already running may have been read too
late. The raise waits for the task to finish and keeps the raise only if the run's decision is it;
otherwise it withdraws the Variable and refuses, and nothing changed.

Everything here is refused with `RaiseRefused`, whose message says why and what would be accepted; the
Airflow task (`steps.raise_cap`) turns it into a failure without retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from tracegen.dag_ids import DECIDING_TASK, GENERATE, REVIEW_TASK
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
from tracegen.run.spec import RunSpec, RunSpecError

NOT_STARTED = ("none", "scheduled", "queued")
FINISHED = ("success", "skipped", "failed", "upstream_failed", "removed")


class RaiseView(Protocol):
    """What making a raise reads and writes in Airflow's metadata (`steps` implements it over the task API)."""

    def run_state(self, run_id: str) -> str | None:
        """The tracegen_generate run's state (lower case), None when Airflow does not know the run."""

    def prepared_run(self, run_id: str) -> Any:
        """The run as its prepare_run handed it over (its `run` XCom), None before that."""

    def servers(self, run_id: str) -> Any:
        """What the run's provision_fleet returned."""

    def deciding_state(self, run_id: str) -> str:
        """The state of the run's `ask_about_cap` (lower case; "none" when it has none yet)."""

    def decided(self, run_id: str) -> Any:
        """What the run's `ask_about_cap` returned."""

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
    if view.deciding_state(target) not in NOT_STARTED:
        raise RaiseRefused(f"run {target!r} has already decided its cap ({DECIDING_TASK} has started): if its "
                           f"question waits in Required Actions ({REVIEW_TASK}), answer it there with 'Continue at the "
                           "cap typed below' and this cap; otherwise start a new run at the new cap, which resumes "
                           "from the ledger and extends the truncated rows")
    raised = CapRaise(run_id=spec.run_id, cap=new_cap, from_cap=from_cap, requested_by=requested_by,
                      requested_at=now_iso(), raised_in=raised_in)
    view.store(key, encode(raised), f"tracegen: raise of run {target}'s max_tokens")
    if not _taken(view, target, raised, wait_s=wait_s, poll_s=poll_s, sleep=sleep):
        view.withdraw(key)
        raise RaiseRefused(f"run {target!r} decided its cap while this raise was written; nothing changed: "
                           "start a new run at the new cap")
    return raised


def _taken(view: RaiseView, run_id: str, raised: CapRaise, *, wait_s: float, poll_s: float,
           sleep: Callable[[float], None]) -> bool:
    """Whether the run will act on the raise just written. Its deciding task not started yet, it will;
    started, it may have read before the write, so wait for it (seconds) and see whether its decision is
    this raise. A task still running after `wait_s` is a RuntimeError: retried, not refused."""
    state, deadline = view.deciding_state(run_id), time.monotonic() + wait_s
    while state not in NOT_STARTED and state not in FINISHED:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{DECIDING_TASK} of run {run_id!r} has been {state} for {wait_s:.0f} s: whether it "
                               f"took the raise is in its log (and in run.json's decisions once it is done)")
        sleep(poll_s)
        state = view.deciding_state(run_id)
    if state in NOT_STARTED:
        return True
    decided = (view.decided(run_id) or {}).get("decided") or {}
    return decided.get("responded_at") == raised.requested_at and decided.get("cap") == raised.cap
