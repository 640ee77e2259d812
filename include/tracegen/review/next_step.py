"""The box above a shown report: where the run stands and what to do next, one click or one command away
(the question to answer, the run to trigger at the recommended cap, or the export). This module decides
which box and what goes in it; `templates/next_step.html.j2` says it."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from tracegen.review.access import GENERATE_DAG, AirflowRun, required_actions_path
from tracegen.review.read_model import FINAL_HTML, RunView
from tracegen.review.summary import RunSummary
from tracegen.run.stage import ASKING, STOPPED

ASKING_BOX, STOPPED_BOX, FINISHED_BOX = "asking", "stopped", "finished"


@dataclass(frozen=True)
class NextStep:
    """One box: `kind` is which, `shown` the report below it. Inside the run's tab (`framed`) links into
    Airflow's own pages are named instead, as the UI's frame may not navigate the window."""

    kind: str
    shown: str
    framed: bool = False
    actions_path: str | None = None  # asking: where the run's question is answered in Airflow
    refused: dict[str, Any] | None = None  # asking: the last answer refused (who, what, why)
    decision: str | None = None  # stopped: who stopped it, when
    cap: int | None = None  # stopped: the recommended cap to trigger again at; None: no higher cap meets it
    settings: str | None = None  # stopped: the next run's conf, to paste into the trigger form
    command: str | None = None  # finished: the export command
    truncated_left: int | None = None  # finished: rows the export leaves out
    dag: str = GENERATE_DAG
    dag_path: str = f"/dags/{GENERATE_DAG}"


def retrigger_conf(conf: dict[str, Any], cap: int) -> dict[str, Any]:
    """The settings a stopped run was triggered with, at the recommended cap: what its next run takes."""
    return {**{k: v for k, v in conf.items() if not str(k).startswith("_")}, "max_tokens": cap}


def next_step(summary: RunSummary, shown: str, *, root_uri: str, airflow_run_id: str | None,
              conf: dict[str, Any] | None, truncated_left: int | None, framed: bool = False,
              refused: dict[str, Any] | None = None) -> NextStep | None:
    if summary.stage == ASKING:
        return NextStep(ASKING_BOX, shown, framed, refused=refused or None,
                        actions_path=required_actions_path(airflow_run_id) if airflow_run_id else None)
    if summary.stage == STOPPED:
        cap = summary.recommended_cap
        if cap is None or (summary.max_tokens is not None and cap <= summary.max_tokens):
            return NextStep(STOPPED_BOX, shown, framed, decision=summary.decision)
        return NextStep(STOPPED_BOX, shown, framed, decision=summary.decision, cap=cap,
                        settings=json.dumps(retrigger_conf(conf or {}, cap), sort_keys=True))
    if shown == FINAL_HTML:
        return NextStep(FINISHED_BOX, shown, framed, truncated_left=truncated_left,
                        command=f"python -m tracegen export {shlex.quote(root_uri)} EXPORT_DIR")
    return None


def status_for(view: RunView, summary: RunSummary, shown: str, uri: str, af: AirflowRun | None,
               raw_run_id: str | None, framed: bool = False, refused: dict[str, Any] | None = None) -> NextStep | None:
    """The box for `shown`, one of the run's reports, told from the run's view and Airflow's run."""
    left = None
    if shown == FINAL_HTML:
        left = (((view.final or {}).get("audit") or {}).get("truncation") or {}).get("truncated")
    return next_step(summary, shown, root_uri=uri, airflow_run_id=af.run_id if af else raw_run_id,
                     conf=af.conf if af else None, truncated_left=left if isinstance(left, int) else None,
                     framed=framed, refused=refused)
