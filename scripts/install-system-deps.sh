#!/usr/bin/env bash
# Installs the Debian packages that tests run as real components, when they are missing.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
# Headless Chromium renders the review page in tests/plugins (the browser tests never skip).
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
# The distributed e2e tests, `make airflow-up` and bench/ start private PostgreSQL and Redis servers of their
# own (tests/fixtures/services.py): initdb, pg_ctl and postgres from /usr/lib/postgresql/<version>/bin (Debian
# keeps them off PATH; the package also creates the unprivileged `postgres` account the server runs as when
# we are root), and redis-server. Not needed where the environment names running servers (TRACEGEN_PG_PORT,
# TRACEGEN_REDIS_PORT).
if [ -z "${TRACEGEN_PG_PORT:-}${TRACEGEN_PG_HOST:-}" ] && [ -z "${TRACEGEN_PG_BINDIR:-}" ]; then
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null && compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null \
    || need+=(postgresql)
fi
if [ -z "${TRACEGEN_REDIS_PORT:-}${TRACEGEN_REDIS_HOST:-}" ]; then
  command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need+=(redis-server)
fi
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing Debian packages: ${need[*]} (run: sudo apt-get install -y ${need[*]})" >&2
  exit 1
fi
echo "installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
