"""Chaos runs of tracegen_generate on the distributed deployment (`make chaos`; figures in docs/reliability.md).

Everything is real and on loopback: PostgreSQL + CeleryExecutor on Redis (tests/e2e/airflow_cluster.py, two
workers; private PostgreSQL and Redis servers started for the run, which `cluster.restart_postgres()` /
`restart_redis()` can kill and restart), an OpenSSH sshd as the GPU host with one SGLang stand-in per "GPU"
launched over SSH by the fleet, and the output root (and the dataset) on an S3-compatible server (moto, behind the TCP proxy that
tests/fixtures/s3.py uses to cut it off). Real `tracegen_generate` runs on a small dataset are triggered
through the REST API, and while each one generates, faults are injected at random moments:

- `worker`: SIGKILL of every process of a random Celery worker (its task processes included), restarted a
  few seconds later, as a machine lost and replaced;
- `scheduler`: SIGKILL of the scheduler, restarted a few seconds later;
- `s3`: once a generation task has started generating, the S3 endpoint refuses connections and cuts open
  ones until a commit (a part or ledger-entry call) has been refused and is being retried, then 1-5 s more
  (45 s at most);
- `server`: SIGKILL of a random stand-in server's process group on the GPU host;
- `postgres`: the metadata DB (and Celery's result backend) killed with SIGKILL, or stopped fast, while
  generation tasks run; started again 1-5 s later on the same port with its data (crash recovery);
- `redis`: the broker killed (SIGKILL) or stopped while generation tasks run; started again 1-5 s later,
  empty (it keeps nothing on disk, so queued Celery messages are lost);
- `sshd-provision`: while `provision_fleet` runs (half the time with a stand-in killed first, so it
  relaunches one over SSH), the GPU host's sshd and every SSH connection to it are SIGKILLed; sshd is
  started again on the same port 1-4 s later;
- `sshd-tunnel`: the same once a generation task is generating through its tunnels;
- `prepare-kill`: the Celery worker running `prepare_run` SIGKILLed (half the time the moment the dataset
  index is stored, just before the run's record is written); `prepare_run` is not retried, so the run
  fails and is triggered again, as an operator would;
- `prepare-s3`: S3 flaps while `prepare_run` runs: down until one of its calls has been refused, up for
  0.2-1 s, down again, until the run record's PUT has been refused and retried (60 s at most).

Throughout, the scheduled rerun DAG (`tracegen_rerun_failed`) is unpaused on a one-minute schedule
(TRACEGEN_RERUN_SCHEDULE) over every chaos root (the `tracegen_output_roots` Variable), with leases void
after 20 s (TRACEGEN_LEASE_TTL_S) so a killed task's hold expires within a run. Like docker-compose's
`restart: always`, an Airflow component that exits on its own (a scheduler losing its database) is
started again, and counted.

After each run: every dataset row is present exactly once (no row lost, no index committed twice under
one cap), no row is torn (every committed part parses and matches its ledger entry), the ledger invariants
hold, `python -m tracegen verify` is clean, no scheduled rerun found work in the root while its run was
live, and the run completed, by its own task retries or, when the faults exhausted them, by the scheduled
`tracegen_rerun_failed`. The time from each fault to the next commit in the output root (the run making
progress again) is recorded.

    python bench/chaos.py                       # the full campaign (counts: --help)
    python bench/chaos.py --worker 2 --scheduler 1 --s3 1 --server 1 --postgres 1 --redis 1 \
        --sshd-provision 1 --sshd-tunnel 1 --prepare-kill 1 --prepare-s3 1    # a small trial

Results: a JSON file (--out) and a Markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(PROJECT / "include"), str(PROJECT / "tests")]
# This process reads the output root through Airflow's S3 hook: give it a throwaway Airflow home so it never
# touches a developer's ~/airflow (the cluster's components get their own).
_CLIENT_HOME = Path(tempfile.mkdtemp(prefix="tracegen-chaos-client-"))
os.environ.update({"AIRFLOW_HOME": str(_CLIENT_HOME), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                   "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_CLIENT_HOME}/airflow.db"})

from e2e.airflow_cluster import (  # noqa: E402
    AirflowApi,
    AirflowCluster,
    ClusterError,
    DirFactory,
    free_port,
    interrupt_on_signals,
)
from fixtures import s3 as s3_fixture  # noqa: E402
from fixtures import sshd as sshd_fixture  # noqa: E402

GENERATE = "tracegen_generate"
RERUN = "tracegen_rerun_failed"
FAULTS = ("worker", "scheduler", "s3", "server", "postgres", "redis", "sshd-provision", "sshd-tunnel",
          "prepare-kill", "prepare-s3")
# Injected at a moment of their own at the start of a run (prepare_run, provision_fleet), before the others.
PHASE_FAULTS = ("prepare-kill", "prepare-s3", "sshd-provision")
# At most one of each group per run: the fleet keeps one of its two servers; a run is prepared and
# provisioned once.
ONE_PER_RUN = (("server",), ("prepare-kill", "prepare-s3"), ("sshd-provision",))
_COMMIT_CALL = re.compile(r'"S3 (head|put) (ledger|parts)/[^/" ]+/c\d')
_RECORD_PUT = re.compile(r'"S3 put runs/[^/" ]+/run\.json: transient error')
CHUNK_TASKS = ("run_pilot", "generate_alongside_pilot", "generate_chunk", "generate_at_decided_cap")
DATASET_INDEX_KEY = "dataset/index.json"


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the run was triggered
    detail: str
    recovered_s: float | None = None  # fault (s3: end of outage) to the next commit; None: no commit after it
    duration_s: float = 0.0  # s3, postgres, redis, sshd: how long it was down
    missed: bool = False  # injected, but not into what it is meant for (still owed; injected again later)


@dataclass
class Trial:
    run_no: int
    run_id: str
    output: str
    faults: list[Fault] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)  # every tracegen_generate run into this root
    retriggered: int = 0  # runs triggered again after prepare_run died (it is not retried, by design)
    state: str = ""
    wall_s: float = 0.0
    rerun: bool = False  # finished by the scheduled tracegen_rerun_failed
    rerun_s: float = 0.0  # from the run's end until the scheduled rerun had finished it
    reruns_during: int = 0  # scheduled rerun runs whose discovery ran while this root's run was live
    rerun_live_items: int = 0  # work they found in this root meanwhile (must be 0)
    rerun_items: int = 0  # work the scheduled reruns found in this root once its run had ended
    self_exits: list[str] = field(default_factory=list)  # components that exited on their own, restarted
    completed: bool = False
    rows: int = 0
    lost: int = 0
    duplicated: int = 0  # rows beyond the first of one (index, max_tokens), non-failed
    torn: int = 0
    invariant_problems: list[str] = field(default_factory=list)
    verify_rc: int = -1
    s3_put_retries: int = 0  # S3 calls of commits (entry HEAD, part and entry PUTs) retried in the task logs
    s3_retries: int = 0  # every S3 call retried in the run's task logs (reads, listings, PUTs)
    tasks_retried: int = 0
    error: str = ""


def _when(iso: str | None) -> float | None:
    """An Airflow API timestamp as epoch seconds."""
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def _same_root(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class CommitWatch:
    """Polls the output root's ledger listing straight from the S3 server (not through the proxy, so an
    outage does not blind it) and remembers when each new ledger entry (a commit) appeared."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix + "ledger/"
        self.times: list[float] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                keys: set[str] = set()
                token = None
                while True:
                    kw = {"Bucket": self.bucket, "Prefix": self.prefix, **({"ContinuationToken": token} if token else {})}
                    page = self.client.list_objects_v2(**kw)
                    keys.update(o["Key"] for o in page.get("Contents", []))
                    if not page.get("IsTruncated"):
                        break
                    token = page["NextContinuationToken"]
                now = time.monotonic()
                new = keys - self._seen
                self._seen |= keys
                self.times += [now] * len(new)
            self._stop.wait(0.5)

    def first_after(self, t: float) -> float | None:
        later = [x for x in self.times if x > t]
        return min(later) if later else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(args.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stack = contextlib.ExitStack()
        self.trials: list[Trial] = []
        self.timers: list[threading.Timer] = []
        self.roots: list[str] = []  # every chaos root so far: the scheduled rerun's tracegen_output_roots
        # Airflow components down on purpose (a kill whose restart is pending): the supervisor leaves them.
        self.down: set[str] = set()
        self.exits: list[tuple[float, str]] = []  # (monotonic time, what) of components that exited on their own
        self._lock = threading.Lock()
        self._supervising = threading.Event()
        self.sshd_procs: list[subprocess.Popen] = []  # sshd listeners started again after a kill

    # ---- set-up --------------------------------------------------------------------------------------

    def start(self) -> None:
        factory = DirFactory(self.root)
        self.s3 = self.stack.enter_context(contextlib.contextmanager(s3_fixture.s3.__wrapped__)())
        self.sshd = self.stack.enter_context(contextlib.contextmanager(sshd_fixture.sshd.__wrapped__)(factory))
        # After the fleet's teardown (which needs sshd) and the cluster's stop: the listeners started again.
        self.stack.callback(self._stop_sshd_restarts)
        import boto3

        self.direct = boto3.client("s3", endpoint_url=self.s3.direct_endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing-key", aws_secret_access_key="testing-secret")
        self.prefix = f"chaos-{int(time.time())}/"
        # The dataset: the first rows of the bundled prompts, on S3 beside the output roots.
        from tracegen.config import SAMPLE_DATASET

        with gzip.open(SAMPLE_DATASET, "rt") as src:
            lines = [next(src) for _ in range(self.args.rows)]
        self.direct.put_object(Bucket=self.s3.bucket, Key=self.prefix + "prompts.jsonl", Body="".join(lines).encode())
        self.dataset_uri = f"s3://{self.s3.bucket}/{self.prefix}prompts.jsonl"

        # The fleet: two stand-ins on the sshd "GPU host", launched over SSH like SGLang.
        self.fleet_work = self.root / "gpu-host"
        fleet = {
            "hosts": [{"conn_id": self.sshd.conn_id, "gpus": [0, 1], "base_port": free_port(2)}],
            "model_path": "Qwen/Qwen3.6-27B", "served_model_name": "qwen3.6-27b",
            "python": sys.executable, "launch_module": "tracegen.simulator",
            "sglang_flags": {"--reasoning-parser": "qwen3", "--max-running-requests": 32, "--context-length": 40960,
                             "--enable-metrics": True, "--sim-time-scale": self.args.time_scale},
            "work_dir": str(self.fleet_work), "health_timeout_s": 60, "stop_timeout_s": 5,
        }
        self.fleet_path = self.root / "fleet.json"
        self.fleet_path.write_text(json.dumps(fleet, indent=1))
        ssh_var = f"AIRFLOW_CONN_{self.sshd.conn_id.upper()}"
        self.cluster = AirflowCluster(self.root / "cluster", workers=2, worker_concurrency=2, extra_env={
            "AIRFLOW_CONN_AWS_DEFAULT": self.s3.conn_json, ssh_var: os.environ[ssh_var],
            "TRACEGEN_FLEET": str(self.fleet_path), "TRACEGEN_RETRY_DELAY_S": "2",
            # The campaign's dataset and roots (tracegen.common.locations).
            "TRACEGEN_WRITE_PREFIXES": f"s3://{self.s3.bucket}/{self.prefix}",
            # Airflow's defaults (300 s, 30 s) leave the tasks of a scheduler killed together with their
            # worker "running" for up to 5 minutes: the new scheduler adopts them, and only then fails and
            # retries them, at its orphaned-task check (docs/reliability.md). Shorter here so the campaign fits
            # an hour; the figures say how long recovery takes with them.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": str(self.args.orphan_check_s),
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
            # The scheduled rerun runs beside the chaos runs, every minute instead of every hour, over every
            # chaos root; a killed task's lease is void after 20 s instead of 5 minutes, so the rerun can
            # finish a run whose retries ran out within the campaign.
            "TRACEGEN_RERUN_SCHEDULE": self.args.rerun_schedule,
            "TRACEGEN_LEASE_TTL_S": str(self.args.lease_ttl_s),
            # Airflow's advice "under high load": on a shared 2-core machine (load 10) the api-server answered a
            # task's supervisor too late five times running at its default 5 s, and the supervisor killed a
            # fault-free run's prepare_run.
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": str(self.args.execution_api_timeout_s),
        })
        self.stack.callback(self.cluster.stop)
        self.stack.callback(self._teardown_fleet)
        self.stack.callback(self._cancel_timers)
        self.stack.callback(self._supervising.clear)
        self.cluster.start(wait_s=300)
        self.api = self.cluster.api()
        self._set_roots()
        for dag_id in (GENERATE, RERUN):
            self.api.wait_for_dag(dag_id, timeout=300)
            self.api.unpause(dag_id)
        self._supervising.set()
        threading.Thread(target=self._supervise, name="supervisor", daemon=True).start()

    def _set_roots(self) -> None:
        """The scheduled rerun's roots: every chaos root so far (an empty list until the first run)."""
        value = json.dumps(self.roots)
        for _ in range(10):
            try:
                try:
                    self.api.set_variable("tracegen_output_roots", value)
                except ClusterError:  # it exists: replace its value
                    self.api._call("PATCH", "/variables/tracegen_output_roots",
                                   json={"key": "tracegen_output_roots", "value": value})
                return
            except Exception:  # noqa: BLE001 - the api-server may be without its database for a moment
                time.sleep(2)
                self._api()
        raise RuntimeError("could not set tracegen_output_roots")

    def _supervise(self) -> None:
        """docker-compose's `restart: always`: an Airflow component that exits on its own (not killed by a
        fault) is started again, and the exit is recorded."""
        while self._supervising.wait(2) and self._supervising.is_set():
            for name, component in list(self.cluster.components.items()):
                with self._lock:
                    if name in self.down or component.alive or not self._supervising.is_set():
                        continue
                    code = component.proc.returncode if component.proc else None
                    self.exits.append((time.monotonic(), f"{name} (exit {code})"))
                    print(f"  supervisor: {name} exited on its own (code {code}); starting it again", flush=True)
                    self.cluster.restart(name)

    def _restart(self, name: str) -> None:
        with self._lock:
            if self._supervising.is_set():
                self.cluster.restart(name)
            self.down.discard(name)

    def _kill(self, name: str) -> None:
        with self._lock:
            self.down.add(name)
            self.cluster.components[name].kill()

    def _teardown_fleet(self) -> None:
        from tracegen.fleet import teardown
        from tracegen.fleet.sources import load_fleet

        try:
            teardown(load_fleet(str(self.fleet_path)))
        except Exception as exc:  # noqa: BLE001 - the host is this machine: stop what the pid files name
            print(f"fleet teardown over SSH failed ({exc}); stopping the stand-ins by their pid files", flush=True)
            for pid_file in self.fleet_work.glob("*.pid"):
                values = dict(line.split("=", 1) for line in pid_file.read_text().splitlines() if "=" in line)
                with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                    os.killpg(int(values["pgid"]), signal.SIGKILL)

    def close(self) -> None:
        self.stack.close()

    # ---- faults --------------------------------------------------------------------------------------

    def _later(self, seconds: float, fn: Any, *args: Any) -> None:
        timer = threading.Timer(seconds, fn, args=args)
        self.timers.append(timer)
        timer.start()

    def _cancel_timers(self) -> None:
        # A restart still pending when the cluster stops would start a component nothing stops any more.
        for timer in self.timers:
            timer.cancel()
            timer.join(timeout=30)

    def inject(self, kind: str, t0: float, run_id: str) -> Fault | None:
        at = time.monotonic() - t0
        if kind == "worker":
            # Among the workers up now: one still in its restart pause has nothing to lose.
            alive = [n for n in self.cluster.worker_names if self.cluster.components[n].alive]
            if not alive:
                return None
            name = self.rng.choice(alive)
            tasks = self.cluster.components[name].running_tasks()
            self._kill(name)
            pause = self.rng.uniform(1, 4)
            self._later(pause, self._restart, name)
            return Fault(kind, at, f"{name} killed with {len(tasks)} task(s) running, restarted after {pause:.1f} s")
        if kind == "scheduler":
            self._kill("scheduler")
            pause = self.rng.uniform(2, 6)
            self._later(pause, self._restart, "scheduler")
            return Fault(kind, at, f"scheduler killed, restarted after {pause:.1f} s")
        if kind == "s3":
            # Down until a commit (its ledger entry's HEAD, part or entry PUT) has been refused and is retried, then
            # 1-5 s more: an outage *during a commit*, not merely during reads. At most 45 s (the engine
            # rides out 120 s); an outage that caught no commit says so.
            # A task blocked on its first reads (index, ledger) cannot reach a commit while S3 is down: cut it
            # off once a generation task has read what it needs and started generating (the engine's "N to
            # generate" line), so the outage falls on its commits.
            # A task reads its rows' prompts from the dataset (on S3) right after that line: an outage then
            # holds it on that read, before any row is generated. A few seconds later it generates (the
            # servers are not behind S3) and its commit runs into the outage.
            starts = self._log_lines(run_id, "to generate")
            wait_until = time.monotonic() + 30
            while self._log_lines(run_id, "to generate") <= starts and time.monotonic() < wait_until:
                time.sleep(0.3)
            time.sleep(self.rng.uniform(3.0, 8.0))
            at = time.monotonic() - t0
            puts_before = self._s3_retries(run_id)[0]
            started = time.monotonic()
            self.s3.proxy.down()
            caught = False
            try:
                while time.monotonic() - started < 45:
                    time.sleep(0.5)
                    if self._s3_retries(run_id)[0] > puts_before:
                        caught = True
                        break
                time.sleep(self.rng.uniform(1, 5))
            finally:
                self.s3.proxy.up()
            seconds = time.monotonic() - started
            return Fault(kind, at, f"S3 endpoint down for {seconds:.1f} s, "
                         f"{'a commit retried meanwhile' if caught else 'no commit in that time'}",
                         duration_s=seconds, missed=not caught)  # an outage no commit ran into is still owed
        if kind == "server":
            pids = sorted(self.fleet_work.glob("*.pid"))
            self.rng.shuffle(pids)
            for pid_file in pids:
                values = dict(line.split("=", 1) for line in pid_file.read_text().splitlines() if "=" in line)
                with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                    os.killpg(int(values["pgid"]), signal.SIGKILL)
                    return Fault(kind, at, f"stand-in {pid_file.stem} (group {values['pgid']}) killed")
            return None  # none running right now: try again later
        if kind in ("postgres", "redis"):
            # The servers the cluster started for itself: the metadata DB (and Celery's result backend), or
            # the broker. Half the time a crash (SIGKILL), half a clean fast shutdown; back on the same port.
            local = self.cluster.local_services
            crash = self.rng.random() < 0.5
            pause = self.rng.uniform(1, 5)
            started = time.monotonic()
            if kind == "postgres":
                local.kill_postgres() if crash else local.stop_postgres()
                time.sleep(pause)
                local.start_postgres()  # crash recovery from its WAL when killed
            else:
                local.kill_redis() if crash else local.stop_redis()
                time.sleep(pause)
                local.start_redis()  # empty: it keeps nothing on disk, so queued messages are gone
            seconds = time.monotonic() - started
            what = "PostgreSQL" if kind == "postgres" else "Redis"
            return Fault(kind, at, f"{what} {'SIGKILLed' if crash else 'stopped (fast shutdown)'} with "
                         f"{self._running_count(run_id)} generation task(s) running, down {seconds:.1f} s",
                         duration_s=seconds)
        if kind == "sshd-tunnel":
            # Once a generation task generates through its tunnels: a chunk task running and an SSH connection
            # open (sshd's per-connection process under the listener).
            wait_until = time.monotonic() + 60
            while time.monotonic() < wait_until and not (len(self._sshd_processes()) > 1
                                                         and self._running_count(run_id) > 0):
                time.sleep(0.5)
            time.sleep(self.rng.uniform(0.5, 3.0))
            at = time.monotonic() - t0
            if len(self._sshd_processes()) <= 1:
                return Fault(kind, at, "no SSH connection open for a minute", missed=True)
            killed, seconds = self._bounce_sshd()
            return Fault(kind, at, f"sshd and {killed - 1} connection process(es) SIGKILLed with "
                         f"{self._running_count(run_id)} generation task(s) running, down {seconds:.1f} s",
                         duration_s=seconds)
        raise ValueError(kind)

    def _running_count(self, run_id: str) -> int:
        with contextlib.suppress(Exception):
            return sum(1 for ti in self.api.task_instances(GENERATE, run_id)
                       if ti["state"] == "running" and ti["task_id"] in CHUNK_TASKS)
        return -1

    def _task(self, run_id: str, task_id: str) -> dict[str, Any] | None:
        with contextlib.suppress(Exception):
            for ti in self.api.task_instances(GENERATE, run_id):
                if ti["task_id"] == task_id:
                    return ti
        return None

    def _wait_task_running(self, run_id: str, task_id: str, timeout: float = 240) -> dict[str, Any] | None:
        """The task instance once it runs; None when it ended first or the run did (or at the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ti = self._task(run_id, task_id)
            if ti is not None and ti["state"] == "running":
                return ti
            if ti is not None and ti["state"] in ("success", "failed", "upstream_failed", "skipped"):
                return None
            time.sleep(0.2)
        return None

    def _has(self, key: str) -> bool:
        with contextlib.suppress(Exception):
            self.direct.head_object(Bucket=self.s3.bucket, Key=key)
            return True
        return False

    def inject_prepare(self, kind: str, t0: float, run_id: str, root_prefix: str) -> Fault:
        """A fault in `prepare_run`, the run's first task (retries=0)."""
        ti = self._wait_task_running(run_id, "prepare_run")
        at = time.monotonic() - t0
        if ti is None:
            return Fault(kind, at, "prepare_run was never seen running", missed=True)
        record = f"{root_prefix}runs/"
        if kind == "prepare-kill":
            # The worker whose supervisor runs this task instance (titled with its id).
            name = None
            deadline = time.monotonic() + 20
            while name is None and time.monotonic() < deadline:
                name = next((n for n in self.cluster.worker_names if self.cluster.components[n].alive and any(
                    ti["id"] in t for t in self.cluster.components[n].running_tasks())), None)
                if name is None:
                    time.sleep(0.05)
            if name is None:
                return Fault(kind, at, "no worker was found running prepare_run", missed=True)
            at_index = self.rng.random() < 0.5
            if at_index:
                # The moment the dataset index is stored: the run's record is the next write.
                deadline = time.monotonic() + 60
                while not self._has(root_prefix + DATASET_INDEX_KEY) and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                time.sleep(self.rng.uniform(0, 2))
            at = time.monotonic() - t0
            ended = self._task(run_id, "prepare_run")
            self._kill(name)
            pause = self.rng.uniform(1, 4)
            self._later(pause, self._restart, name)
            wrote = bool(self.direct.list_objects_v2(Bucket=self.s3.bucket, Prefix=record).get("KeyCount"))
            missed = ended is not None and ended["state"] == "success"
            return Fault(kind, at, f"{name} running prepare_run SIGKILLed "
                         f"{'as the dataset index was stored' if at_index else 'at a random moment'} "
                         f"(run record {'written' if wrote else 'not written'}), restarted after {pause:.1f} s"
                         f"{'; prepare_run had already succeeded' if missed else ''}", missed=missed)
        # prepare-s3: S3 flaps from the moment the dataset is indexed (what follows are prepare_run's
        # writes: the dataset binding, the index, the run record) until the run record's PUT has been refused
        # and is being retried: down until a call is refused, up for a moment (its retry may go through), down.
        log_dir = self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={run_id}" / "task_id=prepare_run"
        wait_until = time.monotonic() + 60
        while self._log_count(log_dir, '"indexed ') == 0 and time.monotonic() < wait_until:
            time.sleep(0.03)
        at = time.monotonic() - t0
        started = time.monotonic()
        flaps = 0
        caught = False
        try:
            while time.monotonic() - started < 60:
                refused = self._log_count(log_dir, "transient error")
                self.s3.proxy.down()
                flaps += 1
                until = time.monotonic() + 10
                while self._log_count(log_dir, "transient error") <= refused and time.monotonic() < until:
                    time.sleep(0.05)
                if self._log_count(log_dir, _RECORD_PUT) > 0:
                    caught = True
                    time.sleep(self.rng.uniform(1, 5))
                    break
                if time.monotonic() >= until:  # nothing refused for 10 s: has prepare_run ended?
                    ti = self._task(run_id, "prepare_run")
                    if ti is None or ti["state"] != "running":
                        break
                # Up when the refused call is retried (its log line says in how long), for a moment: the
                # retry and perhaps a call or two after it go through, the next is refused.
                time.sleep(max(0.0, self._last_retry_delay(log_dir) - 0.1))
                self.s3.proxy.up()
                time.sleep(self.rng.uniform(0.05, 0.25))
        finally:
            self.s3.proxy.up()
        seconds = time.monotonic() - started
        ti = self._task(run_id, "prepare_run")
        # Missed only when prepare_run got through without its record's PUT being refused: a prepare_run
        # that failed on the outage is an outcome, not a miss.
        missed = not caught and ti is not None and ti["state"] == "success"
        return Fault(kind, at, f"S3 flapped {flaps} time(s) over {seconds:.1f} s during prepare_run, "
                     f"{'the run record PUT refused and retried' if caught else 'the run record PUT never refused'}"
                     f" (prepare_run {ti and ti['state']})", duration_s=seconds, missed=missed)

    def inject_provision(self, t0: float, run_id: str) -> Fault:
        """sshd (with every SSH connection) killed while `provision_fleet` runs."""
        relaunch = self.rng.random() < 0.5
        killed = ""
        if relaunch:
            for pid_file in sorted(self.fleet_work.glob("*.pid")):
                values = dict(line.split("=", 1) for line in pid_file.read_text().splitlines() if "=" in line)
                with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                    os.killpg(int(values["pgid"]), signal.SIGKILL)
                    killed = pid_file.stem
                    break
        ti = self._wait_task_running(run_id, "provision_fleet")
        if ti is None:
            return Fault("sshd-provision", time.monotonic() - t0, "provision_fleet was never seen running",
                         missed=True)
        # Once it has connected over SSH (paramiko's "Connected" line): then it checks, (re)launches and
        # health-checks the servers through that connection and its tunnels.
        log_dir = self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={run_id}" / "task_id=provision_fleet"
        wait_until = time.monotonic() + 60
        while self._log_count(log_dir, '"Connected (version') == 0 and time.monotonic() < wait_until:
            time.sleep(0.05)
        time.sleep(self.rng.uniform(0.0, 1.0))
        ti = self._task(run_id, "provision_fleet")
        at = time.monotonic() - t0
        if ti is None or ti["state"] != "running":
            return Fault("sshd-provision", at, f"provision_fleet was {ti and ti['state']} before sshd was killed",
                         missed=True)
        count, seconds = self._bounce_sshd()
        return Fault("sshd-provision", at, f"sshd and {count - 1} connection process(es) SIGKILLed while "
                     f"provision_fleet ran{f' (relaunching {killed}, killed first)' if killed else ''}, "
                     f"down {seconds:.1f} s", duration_s=seconds)

    # ---- the GPU host's sshd ------------------------------------------------------------------------

    def _sshd_processes(self) -> list[int]:
        """The GPU host's sshd listener and every sshd process under it (each connection's)."""
        config = str(self.sshd.dir / "sshd_config")
        exe_path = os.path.realpath(sshd_fixture.SSHD)
        parent: dict[int, int] = {}
        exe: dict[int, str] = {}
        named: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                exe[pid] = os.readlink(entry / "exe")
                # sshd retitles itself ("sshd: /usr/sbin/sshd -D -e -f CONFIG [listener] ..."): a substring.
                if config in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    named.add(pid)
        found = {pid for pid in named if exe.get(pid) == exe_path and exe.get(parent.get(pid, 0)) != exe_path}
        grew = True
        while grew:
            more = {pid for pid, ppid in parent.items() if ppid in found and exe.get(pid) == exe_path} - found
            found |= more
            grew = bool(more)
        return sorted(found)

    def _bounce_sshd(self) -> tuple[int, float]:
        """SIGKILL sshd and every connection it serves (tunnels, running scripts lose their SSH side), then
        start it again on the same port 1-4 s later; (processes killed, seconds down)."""
        started = time.monotonic()
        for _ in range(3):  # stopped first, so none forks a process we would miss
            for pid in self._sshd_processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
        victims = self._sshd_processes()
        if not victims:
            raise RuntimeError(f"no sshd process of {self.sshd.dir / 'sshd_config'} found to kill")
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.sshd_procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        time.sleep(self.rng.uniform(1, 4))
        config = self.sshd.dir / "sshd_config"
        with self.sshd.log.open("ab") as log_fh:
            proc = subprocess.Popen([sshd_fixture.SSHD, "-D", "-e", "-f", str(config)], stdout=log_fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.sshd_procs.append(proc)
        sshd_fixture._wait_for_banner(self.sshd.port, proc, self.sshd.log)
        return len(victims), time.monotonic() - started

    def _stop_sshd_restarts(self) -> None:
        for proc in self.sshd_procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()

    # ---- one run -------------------------------------------------------------------------------------

    def conf(self, output: str) -> dict[str, Any]:
        return {"dataset_uri": self.dataset_uri, "output_uri": output, "fleet": str(self.fleet_path),
                "max_tokens": 8192, "pilot_size": self.args.pilot, "chunk_size": self.args.chunk,
                "gate_mode": "warn", "measure_tail": "never", "teardown": False}

    def _api(self) -> AirflowApi:
        # A fresh token: the api-server outlives the scheduler, but a long run can outlive a token.
        for _ in range(30):
            try:
                self.api = self.cluster.api()
                return self.api
            except Exception:  # noqa: BLE001 - the api-server may be busy; retry
                time.sleep(2)
        return self.api

    def _state(self, dag_id: str, run_id: str) -> str:
        for _ in range(10):
            try:
                return self.api.run(dag_id, run_id)["state"]
            except Exception:  # noqa: BLE001
                time.sleep(1)
                self._api()
        return "unknown"

    def _chunk_running(self, run_id: str) -> bool:
        with contextlib.suppress(Exception):
            return any(ti["state"] == "running" and ti["task_id"] in CHUNK_TASKS
                       for ti in self.api.task_instances(GENERATE, run_id))
        return False

    def _generating(self, run_id: str) -> bool:
        with contextlib.suppress(Exception):
            for ti in self.api.task_instances(GENERATE, run_id):
                if ti["task_id"] == "prepare_run" and ti["state"] == "success":
                    return True
        return False

    def trial(self, run_no: int, faults: list[str]) -> tuple[Trial, list[str]]:
        """One run with `faults` injected at random moments while it generates (those of PHASE_FAULTS at
        their phase first); returns the trial and the faults it ended before they could be injected."""
        name = f"run-{run_no:02d}"
        output = f"s3://{self.s3.bucket}/{self.prefix}{name}/"
        root_prefix = f"{self.prefix}{name}/"
        self._api()
        # The scheduled rerun watches this root from now on, as it watches every earlier one.
        self.roots.append(output)
        self._set_roots()
        t0 = time.monotonic()
        t0_wall = time.time()
        run_id = self.api.trigger(GENERATE, self.conf(output))
        trial = Trial(run_no, run_id, output, run_ids=[run_id])
        watch = CommitWatch(self.direct, self.s3.bucket, root_prefix)
        left = list(faults)
        deadline = t0 + self.args.run_timeout

        def record(fault: Fault | None, kind: str) -> None:
            if fault is None:
                return
            trial.faults.append(fault)
            # A fault that missed what it is meant for (an S3 outage no commit ran into, a prepare_run or
            # provisioning over before it struck) is recorded, but still owed.
            if not fault.missed:
                left.remove(kind)
            print(f"  run {run_no} +{fault.at:5.1f}s {fault.kind}{' (missed)' if fault.missed else ''}: "
                  f"{fault.detail}", flush=True)

        def prepared_or_again() -> str:
            """Wait for prepare_run's outcome (a dead worker's task: after its heartbeat timeout). prepare_run
            is not retried (a bad param must fail at once): when it failed, wait for the run to end and trigger
            it again, as an operator would. Returns the run id to follow."""
            nonlocal run_id
            for _ in range(3):
                while True:
                    prepared = self._task(run_id, "prepare_run")
                    if prepared is None or prepared["state"] in ("success", "failed", "upstream_failed") \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                if prepared is None or prepared["state"] == "success" or time.monotonic() > deadline:
                    return run_id
                while self._state(GENERATE, run_id) not in ("success", "failed") and time.monotonic() < deadline:
                    time.sleep(1)
                print(f"  run {run_no}: prepare_run {prepared['state']}, run {self._state(GENERATE, run_id)}; "
                      "triggered again", flush=True)
                run_id = self.api.trigger(GENERATE, self.conf(output))
                trial.run_ids.append(run_id)
                trial.run_id = run_id
                trial.retriggered += 1
            return run_id

        # Faults of the run's first tasks, at their moment.
        for kind in [k for k in left if k in ("prepare-kill", "prepare-s3")][:1]:
            record(self.inject_prepare(kind, t0, run_id, root_prefix), kind)
        prepared_or_again()
        if "sshd-provision" in left:
            record(self.inject_provision(t0, run_id), "sshd-provision")
        # The other faults start once the run is planned.
        while not self._generating(run_id) and self._state(GENERATE, run_id) not in ("success", "failed"):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        while any(k not in PHASE_FAULTS for k in left):
            kind = next(k for k in left if k not in PHASE_FAULTS)
            time.sleep(self.rng.uniform(self.args.gap_min, self.args.gap_max))
            if self._state(GENERATE, run_id) in ("success", "failed") or time.monotonic() > deadline:
                break
            # An S3 outage, a lost server, a database, broker or sshd down are meant for a run that is
            # committing or generating: wait for a generation task to be running (not merely queued behind a retry).
            if kind in ("s3", "server", "postgres", "redis", "sshd-tunnel") and not self._chunk_running(run_id):
                continue
            record(self.inject(kind, t0, run_id), kind)
        while (state := self._state(GENERATE, run_id)) not in ("success", "failed"):
            if time.monotonic() > deadline:
                state = "timeout"
                break
            time.sleep(2)
        trial.state = state
        trial.wall_s = time.monotonic() - t0
        self.s3.proxy.up()
        status = self._status(output)
        if state != "success" or status.get("left", 1) != 0:
            # Not by the harness: the scheduled rerun (every minute here) finishes it once the run has ended
            # and its dead tasks' leases have expired.
            trial.rerun = True
            started = time.monotonic()
            while self._status(output).get("left", 1) != 0 and time.monotonic() - started < self.args.rerun_wait:
                time.sleep(5)
            trial.rerun_s = time.monotonic() - started
        time.sleep(1.5)  # the watcher's last poll
        watch.stop()
        for fault in trial.faults:
            # From the fault; from the end of an S3 outage (the run cannot commit during it).
            since = fault.at + (fault.duration_s if fault.kind in ("s3", "prepare-s3") else 0.0) + t0
            commit = watch.first_after(since)
            fault.recovered_s = None if commit is None else round(commit - since, 1)
        self._check(trial)
        self._check_reruns(trial, t0_wall)
        with self._lock:
            trial.self_exits = [what for when, what in self.exits if when >= t0]
        with contextlib.suppress(Exception):
            trial.tasks_retried = sum(1 for r in trial.run_ids for t in self.api.task_instances(GENERATE, r)
                                      if t["try_number"] > 1)
        counts = [self._s3_retries(r) for r in trial.run_ids]
        trial.s3_put_retries, trial.s3_retries = sum(c[0] for c in counts), sum(c[1] for c in counts)
        return trial, left

    def _check_reruns(self, trial: Trial, since: float) -> None:
        """What the scheduled reruns found in this root: nothing while one of its runs was queued or running
        (their discovery started inside the run's live window, from Airflow's own timestamps)."""
        try:
            self._api()
            live = []
            for run_id in trial.run_ids:
                run = self.api.run(GENERATE, run_id)
                live.append((_when(run.get("queued_at")) or _when(run.get("start_date")) or since,
                             _when(run.get("end_date")) or time.time()))
            body = self.api._call("GET", f"/dags/{RERUN}/dagRuns", params={"limit": 100, "order_by": "-start_date"})
            for rerun in body["dag_runs"]:
                if (_when(rerun.get("start_date")) or 0) < since - 120:
                    continue
                rid = rerun["dag_run_id"]
                find = next((t for t in self.api.task_instances(RERUN, rid)
                             if t["task_id"] == "find_unfinished_work"), None)
                began = _when(find and find.get("start_date"))
                if began is None:
                    continue
                try:
                    items = self.api.xcom(RERUN, rid, "find_unfinished_work") or []
                except ClusterError:
                    items = []
                mine = sum(1 for item in items if _same_root(item.get("output_uri", ""), trial.output))
                if any(start <= began <= end for start, end in live):
                    trial.reruns_during += 1
                    trial.rerun_live_items += mine
                elif began >= since:
                    trial.rerun_items += mine
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed trial
            trial.error = (trial.error + "; " if trial.error else "") + f"rerun check: {type(exc).__name__}: {exc}"

    def _status(self, output: str) -> dict[str, Any]:
        from tracegen.status import dataset_status

        try:
            return dataset_status(output)
        except Exception as exc:  # noqa: BLE001 - reported in the trial
            return {"error": str(exc)}

    def _check(self, trial: Trial) -> None:
        from tracegen.store.records import FAILED
        from tracegen.store.root import OutputRoot
        from tracegen.store.storage import open_storage

        n = self.args.rows
        try:
            status = self._status(trial.output)
            output_root = OutputRoot(open_storage(trial.output))
            trial.invariant_problems = output_root.repair.check_invariants(deep=True)
            damage = output_root.repair.verify_parts(deep=True)
            frame = output_root.snapshots.frame()
            kept = frame[frame["status"] != FAILED] if len(frame) else frame
            indices = set(kept["index"].tolist()) if len(kept) else set()
            trial.rows = len(indices)
            trial.lost = n - len(indices & set(range(n)))
            # No index committed twice under one cap: each (index, max_tokens) of the non-failed rows once.
            per_cap = kept.groupby(["index", "max_tokens"]).size() if len(kept) else None
            trial.duplicated = int((per_cap - 1).sum()) if per_cap is not None else 0
            # A torn row is a committed row that cannot be read back: a damaged part, or a row that fails to
            # parse (read_part raises on the first one).
            damaged = {item.part for item in damage}
            torn = 0
            for key in output_root.commits.entries():
                entry = output_root.commits.read_entry(key)
                if entry["part"] in damaged:
                    torn += int(entry.get("n_rows") or 1)
                    continue
                try:
                    rows = list(output_root.commits.read_part(entry["part"]))
                    torn += max(0, int(entry.get("n_rows", len(rows))) - len(rows))
                except Exception:  # noqa: BLE001 - counted
                    torn += int(entry.get("n_rows", 1))
            trial.torn = torn
            trial.completed = status.get("left") == 0 and status.get("done") == n
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed trial
            trial.error = f"{type(exc).__name__}: {exc}"
        env = {**os.environ, "PYTHONPATH": str(PROJECT / "include")}
        verify = subprocess.run([sys.executable, "-m", "tracegen", "verify", trial.output], env=env,
                                capture_output=True, text=True, timeout=300, check=False)
        trial.verify_rc = verify.returncode

    def _log_lines(self, run_id: str, text: str) -> int:
        return self._log_count(self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={run_id}", text)

    @staticmethod
    def _last_retry_delay(where: Path) -> float:
        """The delay the last retried S3 call announced in these logs ("...; retry 3 in 1.23s")."""
        found = 0.0
        for path in where.rglob("*.log") if where.exists() else []:
            with contextlib.suppress(OSError):
                delays = re.findall(r"transient error .*?; retry \d+ in ([0-9.]+)s", path.read_text(errors="replace"))
                found = float(delays[-1]) if delays else found
        return found

    @staticmethod
    def _log_count(where: Path, pattern: str | re.Pattern[str]) -> int:
        count = 0
        for path in where.rglob("*.log") if where.exists() else []:
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")
                count += text.count(pattern) if isinstance(pattern, str) else len(pattern.findall(text))
        return count

    def _s3_retries(self, run_id: str) -> tuple[int, int]:
        """(commit calls, all calls) retried through S3 outages, from the run's task logs (storage.py's
        warning). A commit is the HEAD of its ledger entry (never committed twice), the part's PUT, then the
        entry's PUT: any of those retried is a commit caught by the outage."""
        logs = self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={run_id}"
        commits = calls = 0
        for path in logs.rglob("*.log") if logs.exists() else []:
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if "transient error" in line and '"S3 ' in line:
                        calls += 1
                        commits += bool(_COMMIT_CALL.search(line))
        return commits, calls

    # ---- the whole campaign --------------------------------------------------------------------------

    def campaign(self) -> None:
        quota = {kind: getattr(self.args, kind.replace("-", "_")) for kind in FAULTS}
        pending = [k for k, n in quota.items() for _ in range(n)]
        self.rng.shuffle(pending)
        started = time.monotonic()
        run_no = 0
        if self.args.baseline:
            print("run 0: baseline, no faults", flush=True)
            trial, _ = self.trial(0, [])
            self._report(trial)
            run_no = 1
        while pending and time.monotonic() - started < self.args.budget_minutes * 60:
            take = take_faults(pending, self.args.faults_per_run)
            for kind in take:
                pending.remove(kind)
            print(f"run {run_no}: faults {take}", flush=True)
            self.pending = take + pending  # what an interruption would leave
            trial, left = self.trial(run_no, take)
            pending = left + pending
            self._report(trial)
            run_no += 1
        self.pending = pending
        self.elapsed = time.monotonic() - started

    def _report(self, trial: Trial) -> None:
        self.trials.append(trial)
        ok = trial.completed and not (trial.lost or trial.duplicated or trial.torn or trial.invariant_problems) \
            and trial.verify_rc == 0
        ok = ok and not trial.rerun_live_items and not trial.error
        print(f"  -> {trial.state}{' + rerun' if trial.rerun else ''} in {trial.wall_s:.0f} s"
              f"{f' (+{trial.rerun_s:.0f} s until the scheduled rerun finished it)' if trial.rerun else ''}"
              f"{f', triggered again {trial.retriggered}x' if trial.retriggered else ''}: rows "
              f"{trial.rows}/{self.args.rows}, lost {trial.lost}, duplicated {trial.duplicated}, torn {trial.torn}, "
              f"invariants {len(trial.invariant_problems)} problems, verify rc {trial.verify_rc}; scheduled reruns "
              f"during the run {trial.reruns_during} (work found in it {trial.rerun_live_items}), after it "
              f"{trial.rerun_items} item(s)"
              f"{'; exited on their own: ' + ', '.join(trial.self_exits) if trial.self_exits else ''}"
              f"{', ERROR ' + trial.error if trial.error else ''} [{'ok' if ok else 'FAIL'}]", flush=True)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(self.args), "trials": [asdict(t) for t in self.trials]}, indent=1))


def take_faults(pending: list[str], n: int) -> list[str]:
    """The next faults of the queue for one run: up to n, at most one of each ONE_PER_RUN group."""
    take: list[str] = []
    for kind in pending:
        if len(take) == n:
            break
        group = next((g for g in ONE_PER_RUN if kind in g), ())
        if not any(k in group for k in take):
            take.append(kind)
    return take


def _ok(t: Trial) -> bool:
    return (t.completed and not (t.lost or t.duplicated or t.torn or t.invariant_problems or t.rerun_live_items
                                 or t.error) and t.verify_rc == 0)


def summary(trials: list[Trial], rows: int) -> str:
    faults = [f for t in trials for f in t.faults]
    lines = ["| fault | injected | runs with it | completed | by own retries / scheduled rerun / triggered again "
             "| next commit after it: median / max (s) | no commit after it | rows lost | duplicated | "
             "`verify` not clean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in FAULTS:
        mine = [f for f in faults if f.kind == kind and not f.missed]
        missed = sum(1 for f in faults if f.kind == kind and f.missed)
        runs = [t for t in trials if any(f.kind == kind and not f.missed for f in t.faults)]
        rec = sorted(f.recovered_s for f in mine if f.recovered_s is not None)
        med = f"{rec[len(rec) // 2]:.1f} / {rec[-1]:.1f}" if rec else "-"
        done = [t for t in runs if t.completed]
        how = (f"{sum(not t.rerun and not t.retriggered for t in done)} / {sum(t.rerun for t in done)} / "
               f"{sum(bool(t.retriggered) for t in done)}")
        lines.append(f"| {kind} | {len(mine)}{f' (+{missed} missed)' if missed else ''} | {len(runs)} | "
                     f"{len(done)}/{len(runs)} | {how} | {med} | {len(mine) - len(rec)} | "
                     f"{sum(t.lost for t in runs)} | {sum(t.duplicated for t in runs)} | "
                     f"{sum(t.verify_rc != 0 for t in runs)} |")
    workers = [f for f in faults if f.kind == "worker"]
    outages = [f for f in faults if f.kind == "s3"]
    lines += ["", f"worker kills that took running tasks: {sum(' 0 task' not in f.detail for f in workers)} of "
              f"{len(workers)}; S3 outages during a commit (refused and retried): "
              f"{sum('a commit retried' in f.detail for f in outages)} of {len(outages)}, down "
              f"{min((f.duration_s for f in outages), default=0):.0f}-{max((f.duration_s for f in outages), default=0):.0f} s"]
    for kind in ("postgres", "redis", "sshd-provision", "sshd-tunnel", "prepare-s3"):
        mine = [f for f in faults if f.kind == kind and not f.missed]
        if mine:
            lines.append(f"{kind}: down {min(f.duration_s for f in mine):.1f}-{max(f.duration_s for f in mine):.1f} s"
                         + (f", {sum('SIGKILL' in f.detail for f in mine)} of {len(mine)} a SIGKILL"
                            if kind in ("postgres", "redis") else ""))
    exits: dict[str, int] = {}
    for t in trials:
        for what in t.self_exits:
            name = what.split(" ")[0]
            exits[name] = exits.get(name, 0) + 1
    faulty = [t for t in trials if t.faults]
    lines += [
        "",
        f"runs: {len(trials)} ({len(faulty)} with faults) of {rows} rows each; "
        f"completed: {sum(t.completed for t in trials)}; by their own retries: "
        f"{sum(t.completed and not t.rerun and not t.retriggered for t in trials)}, after the scheduled "
        f"tracegen_rerun_failed: {sum(t.completed and t.rerun for t in trials)} (finished "
        f"{' '.join(f'{t.rerun_s:.0f}' for t in trials if t.rerun) or '-'} s after the run ended), triggered again "
        f"after prepare_run died: {sum(bool(t.retriggered) for t in trials)}; all checks clean: "
        f"{sum(_ok(t) for t in trials)}",
        f"rows lost: {sum(t.lost for t in trials)}, duplicated (an index twice under one cap): "
        f"{sum(t.duplicated for t in trials)}, torn: {sum(t.torn for t in trials)}; ledger invariant problems: "
        f"{sum(len(t.invariant_problems) for t in trials)}; `tracegen verify` not clean: "
        f"{sum(t.verify_rc != 0 for t in trials)}",
        f"scheduled reruns whose discovery ran during a live run: {sum(t.reruns_during for t in trials)}, work they "
        f"found in its root: {sum(t.rerun_live_items for t in trials)}; work found in a root after its run ended: "
        f"{sum(t.rerun_items for t in trials)} chunk(s)",
        f"components that exited on their own and were started again: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(exits.items())) or 'none'}",
        f"run wall time: {' '.join(f'{t.wall_s:.0f}' for t in trials)} s; task retries: "
        f"{sum(t.tasks_retried for t in trials)}; S3 calls retried through outages: "
        f"{sum(t.s3_retries for t in trials)}, of which commits: {sum(t.s3_put_retries for t in trials)}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=int, default=30, help="Celery worker SIGKILLs (default 30)")
    parser.add_argument("--scheduler", type=int, default=10, help="scheduler SIGKILLs (default 10)")
    parser.add_argument("--s3", type=int, default=10, help="S3 outages (default 10)")
    parser.add_argument("--server", type=int, default=10, help="stand-in server SIGKILLs (default 10)")
    parser.add_argument("--postgres", type=int, default=6, help="PostgreSQL restarts mid-run (default 6)")
    parser.add_argument("--redis", type=int, default=6, help="Redis (broker) restarts mid-run (default 6)")
    parser.add_argument("--sshd-provision", type=int, default=4,
                        help="sshd killed with its connections while provision_fleet runs (default 4)")
    parser.add_argument("--sshd-tunnel", type=int, default=4,
                        help="sshd killed with its connections while tunnels carry requests (default 4)")
    parser.add_argument("--prepare-kill", type=int, default=3,
                        help="the worker running prepare_run SIGKILLed (default 3)")
    parser.add_argument("--prepare-s3", type=int, default=3,
                        help="S3 flapping while prepare_run writes the run record (default 3)")
    parser.add_argument("--faults-per-run", type=int, default=6)
    parser.add_argument("--rows", type=int, default=60, help="dataset rows (default 60)")
    parser.add_argument("--pilot", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=15)
    parser.add_argument("--time-scale", type=float, default=60.0, help="the stand-ins' --sim-time-scale")
    parser.add_argument("--gap-min", type=float, default=2.0, help="seconds between faults, at least")
    parser.add_argument("--gap-max", type=float, default=10.0, help="seconds between faults, at most")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--budget-minutes", type=float, default=90.0,
                        help="start no new run after this; what was not injected is reported")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="a first run without faults, for the wall time")
    parser.add_argument("--orphan-check-s", type=int, default=15,
                        help="[scheduler] orphaned_tasks_check_interval of the cluster (Airflow's default: 300)")
    parser.add_argument("--rerun-schedule", default="* * * * *",
                        help="TRACEGEN_RERUN_SCHEDULE: the scheduled rerun's cron, running beside the runs")
    parser.add_argument("--lease-ttl-s", type=float, default=20.0,
                        help="TRACEGEN_LEASE_TTL_S: a killed task's lease is void after this (default 20)")
    parser.add_argument("--rerun-wait", type=float, default=600.0,
                        help="how long a run that did not finish may wait for the scheduled rerun (s)")
    parser.add_argument("--execution-api-timeout-s", type=float, default=30.0,
                        help="[workers] execution_api_timeout of the cluster (Airflow's default: 5)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--root", default=str(PROJECT / ".state" / "chaos"))
    parser.add_argument("--out", default=str(PROJECT / ".state" / "chaos" / "results.json"))
    args = parser.parse_args(argv)
    chaos = Chaos(args)
    interrupt_on_signals()  # a SIGTERM stops what the campaign started, as Ctrl-C does
    started = time.monotonic()
    try:
        chaos.start()
        print(f"cluster up in {time.monotonic() - started:.0f} s", flush=True)
        chaos.campaign()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        chaos.close()
    print("\n" + summary(chaos.trials, args.rows))
    left = getattr(chaos, "pending", None)
    print(f"\nwall time: {(time.monotonic() - started) / 60:.1f} min; faults not injected (budget): {left or 'none'}")
    bad = [t for t in chaos.trials if not _ok(t)]
    return 1 if bad or left else 0


if __name__ == "__main__":
    sys.exit(main())
