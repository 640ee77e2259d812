"""The task callables the DAG files wire together: Airflow context in, one call into the package out.

This is the one module that reads Airflow's task context. Each task wraps it in a `tasks.api.TaskApi`,
calls one function below with it and its inputs, and maps the outcome to Airflow's (`_outcome`): a return
value is the task's XCom, a `tasks.outcomes.Skip` a skip, a `Refuse` or a configuration error (a bad param,
a fleet changed since the run began, a raise the run cannot take) a failure without retries, since a retry
would meet the same input. Imports of Airflow and of the heavy modules happen inside the functions, so a
DAG file importing this module parses in milliseconds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tracegen.tasks.chunks import CHUNK_LABEL_TEMPLATE, CHUNK_TASK_DOC

__all__ = ["CHUNK_LABEL_TEMPLATE", "CHUNK_TASK_DOC"]

log = logging.getLogger(__name__)


def _context() -> dict[str, Any]:
    from airflow.sdk import get_current_context

    return get_current_context()


def _api():
    from tracegen.tasks.api import TaskApi

    return TaskApi(_context())


@contextmanager
def _outcome() -> Iterator[None]:
    """The outcomes of the work below, as Airflow's (see the module's docstring)."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from tracegen.config import ConfigError
    from tracegen.fleet.spec import FleetSpecError
    from tracegen.run.cap_raise import RaiseRefused
    from tracegen.tasks.outcomes import Refuse, Skip

    try:
        yield
    except Skip as exc:
        raise AirflowSkipException(str(exc)) from None
    except (Refuse, ConfigError, FleetSpecError, RaiseRefused) as exc:
        raise AirflowFailException(str(exc)) from None


def refuse_unknown_conf(ctx: dict[str, Any] | None = None) -> None:
    """Fail the task, without retries, when its DagRun's conf holds a key that is not one of the DAG's (or
    the task's) params: the one check for every DAG that takes conf (`config.check_conf_keys`). Outside a
    DagRun nothing was triggered with conf."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.config import ConfigError, check_conf_keys

    ctx = _context() if ctx is None else ctx
    dag_run, dag = ctx.get("dag_run"), ctx.get("dag")
    if dag_run is None or dag is None:
        return
    declared = set(dag.params.keys()) | set(getattr(ctx.get("task"), "params", None) or {})
    try:
        check_conf_keys(getattr(dag_run, "conf", None), declared, dag_id=dag.dag_id)
    except ConfigError as exc:
        raise AirflowFailException(f"invalid params: {exc}") from None


# ---- tracegen_generate ------------------------------------------------------------------------------


def prepare_run(lead: int) -> dict[str, Any]:
    """The run's first task (`tasks.prepare.prepare_task`): a bad param fails it, naming the param, before
    anything is launched."""
    from tracegen.tasks.prepare import prepare_task

    api = _api()
    refuse_unknown_conf(api.ctx)
    with _outcome():
        return prepare_task(api, lead)


def provision_fleet(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One server per GPU, healthy, whose context holds the cap (`tasks.provision`)."""
    from tracegen.run.run_spec import handed_over
    from tracegen.tasks.provision import provision_for_run

    with _outcome():
        return provision_for_run(handed_over(run))


def run_pilot(run: dict[str, Any]) -> dict[str, Any]:
    """Generate the pilot sample; its rows are committed like any other and never generated twice."""
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import run_pilot as pilot
    from tracegen.run.run_spec import handed_over

    with _outcome():
        spec = handed_over(run)
        summary = pilot(spec, fleet=resolve(spec.fleet), attempt=_api().attempt())
    if summary is None:
        log.info("pilot_size=0: no pilot; the continuous gate watches the fan-out instead")
        return {"indices": 0}
    return {"indices": summary.considered, **summary.to_json()}


def measure_tail(run: dict[str, Any], pilot: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """The tail measured past the cap before the gate reports (`tasks.pilot.measure_tail`)."""
    from tracegen.tasks.pilot import measure_tail as measure

    with _outcome():
        return measure(run, pilot, servers)


def audit_and_gate(
    run: dict[str, Any], pilot: dict[str, Any], chunks: list[dict[str, Any]], servers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The pilot gate (`tasks.pilot.audit_and_gate`): the chunks to fan out past it."""
    from tracegen.tasks.pilot import audit_and_gate as gate

    with _outcome():
        return gate(run, pilot, chunks, servers)


def generate_chunk(run: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """One mapped task past the pilot gate, or at the decided cap: generate what is left of one chunk.
    Starts only while the running gate holds."""
    from tracegen.tasks.chunks import generate_chunk as generate

    with _outcome():
        return generate(_api(), run, chunk, alongside_pilot=False)


def generate_alongside_pilot(run: dict[str, Any], chunks: list[dict[str, Any]], slot: int) -> dict[str, Any]:
    """The plan's chunk number `slot` (one of the first few), generated while the pilot runs and the gate
    audits it: leaves the pilot's rows to the pilot, and stops (committing what finished) as soon as the
    gate says stop."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.tasks.chunks import generate_chunk as generate

    api = _api()
    if slot >= len(chunks):
        api.label(f"slot {slot}: no chunk")
        raise AirflowSkipException(f"the plan has {len(chunks)} chunks with work; none for slot {slot}")
    with _outcome():
        return generate(api, run, chunks[slot], alongside_pilot=True)


def ask_about_cap(run: dict[str, Any], pilot: dict[str, Any], servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After the first fan-out, under gate_mode=ask: the question, or the raise taken instead, or nothing
    to ask (skipped, and the question's chain with it): `tasks.question.ask_about_cap`."""
    from tracegen.tasks.question import ask_about_cap as ask

    with _outcome():
        return ask(_api(), run, pilot, servers)


def generate_while_asking(run: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """One chunk generated while the gate's question waits (`tasks.chunks.generate_while_asking`)."""
    from tracegen.tasks.chunks import generate_while_asking as generate

    with _outcome():
        return generate(_api(), run, chunk)


def apply_decision(decision: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The reviewer's answer applied (`tasks.question.apply_decision`): the chunks at its cap."""
    from tracegen.tasks.question import apply_decision as apply

    with _outcome():
        return apply(_api(), decision)


def resample_runaways(run: dict[str, Any]) -> dict[str, Any]:
    """runaway_policy=resample, once the fan-outs are over: one fresh sample for each runaway row (its tail
    loops, no cap finishes it), under the run's cap as decided; skipped under any other policy, and when
    the run stopped at its gate (a stopped run spends no more GPU time)."""
    from tracegen.tasks.question import as_decided
    from tracegen.tasks.resample import resample_decided_run

    with _outcome():
        return resample_decided_run(as_decided(_api(), run))


def final_report(run: dict[str, Any]) -> dict[str, Any]:
    """Audit the whole output root at the run's cap and write report.json / report.html beside the data.

    The cap, and the reviewer's decision when the gate asked, are the decided run's (`apply_decision`'s
    XCom, pushed for a stop too): this task runs whatever happened, so a run that never decided is
    audited at the cap it was prepared with; one whose first task failed has nothing to audit, and the
    task is skipped saying so, leaving that failure (and the watcher's, which fails the run) to read."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.run.run_report import audit_and_report
    from tracegen.tasks.question import as_decided

    if not run:
        raise AirflowSkipException("no report: prepare_run did not describe the run (it failed; its log says why)")
    with _outcome():
        return audit_and_report(as_decided(_api(), run), name="report").to_json()


def teardown_fleet(run: dict[str, Any]) -> str:
    """Stop the servers when the run asked for it; otherwise leave them for the next run. Skipped, saying
    why, when the first task failed: then no server was launched for the run."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.fleet import teardown
    from tracegen.fleet.sources import resolve
    from tracegen.run.run_spec import handed_over

    if not run:
        raise AirflowSkipException("nothing to stop: prepare_run did not describe the run (it failed; its log says "
                                   "why), so no server was launched for it")
    with _outcome():
        spec = handed_over(run)
        if not spec.teardown:
            return "servers left running (teardown=false)"
        return f"stopped {len(teardown(resolve(spec.fleet)))} servers"


def watcher() -> None:
    """Fails the run when any task failed: teardown and report run with relaxed trigger rules, and
    without this the run would look successful whenever they did."""
    from airflow.sdk.exceptions import AirflowFailException

    raise AirflowFailException("a task of this run failed; see the failed task's log and the run's report")


# ---- tracegen_raise_cap ----------------------------------------------------------------------------


def raise_cap() -> dict[str, Any]:
    """Raise the cap of a running `tracegen_generate` run (params `run_id`, `max_tokens`):
    `tasks.raise_cap.raise_from_task`. A refusal fails the task without retries, naming why."""
    from tracegen.tasks.raise_cap import raise_from_task

    api = _api()
    refuse_unknown_conf(api.ctx)
    with _outcome():
        return raise_from_task(api)


# ---- tracegen_rerun_failed -------------------------------------------------------------------------


def find_unfinished_work() -> list[dict[str, Any]]:
    """Chunks with failed or missing rows in the newest run of each output root, as Airflow knows the run;
    [] when all is done, and nothing for a root a live run or another writer owns (`run.rerun`)."""
    from tracegen.params import output_roots
    from tracegen.tasks.rerun import unfinished_in_roots

    api = _api()
    refuse_unknown_conf(api.ctx)
    return unfinished_in_roots(api, output_roots())


def rerun_unfinished(work: dict[str, Any]) -> dict[str, Any]:
    """What is left of one chunk, on the operator's fleet (`tasks.chunks.rerun_chunk`)."""
    from tracegen.tasks.rerun import rerun_chunk

    with _outcome():
        return rerun_chunk(_api(), work)


# ---- tracegen_fleet ---------------------------------------------------------------------------------


def fleet_action() -> list[dict[str, Any]]:
    """Start, stop or show the servers of a fleet the operator listed (params `fleet`, `action`)."""
    from dataclasses import asdict

    from tracegen.fleet import FleetSpecError, provision, status, teardown
    from tracegen.fleet.sources import listed_fleet, load_fleet
    from tracegen.tasks.outcomes import Refuse

    api = _api()
    refuse_unknown_conf(api.ctx)
    params = api.params
    with _outcome():
        try:
            fleet = load_fleet(listed_fleet(params["fleet"]))
        except FleetSpecError as exc:
            raise Refuse(f"invalid params: {exc}") from None
    act = {"start": provision, "stop": teardown}.get(params["action"], status)
    result = [asdict(item) for item in act(fleet)]
    for item in result:
        log.info("%s", json.dumps(item, default=str))
    return result
