"""An auth manager for the review-page tests: Airflow's SimpleAuthManager, except that the users in
`TRACEGEN_TEST_NO_DAG_USERS` may not read `tracegen_generate`.

SimpleAuthManager's roles grant every DAG alike (viewer and up read all of them), so it cannot express
"may see plugin views but not this DAG's runs"; the api-server under test loads this subclass
(`AIRFLOW__CORE__AUTH_MANAGER=dag_scoped_auth.DagScopedAuthManager`) to check that the review pages ask
the auth manager about the report's DAG and not only about plugin views.
"""

from __future__ import annotations

import os

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

SCOPED_DAG = "tracegen_generate"


class DagScopedAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        denied = set(filter(None, os.environ.get("TRACEGEN_TEST_NO_DAG_USERS", "").split(",")))
        if user.get_name() in denied and (details is None or details.id in (None, SCOPED_DAG)):
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
