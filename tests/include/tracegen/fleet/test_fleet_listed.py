"""The `fleet` param names only a fleet the operator listed (TRACEGEN_FLEET, TRACEGEN_FLEETS): any other path
is refused by the tasks that take the param, before it is opened, in the same words whether a file is there
or not, and quoting nothing of what a file holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from engine_support.helpers import write_dataset

from tracegen import steps
from tracegen.params import default_params

SECRET = "s3cr3t-value-in-a-worker-file"


@pytest.fixture
def worker_files(tmp_path: Path) -> dict[str, Path]:
    """Paths a trigger might probe: a JSON file with a secret, a non-JSON file, a directory, nothing."""
    json_file = tmp_path / "worker" / "app-config.json"
    json_file.parent.mkdir()
    json_file.write_text(json.dumps({"api_token": SECRET, "hosts": [{"password": SECRET}]}))
    text_file = tmp_path / "worker" / "id_rsa"
    text_file.write_text(f"-----BEGIN KEY-----\n{SECRET}\n")
    return {"json": json_file, "text": text_file, "dir": tmp_path / "worker", "missing": tmp_path / "nothing.json",
            "dotdot": tmp_path / "fleets" / ".." / "worker" / "app-config.json"}


def _refusal(call, params: dict) -> str:
    with pytest.raises(AirflowFailException) as refused:
        call(params)
    return str(refused.value)


def _prepare(params: dict) -> None:
    steps.prepare_run(1)


def test_a_fleet_not_listed_is_refused_alike_whether_or_not_it_exists(worker_files, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRACEGEN_FLEET", raising=False)
    (tmp_path / "fleets").mkdir()
    monkeypatch.setenv("TRACEGEN_FLEETS", str(tmp_path / "fleets"))
    dataset = write_dataset(tmp_path / "prompts.jsonl", 10)
    messages = {}
    for kind, path in worker_files.items():
        params = {**default_params(), "dataset_uri": str(dataset), "output_uri": str(tmp_path / "out"),
                  "fleet": str(path)}
        monkeypatch.setattr(steps, "_context", lambda params=params: {"params": params, "run_id": "manual__f"})
        messages[kind] = _refusal(_prepare, params)
        params = {"action": "status", "fleet": str(path)}
        monkeypatch.setattr(steps, "_context", lambda params=params: {"params": params, "run_id": "manual__f"})
        messages[f"fleet_action {kind}"] = _refusal(lambda _: steps.fleet_action(), params)
    assert len(set(messages.values())) == 1, messages
    [message] = set(messages.values())
    assert message.startswith("invalid params: fleet: not one the operator listed (TRACEGEN_FLEET, TRACEGEN_FLEETS)")
    assert SECRET not in message and "api_token" not in message and "worker" not in message
    assert not (tmp_path / "out").exists()


def test_the_listed_fleets_and_files_in_listed_directories_are_accepted(tmp_path, monkeypatch) -> None:
    from tracegen.fleet.sources import LISTED_FLEETS_ENV, FleetNotListed, listed_fleet

    listed_dir, listed_file = tmp_path / "fleets", tmp_path / "other" / "gpu.json"
    listed_dir.mkdir()
    listed_file.parent.mkdir()
    (listed_dir / "a.json").write_text("{}")
    (listed_dir / "escape.json").symlink_to(tmp_path / "other" / "secret.json")
    monkeypatch.setenv("TRACEGEN_FLEET", str(listed_dir / "a.json"))
    monkeypatch.setenv(LISTED_FLEETS_ENV, f" {listed_dir} , {listed_file}")
    for ok in (listed_dir / "a.json", listed_file, listed_dir / "sub" / "b.json"):
        assert listed_fleet(str(ok)) == str(ok)
    # The default, local-sim, is listed only while TRACEGEN_FLEET is unset; a link out of a listed directory,
    # a relative path or a sibling sharing its name's start are not listed.
    for refused in ("local-sim", str(listed_dir / "escape.json"), "fleets/a.json", f"{listed_dir}-b/a.json", "",
                    None, 7):
        with pytest.raises(FleetNotListed):
            listed_fleet(refused)
    monkeypatch.delenv("TRACEGEN_FLEET")
    assert listed_fleet("local-sim") == "local-sim"
