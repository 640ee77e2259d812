"""Secrets in the fleet's `env`.

An `HF_TOKEN` written into the fleet file went wherever the fleet went. Now the fleet references secrets
held in Airflow (`{"from_variable": ...}`, `{"from_connection": ..., "field": ...}`), resolved on the worker
when a server is launched; an inline secret-looking value is refused, pointing at that syntax. Checked
through `python -m tracegen fleet validate` and the DAG's task callables launching a stand-in over a real
sshd: the server's environment holds the secret; its argv, the run's record, the XComs, the task logs and
the files on the host do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support.helpers import ROOT, write_dataset
from fixtures.ports import free_port
from fleet_helpers import wait_for

from tracegen import steps
from tracegen.fleet import FleetSpec, FleetSpecError
from tracegen.params import default_params

HF_TOKEN = "hf_SecretValueForTheTest0123456789abcdef"
WANDB_KEY = "wandb-secret-9d1c0e77aa41"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    return subprocess.run([sys.executable, "-m", "tracegen", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def _fleet(conn_id: str, base_port: int, work_dir: Path, env: dict) -> dict:
    return {
        "hosts": [{"conn_id": conn_id, "gpus": [0], "base_port": base_port}],
        "model_path": "Qwen/Qwen3-8B",
        "served_model_name": "qwen3-8b",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "work_dir": str(work_dir),
        "env": env,
        "sglang_flags": {"--context-length": 40960, "--max-running-requests": 16, "--sim-time-scale": 1000,
                         "--sim-length-model": "short"},
        "health_timeout_s": 60,
        "stop_timeout_s": 5,
    }


@pytest.mark.parametrize("name,value", [
    ("HF_TOKEN", "plain-looking"),
    ("HUGGING_FACE_HUB_TOKEN", "abc"),
    ("OPENAI_API_KEY", "abc"),
    ("AWS_SECRET_ACCESS_KEY", "abc"),
    ("DB_PASSWORD", "abc"),
    ("SOME_SETTING", HF_TOKEN),  # a Hugging Face token under any name
])
def test_fleet_validate_refuses_an_inline_secret_and_names_the_reference_syntax(tmp_path, name, value):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet("local", 31000, tmp_path / "w", {name: value})))
    result = _cli("fleet", "validate", str(path))
    assert result.returncode == 2, result
    assert f"env[{name}]" in result.stderr and '"from_variable"' in result.stderr
    assert '"from_connection"' in result.stderr
    assert value not in result.stderr + result.stdout, "the refused value must not be echoed"


def test_fleet_validate_accepts_references_and_ordinary_names(tmp_path):
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
           "HF_TOKEN": {"from_variable": "hf_token"},
           "WANDB_API_KEY": {"from_connection": "wandb", "field": "password"},
           "GH_TOKEN": {"from_connection": "gh", "field": "extra.token"}}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet("local", 31000, tmp_path / "w", env)))
    result = _cli("fleet", "validate", str(path))
    assert result.returncode == 0, result.stderr
    assert "env HF_TOKEN: from Airflow Variable 'hf_token'" in result.stdout
    assert "env WANDB_API_KEY: from field 'password' of Airflow connection 'wandb'" in result.stdout
    for bad, why in [({"from_variable": "x", "field": "password"}, "not a secret reference"),
                     ({"from_connection": "c", "field": "port"}, "field"),
                     ({"from_variable": "a b"}, "Airflow Variable key"), ({}, "not a secret reference")]:
        with pytest.raises(FleetSpecError, match=why):
            FleetSpec.from_dict(_fleet("local", 31000, tmp_path / "w", {"HF_TOKEN": bad}))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_referenced_secret_reaches_the_launched_server_and_nothing_else(
    sshd, tmp_path, monkeypatch, caplog, capfd, stray_groups
):
    monkeypatch.setenv("AIRFLOW_VAR_HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("AIRFLOW_CONN_WANDB", json.dumps({"conn_type": "generic", "password": WANDB_KEY}))
    work_dir = tmp_path / "host-work"
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(json.dumps(_fleet(sshd.conn_id, free_port(), work_dir, {
        "HF_TOKEN": {"from_variable": "hf_token"},
        "WANDB_API_KEY": {"from_connection": "wandb"},
        "HF_HUB_OFFLINE": "1",
    })))
    dataset = write_dataset(tmp_path / "prompts.jsonl", 20)
    output = tmp_path / "out"
    params = {**default_params(), "dataset_uri": str(dataset), "output_uri": str(output),
              "fleet": str(fleet_file), "max_tokens": 4096, "pilot_size": 8, "chunk_size": 10, "teardown": True}
    monkeypatch.setenv("TRACEGEN_FLEETS", str(fleet_file))  # the operator lists the fleet the trigger names
    monkeypatch.setattr(steps, "_context", lambda: {"params": params, "run_id": "manual__secrets"})
    caplog.set_level("DEBUG")

    xcoms = [steps.prepare_run(1)]
    run = xcoms[0]["run"]
    try:
        servers = steps.provision_fleet(run)
        xcoms.append(servers)
        pid = servers[0]["pid"]
        stray_groups.append(pid)
        environ = _environ(pid)
        assert environ["HF_TOKEN"] == HF_TOKEN and environ["WANDB_API_KEY"] == WANDB_KEY
        assert environ["HF_HUB_OFFLINE"] == "1" and environ["CUDA_VISIBLE_DEVICES"] == "0"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert HF_TOKEN not in cmdline and WANDB_KEY not in cmdline
        xcoms.append(steps.run_pilot(run))
    finally:
        xcoms.append(steps.teardown_fleet(run))
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists() or
                    Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"), timeout=10)

    leaks = {"XCom": json.dumps(xcoms), "task log": caplog.text, "output": "".join(capfd.readouterr())}
    for path in [*output.rglob("*"), *work_dir.rglob("*")]:
        if path.is_file():
            leaks[str(path)] = path.read_bytes().decode(errors="replace")
    for where, text in leaks.items():
        assert HF_TOKEN not in text and WANDB_KEY not in text, f"a secret leaked into {where}"
    record = json.loads((output / "runs" / "manual__secrets" / "run.json").read_text())
    assert record["fleet"]["source"] == str(fleet_file)


def test_a_missing_secret_fails_the_launch_naming_the_reference_not_a_value(tmp_path, monkeypatch):
    from tracegen.fleet import FleetConnection, FleetError, provision

    monkeypatch.delenv("AIRFLOW_VAR_NOT_THERE", raising=False)
    spec = FleetSpec.from_dict(_fleet("local", free_port(), tmp_path / "w",
                                      {"HF_TOKEN": {"from_variable": "not_there"}}))
    with FleetConnection(spec) as fleet, pytest.raises(FleetError, match="Airflow Variable 'not_there'"):
        provision(spec, fleet)
    assert not (tmp_path / "w").exists() or not list((tmp_path / "w").glob("*.pid"))
