"""A run reads and writes only under the operator's prefixes: the first task refuses an output root or a dataset
outside them before anything is written (before, any path the worker could reach was created and written), and
the scheduled rerun leaves alone a root outside them that the `tracegen_output_roots` Variable lists."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support.helpers import fleet_ref, make_config, prepare, write_dataset

from tracegen.config import ConfigError, RunConfig
from tracegen.run.prepare import prepare_run
from tracegen.run.rerun import RerunRefused, RerunWork, run_for_rerun, unfinished_work

WRITE, READ = "TRACEGEN_WRITE_PREFIXES", "TRACEGEN_READ_PREFIXES"


@pytest.fixture
def allowed(tmp_path, monkeypatch) -> Path:
    base = tmp_path / "allowed"
    base.mkdir()
    monkeypatch.setenv(WRITE, str(base))
    monkeypatch.setenv(READ, str(tmp_path / "datasets"))
    return base


@pytest.mark.parametrize("field", ["output_uri", "dataset_uri"])
def test_a_run_outside_the_prefixes_is_refused_before_anything_is_written(allowed, tmp_path, field):
    (tmp_path / "datasets").mkdir()
    dataset = write_dataset(tmp_path / "datasets" / "prompts.jsonl", 5)
    outside_data = write_dataset(tmp_path / "prompts.jsonl", 5)
    output = allowed / "out"
    params = {"output_uri": str(tmp_path / "out")} if field == "output_uri" else {"dataset_uri": str(outside_data)}
    config = make_config(dataset, output, **params)  # decoding checks the form, not the prefixes
    with pytest.raises(ConfigError, match=rf"{field}: .* outside the prefixes"):
        prepare_run(config, "run-a", fleet_ref())
    assert not (tmp_path / "out").exists() and not output.exists()
    # Inside the prefixes the same run is prepared.
    prepare(make_config(dataset, output), "run-a")
    assert (output / "runs" / "run-a" / "run.json").exists()


def test_a_record_outside_todays_prefixes_still_decodes(allowed, tmp_path):
    # A run record describes where a run was; narrowing the prefixes later must not make it unreadable.
    config = RunConfig(dataset_uri="/data/p.jsonl", output_uri="/elsewhere/out")
    assert RunConfig.from_params(config.to_json()) == config
    with pytest.raises(ConfigError, match="dataset_uri: .* outside the prefixes"):
        config.check_locations()


def test_the_rerun_leaves_a_root_outside_the_write_prefixes_alone(allowed, tmp_path, monkeypatch):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 5)
    monkeypatch.setenv(WRITE, str(tmp_path))
    prepare(make_config(dataset, tmp_path / "old"), "run-a")  # written while the operator allowed it
    monkeypatch.setenv(WRITE, str(allowed))
    before = sorted(p.relative_to(tmp_path / "old") for p in (tmp_path / "old").rglob("*"))

    assert unfinished_work(str(tmp_path / "old"), airflow=None) == []
    with pytest.raises(RerunRefused, match="tracegen_output_roots: .*TRACEGEN_WRITE_PREFIXES"):
        run_for_rerun(RerunWork(str(tmp_path / "old"), "run-a", None), airflow=None)
    assert sorted(p.relative_to(tmp_path / "old") for p in (tmp_path / "old").rglob("*")) == before

