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
- `server`: SIGKILL of a random stand-in server's process group on the GPU host.

After each run: every dataset row is present exactly once (no row lost, none committed twice), no row is
torn (every committed part parses and matches its ledger entry), the ledger invariants hold,
`python -m tracegen verify` is clean, and the run completed, by its own task retries or, when the faults
exhausted them, by `tracegen_rerun_failed`. The time from each fault to the next commit in the output
root (the run making progress again) is recorded.

    python bench/chaos.py                       # the full run: >= 30 worker, 10 scheduler, 10 S3, 10 server faults
    python bench/chaos.py --worker 2 --scheduler 1 --s3 1 --server 1    # a small trial

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

from e2e.airflow_cluster import AirflowApi, AirflowCluster, ClusterError, DirFactory, free_port  # noqa: E402
from fixtures import s3 as s3_fixture  # noqa: E402
from fixtures import sshd as sshd_fixture  # noqa: E402

GENERATE = "tracegen_generate"
RERUN = "tracegen_rerun_failed"
FAULTS = ("worker", "scheduler", "s3", "server")
_COMMIT_CALL = re.compile(r'"S3 (head|put) (ledger|parts)/[^/" ]+/c\d')
CHUNK_TASKS = ("run_pilot", "generate_alongside_pilot", "generate_chunk", "generate_at_decided_cap")


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the run was triggered
    detail: str
    recovered_s: float | None = None  # fault (s3: end of outage) to the next commit; None: no commit after it
    duration_s: float = 0.0  # s3: how long the endpoint was down


@dataclass
class Trial:
    run_no: int
    run_id: str
    output: str
    faults: list[Fault] = field(default_factory=list)
    state: str = ""
    wall_s: float = 0.0
    rerun: bool = False
    rerun_s: float = 0.0
    completed: bool = False
    rows: int = 0
    lost: int = 0
    duplicated: int = 0
    torn: int = 0
    invariant_problems: list[str] = field(default_factory=list)
    verify_rc: int = -1
    s3_put_retries: int = 0  # S3 calls of commits (entry HEAD, part and entry PUTs) retried in the task logs
    s3_retries: int = 0  # every S3 call retried in the run's task logs (reads, listings, PUTs)
    tasks_retried: int = 0
    error: str = ""


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

    # ---- set-up --------------------------------------------------------------------------------------

    def start(self) -> None:
        factory = DirFactory(self.root)
        self.s3 = self.stack.enter_context(contextlib.contextmanager(s3_fixture.s3.__wrapped__)())
        self.sshd = self.stack.enter_context(contextlib.contextmanager(sshd_fixture.sshd.__wrapped__)(factory))
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
            # Airflow's defaults (300 s, 30 s) leave the tasks of a scheduler killed together with their
            # worker "running" for up to 5 minutes: the new scheduler adopts them, and only then fails and
            # retries them, at its orphaned-task check (docs/reliability.md). Shorter here so the campaign fits
            # an hour; the figures say how long recovery takes with them.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": str(self.args.orphan_check_s),
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
        })
        self.stack.callback(self.cluster.stop)
        self.stack.callback(self._teardown_fleet)
        self.stack.callback(self._cancel_timers)
        self.cluster.start(wait_s=300)
        self.api = self.cluster.api()
        for dag_id in (GENERATE, RERUN):
            self.api.wait_for_dag(dag_id, timeout=300)
            self.api.unpause(dag_id)

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
            self.cluster.components[name].kill()
            pause = self.rng.uniform(1, 4)
            self._later(pause, self.cluster.restart, name)
            return Fault(kind, at, f"{name} killed with {len(tasks)} task(s) running, restarted after {pause:.1f} s")
        if kind == "scheduler":
            self.cluster.components["scheduler"].kill()
            pause = self.rng.uniform(2, 6)
            self._later(pause, self.cluster.restart, "scheduler")
            return Fault(kind, at, f"scheduler killed, restarted after {pause:.1f} s")
        if kind == "s3":
            # Down until a commit (its ledger entry's HEAD, part or entry PUT) has been refused and is retried, then
            # 1-5 s more: an outage *during a commit*, not merely during reads. At most 45 s (the engine
            # rides out 120 s); an outage that caught no commit says so.
            # A task blocked on its first reads (index, ledger) cannot reach a commit while S3 is down: cut it
            # off once a generation task has read what it needs and started generating (the engine's "N to
            # generate" line), so the outage falls on its commits.
            starts = self._log_lines(run_id, "to generate")
            wait_until = time.monotonic() + 30
            while self._log_lines(run_id, "to generate") <= starts and time.monotonic() < wait_until:
                time.sleep(0.3)
            time.sleep(self.rng.uniform(0.5, 2.0))
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
                         duration_s=seconds)
        if kind == "server":
            pids = sorted(self.fleet_work.glob("*.pid"))
            self.rng.shuffle(pids)
            for pid_file in pids:
                values = dict(line.split("=", 1) for line in pid_file.read_text().splitlines() if "=" in line)
                with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                    os.killpg(int(values["pgid"]), signal.SIGKILL)
                    return Fault(kind, at, f"stand-in {pid_file.stem} (group {values['pgid']}) killed")
            return None  # none running right now: try again later
        raise ValueError(kind)

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
        """One run with `faults` injected at random moments while it generates; returns the trial and the
        faults it ended before they could be injected."""
        output = f"s3://{self.s3.bucket}/{self.prefix}run-{run_no:02d}/"
        self._api()
        t0 = time.monotonic()
        run_id = self.api.trigger(GENERATE, self.conf(output))
        trial = Trial(run_no, run_id, output)
        watch = CommitWatch(self.direct, self.s3.bucket, f"{self.prefix}run-{run_no:02d}/")
        left = list(faults)
        deadline = t0 + self.args.run_timeout
        # Faults start once the run is planned (prepare_run is not retried: a bad param must fail at once).
        while not self._generating(run_id) and self._state(GENERATE, run_id) not in ("success", "failed"):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        while left:
            time.sleep(self.rng.uniform(self.args.gap_min, self.args.gap_max))
            if self._state(GENERATE, run_id) in ("success", "failed") or time.monotonic() > deadline:
                break
            # An S3 outage or a lost server is meant for a run that is committing or generating: wait for a
            # generation task to be running (not merely queued behind a retry).
            if left[0] in ("s3", "server") and not self._chunk_running(run_id):
                continue
            fault = self.inject(left[0], t0, run_id)
            if fault is not None:
                trial.faults.append(fault)
                # An outage no commit ran into is recorded, but an outage during a commit is still owed.
                if not (fault.kind == "s3" and "no commit" in fault.detail):
                    left.pop(0)
                print(f"  run {run_no} +{fault.at:5.1f}s {fault.kind}: {fault.detail}", flush=True)
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
            trial.rerun = True
            started = time.monotonic()
            self._rerun(output)
            trial.rerun_s = time.monotonic() - started
        time.sleep(1.5)  # the watcher's last poll
        watch.stop()
        for fault in trial.faults:
            since = fault.at + fault.duration_s + t0
            commit = watch.first_after(since)
            fault.recovered_s = None if commit is None else round(commit - since, 1)
        self._check(trial)
        with contextlib.suppress(Exception):
            trial.tasks_retried = sum(1 for t in self.api.task_instances(GENERATE, run_id) if t["try_number"] > 1)
        trial.s3_put_retries, trial.s3_retries = self._s3_retries(run_id)
        return trial, left

    def _status(self, output: str) -> dict[str, Any]:
        from tracegen.status import dataset_status

        try:
            return dataset_status(output)
        except Exception as exc:  # noqa: BLE001 - reported in the trial
            return {"error": str(exc)}

    def _rerun(self, output: str) -> None:
        """The scheduled rerun DAG, triggered now for this root; twice at most."""
        self._api()
        with contextlib.suppress(ClusterError):
            self.api._call("DELETE", "/variables/tracegen_output_roots")
        self.api.set_variable("tracegen_output_roots", json.dumps([output]))
        for _ in range(2):
            run_id = self.api.trigger(RERUN, {})
            with contextlib.suppress(ClusterError):
                self.api.wait_run(RERUN, run_id, self.args.run_timeout)
            if self._status(output).get("left", 1) == 0:
                return

    def _check(self, trial: Trial) -> None:
        from tracegen.store.ledger import Ledger
        from tracegen.store.records import FAILED
        from tracegen.store.storage import open_storage

        n = self.args.rows
        try:
            status = self._status(trial.output)
            ledger = Ledger(open_storage(trial.output))
            trial.invariant_problems = ledger.check_invariants(deep=True)
            damage = ledger.verify_parts(deep=True)
            frame = ledger.frame()
            kept = frame[frame["status"] != FAILED]["index"].tolist() if len(frame) else []
            trial.rows = len(set(kept))
            trial.lost = n - len(set(kept) & set(range(n)))
            trial.duplicated = len(kept) - len(set(kept))
            # A torn row is a committed row that cannot be read back: a damaged part, or a row that fails to
            # parse (read_part raises on the first one).
            damaged = {item.part for item in damage}
            torn = 0
            for key in ledger.entries():
                entry = ledger.read_entry(key)
                if entry["part"] in damaged:
                    torn += int(entry.get("n_rows") or 1)
                    continue
                try:
                    rows = list(ledger.read_part(entry["part"]))
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
        logs = self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={run_id}"
        count = 0
        for path in logs.rglob("*.log") if logs.exists() else []:
            with contextlib.suppress(OSError):
                count += path.read_text(errors="replace").count(text)
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
        quota = {"worker": self.args.worker, "scheduler": self.args.scheduler, "s3": self.args.s3,
                 "server": self.args.server}
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
            take = pending[: self.args.faults_per_run]
            # At most one stand-in kill per run: the fleet here has two servers, and a run must keep one.
            if take.count("server") > 1:
                take = [k for k in take if k != "server"] + ["server"]
                take = take[: self.args.faults_per_run]
            for kind in take:
                pending.remove(kind)
            print(f"run {run_no}: faults {take}", flush=True)
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
        print(f"  -> {trial.state}{' + rerun' if trial.rerun else ''} in {trial.wall_s:.0f} s"
              f"{f' (+{trial.rerun_s:.0f} s rerun)' if trial.rerun else ''}: rows {trial.rows}/{self.args.rows}, "
              f"lost {trial.lost}, duplicated {trial.duplicated}, torn {trial.torn}, invariants "
              f"{len(trial.invariant_problems)} problems, verify rc {trial.verify_rc}"
              f"{', ERROR ' + trial.error if trial.error else ''} [{'ok' if ok else 'FAIL'}]", flush=True)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(self.args), "trials": [asdict(t) for t in self.trials]}, indent=1))


def summary(trials: list[Trial], rows: int) -> str:
    faults = [f for t in trials for f in t.faults]
    lines = ["| fault | injected | next commit after it: median / max (s) | no commit after it |",
             "|---|---|---|---|"]
    for kind in FAULTS:
        mine = [f for f in faults if f.kind == kind]
        rec = sorted(f.recovered_s for f in mine if f.recovered_s is not None)
        med = f"{rec[len(rec) // 2]:.1f} / {rec[-1]:.1f}" if rec else "-"
        lines.append(f"| {kind} | {len(mine)} | {med} | {len(mine) - len(rec)} |")
    workers = [f for f in faults if f.kind == "worker"]
    outages = [f for f in faults if f.kind == "s3"]
    lines += ["", f"worker kills that took running tasks: {sum(' 0 task' not in f.detail for f in workers)} of "
              f"{len(workers)}; S3 outages during a commit (refused and retried): "
              f"{sum('a commit retried' in f.detail for f in outages)} of {len(outages)}, down "
              f"{min((f.duration_s for f in outages), default=0):.0f}-{max((f.duration_s for f in outages), default=0):.0f} s"]
    faulty = [t for t in trials if t.faults]
    lines += [
        "",
        f"runs: {len(trials)} ({len(faulty)} with faults) of {rows} rows each; "
        f"completed: {sum(t.completed for t in trials)}; by their own retries: "
        f"{sum(t.completed and not t.rerun for t in trials)}, after tracegen_rerun_failed: "
        f"{sum(t.completed and t.rerun for t in trials)}",
        f"rows lost: {sum(t.lost for t in trials)}, duplicated: {sum(t.duplicated for t in trials)}, "
        f"torn: {sum(t.torn for t in trials)}; ledger invariant problems: "
        f"{sum(len(t.invariant_problems) for t in trials)}; `tracegen verify` not clean: "
        f"{sum(t.verify_rc != 0 for t in trials)}",
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
    parser.add_argument("--faults-per-run", type=int, default=6)
    parser.add_argument("--rows", type=int, default=60, help="dataset rows (default 60)")
    parser.add_argument("--pilot", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=15)
    parser.add_argument("--time-scale", type=float, default=60.0, help="the stand-ins' --sim-time-scale")
    parser.add_argument("--gap-min", type=float, default=2.0, help="seconds between faults, at least")
    parser.add_argument("--gap-max", type=float, default=10.0, help="seconds between faults, at most")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--budget-minutes", type=float, default=50.0,
                        help="start no new run after this; what was not injected is reported")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="a first run without faults, for the wall time")
    parser.add_argument("--orphan-check-s", type=int, default=15,
                        help="[scheduler] orphaned_tasks_check_interval of the cluster (Airflow's default: 300)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--root", default=str(PROJECT / ".state" / "chaos"))
    parser.add_argument("--out", default=str(PROJECT / ".state" / "chaos" / "results.json"))
    args = parser.parse_args(argv)
    chaos = Chaos(args)
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
    bad = [t for t in chaos.trials if not t.completed or t.lost or t.duplicated or t.torn or t.invariant_problems
           or t.verify_rc != 0 or t.error]
    return 1 if bad or left else 0


if __name__ == "__main__":
    sys.exit(main())
