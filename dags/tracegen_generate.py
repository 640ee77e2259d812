"""
### tracegen_generate — complete completions for a drafter-training dataset

Trigger with a `max_tokens` cap. The run:

1. **validates** the params and the fleet description (steps 2 and 3 start at the same time and
   validate them too, so a bad param stops all three before anything is launched);
2. **provisions** one SGLang server per GPU over SSH (healthy servers already serving the same model
   and flags are reused) and waits for health;
3. **plans** the work from the ledger in the output root (rows already committed are never generated twice);
4. runs a **pilot** on a random sample, **audits** it and **gates**: if the pilot's truncation rate
   (`finish_reason == "length"`) is above the threshold the run stops before spending GPU-days, and the
   report says which cap would fix it and what that costs;
5. **fans out** one mapped task per index chunk, each resuming from what is committed. The first few
   (`generate_alongside_pilot`) start with the pilot so no GPU idles while the pilot's last rows finish
   and the gate audits; they stop, keeping what finished, if the gate says stop. The rest
   (`generate_chunk`) start once the gate has passed;
6. writes the **final audit report** (JSON + HTML under `runs/<run_id>/` in the output root);
7. optionally **tears down** the servers (they are long-lived infrastructure by default).

Changing your mind mid-run (the 4096 → 8192 pivot): stop the run, trigger again with the higher
`max_tokens` and `truncated_policy=regenerate`. Finished rows are kept; rows truncated under the old cap
are regenerated. See `python -m tracegen status <output_uri>` for progress from any shell.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import Param, TriggerRule, dag, task

from tracegen import steps

DEFAULTS = steps.default_params()
# Seconds between retries of a task; the distributed end-to-end test shortens it so a task lost with its
# worker is retried within the test's time budget.
RETRY_DELAY_S = int(os.environ.get("TRACEGEN_RETRY_DELAY_S", "30"))

PARAMS = {
    "max_tokens": Param(
        DEFAULTS["max_tokens"],
        type="integer",
        minimum=1,
        maximum=1_048_576,
        title="Max tokens (completion cap)",
        description="Cap on completion tokens (thinking + answer). Rows that hit it finish with 'length' "
        "and are truncated; the pilot gate stops the run when too many do. Must be below the model's "
        "context length.",
    ),
    "dataset_uri": Param(
        DEFAULTS["dataset_uri"],
        type="string",
        minLength=1,
        title="Dataset",
        description="Prompts: JSONL, JSONL.gz or Parquet with OpenAI-style 'messages'; local path or s3://bucket/key.",
    ),
    "output_uri": Param(
        DEFAULTS["output_uri"],
        type="string",
        minLength=1,
        title="Output root",
        description="Where committed parts, the ledger, run configs and reports live: a local directory, "
        "file:///..., or s3://bucket/prefix (through the AWS connection below).",
    ),
    "fleet": Param(
        DEFAULTS["fleet"],
        type="string",
        minLength=1,
        title="Fleet description",
        description="Path to a fleet JSON file (hosts, GPUs, model, SGLang flags), or 'local-sim' for the "
        "bundled simulated fleet.",
    ),
    "temperature": Param(DEFAULTS["temperature"], type="number", minimum=0, maximum=2, title="Temperature",
                         description="Sampling temperature sent with every request."),
    "top_p": Param(DEFAULTS["top_p"], type="number", exclusiveMinimum=0, maximum=1, title="Top-p",
                   description="Nucleus sampling probability mass."),
    "chunk_size": Param(
        DEFAULTS["chunk_size"],
        type="integer",
        minimum=0,
        maximum=1_000_000,
        title="Chunk size",
        description="Rows per mapped generation task; 0 chooses it: four batches of the whole fleet "
        "(--max-running-requests x GPUs) and at least 500, grown so the number of mapped tasks stays well "
        "under Airflow's max_map_length (1024), with the first chunks twice the pilot. The chunks that start "
        "together when the gate passes are 1/N, 2/N ... N/N of the size (N chunk tasks at once, "
        "TRACEGEN_CHUNK_CONCURRENCY), so they end apart.",
    ),
    "pilot_size": Param(DEFAULTS["pilot_size"], type="integer", minimum=0, maximum=1_000_000,
                        title="Pilot size",
                        description="Random rows generated and audited before the fan-out; 0 skips the pilot "
                        "(the continuous gate still watches the running truncation rate)."),
    "truncation_threshold": Param(
        DEFAULTS["truncation_threshold"],
        type="number",
        minimum=0,
        maximum=1,
        title="Truncation threshold",
        description="Largest acceptable share of rows finishing with 'length' (0.05 = 5%).",
    ),
    "gate_mode": Param(DEFAULTS["gate_mode"], type="string", enum=["stop", "warn"], title="Gate mode",
                       description="'stop' fails the run when the pilot is over the threshold; 'warn' logs "
                       "and goes on."),
    "truncated_policy": Param(
        DEFAULTS["truncated_policy"],
        type="string",
        enum=["regenerate", "keep"],
        title="Rows truncated under a lower cap",
        description="'regenerate': rows that hit a lower cap in an earlier run are generated again under this "
        "cap (the new row supersedes the old one at export); 'keep': they count as done.",
    ),
    "invalid_rows": Param(DEFAULTS["invalid_rows"], type="string", enum=["record", "fail"],
                          title="Malformed dataset rows",
                          description="'record' marks them invalid in the ledger and goes on; 'fail' stops "
                          "the chunk naming the row."),
    "teardown": Param(False, type="boolean", title="Stop servers at the end",
                      description="Stop the SGLang servers when the run ends (they are reused by later runs "
                      "otherwise)."),
}


@dag(
    dag_id="tracegen_generate",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["tracegen", "generation"],
    doc_md=__doc__,
    params=PARAMS,
    default_args={"retries": 2, "retry_delay": pendulum.duration(seconds=RETRY_DELAY_S)},
    max_active_runs=1,
)
def tracegen_generate():
    # Validation, provisioning and planning start together: provision_fleet and plan_run validate the
    # params themselves (a bad param fails all three, naming it, before anything is launched). The run's
    # snapshot for every later task, the report and teardown included, is validate_run's.
    run = task(steps.validate_run, retries=0)()
    servers = task(steps.provision_fleet)()
    chunks = task(steps.plan_run, retries=0)()
    pilot = task(steps.run_pilot)(run, servers)
    lead = steps.generate_chunk_concurrency()
    # The gate passes on the chunks past the first `lead`; it fails (and they never start) on stop.
    past_gate = task(steps.audit_and_gate, retries=0)(run, pilot, chunks, lead=lead)
    chunk_task = {"map_index_template": "{{ chunk_label }}", "max_active_tis_per_dagrun": lead}
    # The first `lead` chunks keep the fleet busy while the pilot finishes and the gate decides, and stop
    # when it says stop: one task per slot, each taking its chunk from the plan.
    alongside = (
        task(steps.generate_alongside_pilot, **chunk_task)
        .partial(run=run, servers=servers, chunks=chunks)
        .expand(slot=list(range(lead)))
    )
    generated = (
        task(steps.generate_chunk, **chunk_task)
        .partial(run=run, servers=servers)
        .expand(chunk=past_gate)
    )
    report = task(steps.final_report, trigger_rule=TriggerRule.ALL_DONE, retries=0)(run)
    stop = task(steps.teardown_fleet, trigger_rule=TriggerRule.ALL_DONE, retries=0)(run)
    watcher = task(steps.watcher, trigger_rule=TriggerRule.ONE_FAILED, retries=0)()

    chunks >> pilot
    # The report reads only the ledger: stopping the servers need not wait for it, nor it for them.
    [alongside, generated] >> report
    [alongside, generated] >> stop
    # The report and teardown are leaves: their own failure fails the run. The watcher is there for the
    # failures their ALL_DONE rule would hide, so it waits only for those tasks, and is skipped while the
    # report runs instead of a scheduler loop after it.
    [past_gate, alongside, generated] >> watcher


tracegen_generate()
