#!/usr/bin/env bash
# `make airflow-up`: the distributed setup as local processes (PostgreSQL DB, Celery on Redis, api-server,
# scheduler, dag-processor, triggerer, two Celery workers) on this project's DAGs. Prints the UI URL and
# credentials; Ctrl-C stops everything and drops the database. Options: --port N --workers N --root DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python tests/e2e/airflow_cluster.py "$@"
