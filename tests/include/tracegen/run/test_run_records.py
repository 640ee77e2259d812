"""One run, one record: an Airflow run id never reaches another run's `runs/<id>/`, a run's first record
never replaces another run's, and runs stored under the earlier id form (the cleaned id alone) are still
found by the Airflow run their record names."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support.helpers import fleet_ref, make_config, write_dataset

from tracegen import steps
from tracegen.audit.cap_question import OTHER, CapDecision
from tracegen.config import RUN_ID_PATTERN, ConfigError, safe_run_id
from tracegen.params import default_params
from tracegen.review.access import AirflowRun
from tracegen.run import RUN_FILE
from tracegen.run.prepare import prepare_run
from tracegen.run.run_record import read_run_record, write_run_record
from tracegen.store.root import open_root

EARLIER = "manual__2026-12-03T12:00:56.997472+00:00"  # as Airflow names a run triggered from the UI
# Accepted by Airflow's default run-id pattern, and what the earlier id cleans to.
LOOKALIKE = "manual__2026-12-03T12_00_56.997472_00_00"


def test_two_airflow_run_ids_that_clean_alike_are_stored_apart() -> None:
    from tracegen.config import legacy_run_id

    assert legacy_run_id(EARLIER) == LOOKALIKE  # the form the earlier run was stored under
    assert safe_run_id(LOOKALIKE) == LOOKALIKE  # an id that is already safe stays readable as it is
    assert safe_run_id(EARLIER) != LOOKALIKE and safe_run_id(EARLIER).startswith(LOOKALIKE + "--")
    # An id copying another run's stored id is not stored there: a kept id never ends as a changed one does.
    assert safe_run_id(safe_run_id(EARLIER)) != safe_run_id(EARLIER)
    ids = [EARLIER, LOOKALIKE, "manual__2026-12-03T12:00:56.997472_00:00", "a" * 300, "a" * 300 + "b",
           "_x", "x_", "x.", "-x", "-x:", ".-_x", safe_run_id(EARLIER), "run-1", "run 1", "run+1", "run:1"]
    stored = [safe_run_id(i) for i in ids]
    assert len(set(stored)) == len(ids)
    assert all(RUN_ID_PATTERN.fullmatch(s) for s in stored), stored
    for unusable in ("::", "-_.", "--"):
        with pytest.raises(ConfigError, match="no usable characters"):
            safe_run_id(unusable)


def _decided(spec, who: str = "alice"):
    return spec.decided(CapDecision(
        trigger="pilot", option="Continue at the cap typed below", kind=OTHER, from_cap=spec.config.max_tokens,
        cap=16384, responded_by=who, responded_at="2026-12-03T12:30:00+00:00", timed_out=False, verdict={},
        cap_rows=[], report_uri=""))


def _earlier_run_stored_as_before(config) -> Path:
    """The earlier run as the previous id form stored it (the cleaned id alone), decided by its reviewer."""
    spec, _ = prepare_run(config, LOOKALIKE, fleet_ref(), airflow_run_id=EARLIER)
    write_run_record(open_root(config.output_uri), _decided(spec))
    return Path(config.output_uri) / "runs" / LOOKALIKE / RUN_FILE


def _prepare_as_the_dag_does(monkeypatch, config, airflow_run_id: str, **conf):
    params = {**default_params(), "dataset_uri": config.dataset_uri, "output_uri": config.output_uri,
              "pilot_size": 0, "chunk_size": 100, **conf}
    monkeypatch.setattr(steps, "_context", lambda: {"params": params, "run_id": airflow_run_id})
    return steps.prepare_run(1)


def test_a_chosen_run_id_does_not_take_over_another_runs_record(tmp_path, monkeypatch) -> None:
    """A run triggered with the id another run's id cleans to: it is refused, naming both, and the earlier
    run's record (who answered its gate, when, its cap, its Airflow run) stays byte for byte."""
    from airflow.sdk.exceptions import AirflowFailException

    config = make_config(write_dataset(tmp_path / "d.jsonl", 40), tmp_path / "out", chunk_size=100)
    record = _earlier_run_stored_as_before(config)
    before = record.read_bytes()
    with pytest.raises(AirflowFailException) as refused:
        _prepare_as_the_dag_does(monkeypatch, config, LOOKALIKE, max_tokens=4096)
    assert EARLIER in str(refused.value) and LOOKALIKE in str(refused.value)
    assert record.read_bytes() == before
    assert read_run_record(open_root(config.output_uri), LOOKALIKE).decisions[0].responded_by == "alice"


def test_a_run_of_the_earlier_id_form_keeps_its_record_and_new_runs_get_their_own(tmp_path, monkeypatch) -> None:
    from tracegen.run.run_record import stored_run_id

    config = make_config(write_dataset(tmp_path / "d.jsonl", 40), tmp_path / "out", chunk_size=100)
    record = _earlier_run_stored_as_before(config)
    root = open_root(config.output_uri)
    # Found by the Airflow run its record names, and only by that one.
    assert stored_run_id(root, EARLIER) == LOOKALIKE
    assert stored_run_id(root, "manual__2026-12-03T12:00:56.997472_00:00") != LOOKALIKE
    # A retried first task of that run keeps writing where the run is stored (the ledger's rows name it).
    doc = _prepare_as_the_dag_does(monkeypatch, config, EARLIER)
    assert doc["run"]["run_id"] == LOOKALIKE and doc["run"]["airflow_run_id"] == EARLIER
    # Two new runs whose ids clean alike: each its own record.
    other = tmp_path / "other"
    config2 = make_config(config.dataset_uri, other, chunk_size=100)
    a = _prepare_as_the_dag_does(monkeypatch, config2, EARLIER)["run"]
    b = _prepare_as_the_dag_does(monkeypatch, config2, LOOKALIKE)["run"]
    assert a["run_id"] != b["run_id"]
    root2 = open_root(str(other))
    assert read_run_record(root2, a["run_id"]).airflow_run_id == EARLIER
    assert read_run_record(root2, b["run_id"]).airflow_run_id == LOOKALIKE
    assert record.exists()


def test_a_first_record_is_created_exclusively(tmp_path) -> None:
    """Of two first tasks writing one `runs/<id>/`, the second is refused whatever it names, and one of the
    same Airflow run (a retry) replaces its own record."""
    from tracegen.run.run_record import RunRecordTaken, create_run_record

    config = make_config(write_dataset(tmp_path / "d.jsonl", 10), tmp_path / "out")
    spec, _ = prepare_run(config, "shared", fleet_ref(), airflow_run_id="run-a")
    root = open_root(config.output_uri)
    before = (tmp_path / "out" / "runs" / "shared" / RUN_FILE).read_bytes()
    from dataclasses import replace

    for intruder in (replace(spec, airflow_run_id="run-b"), replace(spec, airflow_run_id=None)):
        with pytest.raises(RunRecordTaken, match="'run-a'"):
            create_run_record(root, intruder)
    assert (tmp_path / "out" / "runs" / "shared" / RUN_FILE).read_bytes() == before
    (tmp_path / "out" / "runs" / "shared" / RUN_FILE).write_text("{not json")
    with pytest.raises(RunRecordTaken, match="cannot be read"):
        create_run_record(root, spec)
    (tmp_path / "out" / "runs" / "shared" / RUN_FILE).write_bytes(before)
    create_run_record(root, replace(spec, created_at=spec.created_at + 1))  # the same run again
    assert read_run_record(root, "shared").created_at == spec.created_at + 1


def test_the_review_pages_find_a_run_stored_under_the_earlier_id_form() -> None:
    from tracegen.config import stored_as
    from tracegen.review.roots import airflow_run_of

    earlier = AirflowRun(EARLIER, "success", None, {})
    lookalike = AirflowRun(LOOKALIKE, "running", None, {})
    by_stored = {safe_run_id(r.run_id): r for r in (earlier, lookalike)}
    assert airflow_run_of(safe_run_id(EARLIER), None, by_stored) is earlier
    # runs/<LOOKALIKE>/ is the lookalike's by its new id; the earlier run's when its record names it...
    assert airflow_run_of(LOOKALIKE, LOOKALIKE, by_stored) is lookalike
    assert airflow_run_of(LOOKALIKE, EARLIER, by_stored) is earlier
    assert stored_as(LOOKALIKE, EARLIER, EARLIER)
    # ...and never the earlier run's on a record naming another run.
    assert not stored_as(LOOKALIKE, EARLIER, "manual__x")
    only_earlier = {safe_run_id(EARLIER): earlier}
    assert airflow_run_of(LOOKALIKE, EARLIER, only_earlier) is earlier
    assert airflow_run_of(LOOKALIKE, "manual__x", only_earlier) is None
