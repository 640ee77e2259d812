"""A run's audit report: audit the ledger (all of it, or the pilot's rows), fit the cap table, decide the
gate, and write `runs/<run_id>/<name>.{json,html}` beside the data. Reads ledger entries, and the parts
of a few example rows only."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracegen import plan
from tracegen.audit import capfit, gate, report
from tracegen.audit.stats import audit, censoring_arrays, current_mask, gate_counts
from tracegen.run.spec import RunSpec
from tracegen.store.ledger import COMPACT_OVER, Ledger, open_ledger
from tracegen.store.records import OK

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportOutcome:
    """Where a report went and what it decided; small enough for an XCom."""

    verdict: str | None
    reason: str | None
    action: str | None
    json_uri: str
    html_uri: str
    summary: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def audit_and_report(
    spec: RunSpec,
    *,
    name: str,
    indices: np.ndarray | None = None,
    tokens_per_s_per_gpu: float | None = None,
    context_length: int | None = None,
) -> ReportOutcome:
    """Audit the ledger (all of it, or only `indices`), decide the gate, write the report files."""
    config = spec.config
    ledger = open_ledger(config.output_uri, config.aws_conn_id)
    full = ledger.frame(compact_over=COMPACT_OVER)
    frame = full
    if indices is not None:
        frame = full[np.isin(full["index"].to_numpy(dtype=np.int64), indices)].reset_index(drop=True)
    result = audit(frame, config.max_tokens, run_id=spec.run_id)
    if indices is None:
        # The cheap form of `python -m tracegen verify`: sizes from one listing. Silent loss must show in the
        # report that says the dataset is complete.
        for damage in ledger.verify_parts(deep=False):
            log.warning("damaged part %s (%s)", damage.part, damage.problem)
            result.notes.append(
                f"part {damage.part} no longer matches its ledger entry ({damage.problem}): its rows count as "
                f"done but cannot be exported; `python -m tracegen verify <output root> --retire` makes them "
                f"work again for the scheduled rerun")

    table = None
    lengths, censored = censoring_arrays(frame)
    try:
        fit = capfit.fit_lengths(lengths, censored, bootstrap=100)
    except ValueError as exc:
        log.warning("no cap table: %s", exc)
    else:
        throughput = None
        if tokens_per_s_per_gpu and tokens_per_s_per_gpu > 0:
            remaining = int((~plan.done_mask(full, spec.dataset.n_rows, config.max_tokens,
                                             config.truncated_policy)).sum())
            throughput = capfit.Throughput(tokens_per_s_per_gpu, max(1, spec.fleet.gpus), remaining)
        table = capfit.cap_table(
            fit, config.max_tokens, context_length=context_length or config.context_length or None,
            threshold=config.truncation_threshold, throughput=throughput,
        )

    truncated, judged = gate_counts(frame, config.max_tokens)
    decision = gate.decide(
        truncated, judged, config.truncation_threshold, max_tokens=config.max_tokens,
        suggested_cap=table.recommended_cap if table else None,
        suggested_truncation=table.recommended_truncation if table else None,
    )
    examples = _example_rows(ledger, frame)
    meta = {"run_id": spec.run_id, "report": name, "config": config.to_json(),
            "scope_rows": int(frame["index"].nunique()) if len(frame) else 0}
    report_json, html = report.render_report(result, table, decision, meta, examples,
                                             decisions=[d.to_json() for d in spec.decisions])
    json_uri = ledger.put_run_file(spec.run_id, f"{name}.json", json.dumps(report_json, indent=2).encode())
    html_uri = ledger.put_run_file(spec.run_id, f"{name}.html", html.encode())
    summary = report.summary_text(result, table, decision)
    log.info("%s report: %s\n%s", name, html_uri, summary)
    return ReportOutcome(decision.verdict, decision.reason, decision.action, json_uri, html_uri, summary)


def _example_rows(ledger: Ledger, frame: pd.DataFrame, per_outcome: int = 3) -> dict[str, list[dict[str, Any]]]:
    """A few full rows per outcome (truncated in thinking / in answer, errors), read from their parts.

    Drawn from the current row of each index only: a row another has superseded (a 4096 truncation
    finished again at 8192) no longer describes the dataset."""
    if len(frame) == 0 or "part" not in frame.columns:
        return {}
    current = current_mask(frame)
    status = frame["status"].to_numpy(dtype=object)
    length = (status == OK) & (frame["finish_reason"].to_numpy(dtype=object) == "length")
    thinking = frame["cut_in_reasoning"].fillna(False).to_numpy(dtype=bool)
    picks = {
        "truncated_in_thinking": np.flatnonzero(current & length & thinking)[:per_outcome],
        "truncated_in_answer": np.flatnonzero(current & length & ~thinking)[:per_outcome],
        "error": np.flatnonzero(current & (status != OK))[:per_outcome],
    }
    wanted: dict[str, set[int]] = {}
    for rows in picks.values():
        for i in rows:
            wanted.setdefault(frame["part"].iat[i], set()).add(int(frame["index"].iat[i]))
    by_index: dict[tuple[str, int], dict[str, Any]] = {}
    for part, idx in wanted.items():
        for row in ledger.read_part(part):
            if row.index in idx:
                by_index[(part, row.index)] = row.to_json()
    examples: dict[str, list[dict[str, Any]]] = {}
    for outcome, rows in picks.items():
        examples[outcome] = [
            by_index[key] for i in rows if (key := (frame["part"].iat[i], int(frame["index"].iat[i]))) in by_index
        ]
    return examples
