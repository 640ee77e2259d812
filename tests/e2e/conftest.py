"""The end-to-end modules' shared Airflow cluster (`e2e.shared_cluster`): the fixture that hands it out and
the teardown that stops it once this worker is done with the modules that share it."""

from __future__ import annotations

import pytest
from e2e.shared_cluster import SHARED, shares_the_cluster


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory):
    return SHARED.cluster or SHARED.get(tmp_path_factory.mktemp("shared-cluster"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    if SHARED.cluster is not None and (nextitem is None or not shares_the_cluster(nextitem.nodeid)):
        SHARED.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    SHARED.stop()
