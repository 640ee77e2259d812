"""The work of the chunk tasks: one chunk generated at the cap Airflow's metadata says, beside the pilot, past
the gate, while the question waits, at the decided cap, or by the scheduled rerun.

Each opens the run's output root once and hands it down, resolves the run's fleet from the operator's
configuration (`fleet.sources.resolve`: refused when it changed since the run began), and ends in a summary,
a `Skip` (the gate stopped or held the chunk, another writer owns the root) or an error. The grid's label of
the mapped task and what "skipped" means on it are here too, beside the work they describe.
"""

from __future__ import annotations

import logging
from typing import Any

from tracegen.run.stage import STOPPED
from tracegen.tasks.outcomes import Skip

log = logging.getLogger(__name__)

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


def generate_chunk(api, run: dict[str, Any], chunk: dict[str, Any], *, alongside_pilot: bool) -> dict[str, Any]:
    """One chunk of the first fan-out (beside the pilot, or past the gate) or of the decided cap's, at a raised
    cap when an operator raised it meanwhile. The last chunk of the first fan-out settles the question
    (`decision.settle_when_last`)."""
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.generate.engine import ChunkOptions
    from tracegen.run.cap_raise import at_current_cap
    from tracegen.run.plan import ChunkWork
    from tracegen.run.run_spec import handed_over
    from tracegen.store.root import open_root
    from tracegen.tasks.question import settle_when_last

    work = ChunkWork.from_json(chunk)
    api.label(work.label)
    spec = handed_over(run)
    root = open_root(spec.config.output_uri, spec.config.aws_conn_id)
    at = at_current_cap(api, spec)
    try:
        summary = generate_chunk_work(at, work, alongside_pilot=alongside_pilot, fleet=resolve(at.fleet),
                                      root=root, options=ChunkOptions(attempt=api.attempt()))
    except GateClosed as exc:
        if at.config.gate_mode == "ask":
            # Held, not failed: what this chunk leaves is the reviewer's to decide on (`ask_about_cap`),
            # and the chunks generated after the answer take it up at the cap they choose.
            raise Skip(f"{exc}; its rows left wait for the reviewer's answer") from None
        # gate_mode=stop: the gate stopped the run, so the chunk stops with it, skipped, keeping what it
        # committed; the run's tab and the gate's task say "stopped by the gate" (not a failed chunk).
        raise Skip(f"{STOPPED}: {exc}") from None
    try:
        settle_when_last(api, spec, root)
    except Exception as exc:  # noqa: BLE001 - only a shortcut: the question task decides without it
        from tracegen.common.dag_ids import DECIDING_TASK

        log.warning("could not settle the question after the last chunk (%s: %s); %s decides",
                    type(exc).__name__, exc, DECIDING_TASK)
    return summary.to_json()


def generate_while_asking(api, run: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """One chunk generated while the gate's question waits (`run.while_asking`). Which cap it runs at is
    Airflow's to say, when it starts: the answer's, once there is one (a 'stop' skips it, "stopped by the
    gate"), else the provisional cap the question task chose. While it runs at that cap its rows are marked
    in the ledger, and an answer to stop (or the question's timeout) stops it after committing what finished."""
    from tracegen.audit.cap_question import CapDecision
    from tracegen.common import dag_ids
    from tracegen.fleet.sources import resolve
    from tracegen.generate.chunk import GateClosed, generate_chunk_work
    from tracegen.generate.engine import ChunkOptions
    from tracegen.run.plan import ChunkWork
    from tracegen.run.run_spec import handed_over
    from tracegen.run.while_asking import provisional
    from tracegen.store.root import open_root

    work = ChunkWork.from_json(chunk)
    api.label(work.label)
    spec = handed_over(run)

    def answer() -> CapDecision | None:
        doc = api.xcom_pull(dag_ids.REVIEW_TASK)
        return CapDecision.from_json(doc) if doc else None

    def stopped(truncated: int = 0, judged: int = 0) -> str | None:
        decision = answer()
        return decision.summary() if decision is not None and not decision.continues else None

    decided = answer()
    if decided is not None and not decided.continues:
        raise Skip(f"{STOPPED}: {decided.summary()}")
    if decided is not None:
        at, asking, check = spec.decided(decided), False, None
        log.info("%s: %s: generating at max_tokens=%d", work.label, decided.summary(), at.config.max_tokens)
    else:
        question = api.xcom_pull(dag_ids.DECIDING_TASK, key=dag_ids.QUESTION_KEY)
        at, asking, check = provisional(spec, int(question["while_asking"]["cap"])), True, stopped
        log.info("%s: generating at max_tokens=%d while the question waits", work.label, at.config.max_tokens)
    root = open_root(at.config.output_uri, at.config.aws_conn_id)
    try:
        options = ChunkOptions(while_asking=asking, stop_check=check, attempt=api.attempt())
        return generate_chunk_work(at, work, fleet=resolve(at.fleet), root=root, options=options).to_json()
    except GateClosed as exc:
        # The answer was 'stop' (or nobody answered in time), or the decided cap's own gate closed: what this
        # chunk committed stays, the rest is not generated.
        raise Skip(f"{STOPPED}: {exc}") from None
