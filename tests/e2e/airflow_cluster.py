"""A distributed Airflow 3 deployment as real local processes: the harness of the distributed e2e test.

`AirflowCluster` creates a fresh PostgreSQL database and picks an empty Redis DB number, migrates, and
starts api-server, scheduler, dag-processor, triggerer and N Celery workers (`airflow ...` commands, each
in its own process group so a test can SIGKILL one worker with everything it forked) with one shared
JWT secret, fernet key and execution API URL, the project's dags/ and plugins/. `stop()` ends them and
drops the database. `AirflowApi` is the small REST client the test drives it with.

PostgreSQL and Redis are private throwaway servers on free loopback ports (tests/fixtures/services.py):
one per test session, shared by the e2e modules (`running_cluster`), or one per cluster started on its
own (`make airflow-up`, bench/), stopped with it. `restart_postgres()` / `restart_redis()` (kill=True: a
crash) bring them back on the same port. An already-running server is used only when the environment
names it: TRACEGEN_PG_PORT (with TRACEGEN_PG_HOST/USER) for PostgreSQL, TRACEGEN_REDIS_PORT (with
TRACEGEN_REDIS_HOST) for Redis.

It is also what a person runs to see the distributed setup (`make airflow-up`):
`python tests/e2e/airflow_cluster.py [--port 8080] [--workers 2]` prints the UI URL and credentials.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

PROJECT_DIR = Path(__file__).resolve().parents[2]
# tests/ on the path for `make airflow-up` and bench/occupancy_airflow.py, which import this file from
# tests/e2e; pytest's conftest and the other benchmarks put it there already.
if str(PROJECT_DIR / "tests") not in sys.path:
    sys.path.insert(0, str(PROJECT_DIR / "tests"))

from fixtures.ports import free_port  # noqa: E402
from fixtures.services import LocalServices, ServiceError, shared_local_services  # noqa: E402

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
ADMIN_USER = "admin"


class ClusterError(RuntimeError):
    """A service the cluster needs is missing, or a component did not come up; the message says which."""


@dataclass(frozen=True)
class Services:
    """Where the metadata DB and the broker run: normally our own private servers (`start_services`)."""

    pg_host: str = "127.0.0.1"
    pg_port: int = 5432
    pg_user: str = "postgres"
    pg_password: str | None = field(default=None, repr=False)
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379

    def __post_init__(self) -> None:
        for name in ("pg_port", "redis_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"{name}: {value!r} is not a TCP port")

    @classmethod
    def from_env(cls, local: LocalServices | None = None) -> Services:
        """The servers the environment names (TRACEGEN_PG_*, TRACEGEN_REDIS_*); where it names none, the
        private one in `local`."""
        pg_named, redis_named = env_names_postgres(), env_names_redis()
        return cls(
            pg_host=os.environ.get("TRACEGEN_PG_HOST", "127.0.0.1"),
            pg_port=int(os.environ.get("TRACEGEN_PG_PORT", "5432")) if pg_named or local is None else local.pg_port,
            pg_user=os.environ.get("TRACEGEN_PG_USER", "postgres") if pg_named else "postgres",
            pg_password=(os.environ.get("TRACEGEN_PG_PASSWORD") or None if pg_named or local is None
                         else local.pg_password),
            redis_host=os.environ.get("TRACEGEN_REDIS_HOST", "127.0.0.1"),
            redis_port=(int(os.environ.get("TRACEGEN_REDIS_PORT", "6379")) if redis_named or local is None
                        else local.redis_port),
        )

    def pg_url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        login = quote(self.pg_user, safe="") + (f":{quote(self.pg_password, safe='')}" if self.pg_password else "")
        return f"{driver}://{login}@{self.pg_host}:{self.pg_port}/{database}"


def env_names_postgres() -> bool:
    return bool(os.environ.get("TRACEGEN_PG_PORT") or os.environ.get("TRACEGEN_PG_HOST"))


def env_names_redis() -> bool:
    return bool(os.environ.get("TRACEGEN_REDIS_PORT") or os.environ.get("TRACEGEN_REDIS_HOST"))


def start_services(shared: bool = False) -> tuple[Services, LocalServices | None]:
    """Start private PostgreSQL and Redis (those the environment does not name). shared: the process's one
    instance, kept for the test session (the e2e modules pay the start-up once), PostgreSQL without fsync;
    else a new one with PostgreSQL's defaults (a person's cluster, the benchmarks), the caller's to stop."""
    pg, redis = not env_names_postgres(), not env_names_redis()
    local = None
    if pg or redis:
        try:
            local = shared_local_services(pg, redis) if shared else LocalServices(pg, redis, durable=True).start()
        except ServiceError as exc:
            raise ClusterError(f"could not start a private PostgreSQL/Redis: {exc}") from None
    return Services.from_env(local), local


def _pg_admin(services: Services, sql: str) -> None:
    import psycopg

    try:
        with psycopg.connect(host=services.pg_host, port=services.pg_port, user=services.pg_user,
                             password=services.pg_password, dbname="postgres", autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql)
    except psycopg.OperationalError as exc:
        raise ClusterError(
            f"PostgreSQL at {services.pg_host}:{services.pg_port} (user {services.pg_user}) is not reachable: "
            f"{str(exc).strip()}. Unset TRACEGEN_PG_PORT/HOST to use a private one (see docs/deployment.md)."
        ) from None


def _redis(services: Services, db: int = 0):
    import redis

    client = redis.Redis(host=services.redis_host, port=services.redis_port, db=db, socket_timeout=5,
                         socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ClusterError(
            f"Redis at {services.redis_host}:{services.redis_port} is not reachable: {exc}. Unset "
            "TRACEGEN_REDIS_PORT/HOST to use a private one (see docs/deployment.md)."
        ) from None
    return client


# The key a cluster sets in the Redis DB it takes; stop() flushes the DB, the key with it.
REDIS_CLAIM_KEY = "tracegen-e2e:claimed-by"


def pick_redis_db(services: Services) -> int:
    """An empty Redis DB number other than 0, claimed, so the cluster's broker queue is nobody else's.

    Empty is not enough where clusters share a Redis the environment names (TRACEGEN_REDIS_PORT/HOST: two
    pytest runs, a benchmark beside the tests): starting at the same moment, they would all see one DB empty.
    The claim is a SET NX in the DB itself, which exactly one of them wins."""
    client = _redis(services)
    count = int(client.config_get("databases").get("databases", 16))
    candidates = list(range(1, count))
    secrets.SystemRandom().shuffle(candidates)
    claim = f"{os.getpid()}-{uuid.uuid4().hex}"
    for db in candidates:
        candidate = _redis(services, db)
        if candidate.dbsize() == 0 and candidate.set(REDIS_CLAIM_KEY, claim, nx=True):
            return db
    raise ClusterError(f"Redis at {services.redis_host}:{services.redis_port}: no empty DB among 1..{count - 1}")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Component:
    """One running Airflow command, in its own process group, logging to a file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            # Own session: `kill()` finds the worker's pool and task processes by it, as losing the
            # machine would take them all.
            self.proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=PROJECT_DIR)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of the component's session: it dies mid-task without any cleanup, as if
        its machine were lost. A session, not a process group: Airflow's task supervisor moves each task
        process into a process group of its own."""
        if self.proc is None:
            return
        # Stop first so nothing can fork a process we would miss, then kill what is stopped.
        for _ in range(3):
            for pid in self.session_pids():
                _signal(pid, signal.SIGSTOP)
        for pid in self.session_pids():
            _signal(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.session_pids():  # children that outlived their parent's SIGTERM
            _signal(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def session_pids(self) -> set[int]:
        """Every live process of this component's session (worker, pool, task supervisors, tasks)."""
        if self.proc is None:
            return set()
        pids = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getsid(int(entry.name)) == self.proc.pid:
                        pids.add(int(entry.name))
                except (ProcessLookupError, PermissionError):
                    continue
        return pids

    def running_tasks(self) -> set[str]:
        """Task instance ids this component (a Celery worker) runs now: each under a process titled
        `airflow supervisor: <ti id>`."""
        tasks = set()
        for pid in self.session_pids():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("airflow supervisor: "):
                tasks.add(title.split(": ", 1)[1].strip())
        return tasks

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class AirflowCluster:
    """PostgreSQL + Redis + every Airflow 3 component as local processes, on loopback ports."""

    root: Path
    workers: int = 2
    worker_concurrency: int = 2
    api_port: int = 0  # 0: a free port
    # None: start private PostgreSQL/Redis with the cluster (`local_services`), stopped with it.
    services: Services | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    keep_database: bool = False
    # More users of the simple auth manager (name -> role), each with a password of its own (`passwords`).
    users: dict[str, str] = field(default_factory=dict)
    # A user whose credentials the operator's API connection (tracegen.run.api_answer) holds: a raise
    # made while the question waits answers it as them.
    api_conn_user: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 16:
            raise ValueError(f"workers: {self.workers!r} must be 1..16")
        self.root = Path(self.root)
        self.home = self.root / "airflow"
        self.database = f"tracegen_e2e_{uuid.uuid4().hex[:12]}"
        self.redis_db: int | None = None
        self.components: dict[str, Component] = {}
        self._db_created = False
        # The private servers in use (None where the environment names both); stopped by stop() if owned.
        self.local_services: LocalServices | None = None
        self._owns_services = False
        self.env: dict[str, str] = {}
        self.passwords = {ADMIN_USER: self.password, **{u: secrets.token_urlsafe(12) for u in self.users}}

    # ---- lifecycle ---------------------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{i + 1}" for i in range(self.workers)]

    def build_env(self) -> dict[str, str]:
        """What every component runs with: the same secrets, DB, broker and execution API URL."""
        from cryptography.fernet import Fernet

        db = self.services.pg_url(self.database)
        state = self.root / "state"
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            # This checkout's include/ first: the venv's editable install may name another checkout's.
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_DIR / "include"), os.environ.get("PYTHONPATH"))
                                          if p),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_DIR / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_DIR / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
                f"{user}:{role}" for user, role in {ADMIN_USER: "admin", **self.users}.items()),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db,
            "AIRFLOW__CELERY__BROKER_URL": f"redis://{self.services.redis_host}:{self.services.redis_port}/{self.redis_db}",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.services.pg_url(self.database, "postgresql"),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.worker_concurrency),
            # Workers import pandas & co. once, before forking task processes (as docker-compose.yaml).
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "tracegen.common.celery_config.CELERY_CONFIG",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
            "AIRFLOW__API__BASE_URL": self.api_url,
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            # New DAG files show up within seconds instead of minutes.
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # The DAG files do not change while a cluster runs, and no DAG has a callback for the processor to
            # run: each file is parsed when it shows up, not again every 30 s in a process of its own.
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            # A task whose worker died is noticed within ~20 s instead of 5 min, then retried.
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "3",
            # A task handed to a worker that died before starting it is re-queued after this.
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "90",
            "TRACEGEN_STATE_DIR": str(state),
            "TRACEGEN_SPOOL_DIR": str(state / "spool"),
            "TRACEGEN_OUTPUT_URI": str(self.root / "output"),
            # Where runs may write (tracegen.common.locations): the tests' setting (tests/conftest.py), else this root.
            "TRACEGEN_WRITE_PREFIXES": os.environ.get("TRACEGEN_WRITE_PREFIXES") or str(self.root),
            "TRACEGEN_SIM_PORT": str(free_port(2)),
            "TRACEGEN_RETRY_DELAY_S": "2",
            "PYTHONUNBUFFERED": "1",
        }
        if self.api_conn_user is not None:
            env["AIRFLOW_CONN_TRACEGEN_API"] = json.dumps({
                "conn_type": "http", "host": "127.0.0.1", "port": self.api_port, "login": self.api_conn_user,
                "password": self.passwords[self.api_conn_user]})
        env.update(self.extra_env)
        return env

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "airflow", *args], env=self.env, cwd=PROJECT_DIR,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, wait_s: float = 180.0) -> None:
        """Create the DB, migrate, start every component and wait until the api-server is healthy."""
        if not self.api_port:
            self.api_port = free_port()
        if self.services is None:
            self.services, self.local_services = start_services()
            self._owns_services = self.local_services is not None
        _pg_admin(self.services, "SELECT 1")
        self.redis_db = pick_redis_db(self.services)
        _pg_admin(self.services, f'CREATE DATABASE "{self.database}"')
        self._db_created = True
        self.home.mkdir(parents=True, exist_ok=True)
        # SimpleAuthManager keeps users' passwords in this file; writing it first fixes the password.
        (self.home / "passwords.json").write_text(json.dumps(self.passwords) + "\n")
        self.env = self.build_env()
        migrated = self.airflow("db", "migrate")
        if migrated.returncode != 0:
            raise ClusterError(f"airflow db migrate failed:\n{migrated.stdout[-3000:]}\n{migrated.stderr[-3000:]}")
        logs = self.home / "component-logs"
        argv = [sys.executable, "-m", "airflow"]
        self.components["api-server"] = Component(
            "api-server", [*argv, "api-server", "--host", "127.0.0.1", "--port", str(self.api_port), "--workers", "1"],
            logs / "api-server.log")
        for name in ("scheduler", "dag-processor", "triggerer"):
            self.components[name] = Component(name, [*argv, name], logs / f"{name}.log")
        for name in self.worker_names:
            self.components[name] = Component(
                name, [*argv, "celery", "worker", "--celery-hostname", f"{name}@%h",
                       "--concurrency", str(self.worker_concurrency)], logs / f"{name}.log")
        for name, component in self.components.items():
            env = dict(self.env)
            if name.startswith("worker-"):
                # Two workers on one machine: each serves its task logs on its own port and spools
                # locally, as on separate machines.
                env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
                env["TRACEGEN_SPOOL_DIR"] = str(self.root / "state" / f"spool-{name}")
            component.start(env)
        self.wait_healthy(wait_s)

    def wait_healthy(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        last: Any = None
        # One client for the whole wait: a client per poll loads the CA store each time.
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                dead = [name for name, c in self.components.items() if not c.alive]
                if dead:
                    raise ClusterError(f"{dead[0]} exited during start-up:\n{self.components[dead[0]].tail()}")
                try:
                    last = client.get(f"{self.api_url}/api/v2/monitor/health").json()
                    if all(last.get(k, {}).get("status") == "healthy"
                           for k in ("metadatabase", "scheduler", "triggerer", "dag_processor")):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(1)
        raise ClusterError(f"the cluster did not become healthy in {wait_s:.0f} s; last health: {last}\n"
                           f"api-server log:\n{self.components['api-server'].tail()}")

    def stop(self) -> None:
        """Stop every component, any simulated GPU server left running, the Redis DB and the database."""
        # In parallel: each component may take its full SIGTERM grace period (Celery's warm shutdown).
        threads = [threading.Thread(target=c.stop) for c in self.components.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._stop_sim_servers()
        # Servers of our own go whole (their database and queue with them); on shared or named ones, only ours.
        owned = self.local_services if self._owns_services else None
        if self.redis_db is not None and self.services is not None and not (owned and owned.redis):
            try:
                _redis(self.services, self.redis_db).flushdb()
            except ClusterError:
                pass
        if (self._db_created and not self.keep_database and self.services is not None
                and not (owned and owned.postgres)):
            _pg_admin(self.services, f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            self._db_created = False
        if owned is not None:
            owned.stop()
            self._owns_services = False
            self._db_created = False

    # ---- the servers under it: stopped, killed, started again (faults) ----------------------------

    def _local(self) -> LocalServices:
        if self.local_services is None:
            raise ClusterError("PostgreSQL and Redis are servers the environment names, not the cluster's own")
        return self.local_services

    def restart_postgres(self, kill: bool = False) -> None:
        """Stop PostgreSQL (kill=True: SIGKILL the postmaster and its backends) and start it again on the
        same port with its data. In a test session the server is shared by the session's clusters."""
        self._local().restart_postgres(kill=kill)

    def restart_redis(self, kill: bool = False) -> None:
        """Stop Redis (kill=True: SIGKILL) and start it again on the same port; it keeps no data, so the
        broker's queued messages are lost, as with a Redis that keeps nothing on disk."""
        self._local().restart_redis(kill=kill)

    def _stop_sim_servers(self) -> None:
        # A failed run may leave the stand-ins up (teardown only runs when the DAG gets that far).
        if not self.env:
            return
        from tracegen.fleet import FleetSpec, teardown
        from tracegen.fleet.sources import local_sim_fleet

        saved = {k: os.environ.get(k) for k in ("TRACEGEN_STATE_DIR", "TRACEGEN_SIM_PORT")}
        try:
            os.environ.update({k: self.env[k] for k in saved})
            teardown(FleetSpec.from_dict(local_sim_fleet()))
        except Exception as exc:  # noqa: BLE001 - cleanup must not hide the test's own failure
            print(f"airflow_cluster: stopping simulated servers failed: {exc}", file=sys.stderr)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def restart(self, name: str) -> None:
        """Start a killed component again with what it had (a worker: its own log port and spool)."""
        env = dict(self.env)
        if name.startswith("worker-"):
            env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
            env["TRACEGEN_SPOOL_DIR"] = str(self.root / "state" / f"spool-{name}")
        self.components[name].start(env)

    def __enter__(self) -> AirflowCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self) -> AirflowApi:
        return AirflowApi(self.api_url, ADMIN_USER, self.password)

    def ready_api(self, dag_id: str) -> AirflowApi:
        """The REST API once `dag_id` is parsed, unpaused: what a test module needs before it triggers."""
        api = self.api()
        api.wait_for_dag(dag_id)
        api.unpause(dag_id)
        return api

    def logs_summary(self, lines: int = 25) -> str:
        """The tail of every component's log, for a failing assertion's message."""
        return "\n".join(f"--- {name} ---\n{c.tail(lines)}" for name, c in self.components.items())


class AirflowApi:
    """The REST calls the test needs, with a JWT from SimpleAuthManager's /auth/token."""

    def __init__(self, base_url: str, username: str, password: str) -> None:
        self.base_url = base_url
        token = httpx.post(f"{base_url}/auth/token", json={"username": username, "password": password},
                           timeout=30)
        if token.status_code >= 300:
            raise ClusterError(f"/auth/token for {username!r}: HTTP {token.status_code} {token.text[:300]}")
        self.client = httpx.Client(base_url=f"{base_url}/api/v2", timeout=30,
                                   headers={"Authorization": f"Bearer {token.json()['access_token']}"})

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, path, **kwargs)
        if response.status_code >= 300:
            raise ClusterError(f"{method} {path}: HTTP {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = self.client.get(f"/dags/{dag_id}")
            if response.status_code == 200:
                return response.json()
            time.sleep(1)
        errors = self._call("GET", "/importErrors")
        raise ClusterError(f"DAG {dag_id} was not parsed within {timeout:.0f} s; import errors: {errors}")

    def unpause(self, dag_id: str) -> None:
        self._call("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def set_variable(self, key: str, value: str) -> None:
        self._call("POST", "/variables", json={"key": key, "value": value})

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        body = {"logical_date": None, "conf": conf}
        return self._call("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """Every task instance of the run, page by page: the API caps a page at [api] maximum_page_limit
        (100 by default), and a full-scale run maps hundreds of chunk tasks."""
        out: list[dict[str, Any]] = []
        while True:
            body = self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                              params={"limit": 100, "offset": len(out), "order_by": "id"})
            page = body["task_instances"]
            out += page
            if not page or len(out) >= body["total_entries"]:
                return out

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        return self._call("GET", path, params={"deserialize": True})["value"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """The run's final state (success/failed), or ClusterError with the task states at the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run(dag_id, run_id)["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(2)
        raise ClusterError(f"{dag_id} {run_id} did not finish in {timeout:.0f} s; tasks: "
                           f"{self.describe(dag_id, run_id)}")

    def describe(self, dag_id: str, run_id: str) -> list[str]:
        return [f"{t['task_id']}[{t['map_index']}]={t['state']} try {t['try_number']}"
                for t in self.task_instances(dag_id, run_id)]


class DirFactory:
    """What the sshd and S3 fixtures ask pytest's tmp_path_factory for, outside pytest (the benchmarks)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


@contextmanager
def running_cluster(root: Path, **kwargs: Any) -> Iterator[AirflowCluster]:
    """A started cluster for a test module's fixture, stopped afterwards. One that cannot start fails the
    tests (never skips them), after stopping whatever it did start."""
    import pytest

    try:
        services, local = start_services(shared=True)
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster = AirflowCluster(root, services=services, **kwargs)
    cluster.local_services = local  # the session's: not stopped with the cluster
    try:
        cluster.start()
    except ClusterError as exc:
        cluster.stop()
        pytest.fail(f"could not start the Airflow cluster: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def sample_prompts(path: Path, n_rows: int) -> Path:
    """The first `n_rows` prompts of the bundled dataset, written to `path` as JSONL."""
    from tracegen.config import SAMPLE_DATASET

    with gzip.open(SAMPLE_DATASET, "rt") as src:
        path.write_text("".join(next(src) for _ in range(n_rows)))
    return path


def interrupt_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, so a script's `finally` stops what it started. Explicitly:
    a shell starting a script in the background (nohup, CI) leaves SIGINT ignored."""

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8080, help="api-server / UI port (default 8080)")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers to start (default 2)")
    parser.add_argument("--root", type=Path, default=PROJECT_DIR / ".state" / "cluster",
                        help="AIRFLOW_HOME, logs and the simulated fleet's state (default .state/cluster)")
    args = parser.parse_args(argv)
    cluster = AirflowCluster(args.root, workers=args.workers, api_port=args.port,
                             extra_env={"TRACEGEN_OUTPUT_URI": str(args.root / "output")})
    print(f"starting a distributed Airflow (private PostgreSQL and Redis unless TRACEGEN_PG_PORT/"
          f"TRACEGEN_REDIS_PORT name running ones; DB {cluster.database}, Celery on Redis, {args.workers} workers) "
          "...", flush=True)

    interrupt_on_signals()
    try:
        cluster.start()
        print(f"\nUI:        {cluster.api_url}\nuser:      {ADMIN_USER}\npassword:  {cluster.password}\n"
              f"logs:      {cluster.home / 'component-logs'}\n"
              f"database:  {cluster.services.pg_url(cluster.database, 'postgresql')}\n"
              f"broker:    redis://{cluster.services.redis_host}:{cluster.services.redis_port}/{cluster.redis_db}\n"
              "Ctrl-C stops every component and drops the database (and stops the private servers).", flush=True)
        while True:
            time.sleep(2)
            dead = [name for name, c in cluster.components.items() if not c.alive]
            if dead:
                print(f"{dead[0]} exited; its log:\n{cluster.components[dead[0]].tail()}", flush=True)
                return 1
    except KeyboardInterrupt:
        return 0
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping ...", flush=True)
        cluster.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT_DIR / "include"))
    sys.exit(main())
