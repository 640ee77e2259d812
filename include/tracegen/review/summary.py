"""One line of the run list (and of `runs.json`): a `RunView` summarised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracegen.audit.figures import figures_from_report
from tracegen.review.read_model import PILOT_HTML, RunView, read_run


@dataclass(frozen=True)
class RunSummary:
    """One line of the run list, read from a run's stored files (never from the ledger's rows)."""

    run_id: str
    created: str | None
    max_tokens: int | None
    pilot_verdict: str | None
    final_verdict: str | None
    rows: int | None
    truncation_rate: float | None
    reports: tuple[str, ...]
    problem: str | None = None
    stage: str | None = None  # STOPPED, ASKING, or None (running or finished: Airflow's state says which)
    deciding_report: str | None = None  # the report whose verdict stopped the run or asked the question
    recommended_cap: int | None = None
    has_record: bool = False  # run.json is there: the run has progress to show
    # The shown report's truncation figures under their names (`audit.figures.AT_CAP`, `STILL`): (count, of).
    truncation_figures: dict[str, tuple[int, int]] | None = None
    decision: str | None = None  # the run's last decision in words: who, when, what
    airflow_run_id: str | None = None  # the Airflow run its record names (`RunView.airflow_run_id`)
    # The shown report's token account (`audit.token_account.token_account`): where the fleet's tokens went.
    token_account: dict[str, Any] | None = None

    @property
    def verdict(self) -> str | None:
        return self.final_verdict or self.pilot_verdict


def decision_text(d: dict[str, Any] | None) -> str | None:
    """'stopped by admin at 2026-…', 'continued at 8,192 by admin at …', or the timeout's stop."""
    if not d:
        return None
    when = d.get("responded_at") or "an unknown time"
    if d.get("timed_out"):
        return f"stopped: nobody answered the gate's question by {when}"
    who = d.get("responded_by") or "an unknown user"
    if d.get("trigger") == "raise":
        return f"cap raised to {d.get('cap'):,} by {who} at {when}" if isinstance(d.get("cap"), int) else None
    if d.get("cap") is None:
        return f"stopped by {who} at {when}, answering the gate's question"
    cap = f"{d['cap']:,}" if isinstance(d["cap"], int) else str(d["cap"])
    return f"continued at max_tokens={cap} by {who} at {when}, answering the gate's question"


def _verdict(report: dict[str, Any] | None) -> str | None:
    return ((report or {}).get("verdict") or {}).get("verdict")


def summarise(view: RunView) -> RunSummary:
    shown = view.final or view.pilot or {}
    audit = shown.get("audit") or {}
    rate = (audit.get("truncation") or {}).get("rate")
    rows = (audit.get("rows") or {}).get("current_rows")
    cap = view.config.get("max_tokens")
    stage, deciding = view.stage_and_decider
    # A run held at its gate goes on at the cap of the report that decided; a finished one at its final's.
    decided_by = (view.pilot if deciding == PILOT_HTML else None) or shown
    rec = (decided_by.get("cap_table") or {}).get("recommended_cap")
    return RunSummary(
        run_id=view.run_id,
        created=view.created(),
        max_tokens=cap if isinstance(cap, int) else None,
        pilot_verdict=_verdict(view.pilot),
        final_verdict=_verdict(view.final),
        rows=rows if isinstance(rows, int) else None,
        truncation_rate=float(rate) if isinstance(rate, int | float) else None,
        reports=view.reports,
        stage=stage,
        deciding_report=deciding,
        recommended_cap=rec if isinstance(rec, int) else None,
        has_record=view.has_record,
        truncation_figures=figures_from_report(shown) or None,
        decision=decision_text(view.decisions[-1] if view.decisions else None),
        airflow_run_id=view.airflow_run_id,
        token_account=account if isinstance(account := (shown.get("run") or {}).get("token_account"), dict) else None,
    )


def summarise_run(output_root: Any, run_id: str, present: set[str] | frozenset[str]) -> RunSummary:
    """Summary of one run; an unreadable file becomes `problem` on its line, not a failed page."""
    try:
        view = read_run(output_root, run_id, present)
    except ValueError as exc:
        reports = RunView(run_id, frozenset(present), None, None, None).reports
        return RunSummary(run_id, None, None, None, None, None, None, reports, problem=str(exc))
    return summarise(view)
