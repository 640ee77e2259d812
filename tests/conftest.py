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

# Real components on loopback: an S3-compatible server, SGLang stand-ins, an OpenSSH sshd, private
# PostgreSQL + Redis for the distributed e2e tests, and one real SGLang server on the CPU (started at first
# use, stopped at the session end).
pytest_plugins = ["fixtures.s3", "fixtures.simulator", "fixtures.sshd", "fixtures.services", "fixtures.real_sglang"]

# The modules that share the one real SGLang server (fixtures.real_sglang): one unit of work, so it starts once.
REAL_SGLANG_DIR = "tests/real_sglang/"


# The modules that take a minute or more of a worker, longest first (`pytest --durations` on the CI machine's
# two cores), in the order `make test` hands them to its four xdist workers (`--no-loadscope-reorder`; by
# default xdist orders modules by test count, which puts the few-test end-to-end modules last, running
# alone at the end). xdist gives worker k the k-th and (k+4)-th module at the start, then one module to
# whichever worker is free: the longest start first, the third Airflow cluster (test_raise_cap) starts only
# once the trainers' check ends, and the hundred short modules fill in around the long ones at the end. Four
# workers on two cores: the end-to-end modules spend much of their time waiting on Airflow's scheduler and
# the stand-ins' clock, which a fourth worker fills with work.
LONG_MODULES = (
    "tests/real_sglang/",  # REAL_SGLANG_DIR (a literal: tests/deploy/test_suite_order.py reads this tuple)
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
    unit of work, and so are the modules sharing the real SGLang server (REAL_SGLANG_DIR): one worker runs
    each group in turn and its cluster or server starts once."""
    if config.getvalue("dist") != "loadfile":
        return None
    from e2e.shared_cluster import SHARED_CLUSTER_MODULES, shares_the_cluster
    from xdist.scheduler import LoadFileScheduling

    class SharedClusterScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope.startswith(REAL_SGLANG_DIR):
                return REAL_SGLANG_DIR
            return SHARED_CLUSTER_MODULES[0] if shares_the_cluster(scope) else scope

    return SharedClusterScheduling(config, log)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {module: i for i, module in enumerate(LONG_MODULES)}

    def module_rank(item) -> int:
        module = item.nodeid.split("::")[0]
        return rank[REAL_SGLANG_DIR] if module.startswith(REAL_SGLANG_DIR) else rank.get(module, len(rank))

    items.sort(key=module_rank)  # stable: the rest keep their order
