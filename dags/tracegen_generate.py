"""
### tracegen_generate — complete completions for a drafter-training dataset

Trigger with a `max_tokens` cap. The run:

1. **prepares** the run: validates the params and the fleet description (a bad param stops the run here,
   naming it, before anything is launched), indexes the dataset, chooses the chunk layout, stores the
   run's record beside the data, and plans the work from the ledger in the output root (rows already
   committed are never generated twice);
2. **provisions** one SGLang server per GPU over SSH (healthy servers already serving the same model
   and flags are reused), waits for health and records what the servers say about themselves; the pilot
   and the first chunks start beside it, each provisioning the same way and checking the cap against the
   servers' context before sending anything;
3. every later task receives the run prepared in step 1 and nothing else;
4. runs a **pilot** on a random sample, **measures the tail** (when the pilot's truncation is over the
   threshold, its truncated rows are continued from their tokens to a higher cap, within a token budget,
   so the cap table is measured rather than extrapolated; those rows stay in the dataset), **audits** it
   and **gates**: if the pilot's truncation rate
   (`finish_reason == "length"`) is above the threshold the run does not spend GPU-days on that cap, and
   the report says which cap would fix it and what that costs. With `gate_mode=ask` (the default) the run
   **asks** (`review_cap`, under Browse → Required Actions): continue at the recommended cap, at another
   cap, at this cap accepting the truncation, or stop; the same run then goes on at the chosen cap
   (`generate_at_decided_cap`). While the question waits the fleet does not: within a budget
   (`while_asking_budget_pct`) it goes on at the cap the question recommends (`generate_while_asking`;
   `while_asking=current` at the run's cap, `idle` not at all), and the answer decides what that work
   becomes (kept, extended, counted as truncated; a stop keeps it committed). The continuous gate, which
   watches the running truncation rate, asks the same way when it holds chunks back mid-run. Unanswered
   within the question's timeout, the run stops; `gate_mode=stop` stops without asking, `warn` only logs;
5. **fans out** one mapped task per index chunk, each resuming from what is committed. The first few
   (`generate_alongside_pilot`) start with the pilot so no GPU idles while the pilot's last rows finish
   and the gate audits; they stop, keeping what finished, if the gate says stop. The rest
   (`generate_chunk`) start once the gate has passed;
6. with `runaway_policy=resample`, gives each runaway row (a truncated row whose tail loops) one fresh sample;
   then writes the **final audit report** (JSON + HTML under `runs/<run_id>/` in the output root);
7. optionally **tears down** the servers (they are long-lived infrastructure by default).

Changing your mind mid-run (the 4096 → 8192 pivot): trigger `tracegen_raise_cap` with this run's id and
the higher `max_tokens`; nothing is stopped, and while the gate's question waits the raise is its answer. A
finished or stopped run: trigger this DAG again with the higher `max_tokens`. Either way finished rows are
kept and rows truncated under the old cap are continued from their exact tokens to the new cap
(`truncated_policy=extend`, the default), paying only for the new tokens.
See `tracegen status <output_uri>` for progress from any shell.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import TriggerRule, XComArg, dag, task

from tracegen import params, steps
from tracegen.common import dag_ids
from tracegen.review_gate import CapReviewOperator

# Seconds between retries of a task; the distributed end-to-end test shortens it so a task lost with its
# worker is retried within the test's time budget.
RETRY_DELAY_S = int(os.environ.get("TRACEGEN_RETRY_DELAY_S", "30"))
# Chunk tasks in flight at once. It shapes this DAG (one task per slot beside the pilot) and is handed to
# prepare_run, which records it in the run's chunk layout: read here, once.
LEAD = params.generate_chunk_concurrency()


@dag(
    dag_id=dag_ids.GENERATE,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen", "generation"],
    doc_md=__doc__,
    params=params.trigger_params(),
    default_args={"retries": 2, "retry_delay": pendulum.duration(seconds=RETRY_DELAY_S)},
    max_active_runs=1,
)
def tracegen_generate():
    prepared = task(steps.prepare_run, retries=0, multiple_outputs=True)(lead=LEAD)
    run, chunks = prepared["run"], prepared["chunks"]
    servers = task(steps.provision_fleet)(run)
    pilot = task(steps.run_pilot)(run)
    # Before the gate's audit, so its report, its verdict's suggested cap and the reviewer's question read
    # the pilot's truncated rows continued to a higher cap (measured, not extrapolated).
    measured = task(steps.measure_tail)(run, pilot, servers)
    # The gate passes on the chunks past the first LEAD; on stop it is skipped, "stopped by the gate" (and
    # they with it), and it hands on none when it is to ask.
    past_gate = task(steps.audit_and_gate, retries=0)(run, pilot, chunks, servers)
    chunk_task = {"map_index_template": steps.CHUNK_LABEL_TEMPLATE, "max_active_tis_per_dagrun": LEAD,
                  "doc_md": steps.CHUNK_TASK_DOC}
    # The first LEAD chunks keep the fleet busy while the pilot finishes and the gate decides, and stop
    # when it says stop: one task per slot, each taking its chunk from the plan.
    alongside = (
        task(steps.generate_alongside_pilot, **chunk_task)
        .partial(run=run, chunks=chunks)
        .expand(slot=list(range(LEAD)))
    )
    generated = task(steps.generate_chunk, **chunk_task).partial(run=run).expand(chunk=past_gate)
    # gate_mode=ask: once the first fan-out is over (chunks a gate held back are skipped, not failed), the
    # reviewer is asked when a gate held the run back; both tasks are skipped when none did. The answer
    # is applied in place: the same run, its record at the chosen cap, a second fan-out over what is left.
    question = task(steps.ask_about_cap, trigger_rule=TriggerRule.NONE_FAILED, retries=0)(run, pilot, servers)
    asked = XComArg(question.operator, key=dag_ids.QUESTION_KEY)
    answer = CapReviewOperator(task_id=dag_ids.REVIEW_TASK, question=asked, retries=0)
    # The fleet does not wait for the answer: the question task chose the chunks to generate meanwhile (within
    # the run's budget, at the cap it recommends: while_asking), and each takes the answer once there is one.
    while_asking = task(steps.generate_while_asking, **chunk_task).partial(run=run).expand(chunk=question)
    # As soon as the answer is in: the chunks generated while asking that have not started take its cap when
    # they start, so the answer's fan-out waits only for those already generating (`apply_decision`).
    decided = task(steps.apply_decision, retries=0)(answer.output)
    at_decided_cap = (
        task(steps.generate_chunk, task_id=dag_ids.DECIDED_FAN_OUT, **chunk_task)
        .partial(run=decided[dag_ids.DECIDED_RUN_KEY])
        .expand(chunk=decided)
    )
    # runaway_policy=resample (skipped otherwise): one fresh sample per looping row, once generation is over,
    # before the report and teardown; not after a failure (NONE_FAILED), nor after a stop at the gate (a
    # skip, which the task checks in the run's record).
    resampled = task(steps.resample_runaways, task_id=dag_ids.RESAMPLE_RUNAWAYS,
                     trigger_rule=TriggerRule.NONE_FAILED)(run)
    report = task(steps.final_report, trigger_rule=TriggerRule.ALL_DONE, retries=0)(run)
    stop = task(steps.teardown_fleet, trigger_rule=TriggerRule.ALL_DONE, retries=0)(run)
    watcher = task(steps.watcher, trigger_rule=TriggerRule.ONE_FAILED, retries=0)()

    # The pilot and the chunks beside it do not wait for provision_fleet: each generation task provisions
    # idempotently (serialised per GPU slot on its host) and checks the cap against the servers' context
    # before its first request, so the fleet starts working one task earlier (docs/benchmarks.md).
    measured >> past_gate
    # The report reads only the ledger: stopping the servers need not wait for it, nor it for them.
    [alongside, generated] >> question
    # The report and teardown wait for every chunk task themselves: the resample is skipped from the start
    # unless runaway_policy=resample, and they must not start before the generation is over.
    generation = [alongside, generated, while_asking, at_decided_cap]
    generation >> resampled
    [*generation, resampled] >> report
    [*generation, resampled] >> stop
    # The report and teardown are leaves: their own failure fails the run. The watcher is there for the
    # failures their ALL_DONE rule would hide (a gate's stop is not one: it skips), so it
    # waits only for those tasks, and is skipped while the report runs instead of a scheduler loop after it.
    [measured, past_gate, alongside, generated, question, answer, while_asking, decided, at_decided_cap,
     resampled] >> watcher


tracegen_generate()
