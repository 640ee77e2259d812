"""The tasks around the reviewer's question, over Airflow's metadata (`tasks.api.TaskApi`): whether the run
asks at all (the last chunk of the first fan-out may settle it, `settle_when_last`), the question or the raise
taken instead (`ask_about_cap`), and the answer applied (`apply_decision`). What is asked and what an answer
leaves are `run.decision`'s; which cap a chunk generated while asking takes is `run.while_asking`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from tracegen.common import dag_ids
from tracegen.run.stage import STOPPED
from tracegen.tasks.outcomes import Skip

log = logging.getLogger(__name__)

FIRST_FAN_OUT = ("generate_alongside_pilot", "generate_chunk")  # the chunk tasks the question waits for


def settle_when_last(api, spec, root) -> None:
    """The last chunk of the first fan-out to finish decides whether the run has a question: when it has
    none (no gate held the run back, no raise to take), the question task is skipped now, and with it the
    answer and the second fan-out, instead of starting a process after this chunk only to skip itself.
    Two chunks ending at once may each see the other running: then neither skips, and the question task
    decides, as it always can. Any raise Variable, even one its raise task has not yet vouched for, keeps
    the question task: it reads the raise once vouched for. A raise written after this look sees the skip
    (it looks again a few seconds after writing: `run.raise_request`) and is refused."""
    from tracegen.run.cap_raise import variable_key
    from tracegen.run.decision import held_by

    if api.ti.task_id not in FIRST_FAN_OUT:
        return  # a chunk at the decided cap: the question was asked already
    others = [state for key, state in api.task_states(list(FIRST_FAN_OUT)).items() if key != api.task_key]
    if not others or any(state not in ("success", "skipped") for state in others):
        return  # not the last (or a sibling failed: the question task is not run then anyway)
    if api.variable(variable_key(spec.run_id)) is not None:
        return  # the question task turns the raise into the run's decision
    if held_by(spec, root) is not None:
        return
    log.info("the last chunk of the fan-out: no gate held the run back, nothing to ask; %s are skipped",
             ", ".join(dag_ids.QUESTION_CHAIN))
    # The whole chain at once: skipped from its head only, the scheduler propagates the skip a level per
    # loop, and the report and teardown wait for it with the fleet idle (docs/benchmarks.md).
    api.skip(*dag_ids.QUESTION_CHAIN)


def ask_about_cap(api, run: dict[str, Any], pilot: dict[str, Any] | None,
                  servers: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """After the first fan-out, under gate_mode=ask: the question for the reviewer when a gate held the run
    back, pushed as XCom `question`; a raise above the run's cap instead is the decision, pushed as
    `{"decided": ...}`, and nobody is asked. Nothing to ask is a `Skip`: the scheduler then skips the
    question, the answer and the second fan-out itself, in one pass, instead of starting a task process only
    for it to skip (seconds of idle fleet between the last chunk and the report, bench/occupancy_airflow.py).

    Returns the chunks to generate while the question waits (`run.while_asking`; none under
    while_asking=idle), which `generate_while_asking` maps over: a mapped task maps only over a return value."""
    from tracegen.generate.gate_watch import continuous_sample
    from tracegen.review.roots import review_page_url
    from tracegen.run.cap_raise import as_decision, current_raise, served_context
    from tracegen.run.decision import ask
    from tracegen.run.run_spec import handed_over
    from tracegen.tasks.pilot import tokens_per_s_per_gpu

    spec = handed_over(run)
    raised = current_raise(api, spec.run_id)
    if raised is not None and raised.cap > spec.config.max_tokens:
        decision = as_decision(spec, raised)
        log.warning("%s: no question; the rows left at max_tokens=%d are generated next", raised.summary(),
                    raised.cap)
        api.xcom_push(dag_ids.QUESTION_KEY, {"decided": decision.to_json()})
        return []
    question = ask(spec, context_length=served_context(servers), drift_sample=continuous_sample(spec),
                   tokens_per_s_per_gpu=tokens_per_s_per_gpu(pilot or {}, spec.fleet.gpus),
                   report_url=lambda name: review_page_url(spec.config.output_uri, spec.run_id, name,
                                                           run_conf=api.conf))
    if question is None:
        raise Skip(f"nothing to ask (gate_mode={spec.config.gate_mode}): no gate held this run back")
    log.warning("asking the reviewer (Required Actions): %s\n%s", question.subject, question.body)
    api.xcom_push(dag_ids.QUESTION_KEY, question.to_json())
    return (question.while_asking or {}).get("chunks") or []


def apply_decision(api, decision: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The reviewer's answer applied in place: the run's record takes the decision and the chosen cap.
    Returns the chunks with work left at that cap (the pilot's truncated rows and what the held chunks
    left) for the second fan-out to map over, and pushes the decided run as XCom `run` for it. An answer
    (or a timeout) to stop is recorded, then is a `Skip` of this task and the chunks after it: the run ends
    stopped by the gate, not failed.

    It runs as soon as the answer is in: the chunks generated while asking that are still to start take the
    answer's cap themselves and are left out here; those generating are waited for, and what they leave
    (rows truncated under the provisional cap) is planned with the rest (`run.while_asking`).

    The run is read from prepare_run's XCom here, not handed in, so that the answer is its one upstream task."""
    from tracegen.audit.cap_question import CapDecision
    from tracegen.run.decision import apply
    from tracegen.run.run_spec import handed_over
    from tracegen.run.while_asking import settled_left_to_start

    run = api.xcom_pull(dag_ids.PREPARE_RUN, key="run")
    starting_later = settled_left_to_start(api)
    decided, work = apply(handed_over(run), CapDecision.from_json(decision))
    if starting_later:
        work = [w for w in work if w.chunk not in starting_later]
        log.info("%d chunks generated while asking start after the answer, at its cap: left to them",
                 len(starting_later))
    made = decided.decisions[-1]
    # Pushed for a stop too: the report, the resample and the scheduled rerun read the decision from
    # Airflow's metadata, never from the record in the root. A mapped task can only map over a return
    # value, so the run travels beside it under its own key.
    api.xcom_push(dag_ids.DECIDED_RUN_KEY, decided.to_json())
    if not made.continues:
        # Recorded above; skipped, not failed: the reviewer's stop (or the question's timeout) is the gate
        # doing its job, and the chunks at a decided cap are skipped with it.
        raise Skip(f"{STOPPED}: {made.summary()}")
    log.info("%s; %d chunks to generate at max_tokens=%d", made.summary(), len(work), decided.config.max_tokens)
    return [w.to_json() for w in work]


def as_decided(api, run: dict[str, Any]):
    """The run a task was handed, as decided: `apply_decision`'s XCom once the reviewer (or a raise) chose
    its cap, else the run `prepare_run` described. Airflow's metadata, never the record in the root."""
    from tracegen.run.run_spec import handed_over

    decided = api.xcom_pull(dag_ids.APPLY_DECISION, key=dag_ids.DECIDED_RUN_KEY)
    return handed_over(decided or run)
