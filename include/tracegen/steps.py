"""The task callables the DAG files wire together: Airflow context in, one call into the package out.

This is the one module that touches Airflow's task context. Each task decodes the run's `RunSpec` (built
once, by `prepare_run`), resolves the fleet from the operator's configuration when it talks to servers,
and calls one function below it. Imports of Airflow and of the heavy modules happen inside the
functions, so a DAG file importing this module parses in milliseconds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tracegen import dag_ids
from tracegen.params import CONFIG_PARAMS, default_fleet_source, output_roots

log = logging.getLogger(__name__)


def _context() -> dict[str, Any]:
    from airflow.sdk import get_current_context

    return get_current_context()


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
    task = ctx.get("task")
    declared = set(dag.params.keys()) | set(getattr(task, "params", None) or {})
    try:
        check_conf_keys(getattr(dag_run, "conf", None), declared, dag_id=dag.dag_id)
    except ConfigError as exc:
        raise AirflowFailException(f"invalid params: {exc}") from None


def _attempt():
    """This task's try, for the chunk's claim (`store.claims`): a newer try of a chunk always wins over an
    older one still running on another worker."""
    from tracegen.store.claims import Attempt

    ti = _context().get("ti")
    task_id, map_index = getattr(ti, "task_id", "task"), getattr(ti, "map_index", -1)
    task = task_id if not isinstance(map_index, int) or map_index < 0 else f"{task_id}[{map_index}]"
    tried = getattr(ti, "try_number", None)
    return Attempt(f"{getattr(ti, 'dag_id', '?')}/{task}", tried if isinstance(tried, int) else None)


def _spec(run: dict[str, Any]):
    from tracegen.run.spec import RunSpec

    return RunSpec.from_json(run, "the run handed over by prepare_run")


def _fleet(spec):
    """The run's fleet from the source it recorded; refused, without retries, when it has changed since."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.fleet import FleetSpecError
    from tracegen.fleet.sources import resolve

    try:
        return resolve(spec.fleet)
    except FleetSpecError as exc:
        raise AirflowFailException(str(exc)) from None


@contextmanager
def _refused_without_retry() -> Iterator[None]:
    """A `ConfigError` inside (a cap over a server's context) fails the task without retries: a retry
    would meet the same servers."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.config import ConfigError

    try:
        yield
    except ConfigError as exc:
        raise AirflowFailException(str(exc)) from None


# ---- tracegen_generate ------------------------------------------------------------------------------


def prepare_run(lead: int) -> dict[str, Any]:
    """The run's first task: params → validated `RunConfig` and fleet, then the plan: the dataset indexed
    and bound to the output root, the chunk layout (staggered over `lead` chunk tasks, the DAG's own
    number), the run's record stored, and the chunks with work left. A bad param fails here, naming it,
    before anything is launched: a cap the fleet's declared context length (its `--context-length`
    flag) cannot hold is refused here too, so a value the trigger form clamped to its maximum never
    reaches a server (a fleet that declares none is checked by provision_fleet, from the servers)."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.config import ConfigError, RunConfig, safe_run_id
    from tracegen.fleet import FleetSpecError
    from tracegen.fleet.sources import listed_fleet, reference
    from tracegen.run.prepare import prepare_run as prepare
    from tracegen.run.records import RunRecordTaken

    ctx = _context()
    refuse_unknown_conf(ctx)
    params = dict(ctx["params"])
    try:
        config = RunConfig.from_params({k: params[k] for k in CONFIG_PARAMS})
        fleet, ref = reference(listed_fleet(params.get("fleet") or default_fleet_source()))
        declared = fleet.sglang_flags.get("--context-length")
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
            config.check_context_length(declared)
    except (ConfigError, FleetSpecError) as exc:
        raise AirflowFailException(f"invalid params: {exc}") from None
    try:
        safe_run_id(ctx["run_id"])
        spec, work = prepare(config, None, ref, stagger=lead, teardown=bool(params.get("teardown", False)),
                             airflow_run_id=ctx["run_id"])
    except (ConfigError, RunRecordTaken) as exc:
        raise AirflowFailException(f"run {ctx['run_id']!r}: {exc}") from None
    log.info("run %s (stored as %s): max_tokens=%d, dataset %s, output %s, %d GPUs", ctx["run_id"], spec.run_id,
             config.max_tokens, config.dataset_uri, config.output_uri, len(fleet.servers()))
    if config.runaway_policy != "resample":
        # Skipped now, not by a process started after the last chunk only to skip itself: the report and
        # teardown then follow the last chunk in the scheduler's next loop (docs/benchmarks.md).
        _skip_tasks(dag_ids.RESAMPLE_RUNAWAYS)
    return {"run": spec.to_json(), "chunks": [w.to_json() for w in work]}


def _skip_tasks(*task_ids: str) -> None:
    """Mark tasks of this run skipped before they start (`tracegen.run.skip_tasks`)."""
    from tracegen.run.skip_tasks import skip_tasks

    skip_tasks(*task_ids)


def provision_fleet(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Launch or reuse one server per GPU and wait for health; check the cap fits the model's context.

    Returns each server with the context length it reports: the gate and its question (which caps a
    reviewer may choose) read it from here."""
    from tracegen.fleet import FleetConnection, provision
    from tracegen.generate.chunk import check_served_context

    spec = _spec(run)
    fleet = _fleet(spec)
    with FleetConnection(fleet) as connection:
        handles = provision(fleet, connection)
        with _refused_without_retry():
            context_lengths = check_served_context(spec.config, handles, connection.headers())
        _record_servers(spec, [h.url for h in handles], connection.headers())
    for handle in handles:
        log.info("%s: %s server pid %d (%s)", handle.label, "reused" if handle.reused else "launched",
                 handle.pid, handle.model)
    return [{"server": h.label, "pid": h.pid, "reused": h.reused, "context_length": context_lengths[h.label]}
            for h in handles]


def _record_servers(spec, urls: list[str], headers: dict[str, str]) -> None:
    """Keep what the servers say about their model, tokenizer, chat template and SGLang version beside the
    run (`runs/<run>/servers.json`), for the export's provenance. Provenance, not a condition to generate:
    a server that does not answer is logged, and the export's manifest then says it was not recorded."""
    from tracegen.export.servers import record
    from tracegen.store.root import open_root

    try:
        doc = record(open_root(spec.config.output_uri, spec.config.aws_conn_id), spec.run_id, urls, headers)
    except Exception as exc:  # noqa: BLE001 - provenance must never stop a run
        log.warning("could not record what the servers report about themselves (%s: %s); the export's "
                    "manifest will say so", type(exc).__name__, exc)
        return
    log.info("servers: %s", {k: doc.get(k) for k in ("model_path", "sglang_version", "agree")})


def run_pilot(run: dict[str, Any]) -> dict[str, Any]:
    """Generate the pilot sample; its rows are committed like any other and never generated twice."""
    from tracegen.generate.chunk import run_pilot as pilot

    spec = _spec(run)
    with _refused_without_retry():
        summary = pilot(spec, fleet=_fleet(spec), attempt=_attempt())
    if summary is None:
        log.info("pilot_size=0: no pilot; the continuous gate watches the fan-out instead")
        return {"indices": 0}
    return {"indices": summary.considered, **summary.to_json()}


def measure_tail(run: dict[str, Any], pilot: dict[str, Any], servers: list[dict[str, Any]]) -> dict[str, Any]:
    """Measure the tail before the gate reports (`tracegen.generate.measure`): when the pilot's truncation
    is over the threshold (measure_tail=auto) or always, continue its truncated rows from their tokens to
    the highest candidate cap the context and the token budget allow, so the pilot report's cap table is
    measured up to that cap. The pilot report is written first, for its verdict: the chunks beside the
    pilot stop on it and leave the fleet to the measurement; the gate's audit then rewrites it."""
    from tracegen.generate.measure import measure_tail as measure
    from tracegen.plan import pilot_indices
    from tracegen.run.report import audit_and_report
    from tracegen.store.root import open_root

    spec = _spec(run)
    if not pilot.get("indices"):
        return {"cap": None, "reason": "no pilot"}
    context_length = _context_length(servers)
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)

    def verdict_first() -> None:
        audit_and_report(spec, name="pilot-report", indices=pilot_indices(spec.config, spec.dataset.n_rows),
                         tokens_per_s_per_gpu=_tokens_per_s_per_gpu(pilot, spec.fleet.gpus),
                         context_length=context_length, root=root)

    m = measure(spec, context_length=context_length, fleet=_fleet(spec), before_measuring=verdict_first,
                root=root)
    return {"cap": m.cap, "reason": m.reason, "trigger": m.trigger, "rows": len(m.indices),
            "worst_case_tokens": m.worst_case_tokens, "budget_tokens": m.budget_tokens, **(m.outcome or {})}


def audit_and_gate(
    run: dict[str, Any], pilot: dict[str, Any], chunks: list[dict[str, Any]], servers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Audit the pilot rows and gate the fan-out on their truncation. Over the threshold, gate_mode=stop
    stops the run (this task and the chunks past it are skipped, "stopped by the gate"), 'ask' holds every
    chunk for the reviewer's question (`ask_about_cap`, once the first chunks have stopped), 'warn' logs
    and goes on.

    Returns the chunks to fan out past the gate: the plan's chunks but the first `stagger` ones, which
    run beside the pilot (`generate_alongside_pilot`); none while a question is to be asked."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.plan import pilot_indices
    from tracegen.run.report import audit_and_report

    spec = _spec(run)
    lead = spec.layout.stagger
    if not pilot.get("indices"):
        log.info("no pilot (pilot_size=0): nothing to gate on; the continuous gate watches the fan-out")
        return chunks[lead:]
    outcome = audit_and_report(
        spec, name="pilot-report", indices=pilot_indices(spec.config, spec.dataset.n_rows),
        tokens_per_s_per_gpu=_tokens_per_s_per_gpu(pilot, spec.fleet.gpus), context_length=_context_length(servers),
    )
    if outcome.verdict == "stop":
        message = f"{outcome.reason}; see report {outcome.html_uri}"
        if spec.config.gate_mode == "stop":
            # The gate doing its job is not a crash: this task is skipped, saying so, and the chunks past
            # it with it; the run ends without a failed task (docs/deployment.md, "A run stopped by the gate").
            raise AirflowSkipException(f"{STOPPED_BY_GATE}: {message}")
        if spec.config.gate_mode == "ask":
            log.warning("gate_mode=ask: no chunk starts before the reviewer answers: %s", message)
            return []
        log.warning("gate_mode=warn, going on: %s", message)
    return chunks[lead:]


def _context_length(servers: list[dict[str, Any]] | None) -> int | None:
    from tracegen.run.cap_raise import served_context

    return served_context(servers)


def _tokens_per_s_per_gpu(summary: dict[str, Any], n_gpus: int) -> float | None:
    elapsed, tokens = summary.get("elapsed_s") or 0, summary.get("completion_tokens") or 0
    return tokens / elapsed / max(1, n_gpus) if elapsed > 0 and tokens > 0 else None


def generate_chunk(run: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """One mapped task past the pilot gate: generate what is left of one chunk. Starts only while the
    running gate holds."""
    return _generate(run, chunk, alongside_pilot=False)


def generate_alongside_pilot(run: dict[str, Any], chunks: list[dict[str, Any]], slot: int) -> dict[str, Any]:
    """The plan's chunk number `slot` (one of the first few), generated while the pilot runs and the gate
    audits it: leaves the pilot's rows to the pilot, and stops (committing what finished) as soon as the
    gate says stop."""
    from airflow.sdk.exceptions import AirflowSkipException

    if slot >= len(chunks):
        _context()["chunk_label"] = f"slot {slot}: no chunk"
        raise AirflowSkipException(f"the plan has {len(chunks)} chunks with work; none for slot {slot}")
    return _generate(run, chunks[slot], alongside_pilot=True)


def _generate(run: dict[str, Any], chunk: dict[str, Any], *, alongside_pilot: bool) -> dict[str, Any]:
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.plan import ChunkWork

    work = ChunkWork.from_json(chunk)
    _context()["chunk_label"] = work.label
    spec = _at_raised_cap(_spec(run))
    try:
        with _refused_without_retry():
            summary = generate_chunk_work(spec, work, alongside_pilot=alongside_pilot, fleet=_fleet(spec),
                                          attempt=_attempt())
    except GateClosed as exc:
        if spec.config.gate_mode == "ask":
            # Held, not failed: what this chunk leaves is the reviewer's to decide on (`ask_about_cap`),
            # and the chunks generated after the answer take it up at the cap they choose.
            raise AirflowSkipException(f"{exc}; its rows left wait for the reviewer's answer") from None
        # gate_mode=stop: the gate stopped the run, so the chunk stops with it, skipped, keeping what it
        # committed; the run's tab and the gate's task say "stopped by the gate" (not a failed chunk).
        raise AirflowSkipException(f"{STOPPED_BY_GATE}: {exc}") from None
    try:
        _settle_the_question_when_last(_spec(run))
    except Exception as exc:  # noqa: BLE001 - only a shortcut: the question task decides without it
        log.warning("could not settle the question after the last chunk (%s: %s); %s decides", type(exc).__name__,
                    exc, dag_ids.DECIDING_TASK)
    return summary.to_json()


FIRST_FAN_OUT = ("generate_alongside_pilot", "generate_chunk")  # the chunk tasks the question waits for


def _settle_the_question_when_last(spec) -> None:
    """The last chunk of the first fan-out to finish decides whether the run has a question: when it has
    none (no gate held the run back, no raise to take), the question task is skipped now, and with it the
    answer and the second fan-out, instead of starting a process after this chunk only to skip itself.
    Two chunks ending at once may each see the other running: then neither skips, and the question task
    decides, as it always can. Any raise Variable, even one its raise task has not yet vouched for, keeps
    the question task: it reads the raise once vouched for. A raise written after this look sees the skip
    (it looks again a few seconds after writing: `run.raise_request`) and is refused."""
    from tracegen.run.decision import held_by
    from tracegen.store.root import open_root

    ctx = _context()
    ti = ctx["ti"]
    if ti.task_id not in FIRST_FAN_OUT:
        return  # a chunk at the decided cap: the question was asked already
    states = (ti.get_task_states(dag_id=GENERATE_DAG, run_ids=[ctx["run_id"]], task_ids=list(FIRST_FAN_OUT))
              or {}).get(ctx["run_id"]) or {}
    others = [dag_ids.state_name(v) for k, v in states.items()
              if k != f"{ti.task_id}_{ti.map_index}"]
    if not others or any(state not in ("success", "skipped") for state in others):
        return  # not the last (or a sibling failed: the question task is not run then anyway)
    from airflow.sdk import Variable

    from tracegen.run.cap_raise import variable_key

    if Variable.get(variable_key(spec.run_id), default=None) is not None:
        return  # the question task turns the raise into the run's decision
    if held_by(spec, open_root(spec.config.output_uri, spec.config.aws_conn_id)) is not None:
        return
    log.info("the last chunk of the fan-out: no gate held the run back, nothing to ask; %s are skipped",
             ", ".join(dag_ids.QUESTION_CHAIN))
    # The whole chain at once: skipped from its head only, the scheduler propagates the skip a level per
    # loop, and the report and teardown wait for it with the fleet idle (docs/benchmarks.md).
    _skip_tasks(*dag_ids.QUESTION_CHAIN)


def ask_about_cap(run: dict[str, Any], pilot: dict[str, Any], servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After the first fan-out, under gate_mode=ask: the question for the reviewer when a gate held the
    run back (the pilot gate's stop verdict, or rows the continuous gate kept from being generated), as
    XCom `question`; otherwise skipped, and the question, the answer and the second fan-out with it.

    Returns the chunks to generate while the question waits (`run.while_asking`; none under
    while_asking=idle), which `generate_while_asking` maps over: a mapped task maps only over a return value."""
    from tracegen.generate.gate_watch import continuous_sample
    from tracegen.run.cap_raise import as_decision
    from tracegen.run.decision import ask

    spec = _spec(run)
    raised = _cap_raise(spec)
    if raised is not None and raised.cap > spec.config.max_tokens:
        # An operator raised the cap while the run ran: that is the decision, and nobody is asked.
        decision = as_decision(spec, raised)
        log.warning("%s: no question; the rows left at max_tokens=%d are generated next", raised.summary(),
                    raised.cap)
        _context()["ti"].xcom_push(key=QUESTION_KEY, value={"decided": decision.to_json()})
        return []
    question = ask(spec, context_length=_context_length(servers), drift_sample=continuous_sample(spec),
                   tokens_per_s_per_gpu=_tokens_per_s_per_gpu(pilot or {}, spec.fleet.gpus),
                   report_url=lambda name: _review_page(spec, name))
    if question is None:
        # Skipped, not returning None: the scheduler then skips the question, the answer and the second
        # fan-out itself, in one pass, instead of starting a task process only for it to skip (seconds of
        # idle fleet between the last chunk and the report, bench/occupancy_airflow.py).
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException(f"nothing to ask (gate_mode={spec.config.gate_mode}): no gate held this run back")
    log.warning("asking the reviewer (Required Actions): %s\n%s", question.subject, question.body)
    _context()["ti"].xcom_push(key=QUESTION_KEY, value=question.to_json())
    return (question.while_asking or {}).get("chunks") or []


QUESTION_KEY = dag_ids.QUESTION_KEY


def generate_while_asking(run: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """One chunk generated while the gate's question waits (`run.while_asking`). Which cap it runs at is
    Airflow's to say, when it starts: the answer's, once there is one (a 'stop' skips it, "stopped by the
    gate"), else the provisional cap the question task chose. While it runs at that cap its rows are marked
    in the ledger, and an answer to stop (or the question's timeout) stops it after committing what finished."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.audit.review import CapDecision
    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.plan import ChunkWork
    from tracegen.run.while_asking import provisional

    ctx = _context()
    work = ChunkWork.from_json(chunk)
    ctx["chunk_label"] = work.label
    spec = _spec(run)
    ti = ctx["ti"]

    def answer() -> CapDecision | None:
        doc = ti.xcom_pull(task_ids=dag_ids.REVIEW_TASK)
        return CapDecision.from_json(doc) if doc else None

    def stopped(truncated: int = 0, judged: int = 0) -> str | None:
        decision = answer()
        return decision.summary() if decision is not None and not decision.continues else None

    decided = answer()
    if decided is not None and not decided.continues:
        raise AirflowSkipException(f"{STOPPED_BY_GATE}: {decided.summary()}")
    if decided is not None:
        at, asking, check = spec.decided(decided), False, None
        log.info("%s: %s: generating at max_tokens=%d", work.label, decided.summary(), at.config.max_tokens)
    else:
        question = ti.xcom_pull(task_ids=dag_ids.DECIDING_TASK, key=QUESTION_KEY)
        at, asking, check = provisional(spec, int(question["while_asking"]["cap"])), True, stopped
        log.info("%s: generating at max_tokens=%d while the question waits", work.label, at.config.max_tokens)
    try:
        return generate_chunk_work(at, work, fleet=_fleet(at), while_asking=asking, stop_check=check,
                                   attempt=_attempt()).to_json()
    except GateClosed as exc:
        # The answer was 'stop' (or nobody answered in time), or the decided cap's own gate closed: what this
        # chunk committed stays, the rest is not generated.
        raise AirflowSkipException(f"{STOPPED_BY_GATE}: {exc}") from None


def _cap_raise(spec):
    """The operator's raise of this run's cap (`tracegen_raise_cap`), or None. A Variable no raise task
    made, or whose cap the run cannot take, is ignored and logged (`run.cap_raise.decode`), never trusted
    and never a reason to fail the run."""
    from airflow.sdk import Variable

    from tracegen.run.cap_raise import decode, variable_key

    return decode(Variable.get(variable_key(spec.run_id), default=None), spec.run_id)


def _at_raised_cap(spec):
    from tracegen.run.cap_raise import at_raised_cap

    raised = _cap_raise(spec)
    at = at_raised_cap(spec, raised)
    if at is not spec:
        log.warning("generating at max_tokens=%d, not %d: %s", at.config.max_tokens, spec.config.max_tokens,
                    raised.summary())
    return at


def _review_page(spec, name: str) -> str | None:
    """The review page (`tracegen.review_app`) showing one of the run's report files, absolute when the
    api-server's base URL is configured; None when the review pages do not serve the run's output root
    (they serve the default root, the `tracegen_output_roots` Variable's and the root a run's conf names,
    never one named by a URL)."""
    from airflow.providers.common.compat.sdk import conf

    from tracegen.review_app import configured_roots, report_file_path

    run_conf = getattr(_context().get("dag_run"), "conf", None) or {}
    if run_conf.get("output_uri") == spec.config.output_uri:
        served = [spec.config.output_uri]  # the review pages find it from this run's conf
    else:
        try:
            served = configured_roots()
        except Exception as exc:  # noqa: BLE001 - a malformed Variable must not keep the question from being asked
            log.warning("cannot tell which output roots the review pages serve: %s", exc)
            return None
    if spec.config.output_uri not in served:
        log.info("the review pages do not serve %s (not in tracegen_output_roots): the question names the "
                 "report's storage location only", spec.config.output_uri)
        return None
    base = (conf.get("api", "base_url", fallback=None) or "").rstrip("/")
    return base + report_file_path(spec.config.output_uri, spec.run_id, name)


# The mapped chunk tasks' label (map_index_template). Airflow renders it once before the task runs and
# again after, so it is computed from the mapped input itself (the chunk, or the plan's chunk for a slot
# beside the pilot): the grid names a running task by its chunk, not by its map index. After the run,
# `chunk_label` (set by the task, the same text) wins. Kept in the form of `ChunkWork.label`.
CHUNK_LABEL_TEMPLATE = (
    "{%- if chunk_label is defined -%}{{ chunk_label }}{%- else -%}"
    "{%- set kw = task.op_kwargs -%}"
    "{%- set plan = kw.get('chunks') or [] -%}"
    "{%- set c = kw.get('chunk') or (plan[kw.get('slot')] if kw.get('slot') is not none "
    "and kw.get('slot') < plan | length else none) -%}"
    "{%- if c -%}chunk {{ '%04d' | format(c['chunk']) }} (rows {{ '{:,}'.format(c['start']) }}–"
    "{{ '{:,}'.format(c['stop'] - 1) }}){%- elif kw.get('slot') is not none -%}slot {{ kw.get('slot') }}"
    "{%- endif -%}{%- endif -%}"
)
# What the grid's "Skipped" on a chunk task means: never a failure (docs/deployment.md).
CHUNK_TASK_DOC = (
    "One chunk of the dataset, resumed from what the ledger holds. **Skipped is not a failure**: "
    "`generate_chunk` is skipped when the chunks beside the pilot (`generate_alongside_pilot`) already "
    "covered every row, so nothing was left past the gate; when the gate stopped the run (its skip message "
    "says \"stopped by the gate\"); or, under gate_mode=ask, when a gate held the run for the reviewer. "
    "A slot beside the pilot with no chunk of the plan is skipped too."
)
# How a task the gate stopped says so in its skip message (and the review pages in the run's tab).
STOPPED_BY_GATE = "stopped by the gate"
DECIDED_RUN_KEY = "run"  # apply_decision's XCom holding the decided run (its return value is the chunks)


def apply_decision(decision: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The reviewer's answer applied in place: the run's record takes the decision and the chosen cap.
    Returns the chunks with work left at that cap (the pilot's truncated rows and what the held chunks
    left) for the second fan-out to map over, and pushes the decided run as XCom `run` for it. An
    answer (or a timeout) to stop is recorded, then skips this task and the chunks after it: the run
    ends stopped by the gate, not failed.

    It runs as soon as the answer is in: the chunks generated while asking that are still to start take
    the answer's cap themselves and are left out here; those generating are waited for, and what they
    leave (rows truncated under the provisional cap) is planned with the rest (`run.while_asking`).

    The run is read from prepare_run's XCom here, not handed in, so that the answer is its one upstream task."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.audit.review import CapDecision
    from tracegen.run.decision import apply

    ti = _context()["ti"]
    run = ti.xcom_pull(task_ids=dag_ids.PREPARE_RUN, key="run")
    starting_later = _while_asking_left_to_start(ti)
    decided, work = apply(_spec(run), CapDecision.from_json(decision))
    if starting_later:
        work = [w for w in work if w.chunk not in starting_later]
        log.info("%d chunks generated while asking start after the answer, at its cap: left to them",
                 len(starting_later))
    made = decided.decisions[-1]
    # Pushed for a stop too: the report, the resample and the scheduled rerun read the decision from
    # Airflow's metadata, never from the record in the root. A mapped task can only map over a return
    # value, so the run travels beside it under its own key.
    _context()["ti"].xcom_push(key=DECIDED_RUN_KEY, value=decided.to_json())
    if not made.continues:
        # Recorded above; skipped, not failed: the reviewer's stop (or the question's timeout) is the gate
        # doing its job, and the chunks at a decided cap are skipped with it.
        raise AirflowSkipException(f"{STOPPED_BY_GATE}: {made.summary()}")
    log.info("%s; %d chunks to generate at max_tokens=%d", made.summary(), len(work), decided.config.max_tokens)
    return [w.to_json() for w in work]


def _while_asking_left_to_start(ti, poll_s: float = 2.0) -> set[int]:
    """The chunk numbers of the chunk tasks generated while asking that had not started when this task
    (which runs after the answer) first looked: they read the answer when they start and take its cap
    themselves (`run.while_asking.left_to_start`). Returned once those that were generating then have ended:
    they may run at the provisional cap, and their rows must be committed before the answer's plan reads
    the ledger. Chunk tasks that start meanwhile are not waited for. Each ends within a chunk's time, and
    sooner on a stop, which it polls for."""
    import time

    from tracegen.run.while_asking import generating, left_to_start

    chunks = ti.xcom_pull(task_ids=dag_ids.DECIDING_TASK) or []
    if not chunks:
        return set()

    def states() -> dict[int, str]:
        found = (ti.get_task_states(dag_id=GENERATE_DAG, run_ids=[ti.run_id], task_ids=[dag_ids.WHILE_ASKING])
                 or {}).get(ti.run_id) or {}
        prefix = f"{dag_ids.WHILE_ASKING}_"
        return {int(k.removeprefix(prefix)): dag_ids.state_name(v)
                for k, v in found.items() if k.startswith(prefix) and k.removeprefix(prefix).isdigit()}

    first = states()
    waited = set(generating(first))
    now, waiting = first, set(waited)
    while waiting:
        log.info("waiting for %d chunk tasks generating since before the answer to commit: %s", len(waiting),
                 sorted(waiting))
        time.sleep(poll_s)
        now = states()
        waiting &= set(generating(now))
    # One of them that failed and waits for its retry reads the answer too when it starts again.
    return left_to_start(first, chunks) | left_to_start(now, chunks, among=waited)


def _as_decided(run: dict[str, Any]):
    """The run this task was handed, as decided: `apply_decision`'s XCom once the reviewer (or a raise)
    chose its cap, else the run `prepare_run` described. Airflow's metadata, never the record in the root."""
    decided = _context()["ti"].xcom_pull(task_ids=dag_ids.APPLY_DECISION, key=DECIDED_RUN_KEY)
    return _spec(decided) if decided else _spec(run)


def resample_runaways(run: dict[str, Any]) -> dict[str, Any]:
    """runaway_policy=resample, once the fan-outs are over: one fresh sample for each runaway row (its tail
    loops, no cap finishes it), under the run's cap as decided; skipped under any other policy."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.generate.resample import resample_runaways as resample
    from tracegen.run.records import stopped_at_gate
    from tracegen.store.root import open_root

    spec = _as_decided(run)
    if spec.config.runaway_policy != "resample":
        raise AirflowSkipException(f"runaway_policy={spec.config.runaway_policy}: nothing to resample")
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)
    if stopped_at_gate(root, spec):
        # A run its gate or its reviewer stopped spends no more GPU time (a stop is a skip, not a failure).
        raise AirflowSkipException("the run stopped at its gate: nothing is resampled")
    return resample(spec, fleet=_fleet(spec), root=root)


def final_report(run: dict[str, Any]) -> dict[str, Any]:
    """Audit the whole output root at the run's cap and write report.json / report.html beside the data.

    The cap, and the reviewer's decision when the gate asked, are the decided run's (`apply_decision`'s
    XCom, pushed for a stop too): this task runs whatever happened, so a run that never decided is
    audited at the cap it was prepared with; one whose first task failed has nothing to audit, and the
    task is skipped saying so, leaving that failure (and the watcher's, which fails the run) to read."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.run.report import audit_and_report

    if not run:
        raise AirflowSkipException("no report: prepare_run did not describe the run (it failed; its log says why)")
    return audit_and_report(_as_decided(run), name="report").to_json()


def teardown_fleet(run: dict[str, Any]) -> str:
    """Stop the servers when the run asked for it; otherwise leave them for the next run. Skipped, saying
    why, when the first task failed: then no server was launched for the run."""
    from airflow.sdk.exceptions import AirflowSkipException

    from tracegen.fleet import teardown

    if not run:
        raise AirflowSkipException("nothing to stop: prepare_run did not describe the run (it failed; its log says "
                                   "why), so no server was launched for it")
    spec = _spec(run)
    if not spec.teardown:
        return "servers left running (teardown=false)"
    results = teardown(_fleet(spec))
    return f"stopped {len(results)} servers"


def watcher() -> None:
    """Fails the run when any task failed: teardown and report run with relaxed trigger rules, and
    without this the run would look successful whenever they did."""
    from airflow.sdk.exceptions import AirflowFailException

    raise AirflowFailException("a task of this run failed; see the failed task's log and the run's report")


# ---- tracegen_raise_cap ----------------------------------------------------------------------------

GENERATE_DAG = dag_ids.GENERATE


def raise_cap() -> dict[str, Any]:
    """Raise the cap of a running `tracegen_generate` run (params `run_id`, `max_tokens`): checked, kept and
    confirmed taken by `run.raise_request.request_raise`, with this DagRun's triggering user and id as who
    raised it and where. A refusal fails the task without retries, naming why. The raise is what this task
    returns: the XCom a reader checks the Variable against."""
    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.run.raise_request import RaiseRefused, request_raise

    ctx = _context()
    refuse_unknown_conf(ctx)
    target = str(ctx["params"]["run_id"]).strip()
    try:
        raised = request_raise(_AirflowRaiseView(ctx["ti"]), target, ctx["params"]["max_tokens"],
                               requested_by=ctx["dag_run"].triggering_user_name, raised_in=ctx["run_id"])
    except RaiseRefused as exc:
        raise AirflowFailException(str(exc)) from None
    log.warning("%s: chunk tasks starting from now generate at max_tokens=%d, and the rows truncated under "
                "%d are extended from their tokens", raised.summary(), raised.cap, raised.from_cap)
    return raised.to_json()


class _AirflowRaiseView:
    """`run.raise_request.RaiseView` over the task API and Airflow Variables."""

    def __init__(self, ti) -> None:
        from airflow.sdk import Variable

        self.ti, self.variable = ti, Variable

    def run_state(self, run_id: str) -> str | None:
        return _dagrun_state(self.ti, run_id)

    def prepared_run(self, run_id: str) -> Any:
        return self.ti.xcom_pull(task_ids=dag_ids.PREPARE_RUN, dag_id=GENERATE_DAG, run_id=run_id, key="run")

    def servers(self, run_id: str) -> Any:
        return self.ti.xcom_pull(task_ids=dag_ids.PROVISION_FLEET, dag_id=GENERATE_DAG, run_id=run_id)

    def deciding_state(self, run_id: str) -> str:
        return self._state(run_id, dag_ids.DECIDING_TASK)

    def review_state(self, run_id: str) -> str:
        return self._state(run_id, dag_ids.REVIEW_TASK)

    def _state(self, run_id: str, task_id: str) -> str:
        return dag_ids.task_state(self.ti, GENERATE_DAG, run_id, task_id) or "none"

    def answerer(self):
        from tracegen.run.api_answer import configured_answerer

        return configured_answerer()

    def assigned_users(self):
        from tracegen.review.notify import assigned_users

        return assigned_users()

    def may_answer(self, user: str) -> bool | None:
        from tracegen.run.api_answer import hitl_permission

        return hitl_permission(user, GENERATE_DAG)

    def announce(self, raised) -> None:
        from tracegen.run.cap_raise import ANSWERING_KEY

        self.ti.xcom_push(key=ANSWERING_KEY, value=raised.to_json())

    def decided(self, run_id: str) -> Any:
        return self.ti.xcom_pull(task_ids=dag_ids.DECIDING_TASK, dag_id=GENERATE_DAG, run_id=run_id,
                                 key=dag_ids.QUESTION_KEY)

    def facts(self, raised, *, run_cap: int, context_length: int | None):
        from tracegen.run.cap_raise import raise_facts

        return raise_facts(self.ti, raised, run_cap=run_cap, context_length=context_length)

    def stored(self, key: str) -> str | None:
        return self.variable.get(key, default=None)

    def store(self, key: str, text: str, description: str) -> None:
        self.variable.set(key, text, description=description)

    def withdraw(self, key: str) -> None:
        self.variable.delete(key)


def _dagrun_state(ti, run_id: str) -> str | None:
    try:
        return str(ti.get_dagrun_state(GENERATE_DAG, run_id)).removeprefix("DagRunState.").lower()
    except Exception as exc:  # noqa: BLE001 - the API answers an unknown run with an error, not a state
        log.info("state of %s run %r: %s", GENERATE_DAG, run_id, exc)
        return None


# ---- tracegen_rerun_failed -------------------------------------------------------------------------


class _AirflowRuns:
    """`run.rerun.AirflowRuns` over the task API: which `tracegen_generate` runs exist, their state, and the
    run each handed its tasks (the decided run once `apply_decision` ran, else `prepare_run`'s)."""

    def __init__(self, ti) -> None:
        self.ti = ti

    def state(self, run_id: str) -> str | None:
        return _dagrun_state(self.ti, run_id)

    def spec(self, run_id: str):
        from tracegen.run.spec import RunSpec, RunSpecError

        for task_id in (dag_ids.APPLY_DECISION, dag_ids.PREPARE_RUN):
            doc = self.ti.xcom_pull(task_ids=task_id, dag_id=GENERATE_DAG, run_id=run_id, key=DECIDED_RUN_KEY)
            if doc:
                try:
                    return RunSpec.from_json(doc, f"{GENERATE_DAG} run {run_id!r}'s {task_id}")
                except RunSpecError as exc:
                    log.warning("%s", exc)
                    return None
        return None


def find_unfinished_work() -> list[dict[str, Any]]:
    """Chunks with failed or missing rows in the newest run of each output root, as Airflow knows the run;
    [] when all is done, and nothing for a root a live run or another writer owns (`run.rerun`)."""
    from tracegen.run.rerun import unfinished_work

    ctx = _context()
    refuse_unknown_conf(ctx)
    airflow = _AirflowRuns(ctx["ti"])
    work: list[dict[str, Any]] = []
    for root in output_roots():
        if not root.startswith("s3://") and not Path(root.removeprefix("file://")).exists():
            log.info("%s: no output yet", root)
            continue
        work.extend(w.to_json() for w in unfinished_work(root, airflow))
    # One mapped task per chunk, bounded well under max_map_length; the next hourly run takes the rest.
    return work[:500]


def rerun_unfinished(work: dict[str, Any]) -> dict[str, Any]:
    """Generate what is left of one chunk with the config Airflow handed its run, on the operator's fleet
    (TRACEGEN_FLEET): never a fleet or config read back from storage. A fleet that changed since the run
    began is refused, naming both digests. Skipped, naming who, when the root has another writer (a live
    run, another deployment's lease) or the run's gate is closed; it holds the root's lease while it writes."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from tracegen.fleet import FleetSpecError
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.run.rerun import RerunRefused, RerunWork, run_for_rerun
    from tracegen.store.lease import RootHeld
    from tracegen.store.root import open_root

    ctx = _context()
    item = RerunWork.from_json(work)
    ctx["chunk_label"] = item.label
    # The spec the rerun generates for is rebased onto this same root and connection.
    root = open_root(item.output_uri)
    try:
        spec = run_for_rerun(item, _AirflowRuns(ctx["ti"]), root=root)
        fleet = resolve(spec.fleet, default_fleet_source())
    except RerunRefused as exc:
        raise AirflowSkipException(f"{item.label}: {exc}") from None
    except FleetSpecError as exc:
        # Not retried: the operator's fleet must change back (or a new run start) before this can succeed.
        raise AirflowFailException(f"{item.label}: {exc}") from None
    try:
        summary = generate_chunk_work(spec, item.work, fleet=fleet, writer=f"tracegen_rerun_failed run {ctx['run_id']}",
                                      lease_wait_s=0, root=root, attempt=_attempt())
    except (RootHeld, GateClosed) as exc:
        raise AirflowSkipException(f"{item.label}: yields: {exc}") from None
    return summary.to_json()


# ---- tracegen_fleet ---------------------------------------------------------------------------------


def fleet_action() -> list[dict[str, Any]]:
    from dataclasses import asdict

    from airflow.sdk.exceptions import AirflowFailException

    from tracegen.fleet import FleetSpecError, provision, status, teardown
    from tracegen.fleet.sources import listed_fleet, load_fleet

    ctx = _context()
    refuse_unknown_conf(ctx)
    params = ctx["params"]
    try:
        fleet = load_fleet(listed_fleet(params["fleet"]))
    except FleetSpecError as exc:
        raise AirflowFailException(f"invalid params: {exc}") from None
    action = params["action"]
    if action == "start":
        result = [asdict(h) for h in provision(fleet)]
    elif action == "stop":
        result = [asdict(r) for r in teardown(fleet)]
    else:
        result = [asdict(s) for s in status(fleet)]
    for item in result:
        log.info("%s", json.dumps(item, default=str))
    return result
