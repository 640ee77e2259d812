"""The run object: one codec for the task hand-off and run.json, records read back as data only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from engine_support.helpers import (
    fleet,
    fleet_ref,
    make_config,
    prepare,
    rerun_work,
    root_of,
    write_dataset,
)

from tracegen.fleet.sources import FleetChangedError, reference, resolve
from tracegen.run import RUN_FILE
from tracegen.run.run_record import latest_run, read_run_record
from tracegen.run.run_spec import RunSpec, RunSpecError


@pytest.fixture
def spec(tmp_path: Path) -> RunSpec:
    config = make_config(write_dataset(tmp_path / "d.jsonl", 50), tmp_path / "out", chunk_size=20)
    return prepare(config, "run-1")


def test_the_hand_off_and_the_record_are_one_codec(spec: RunSpec) -> None:
    assert RunSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    stored = read_run_record(root_of(spec.config), "run-1")
    assert stored.to_json() == spec.to_json() | {"config": stored.config.to_json()}
    assert (stored.dataset.n_rows, stored.layout.size, stored.fleet.gpus) == (50, 20, 1)
    # The record holds the fleet by source and digest only: no hosts, no launch command, no flags.
    doc = json.loads(root_of(spec.config).run_files.get("run-1", RUN_FILE))
    assert set(doc["fleet"]) == {"source", "sha256", "model", "gpus", "max_running_requests"}


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: d.pop("layout"), "missing field 'layout'"),
    (lambda d: d.update(schema=99), "schema 99"),
    (lambda d: d["config"].update(max_tokens=-5), r"max_tokens -5 is below 1 token"),
    (lambda d: d["fleet"].update(sha256=""), "fleet.sha256"),
])
def test_a_damaged_record_is_refused_naming_the_file(spec: RunSpec, damage, message: str) -> None:
    root = root_of(spec.config)
    doc = spec.to_json()
    damage(doc)
    root.run_files.put("run-1", RUN_FILE, json.dumps(doc).encode())
    with pytest.raises(RunSpecError, match=message) as info:
        read_run_record(root, "run-1")
    assert "runs/run-1/run.json" in str(info.value)
    assert latest_run(root) is None  # skipped with a warning, not a crash of every tool over the root


def test_a_copied_root_is_worked_on_where_it_is(spec: RunSpec, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "out", copy)
    stored = read_run_record(root_of(replace(spec.config, output_uri=str(copy))), "run-1")
    assert stored.config.output_uri == copy.as_uri() + "/"  # not the root named inside run.json
    work = rerun_work(str(copy))
    assert {w.output_uri for w in work} == {str(copy)} and sum(w.work.remaining for w in work) == 50


def test_a_planted_record_cannot_choose_the_fleet(spec: RunSpec, tmp_path: Path) -> None:
    """Write access to the output root must not become code execution on the GPU hosts: the rerun loads
    the operator's fleet, and a record naming another source or digest is refused."""
    planted = tmp_path / "evil-fleet.json"
    evil = fleet().to_dict() | {"python": "/bin/sh", "launch_module": "x"}
    planted.write_text(json.dumps(evil))
    _, evil_ref = reference(str(planted))
    doc = spec.to_json() | {"fleet": vars(evil_ref)}
    root_of(spec.config).run_files.put("run-1", RUN_FILE, json.dumps(doc).encode())
    record = read_run_record(root_of(spec.config), "run-1")
    operator = tmp_path / "operator-fleet.json"
    operator.write_text(json.dumps(fleet().to_dict()))
    with pytest.raises(FleetChangedError, match="has changed since the run began"):
        resolve(record.fleet, str(operator))
    # The run's own fleet, from the operator's source, resolves.
    assert resolve(fleet_ref(), str(operator)).to_dict() == fleet().to_dict()
