"""One Airflow cluster for the end-to-end modules whose needs agree, started once for all of them.

A cluster's start-up costs about 40 s of CPU (migrating its database, importing Airflow in each component)
and an idle one keeps using a little. The modules in `SHARED_CLUSTER_MODULES` need the same cluster: one
Celery worker of four slots, the stand-ins' clock at 20x (slow enough that a raise lands while chunks are
still to start), and the test DAG bundle beside the project's DAGs (`dags/`, the consumer of the export's
Asset event: a test's DAG never ships with the project's). `tests/conftest.py` has xdist hand them to one
worker as one unit; the cluster starts at the first test that asks for it and stops once that worker's next
test is of none of them (`tests/e2e/conftest.py`).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

SHARED_CLUSTER_MODULES = ("tests/e2e/test_raise_cap.py", "tests/e2e/test_export_asset.py")
TEST_DAGS = Path(__file__).resolve().parent / "dags"


def dag_bundles(project_dags: str) -> str:
    """The DAG bundles of a cluster that also runs the test DAGs: the project's folder and `TEST_DAGS`."""
    local = "airflow.dag_processing.bundles.local.LocalDagBundle"
    return json.dumps([{"name": "dags-folder", "classpath": local, "kwargs": {"path": project_dags}},
                       {"name": "tracegen-tests", "classpath": local, "kwargs": {"path": str(TEST_DAGS)}}])


def shares_the_cluster(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0] in SHARED_CLUSTER_MODULES


class SharedCluster:
    """The cluster, started at first use and stopped on request (or at the session's end)."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self.cluster: Any = None

    def get(self, root: Path) -> Any:
        if self.cluster is None:
            from e2e.airflow_cluster import PROJECT_DIR, running_cluster

            extra_env = {"TRACEGEN_SIM_TIME_SCALE": "20",
                         "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": dag_bundles(str(PROJECT_DIR / "dags"))}
            stack = ExitStack()
            self.cluster = stack.enter_context(running_cluster(root, workers=1, worker_concurrency=4,
                                                               extra_env=extra_env))
            self._stack = stack
        return self.cluster

    def stop(self) -> None:
        stack, self._stack, self.cluster = self._stack, None, None
        if stack is not None:
            stack.close()


SHARED = SharedCluster()
