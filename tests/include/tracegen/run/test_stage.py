"""One rule for a run's stage at its gate (`run.stage.run_stage`): the rerun, the review pages and
`status` read every stage the same way, including the one that is easiest to read three ways (gate_mode=ask,
the pilot said stop, and the question is not written yet)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from engine_support.helpers import make_config, prepare, root_of, write_dataset

from tracegen.review.read_model import gate_stage
from tracegen.run import PILOT_REPORT, QUESTION_FILE, RUN_FILE
from tracegen.run.run_record import stage_of, stopped_at_gate
from tracegen.run.stage import ASKING, GOING, STOPPED, run_stage
from tracegen.status import dataset_status, format_status


@pytest.mark.parametrize(("mode", "pilot", "asked", "last", "stage"), [
    ("ask", None, False, None, GOING),  # generating, no gate has ruled
    ("ask", "pass", False, None, GOING),
    ("ask", "stop", False, None, ASKING),  # the disputed case: the question is being prepared
    ("ask", "stop", True, None, ASKING),
    ("ask", None, True, None, ASKING),  # the continuous gate asked mid-run
    ("stop", "stop", False, None, STOPPED),
    ("warn", "stop", False, None, GOING),
    ("ask", "stop", True, True, GOING),  # answered: go on at a cap
    ("ask", "stop", True, False, STOPPED),  # answered stop, or the question timed out
    ("stop", "stop", False, True, GOING),  # a raise decided the run's cap
])
def test_every_stage_is_read_the_same_by_every_reader(tmp_path, mode, pilot, asked, last, stage) -> None:
    assert run_stage(gate_mode=mode, pilot_verdict=pilot, question_asked=asked, last_decision_continues=last) == stage
    config = make_config(write_dataset(tmp_path / "d.jsonl", 50), tmp_path / "out", gate_mode=mode, chunk_size=20)
    spec = prepare(config, "run-1")
    root = root_of(config)
    doc = spec.to_json()
    if last is not None:
        doc["decisions"] = [{"cap": 8192 if last else None, "trigger": "pilot"}]
    present = {RUN_FILE}
    if pilot is not None:
        root.run_files.put("run-1", PILOT_REPORT, json.dumps({"verdict": {"verdict": pilot}}).encode())
        present |= {PILOT_REPORT, "pilot-report.html"}
    if asked:
        root.run_files.put("run-1", QUESTION_FILE, b"{}")
        present.add(QUESTION_FILE)
    # The review pages read the raw files; the rerun and status read the run with its decisions.
    pages, _ = gate_stage(doc, {"verdict": {"verdict": pilot}} if pilot else None, present)
    assert (pages or GOING) == stage
    decided = spec if last is None else replace(spec, decisions=(_decision(last),))
    assert stage_of(root, decided) == stage
    assert stopped_at_gate(root, decided) == (stage != GOING)
    if last is None:
        history = dataset_status(config.output_uri)["runs"]
        assert history[0]["stage"] == stage
        assert (f"({stage})" in format_status(dataset_status(config.output_uri))) == (stage != GOING)


def _decision(continues: bool):
    from tracegen.audit.cap_question import CapDecision

    return CapDecision(trigger="pilot", option="x", kind="recommended" if continues else "stop", from_cap=4096,
                       cap=8192 if continues else None, responded_by="Ada", responded_at="2026-12-01T00:00:00+00:00",
                       timed_out=False, verdict={}, cap_rows=[], report_uri="")
