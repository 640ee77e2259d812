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

from tracegen.audit import capfit, gate, length_fit, measure_report, report
from tracegen.audit.cap_question import RAISE
from tracegen.audit.runaway_rows import find_runaways, runaway_counts
from tracegen.audit.stats import AUDIT_COLUMNS, AuditResult, audit, censoring_arrays, gate_counts
from tracegen.audit.token_account import token_account
from tracegen.common.locations import shown_location
from tracegen.run import plan, while_asking
from tracegen.run.run_spec import RunSpec
from tracegen.store.current import current_mask
from tracegen.store.layout import RESAMPLE_CHUNK
from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import FAILED, OK
from tracegen.store.repair import PartDamage
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER

log = logging.getLogger(__name__)

# What a report reads of each ledger row (the lean read: strings as codes, never the whole frame): the audit's
# columns, the runaway judgement's (the score the ledger keeps, and the part a row without one is judged from),
# the while-asking account's flag, the commit time supersession orders by, and the prompt tokens found cached
# (what prefill cost, `audit.token_account.prefill_account`). `attempt` no figure reads.
REPORT_COLUMNS = (*AUDIT_COLUMNS, "runaway_score", "part", "while_asking", "committed_at", "cached_tokens")


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
    root: OutputRoot | None = None,
) -> ReportOutcome:
    """Audit the ledger (all of it, or only `indices`), decide the gate, write the report files. `root`:
    the run's output root, when the task has opened it already."""
    config = spec.config
    root = open_root(config.output_uri, config.aws_conn_id) if root is None else root
    # Folded first (streamed, as a chunk task folds them), so this read and the next reader's take one
    # snapshot instead of parsing the entries committed since the last.
    root.snapshots.compact_loose(COMPACT_OVER)
    full = ledger_rows(root, REPORT_COLUMNS)
    frame = full
    if indices is not None:
        frame = full[np.isin(full["index"].to_numpy(dtype=np.int64), indices)].reset_index(drop=True)
    result = audit(frame, config.max_tokens, run_id=spec.run_id)
    # The cheap form of `python -m tracegen verify` over the whole ledger: silent loss must show in the
    # report that says the dataset is complete, and its verdict (gate.decide) is then `damaged`.
    damaged = _damaged_parts(root, result) if indices is None else []
    runaways, runaway_scope, whole = _runaways(root, spec, frame, indices)
    table = _cap_table(spec, full, frame, _runaway_flags(frame, runaways) if whole else None,
                       tokens_per_s_per_gpu, context_length)
    truncated, judged = gate_counts(frame, config.max_tokens)
    measurement = measure_report.read_measurement(root, spec.run_id)
    suggestion = gate.CapSuggestion(table.recommended_cap if table else None,
                                    table.recommended_truncation if table else None,
                                    basis=_measured_basis(spec, frame, table, measurement))
    decision = gate.decide(gate.GateInputs(truncated, judged, gate.GateRule(config.truncation_threshold),
                                           max_tokens=config.max_tokens, suggestion=suggestion, damage=damaged))
    measured = measure_report.section(
        measurement, runaways=runaway_counts(runaway_scope, runaways) | {"whole_scope": whole,
                                                                          "resampled": _resampled(frame)},
        runaway_examples=[r.to_json() for r in list(runaways.values())[:measure_report.RUNAWAY_EXAMPLES]],
        runaway_policy=config.runaway_policy, cap_table=table.to_json() if table else None,
    )
    # Examples are read from their parts: none from a damaged one.
    examples = _example_rows(
        root, frame[~frame["part"].isin([d.part for d in damaged])].reset_index(drop=True) if damaged else frame)
    # The config as the report shows it: a URI a trigger gave with a token in it is shown without it.
    shown_config = {k: shown_location(v) if k.endswith("_uri") and isinstance(v, str) else v
                    for k, v in config.to_json().items()}
    meta = {"run_id": spec.run_id, "report": name, "config": shown_config,
            "scope_rows": int(frame["index"].nunique()) if len(frame) else 0}
    if indices is None and (asked := _while_asking(spec, full)) is not None:
        meta["while_asking"] = asked
    if indices is None:
        meta["token_account"] = token_account(full)
    report_json, html = report.render_report(result, table, decision, meta, examples,
                                             decisions=[d.to_json() for d in spec.decisions], measurement=measured)
    json_uri = root.run_files.put(spec.run_id, f"{name}.json", json.dumps(report_json, indent=2).encode())
    html_uri = root.run_files.put(spec.run_id, f"{name}.html", html.encode())
    summary = report_json["summary"]
    log.info("%s report: %s\n%s", name, shown_location(html_uri), summary)
    return ReportOutcome(decision.verdict, decision.reason, decision.action, json_uri, html_uri, summary)


def _damaged_parts(root: OutputRoot, result: AuditResult) -> list[PartDamage]:
    """The parts that no longer match their ledger entries (sizes from one listing), each noted in `result`."""
    damaged = root.repair.verify_parts(deep=False)
    for damage in damaged:
        log.warning("damaged part %s (%s)", damage.part, damage.problem)
        result.notes.append(
            f"part {damage.part} no longer matches its ledger entry ({damage.problem}): its rows count as "
            f"done but cannot be exported; `python -m tracegen verify <output root> --retire` makes them "
            f"work again for the scheduled rerun")
    return damaged


def _cap_table(spec: RunSpec, full: pd.DataFrame, frame: pd.DataFrame, runaway: np.ndarray | None,
               tokens_per_s_per_gpu: float | None, context_length: int | None) -> capfit.CapTable | None:
    """The cap table of `frame`'s lengths (runaways flagged apart when the whole scope was judged), with the
    time each cap costs the rest of the dataset when the fleet's throughput is known; None when the lengths
    allow no fit."""
    config = spec.config
    lengths, censored = censoring_arrays(frame)
    try:
        fit = length_fit.fit_lengths(lengths, censored, bootstrap=100, runaway=runaway)
    except ValueError as exc:
        log.warning("no cap table: %s", exc)
        return None
    throughput = None
    if tokens_per_s_per_gpu and tokens_per_s_per_gpu > 0:
        remaining = int((~plan.done_mask(full, spec.dataset.n_rows, config.max_tokens,
                                         config.truncated_policy)).sum())
        throughput = capfit.Throughput(tokens_per_s_per_gpu, max(1, spec.fleet.gpus), remaining)
    return capfit.cap_table(fit, config.max_tokens, context_length=context_length or config.context_length or None,
                            threshold=config.truncation_threshold, throughput=throughput)


def _example_rows(root: OutputRoot, frame: pd.DataFrame, per_outcome: int = 3) -> dict[str, list[dict[str, Any]]]:
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
        for row in root.commits.read_part(part):
            if row.index in idx:
                by_index[(part, row.index)] = row.to_json()
    examples: dict[str, list[dict[str, Any]]] = {}
    for outcome, rows in picks.items():
        examples[outcome] = [
            by_index[key] for i in rows if (key := (frame["part"].iat[i], int(frame["index"].iat[i]))) in by_index
        ]
    return examples


# Rows whose truncation the final report judges for loops when the dataset is larger: reading every truncated
# row's part would read most of the dataset's parts (truncated rows are in nearly all of them).
RUNAWAY_SAMPLE = 20_000


def _runaways(root: OutputRoot, spec: RunSpec, frame: pd.DataFrame,
              indices: np.ndarray | None) -> tuple[dict[int, Any], pd.DataFrame, bool]:
    """(runaways by index, the frame they were judged in, whether that is the report's whole scope). A
    report over given indices (the pilot's, the gate's sample) judges all of them; the final report judges
    a fixed random sample of the dataset, and the fit then gets no runaway flags (a floor from part of the
    rows would be too low), only the report's count."""
    scope = frame
    whole = indices is not None or spec.dataset.n_rows <= RUNAWAY_SAMPLE
    if not whole:
        sample = plan.pilot_sample(spec.dataset.n_rows, RUNAWAY_SAMPLE, spec.config.pilot_seed + 2)
        scope = frame[np.isin(frame["index"].to_numpy(np.int64), sample)].reset_index(drop=True)
    try:
        return find_runaways(root, scope), scope, whole
    except Exception as exc:  # noqa: BLE001 - a part that cannot be read must not cost the run its report
        log.warning("runaway rows not judged: %s", exc)
        return {}, scope.iloc[0:0], False


def _runaway_flags(frame: pd.DataFrame, runaways: dict[int, Any]) -> np.ndarray:
    """Per row of `censoring_arrays(frame)` (current ok rows, in frame order): is it a runaway."""
    if len(frame) == 0:
        return np.zeros(0, dtype=bool)
    cur = current_mask(frame) & (frame["status"] == OK).to_numpy(bool)
    return np.isin(frame["index"].to_numpy(np.int64)[cur], np.fromiter(runaways, np.int64, len(runaways)))


def _measured_basis(spec: RunSpec, frame: pd.DataFrame, table: Any, measurement: dict[str, Any] | None) -> str | None:
    """The gate's words for a recommended cap the tail measurement reached: what share of the pilot's rows
    run past it, counted, not predicted. Over the pilot only: elsewhere rows truncated at the run's cap
    say nothing about a higher one."""
    if table is None or table.recommended_cap is None or not measurement or not measurement.get("cap"):
        return None
    cap = int(table.recommended_cap)
    if cap > int(measurement["cap"]):
        return None
    pilot = plan.pilot_indices(spec.config, spec.dataset.n_rows, spec.layout)
    truncated, judged = gate_counts(frame[np.isin(frame["index"].to_numpy(np.int64), pilot)], cap)
    if not judged:
        return None
    return (f"measured: {100 * truncated / judged:.1f}% of {judged:,} pilot rows truncated at {cap:,}, its "
            f"truncated rows continued to {int(measurement['cap']):,}")


def _resampled(frame: pd.DataFrame) -> int:
    """Fresh samples of runaway rows in the report's scope (runaway_policy=resample)."""
    if frame.empty:
        return 0
    return int(((frame["chunk"] == RESAMPLE_CHUNK) & (frame["status"] != FAILED)).sum())


def _while_asking(spec: RunSpec, frame: pd.DataFrame) -> dict[str, Any] | None:
    """What the run generated while its question waited and what the answer made of it, from the ledger as
    it is now (`run.while_asking.account`), with the sentence the report shows; None when nothing was."""
    answers = [d for d in spec.decisions if d.trigger != RAISE]
    answer = answers[-1] if answers else None
    doc = while_asking.account(frame, spec.run_id, answer.cap if answer else None, answered=answer is not None)
    return None if doc is None else {**doc, "text": while_asking.account_text(doc)}
