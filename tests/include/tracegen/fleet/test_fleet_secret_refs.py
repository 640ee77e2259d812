"""Fleet secret references.

(a) A token pasted where the *name* of a Variable or connection goes must be neither accepted nor printed by
`fleet validate`: a reference name has to look like an Airflow id (a letter, then letters, digits, `_`,
`.`, `-`, at most 64 characters) and not like a credential; a refused name is never echoed.
(b) An env value with a control character is not echoed, even escaped, in the error: an env value may be a
secret that does not look like one, so the refusal names the entry and the character, never the value; C1 controls
(U+0080..U+009F, a terminal's CSI among them) are refused like C0 ones, and no error prints a raw control
character.
(c) No connection Airflow or the fleet itself uses (`airflow_db` among them) may be sent into a host's
environment. Airflow's own connections
(`airflow*`, `*_default`) and the fleet's own (the hosts' SSH connections, the API key's) are refused when the
fleet is validated, and on the worker a referenced connection must be of the Generic type, the one meant to
hold a bare credential.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support.helpers import ROOT

from tracegen.cli import main as cli_main
from tracegen.fleet import FleetError, FleetSpec, FleetSpecError
from tracegen.fleet.server import resolve_secret
from tracegen.fleet.spec import SecretRef

TOKEN = "hf_PastedTokenNotAName0123456789abcdEF"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    return subprocess.run([sys.executable, "-m", "tracegen", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


@pytest.fixture
def validate(tmp_path, capsys):
    """`python -m tracegen fleet validate FLEET_JSON` in this process (the CLI's own `main`): what it prints
    and its exit status. One test runs the real command line, the many cases go through this."""

    def run(fleet: dict) -> subprocess.CompletedProcess:
        path = tmp_path / "fleet.json"
        path.write_text(json.dumps(fleet))
        capsys.readouterr()
        code = cli_main(["fleet", "validate", str(path)])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([], code, out, err)

    return run


def _fleet(env: dict, **over) -> dict:
    data = {
        "hosts": [{"conn_id": "local", "gpus": [0], "base_port": 31000}],
        "model_path": "Qwen/Qwen3-8B",
        "launch_module": "tracegen.simulator",
        "env": env,
    }
    data.update(over)
    return data


def _validate(tmp_path: Path, fleet: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))
    return _cli("fleet", "validate", str(path))


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in text)


# ---- (a) a reference name is an id, never a pasted token ---------------------------------------------------

@pytest.mark.parametrize("kind", ["from_variable", "from_connection"])
@pytest.mark.parametrize("name", [
    TOKEN,                                  # a Hugging Face token
    "sk-proj-Abc123Def456Ghi789Jkl012",     # an OpenAI-style key
    "AKIAIOSFODNN7EXAMPLE",                 # an AWS access key id
    "q8Fz3LmN29xKv7WbT1cY6pRd",             # no known prefix, but a long run of mixed letters and digits
    "x" * 65,                               # longer than any id an operator types
    "has space",
    "9starts_with_a_digit",
])
def test_a_reference_name_that_is_not_an_id_is_refused_without_echoing_it(validate, kind, name):
    result = validate(_fleet({"HF_TOKEN": {kind: name}}))
    assert result.returncode == 2, result
    out = result.stdout + result.stderr
    assert f"env[HF_TOKEN].{kind}" in result.stderr, result.stderr
    assert name not in out, "a refused reference name must not be echoed"
    assert repr(name)[1:-1] not in out


def test_the_command_line_refuses_a_pasted_token_without_printing_it(tmp_path):
    result = _validate(tmp_path, _fleet({"HF_TOKEN": {"from_variable": TOKEN}}))
    assert result.returncode == 2, result
    assert "env[HF_TOKEN].from_variable: looks like a credential" in result.stderr
    assert TOKEN not in result.stdout + result.stderr


def test_ordinary_reference_names_are_accepted_and_printed(tmp_path):
    result = _validate(tmp_path, _fleet({
        "HF_TOKEN": {"from_variable": "hf_token"},
        "WANDB_API_KEY": {"from_connection": "wandb-prod.team_1"},
        "GH_TOKEN": {"from_connection": "gh", "field": "extra.token"},
    }))
    assert result.returncode == 0, result.stderr
    assert "env HF_TOKEN: from Airflow Variable 'hf_token'" in result.stdout
    assert "Airflow connection 'wandb-prod.team_1'" in result.stdout


def test_a_field_that_is_not_one_is_refused_without_echoing_it(validate):
    result = validate(_fleet({"HF_TOKEN": {"from_connection": "hf", "field": TOKEN}}))
    assert result.returncode == 2 and "env[HF_TOKEN].field" in result.stderr
    assert TOKEN not in result.stdout + result.stderr


def test_unknown_reference_keys_are_not_echoed(validate):
    result = validate(_fleet({"HF_TOKEN": {TOKEN: "x"}}))
    assert result.returncode == 2 and "not a secret reference" in result.stderr
    assert TOKEN not in result.stdout + result.stderr


# ---- (b) control characters ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["s3cretValue\x1b[2Jmore", "s3cretValue\x00", "s3cretValue\x9b31m", "s3cretValue\x85"])
def test_an_env_value_with_a_control_character_is_refused_naming_it_not_echoing_it(validate, value):
    result = validate(_fleet({"MY_SETTING": value}))
    assert result.returncode == 2, result
    out = result.stdout + result.stderr
    assert "env[MY_SETTING]" in result.stderr and "control character" in result.stderr
    assert f"U+{ord(value[11]):04X}" in result.stderr, "the refusal says which character"
    assert "s3cretValue" not in out, "an env value may be a secret: never echoed"
    assert not _has_control(out)


@pytest.mark.parametrize("env", [
    {"MY\x1bNAME": "1"},
    {"HF_TOKEN": {"from_variable": "a\x1b[2Jb"}},
    {"HF_TOKEN": {"from_connection": "a\x9bb"}},
])
def test_no_refusal_prints_a_raw_control_character(validate, env):
    result = validate(_fleet(env))
    assert result.returncode == 2, result
    assert not _has_control(result.stdout + result.stderr), repr(result.stderr)


def test_a_flag_value_with_a_control_character_is_refused_escaped(validate):
    result = validate(_fleet({}, sglang_flags={"--reasoning-parser": "qwen3\x9b2J"}))
    assert result.returncode == 2 and "sglang_flags[--reasoning-parser]" in result.stderr
    assert not _has_control(result.stdout + result.stderr), repr(result.stderr)


# ---- (c) which connections may be referenced ----------------------------------------------------------------

@pytest.mark.parametrize("conn_id", ["airflow_db", "AIRFLOW_DB", "airflow_api", "aws_default", "ssh_default",
                                     "google_cloud_default"])
def test_airflow_own_connections_are_refused(validate, conn_id):
    result = validate(_fleet({"DB_PASSWORD": {"from_connection": conn_id}}))
    assert result.returncode == 2, result
    assert "env[DB_PASSWORD].from_connection" in result.stderr and "Airflow" in result.stderr


def test_the_fleet_own_ssh_and_api_key_connections_are_refused():
    hosts = [{"conn_id": "gpu_box_1", "gpus": [0], "base_port": 31000}]
    with pytest.raises(FleetSpecError, match=r"env\[SSH_PASSWORD\].from_connection: .*SSH connection"):
        FleetSpec.from_dict(_fleet({"SSH_PASSWORD": {"from_connection": "gpu_box_1"}}, hosts=hosts))
    with pytest.raises(FleetSpecError, match=r"env\[KEY\].from_connection: .*API key"):
        FleetSpec.from_dict(_fleet({"KEY": {"from_connection": "sglang_key"}}, api_key_conn_id="sglang_key"))


def test_on_the_worker_only_a_generic_connection_is_read(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_WANDB", json.dumps({"conn_type": "generic", "password": "wandb-s3cret"}))
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", json.dumps(
        {"conn_type": "postgres", "host": "db", "login": "etl", "password": "pg-s3cret"}))
    monkeypatch.setenv("AIRFLOW_CONN_PAGER", json.dumps({"conn_type": "http", "password": "http-s3cret"}))
    assert resolve_secret("WANDB_API_KEY", SecretRef(connection="wandb")) == "wandb-s3cret"
    for conn_id, kind, value in (("warehouse", "postgres", "pg-s3cret"), ("pager", "http", "http-s3cret")):
        with pytest.raises(FleetError) as info:
            resolve_secret("X", SecretRef(connection=conn_id))
        message = str(info.value)
        assert f"connection {conn_id!r}" in message and kind in message and "generic" in message.lower()
        assert value not in message
