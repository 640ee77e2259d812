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


# The modules that take a minute or more of a worker, longest first (`pytest --durations` on the CI machine's
# two cores), in the order `make test` hands them to its four xdist workers (`--no-loadscope-reorder`; by
# default xdist orders modules by test count, which puts the few-test end-to-end modules last, running
# alone at the end). xdist gives worker k the k-th and (k+4)-th module at the start, then one module to
# whichever worker is free: the longest start first, the third Airflow cluster (test_raise_cap) starts only
# once the trainers' check ends, and the hundred short modules fill in around the long ones at the end. Four
# workers on two cores: the end-to-end modules spend much of their time waiting on Airflow's scheduler and
# the stand-ins' clock, which a fourth worker fills with work.
LONG_MODULES = (
    "tests/e2e/test_distributed.py",
    "tests/include/tracegen/export/test_export_trainer_conversations.py",
    "tests/e2e/test_generate_dag.py",
    "tests/e2e/test_cap_review.py",
    "tests/e2e/test_raise_cap.py",
    "tests/plugins/test_review_page.py",
    "tests/include/tracegen/test_export_exclusive.py",
    "tests/include/tracegen/export/test_export_trainer_loaders.py",
    "tests/include/tracegen/generate/test_fencing.py",
    "tests/include/tracegen/generate/test_engine_crash.py",
    "tests/dags/test_dag_locations.py",
)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the modules sharing one Airflow cluster (`e2e.shared_cluster`) are one
    unit of work, so one worker runs them in turn and the cluster starts once."""
    if config.getvalue("dist") != "loadfile":
        return None
    from e2e.shared_cluster import SHARED_CLUSTER_MODULES, shares_the_cluster
    from xdist.scheduler import LoadFileScheduling

    class SharedClusterScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_CLUSTER_MODULES[0] if shares_the_cluster(scope) else scope

    return SharedClusterScheduling(config, log)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {module: i for i, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
