"""A run's review under gate_mode=ask: whether to ask, the question, and the run an answer leaves.

After the first fan-out (the chunks past a passing pilot gate, or none when the pilot gate closed) the
run asks when a gate held it back: the pilot gate's stop verdict, or rows the continuous gate kept from
being generated. While the question waits the fleet goes on within a budget (`run.while_asking`): the
question says what runs meanwhile, and the decision records what that work became. The question
(`tracegen.audit.cap_question`) is built from the report JSON the audit wrote and stored as
`runs/<run_id>/question.json`; the answer's `CapDecision` goes into the run's record
(`run.json`), whose config then carries the chosen cap, and the chunks with work left at that cap (the
pilot's truncated rows among them) are the second fan-out's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from tracegen.audit import gate
from tracegen.audit.cap_question import DRIFT, PILOT, CapDecision, CapQuestion, question_from_report
from tracegen.common.cap_rule import highest_cap
from tracegen.dataset.stored import chain_turn_starts
from tracegen.run import QUESTION_FILE, plan, while_asking
from tracegen.run.run_record import gate_verdict, pilot_report, write_run_record
from tracegen.run.run_report import audit_and_report
from tracegen.run.run_spec import RunSpec
from tracegen.store.records import FAILED
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)

GATE_REPORT = "gate-report"  # the audit a mid-run question is built from (the continuous gate's sample)


def rows_held(spec: RunSpec, frame: pd.DataFrame) -> int:
    """Rows not done at the run's cap on which no attempt failed: rows a closed gate kept from being
    generated (a chunk that did not start, or stopped early). Failed rows are not counted: they are the
    scheduled rerun's, whatever the gate says."""
    config = spec.config
    held = ~plan.done_mask(frame, spec.dataset.n_rows, config.max_tokens, config.truncated_policy)
    if len(frame):
        failed = frame["index"].to_numpy(np.int64)[(frame["status"] == FAILED).to_numpy(bool)]
        held[failed] = False
    return int(held.sum())


def held_by(spec: RunSpec, root: OutputRoot, frame: pd.DataFrame | None = None) -> str | None:
    """Which gate held the run back, so that its reviewer is to be asked now: PILOT (the pilot report's
    verdict is stop), DRIFT (the continuous gate kept rows from being generated), or None (nothing to ask,
    and always under a gate_mode other than 'ask'). `frame`: the ledger as `root` holds it, read here
    only when it is needed and not given."""
    if spec.config.gate_mode != "ask":
        return None
    report = pilot_report(root, spec.run_id)
    if report is not None and gate_verdict(report)[0] == gate.STOP:
        return PILOT
    frame = root.snapshots.frame(compact_over=COMPACT_OVER) if frame is None else frame
    return DRIFT if rows_held(spec, frame) else None


def max_cap(context_length: int | None) -> int:
    """The highest cap a continuing run may take: below the servers' context length (`cap_rule`)."""
    return highest_cap(context_length)


def ask(
    spec: RunSpec,
    *,
    context_length: int | None,
    drift_sample: Sequence[int],
    tokens_per_s_per_gpu: float | None = None,
    report_url: Callable[[str], str | None] | None = None,
) -> CapQuestion | None:
    """The question this run must put to its reviewer now, stored beside its record; None when there is
    nothing to ask (gate_mode is not 'ask', or no gate held the run back).

    `drift_sample`: the indices the continuous gate judges (`generate.gate_watch.continuous_sample`),
    audited for the question when that gate held rows back. `report_url(file name)`: the review page
    showing one of the run's report files, when there is one."""
    config = spec.config
    root = open_root(config.output_uri, config.aws_conn_id)
    frame = root.snapshots.frame(compact_over=COMPACT_OVER)
    trigger = held_by(spec, root, frame)
    if trigger is None:
        return None
    if trigger == PILOT:
        name, report = "pilot-report", pilot_report(root, spec.run_id)
    else:
        # The continuous gate closed mid-run: audit what it judged, for the table the reviewer decides on.
        name = GATE_REPORT
        log.info("the continuous gate held back %d rows; auditing its sample for the question", rows_held(spec, frame))
        audit_and_report(spec, name=name, indices=np.asarray(drift_sample, dtype=np.int64),
                         tokens_per_s_per_gpu=tokens_per_s_per_gpu, context_length=context_length, root=root)
        report = json.loads(root.run_files.get(spec.run_id, f"{name}.json"))
    question = question_from_report(
        report, run_id=spec.run_id, trigger=trigger, max_cap=max_cap(context_length),
        context_length=context_length, truncated_policy=config.truncated_policy,
        report_uri=root.storage.uri_for(f"runs/{spec.run_id}/{name}.html"),
        report_url=report_url(f"{name}.html") if report_url else None,
        timeout_minutes=config.gate_question_timeout_minutes,
    )
    work = while_asking.plan_work(spec, question, frame, chain_turn_starts(root))
    if work is not None:
        question = replace(question, while_asking={**work.to_json(), "statement": work.statement()})
    root.run_files.put(spec.run_id, QUESTION_FILE, json.dumps(question.to_json(), indent=2).encode())
    return question


def apply(spec: RunSpec, decision: CapDecision) -> tuple[RunSpec, list[plan.ChunkWork]]:
    """The run as the decision leaves it, stored as its record, and the chunks with work left at the
    chosen cap (none when it stops): the rows the held chunks never generated, and the rows truncated
    below the new cap, the pilot's among them (the run's truncated_policy says how they are redone)."""
    config = spec.config
    root = open_root(config.output_uri, config.aws_conn_id)
    frame = root.snapshots.frame(compact_over=COMPACT_OVER)
    # Applied once the chunks generating while asking have committed (those still to start take the answer's
    # cap): the account of what they made goes into the record with the answer; the final report's is complete.
    account = while_asking.account(frame, spec.run_id, decision.cap)
    if account is not None:
        decision = replace(decision, while_asking=account)
        log.info("%s", while_asking.account_text(account))
    decided = spec.decided(decision)
    write_run_record(root, decided)
    log.info("decision recorded in %s: %s", root.storage.uri_for(f"runs/{spec.run_id}/run.json"),
             decision.summary())
    if not decision.continues:
        return decided, []
    work = plan.chunks_with_work(frame, decided.dataset.n_rows, decided.layout, decided.config,
                                 chain_turn_starts(root))
    log.info("%d chunks with %d rows left at max_tokens=%d", len(work), sum(w.remaining for w in work),
             decided.config.max_tokens)
    return decided, work
