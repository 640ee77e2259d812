"""One read model of a run for the review pages: its stored files, its record, its reports, its question and
its stage at the gate (`run.stage.run_stage`, the rule every reader applies). The report files' names are
known here and nowhere else in the pages.

It reads only `runs/<run_id>/` files (never the ledger's rows), so a page costs a few small reads.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass
from typing import Any

from tracegen.run import FINAL_REPORT, PILOT_REPORT, QUESTION_FILE, RUN_FILE
from tracegen.run.stage import GOING, run_stage

# The reports a run's audits write, JSON and HTML: the final audit, the pilot gate's and the continuous
# gate's (the audit a mid-run question was built from). Anything else under runs/<run_id>/ stays private.
FINAL_HTML, FINAL_JSON = "report.html", FINAL_REPORT
PILOT_HTML, PILOT_JSON = "pilot-report.html", PILOT_REPORT
GATE_HTML, GATE_JSON = "gate-report.html", "gate-report.json"
REPORT_FILES = (FINAL_HTML, PILOT_HTML, GATE_HTML, FINAL_JSON, PILOT_JSON, GATE_JSON)
# Which gate's report decided, by the trigger of the decision it led to.
_BY_TRIGGER = {"pilot": PILOT_HTML, "drift": GATE_HTML}


class StoredFileError(ValueError):
    """A run's stored JSON file does not parse, or is not an object: a page that needs it says so (422)."""


def read_json(output_root: Any, run_id: str, name: str) -> dict[str, Any] | None:
    """A run's stored JSON object; None when the file does not exist."""
    from tracegen.store.storage import StorageKeyError

    try:
        doc = json.loads(output_root.run_files.get(run_id, name))
    except StorageKeyError:
        return None
    except ValueError as exc:
        raise StoredFileError(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise StoredFileError(f"{name} is not a JSON object")
    return doc


def gate_stage(run_doc: dict[str, Any] | None, pilot: dict[str, Any] | None,
               present: set[str] | frozenset[str]) -> tuple[str | None, str | None]:
    """(stage, the report that decided it) from the stored files by `run_stage`; the stage is None while
    no gate holds the run."""
    decisions = [d for d in (run_doc or {}).get("decisions") or [] if isinstance(d, dict)]
    last = decisions[-1] if decisions else None
    pilot_says = ((pilot or {}).get("verdict") or {}).get("verdict")
    mode = (((run_doc or {}).get("config")) or {}).get("gate_mode")
    asked = QUESTION_FILE in present
    stage = run_stage(gate_mode=mode if isinstance(mode, str) else None, pilot_verdict=pilot_says,
                      question_asked=asked,
                      last_decision_continues=None if last is None else last.get("cap") is not None)
    if stage == GOING:
        return None, None
    if last is not None:
        name = _BY_TRIGGER.get(last.get("trigger"), PILOT_HTML)
    elif asked and pilot_says != "stop" and GATE_HTML in present:
        name = GATE_HTML
    else:
        name = PILOT_HTML
    return stage, name if name in present else None


@dataclass(frozen=True)
class RunView:
    """What a run's stored files say: read once per page, asked everything the page shows."""

    run_id: str
    present: frozenset[str]
    record: dict[str, Any] | None  # run.json: the RunSpec as written, with the gate's decisions
    pilot: dict[str, Any] | None
    final: dict[str, Any] | None

    @property
    def reports(self) -> tuple[str, ...]:
        return tuple(name for name in REPORT_FILES if name in self.present)

    @property
    def airflow_run_id(self) -> str | None:
        """The Airflow run the record names, as written: a key to find the run by, not proof it is that run."""
        named = (self.record or {}).get("airflow_run_id")
        return named if isinstance(named, str) and named else None

    @property
    def has_record(self) -> bool:
        return RUN_FILE in self.present

    @property
    def asked(self) -> bool:
        return QUESTION_FILE in self.present

    @property
    def config(self) -> dict[str, Any]:
        shown = self.final or self.pilot or {}
        return (self.record or {}).get("config") or (shown.get("run") or {}).get("config") or {}

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return [d for d in (self.record or {}).get("decisions") or [] if isinstance(d, dict)]

    @property
    def stage_and_decider(self) -> tuple[str | None, str | None]:
        return gate_stage(self.record, self.pilot, self.present)

    def report_json(self, html_name: str) -> dict[str, Any] | None:
        """The JSON of an HTML report this view read (the pilot's or the final's)."""
        return {PILOT_HTML: self.pilot, FINAL_HTML: self.final}.get(html_name)

    def created(self) -> str | None:
        ts = (self.record or {}).get("created_at")
        if isinstance(ts, int | float) and math.isfinite(ts):
            return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        generated = (self.final or self.pilot or {}).get("generated_at")
        return generated if isinstance(generated, str) else None


def run_files(output_root: Any, run_id: str) -> frozenset[str]:
    """The names of a run's stored files (one listing)."""
    return frozenset(k.rsplit("/", 1)[1] for k in output_root.storage.list(f"runs/{run_id}/"))


def read_run(output_root: Any, run_id: str, present: set[str] | frozenset[str] | None = None) -> RunView:
    """A run's view from its stored files; StoredFileError when one it needs does not parse."""
    present = frozenset(run_files(output_root, run_id) if present is None else present)

    def doc(name: str) -> dict[str, Any] | None:
        return read_json(output_root, run_id, name) if name in present else None

    return RunView(run_id, present, doc(RUN_FILE), doc(PILOT_JSON), doc(FINAL_JSON))
