"""docker-compose.yaml, Dockerfile and .env.example checked without a Docker engine.

The compose file is validated against the Compose specification's JSON schema as vendored by
check-jsonschema (not a hand-written schema), then the properties a distributed Airflow needs are checked:
one DB, broker, fernet key, JWT secret and execution API URL for every component, the execution API on
the api-server, mounted paths that exist, an image that installs requirements.txt.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import tomllib
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tracegen.fleet import FleetSpec

ROOT = Path(__file__).resolve().parents[2]
SHARED_KEYS = (
    "AIRFLOW__CORE__EXECUTOR",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "AIRFLOW__CORE__FERNET_KEY",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW__API__SECRET_KEY",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
)
COMPONENT_COMMANDS = {"api-server", "scheduler", "dag-processor", "triggerer", "celery worker"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


def _schema() -> dict:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


def _airflow_services(compose: dict) -> dict[str, dict]:
    """Services running an Airflow component or the init job (the ones that share x-airflow-common)."""
    return {name: svc for name, svc in compose["services"].items() if name.startswith("airflow-")}


def _command(svc: dict) -> str:
    cmd = svc.get("command")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd or "")


def test_compose_file_is_valid_against_the_compose_spec(compose: dict) -> None:
    schema = _schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


def test_the_schema_check_can_fail(compose: dict) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["airflow-scheduler"]["healthcheck"]["interval"] = ["30s"]
    broken["services"]["redis"]["no_such_key"] = 1
    assert len(list(jsonschema.Draft202012Validator(_schema()).iter_errors(broken))) >= 2


def test_every_airflow_component_is_there(compose: dict) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "airflow-init"} <= set(services)
    commands = {_command(svc) for svc in _airflow_services(compose).values()}
    assert COMPONENT_COMMANDS <= commands, f"missing components: {COMPONENT_COMMANDS - commands}"
    for name, svc in services.items():
        if svc.get("profiles") or name == "airflow-init":
            continue
        assert "healthcheck" in svc, f"{name} has no health check"
    for name, svc in _airflow_services(compose).items():
        if name != "airflow-init":
            assert svc["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
    assert "db migrate" in _command(compose["services"]["airflow-init"])


def test_components_share_secrets_db_broker_and_execution_api(compose: dict) -> None:
    airflow = _airflow_services(compose)
    assert len(airflow) >= 6
    first = None
    for name, svc in airflow.items():
        env = svc["environment"]
        missing = [key for key in SHARED_KEYS if not env.get(key)]
        assert not missing, f"{name} lacks {missing}"
        shared = {key: env[key] for key in SHARED_KEYS}
        first = first or (name, shared)
        assert shared == first[1], f"{name} and {first[0]} disagree on {[k for k in SHARED_KEYS if shared[k] != first[1][k]]}"
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert svc["image"] == airflow["airflow-apiserver"]["image"], f"{name} runs another image"

    env = first[1]
    # The host follows the last '@' (the password is a `${VAR:?message}` reference that urlsplit misreads).
    for key, host in (("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgres"), ("AIRFLOW__CELERY__BROKER_URL", "redis"),
                      ("AIRFLOW__CELERY__RESULT_BACKEND", "postgres")):
        assert urlsplit("//" + env[key].rsplit("@", 1)[1]).hostname == host, f"{key} does not point at {host}"
    # Secrets come from .env, never from the compose file itself.
    for key in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
        assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", env[key]), f"{key} must be a required .env variable"


def test_execution_api_url_points_at_the_api_server(compose: dict) -> None:
    url = urlsplit(compose["services"]["airflow-worker"]["environment"]["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    api = [name for name, svc in compose["services"].items() if _command(svc) == "api-server"]
    assert api == [url.hostname], f"execution API host {url.hostname!r}, api-server service(s) {api}"
    ports = compose["services"][url.hostname]["ports"]
    assert any(str(p).endswith(f":{url.port}") for p in ports), f"api-server does not listen on {url.port}: {ports}"
    assert url.path == "/execution/"
    health = compose["services"][url.hostname]["healthcheck"]["test"]
    assert f"http://localhost:{url.port}/api/v2/monitor/health" in health


def test_mounted_project_paths_exist(compose: dict) -> None:
    volumes = compose["x-airflow-common"]["volumes"]
    mounts = dict(v.split(":")[:2] for v in volumes if v.startswith("./"))
    for folder in ("dags", "plugins", "include"):
        source = f"./{folder}"
        assert mounts.get(source) == f"/opt/airflow/{folder}", f"{source} is not mounted at /opt/airflow/{folder}"
        assert (ROOT / folder).is_dir() and any((ROOT / folder).iterdir()), f"{folder}/ is missing or empty"
    assert (ROOT / "dags" / "tracegen_generate.py").exists()
    # The image installs tracegen editable from /opt/airflow (the Dockerfile), so the mounted include/ is what
    # is imported, without a PYTHONPATH.
    assert "PYTHONPATH" not in compose["x-airflow-common"]["environment"]
    assert (ROOT / "include" / "tracegen" / "__init__.py").exists()


def test_image_is_official_airflow_plus_requirements(compose: dict) -> None:
    build = compose["x-airflow-common"]["build"]
    dockerfile = (ROOT / build["context"] / build["dockerfile"]).read_text()
    # The official image's build on the Python the project declares (pyproject.toml) and was verified on.
    assert re.search(r"^ARG AIRFLOW_IMAGE=apache/airflow:3\.3\.2-python3\.11$", dockerfile, re.M)
    assert 'requires-python = ">=3.11,<3.12"' in (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^FROM \$\{AIRFLOW_IMAGE\} AS airflow$", dockerfile, re.M)
    copied = re.search(r"^COPY requirements\.txt (\S+)$", dockerfile, re.M)
    assert copied, "the Dockerfile does not copy requirements.txt"
    pinned = re.search(r"^COPY constraints\.txt (\S+)$", dockerfile, re.M)
    assert pinned, "the Dockerfile does not copy constraints.txt"
    assert re.search(rf"^RUN pip install .*-c {re.escape(pinned[1])} -r {re.escape(copied[1])}$", dockerfile, re.M)
    # tracegen installed as the distribution it is, after its sources and the files pyproject.toml reads.
    project = re.search(r"^COPY --chown=airflow:0 pyproject\.toml README\.md requirements\*\.txt /opt/airflow/$",
                        dockerfile, re.M)
    installed = re.search(r"^RUN pip install --no-cache-dir --no-deps -e /opt/airflow$", dockerfile, re.M)
    assert project and installed and project.start() < installed.start()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]
    read = [pyproject["project"]["readme"], *dynamic["dependencies"]["file"],
            *(f for extra in dynamic["optional-dependencies"].values() for f in extra["file"])]
    assert all(fnmatch.fnmatch(f, "README.md") or fnmatch.fnmatch(f, "requirements*.txt") for f in read), read
    assert dockerfile.index("COPY --chown=airflow:0 include/ /opt/airflow/include/") < installed.start()
    assert "PYTHONPATH" not in dockerfile
    assert "apache-airflow==3.3.2" in (ROOT / "requirements.txt").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    assert compose["services"]["gpu-sim"]["build"]["target"] in targets


def test_env_example_defines_every_required_variable() -> None:
    text = (ROOT / "docker-compose.yaml").read_text()
    required = set(re.findall(r"\$\{([A-Z_0-9]+):\?", text))
    example = {line.split("=", 1)[0] for line in (ROOT / ".env.example").read_text().splitlines()
               if line and not line.startswith("#")}
    assert required, "no required variables found"
    assert required <= example, f".env.example lacks {sorted(required - example)}"
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_env_example_connections_parse() -> None:
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.startswith("AIRFLOW_CONN_") and line.split("=", 1)[1]:
            value = line.split("=", 1)[1].strip("'")
            conn = json.loads(value)
            assert conn["conn_type"] in ("ssh", "aws"), line


def test_fleet_examples_in_the_docs_are_valid() -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text()
    blocks = re.findall(r"```json fleet\n(.*?)```", docs, re.S)
    assert blocks, "docs/deployment.md has no fleet example"
    for block in blocks:
        spec = FleetSpec.from_json(block)
        assert spec.servers()


def _published(compose: dict) -> dict[str, list[str]]:
    return {name: [str(p) for p in svc.get("ports", [])] for name, svc in compose["services"].items()
            if svc.get("ports")}


def _default(value: str) -> str:
    """A `${VAR:-default}` reference's default (the value when .env leaves VAR unset), else the value."""
    return re.sub(r"\$\{[A-Z_0-9]+:-([^}]*)\}", r"\1", value)


def test_every_published_port_is_on_loopback_unless_the_operator_publishes_it(compose: dict) -> None:
    published = _published(compose)
    assert set(published) == {"airflow-apiserver", "s3"}, published
    for name, ports in published.items():
        for port in ports:
            # host address : host port : container port, the address given (a port alone is every interface)
            unset = _default(port)  # as published when .env sets nothing
            assert len(unset.split(":")) == 3, f"{name} publishes {port!r} on every host interface"
            assert unset.split(":")[0] == "127.0.0.1", f"{name} publishes {port!r} beyond loopback"
    # The operator's choice for the UI is one setting, documented in .env.example.
    assert published["airflow-apiserver"] == ["${AIRFLOW_API_BIND:-127.0.0.1}:${AIRFLOW_API_PORT:-8080}:8080"]
    assert "AIRFLOW_API_BIND=" in (ROOT / ".env.example").read_text()


def test_no_service_listens_on_every_interface_of_its_container(compose: dict) -> None:
    for name, svc in compose["services"].items():
        argv = " ".join(str(a) for key in ("entrypoint", "command") for a in (
            svc.get(key) if isinstance(svc.get(key), list) else [svc.get(key) or ""]))
        assert "0.0.0.0" not in argv, f"{name}: {argv}"
    moto = compose["services"]["s3"]
    assert moto["entrypoint"][moto["entrypoint"].index("--host") + 1] == "s3"  # its compose-network name
    assert "http://s3:5000/" in " ".join(moto["healthcheck"]["test"])


@pytest.mark.parametrize("password", ['plain', 'q"uote', "back\\slash", "both\\\"", "new\nline", "dollar$HOME %s {}"])
def test_airflow_init_writes_the_admin_password_file_as_json_whatever_the_password(compose: dict, tmp_path: Path,
                                                                                   password: str) -> None:
    import os
    import subprocess

    script = compose["services"]["airflow-init"]["command"][1]
    assert not re.search(r"^\s*printf\b", script, re.M)
    # The script as the container's bash runs it: compose's `$$` is a `$`; the Airflow commands are stubbed
    # and the config volume is a temporary directory.
    script = script.replace("$$", "$").replace("/opt/airflow/config", str(tmp_path))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "airflow").write_text("#!/bin/sh\nexit 0\n")
    (stubs / "airflow").chmod(0o755)
    (stubs / "python").symlink_to(sys.executable)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "_AIRFLOW_WWW_USER_USERNAME": "admin",
           "_AIRFLOW_WWW_USER_PASSWORD": password}
    subprocess.run(["bash", "-c", script], env=env, check=True, capture_output=True, timeout=60)
    written = json.loads((tmp_path / "simple_auth_manager_passwords.json").read_text())
    assert written == {"admin": password}
