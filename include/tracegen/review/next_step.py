"""The box above a shown report: where the run stands and what to do next, one click or one command away
(the question to answer, the run to trigger at the recommended cap, or the export)."""

from __future__ import annotations

import json
import shlex
from typing import Any

from tracegen.review.access import GENERATE_DAG, AirflowRun, required_actions_path
from tracegen.review.page import STATUS_CSS, e
from tracegen.review.read_model import FINAL_HTML, RunView
from tracegen.review.summary import RunSummary
from tracegen.run.stage import ASKING, STOPPED


def retrigger_conf(conf: dict[str, Any], cap: int) -> dict[str, Any]:
    """The settings a stopped run was triggered with, at the recommended cap: what its next run takes."""
    return {**{k: v for k, v in conf.items() if not str(k).startswith("_")}, "max_tokens": cap}


def _airflow_link(path: str, text: str, framed: bool) -> str:
    """A link into Airflow's own pages; inside the run's tab (a frame that may not navigate the window) the
    path is named instead, so Airflow never opens nested inside itself."""
    if framed:
        return f"{e(text)} (<code>{e(path)}</code>, outside this tab)"
    return f'<a href="{e(path)}">{e(text)}</a>'


def refusal_html(refused: dict[str, Any] | None) -> str:
    """Whose answer the question refused, and why: the question stays open for another."""
    if not refused:
        return ""
    who = refused.get("responded_by") or "someone"
    chosen = ", ".join(str(o) for o in refused.get("chosen_options") or []) or "no option"
    when = f" at {refused['responded_at']}" if refused.get("responded_at") else ""
    return (f'<div id="refused"><b>The last answer was refused, so the question is asked again:</b> {e(who)} chose '
            f'"{e(chosen)}"{e(when)}: {e(refused.get("refused"))}</div>')


def next_step_html(summary: RunSummary, shown: str, *, root_uri: str, airflow_run_id: str | None,
                   conf: dict[str, Any] | None, truncated_left: int | None, framed: bool = False,
                   refused: dict[str, Any] | None = None) -> str:
    if summary.stage == ASKING:
        link = (_airflow_link(required_actions_path(airflow_run_id), "answer the question in Required Actions",
                              framed) + (" — it is also this run's Required Actions tab" if framed else "")
                if airflow_run_id else "answer it under Browse → Required Actions")
        return (f'<div style="{STATUS_CSS}#fff8c5"><b>Waiting for the reviewer\'s answer.</b> This is the report '
                f"the question was built from ({e(shown)}): {link}.{refusal_html(refused)}</div>")
    if summary.stage == STOPPED:
        who = f" ({e(summary.decision)})" if summary.decision else ""
        text = (f'<div style="{STATUS_CSS}#ffebe9"><b>Stopped by the gate.</b>{who} This is the report that decided '
                f"({e(shown)}); the run ended without generating past the gate. ")
        cap = summary.recommended_cap
        if cap is not None and (summary.max_tokens is None or cap > summary.max_tokens):
            settings = json.dumps(retrigger_conf(conf or {}, cap), sort_keys=True)
            text += (f"Next: trigger {_airflow_link(f'/dags/{GENERATE_DAG}', GENERATE_DAG, framed)} again at the "
                     f"recommended cap, <b>max_tokens={cap:,}</b>, with the same settings (paste into the trigger "
                     f"form's JSON conf): <code>{e(settings)}</code>. Rows already finished are kept.")
        else:
            text += "The cap table recommends no higher cap that meets the threshold: see its notes."
        return text + "</div>"
    if shown == FINAL_HTML:
        command = f"python -m tracegen export {shlex.quote(root_uri)} EXPORT_DIR"
        left = ""
        if truncated_left:
            left = (f" {truncated_left:,} rows are still truncated: the export leaves them out (add "
                    "<code>--include-truncated</code> to keep them), or trigger again at a higher cap to finish "
                    "them from their tokens.")
        return (f'<div style="{STATUS_CSS}#dafbe1"><b>Finished.</b> Next: export the dataset: '
                f"<code>{e(command)}</code>.{left}</div>")
    return ""


def status_for(view: RunView, summary: RunSummary, shown: str, uri: str, af: AirflowRun | None,
               raw_run_id: str | None, framed: bool = False, refused: dict[str, Any] | None = None) -> str:
    """The box for `shown`, one of the run's reports, told from the run's view and Airflow's run."""
    left = None
    if shown == FINAL_HTML:
        left = (((view.final or {}).get("audit") or {}).get("truncation") or {}).get("truncated")
    return next_step_html(summary, shown, root_uri=uri, airflow_run_id=af.run_id if af else raw_run_id,
                          conf=af.conf if af else None, truncated_left=left if isinstance(left, int) else None,
                          framed=framed, refused=refused)
