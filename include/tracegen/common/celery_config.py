"""Celery settings for tracegen's Airflow workers: Airflow's defaults, plus the heavy libraries imported once.

Airflow 3's Celery worker forks a fresh process for every task. A tracegen task starts by importing
pandas, numpy, pyarrow and httpx (0.4 s of CPU from bytecode, 1.4 s from source); the gate and the final
report also import scipy's optimizer for the cap fit (0.4 s more). That cost falls where the fleet idles:
between the trigger and the first request, and between the last row and the run's end. With the pilot
and three chunks starting at once on 2 cores (measured from source), each task took 3.6 s to send its
first request; with the modules imported once in the worker before it forks its pool, and inherited by
every task process, 0.8 s.

Only third-party libraries are preloaded: they change only with a reinstall, which restarts the workers
anyway. `tracegen` itself is not, so a task always runs the include/ code on disk, as a DAG file would.

Select it with `AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=tracegen.common.celery_config.CELERY_CONFIG` on the
workers (docker-compose.yaml and tests/e2e/airflow_cluster.py do).
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

# What a task imports before its first request (tracegen.store.snapshots, .engine) or its report (tracegen.audit.length_fit).
PRELOADED_MODULES = ("numpy", "pandas", "pyarrow.parquet", "scipy.optimize", "scipy.special", "httpx")

CELERY_CONFIG = {
    **DEFAULT_CELERY_CONFIG,
    # Celery imports these in the worker's main process before it forks its pool processes.
    "imports": (*DEFAULT_CELERY_CONFIG.get("imports", ()), *PRELOADED_MODULES),
}
