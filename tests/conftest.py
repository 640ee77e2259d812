"""Shared pytest set-up: make `include/` importable as `tracegen`, and load the real-component fixtures."""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Airflow reads its config when first imported: point it at a throwaway home before any test imports it,
# so tests never touch a developer's ~/airflow and CI starts from nothing.
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="tracegen-test-airflow-"))
os.environ.update(
    {
        "AIRFLOW_HOME": str(_AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_AIRFLOW_HOME}/airflow.db",
    }
)
# Where runs and exports may read and write (tracegen.common.locations): the tests' roots are temporary
# directories and prefixes of the test bucket (fixtures.s3.BUCKET), for this process and every subprocess it
# starts. A test of a refusal narrows it with monkeypatch.
os.environ["TRACEGEN_WRITE_PREFIXES"] = f"{os.path.realpath(tempfile.gettempdir())},s3://tracegen-test/"
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "tests"))

# Real components on loopback: an S3-compatible server, SGLang stand-ins, an OpenSSH sshd, and private
# PostgreSQL + Redis for the distributed e2e tests (started at first use, stopped at the session end).
pytest_plugins = ["fixtures.s3", "fixtures.simulator", "fixtures.sshd", "fixtures.services"]

