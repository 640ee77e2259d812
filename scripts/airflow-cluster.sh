#!/usr/bin/env bash
# `make airflow-up`: the distributed setup as local processes (PostgreSQL DB, Celery on Redis, api-server,
# scheduler, dag-processor, triggerer, two Celery workers) on this project's DAGs. PostgreSQL and Redis are
# private servers it starts on free loopback ports (Debian's postgresql and redis-server packages, which
# `make system-deps` installs), unless TRACEGEN_PG_PORT / TRACEGEN_REDIS_PORT name running ones. Prints the UI
# URL and credentials; Ctrl-C stops everything, the private servers with their data included.
# Options: --port N --workers N --root DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python tests/e2e/airflow_cluster.py "$@"
