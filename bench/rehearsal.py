"""Full-scale dress rehearsal (`make rehearsal`; figures in docs/benchmarks.md): the reference job's 913,786 prompts
through the real `tracegen_generate` DAG on the distributed deployment, following the reference job's story.

Everything is real and on loopback, as `make airflow-up` and `make chaos` run it: PostgreSQL metadata DB,
CeleryExecutor on Redis with two workers, api-server, scheduler, dag-processor, triggerer
(tests/e2e/airflow_cluster.py, which starts private PostgreSQL and Redis servers for the run); an OpenSSH
sshd as the GPU host, on which the DAG's own provision_fleet launches one SGLang stand-in per "GPU" (7). The output root is on local disk.

What is scaled, and what is not:
- **not scaled:** the row count (913,786 prompts), the pilot (1,500 rows), the chunk layout the DAG chooses
  for them (`chunk_size=0`: 511 mapped chunk tasks of up to 1,785 rows), the fleet's shape (7 servers x 32
  slots), the DAG, the ledger, the audit and the export;
- **prompts:** the bundled agentic-coding prompts in turn, numbered, each cut to `--prompt-chars` (256);
- **scaled:** output lengths, by `--length-scale` (32): the stand-ins' reference law is calibrated to truncate
  18% of rows at 4096/32 = 128 tokens instead of 4096, and the caps follow, 4096 -> 128 and 8192 -> 256, so
  a 2-core machine can hold the text (86 tokens a row in the recorded run). The cap ladder, the
  tail measurement (to 4x the cap) and the recommendation are relative to the cap, so the story is the
  reference job's scaled; the simulated GPU clock runs `--time-scale` times faster than the wall.

The story: the pilot at 128 is over the 5% threshold, the tail is measured, the gate asks; this script
answers the question as a reviewer would (through the REST API, with 256, the reference job's 8192); the same run
then extends the truncated rows from their tokens and generates the rest at 256, and completes. Halfway
through the fan-out a Celery worker is SIGKILLed (every process of it, its task processes included) and
restarted a few seconds later; the run recovers by its own task retries.

Measured in this one run: wall time against the ideal (simulated GPU work / fleet capacity, from the
stand-ins' own accounting), idle GPU slot-time by phase and orchestration overhead per chunk task, the peak
RSS of the scheduler and the workers, the metadata DB's growth, the ledger's parts and bytes, `status`
while the run goes on and `status` / `audit` / `export` over the full ledger (with their peak RSS), mapped
tasks against `max_map_length`, and every task that failed, with how it recovered.

    make rehearsal                                   # = .venv/bin/python bench/rehearsal.py
    .venv/bin/python bench/rehearsal.py --rows 20000 # a small trial (a few minutes)

Results: --out (JSON) and a Markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(PROJECT / "include"), str(PROJECT / "tests"), str(PROJECT / "bench")]
# This process reads the output root through tracegen: a throwaway Airflow home, never a developer's.
_CLIENT_HOME = Path(tempfile.mkdtemp(prefix="tracegen-rehearsal-client-"))
os.environ.update({"AIRFLOW_HOME": str(_CLIENT_HOME), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                   "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_CLIENT_HOME}/airflow.db"})

from e2e.airflow_cluster import AirflowApi, AirflowCluster, DirFactory, free_port, interrupt_on_signals  # noqa: E402
from fixtures import sshd as sshd_fixture  # noqa: E402
from occupancy_support.fleet import Sample, Sampler, running_fleet  # noqa: E402

GENERATE = "tracegen_generate"
REFERENCE_PROMPTS = 913_786
PILOT_CAP, DECIDED_CAP = 4096, 8192  # the reference job's, before scaling
REFERENCE_TRUNCATED_SHARE = 0.18  # of rows past 4096 in the reference job's pilot: the stand-ins' law, at the scaled cap
CHUNK_TASKS = ("generate_alongside_pilot", "generate_chunk", "generate_at_decided_cap")
OTHER = "Continue at the cap typed below"


def write_prompts(path: Path, n: int, chars: int) -> None:
    """`n` distinct prompts: the bundled agentic-coding prompts in turn, each's last message cut to its first
    `chars` characters and numbered (the stand-ins draw a prompt's length from its hash). Cut because every
    row stores its prompt's token ids: the reference job's ~1,400-character prompts would cost this machine more
    than the completions do."""
    import gzip

    from tracegen.config import SAMPLE_DATASET

    with gzip.open(SAMPLE_DATASET, "rt") as f:
        sample = [json.loads(line) for line in f]
    with path.open("w") as out:
        for i in range(n):
            row = sample[i % len(sample)]
            messages = [dict(m) for m in row["messages"]]
            messages[-1]["content"] = f"[{i}] " + str(messages[-1]["content"])[:chars]
            out.write(json.dumps({"id": f"rehearsal-{i:07d}", "messages": messages}) + "\n")


def epoch(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def _proc_kib(pid: int, field: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def timed(argv: list[str], env: dict[str, str], timeout: float = 1800) -> dict[str, Any]:
    """Run a command: its wall time, exit code and the tails of its output."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    out, err = proc.communicate()
    timer.cancel()
    wall = time.monotonic() - started
    return {"argv": argv[2:], "rc": proc.returncode, "wall_s": round(wall, 2), "stdout": out[-4000:],
            "stderr": err[-2000:]}


def timed_rss(argv: list[str], env: dict[str, str], timeout: float = 1800) -> dict[str, Any]:
    """`timed`, with the child's peak RSS: run under a fresh fork so RUSAGE_CHILDREN is that child's alone."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the intermediate process: runs the command, reports its rusage, exits
        os.close(read)
        result = timed(argv, env, timeout)
        result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while data := os.read(read, 1 << 16):
        chunks.append(data)
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


_KINDS = (("tracegen.simulator", "stand-ins"), ("sshd", "sshd (SSH forwarding)"),
          ("airflow supervisor", "task processes"), ("celeryd", "celery workers"), ("celery worker", "celery workers"),
          ("airflow worker", "task processes"), ("scheduler", "scheduler"), ("api_server", "api-server"),
          ("api-server", "api-server"), ("dag-processor", "dag-processor"), ("dag_processor", "dag-processor"),
          ("triggerer", "triggerer"), ("postgres", "postgresql"), ("redis", "redis"), ("rehearsal.py", "this script"),
          ("tracegen status", "status/audit/export"), ("-m tracegen", "status/audit/export"))


def _kind(cmd: str, stat: str) -> str:
    for needle, kind in _KINDS:
        if needle in cmd:
            return kind
    return "other: " + stat[stat.index("(") + 1 : stat.rindex(")")]


class Rehearsal:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(args.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stack = contextlib.ExitStack()
        self.result: dict[str, Any] = {"args": vars(args)}
        self.events: list[dict[str, Any]] = []
        self.rss: dict[str, dict[str, int]] = {}  # component -> peak of the summed RSS, peak single process
        self.status_samples: list[dict[str, Any]] = []
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds so far)
        self.env = {**os.environ, "PYTHONPATH": str(PROJECT / "include")}
        self.pilot_cap = PILOT_CAP // args.length_scale
        self.decided_cap = DECIDED_CAP // args.length_scale

    def event(self, what: str, **detail: Any) -> None:
        t = time.time() - self.t0 if hasattr(self, "t0") else 0.0
        self.events.append({"t": round(t, 1), "what": what, **detail})
        print(f"  +{t:7.1f}s {what} {json.dumps(detail) if detail else ''}", flush=True)

    # ---- set-up ----------------------------------------------------------------------------------------

    def start(self) -> None:
        args = self.args
        factory = DirFactory(self.root)
        self.sshd = self.stack.enter_context(contextlib.contextmanager(sshd_fixture.sshd.__wrapped__)(factory))
        started = time.monotonic()
        self.dataset = self.root / "prompts.jsonl"
        write_prompts(self.dataset, args.rows, args.prompt_chars)
        self.result["dataset"] = {"rows": args.rows, "bytes": self.dataset.stat().st_size,
                                  "written_s": round(time.monotonic() - started, 1)}
        self.output = self.root / "output"
        self.fleet_work = self.root / "gpu-host"
        self.base_port = free_port(args.gpus)
        fleet = {
            "hosts": [{"conn_id": self.sshd.conn_id, "gpus": list(range(args.gpus)), "base_port": self.base_port}],
            "model_path": "Qwen/Qwen3.6-27B", "served_model_name": "qwen3.6-27b",
            "python": sys.executable, "launch_module": "tracegen.simulator",
            "sglang_flags": {"--reasoning-parser": "qwen3", "--max-running-requests": args.slots,
                             "--context-length": 40960, "--enable-metrics": True,
                             "--sim-time-scale": args.time_scale, "--sim-truncated-at": self.pilot_cap,
                             "--sim-truncated-share": REFERENCE_TRUNCATED_SHARE,
                             "--sim-seed": args.seed, "--log-level": "warning"},
            "work_dir": str(self.fleet_work), "health_timeout_s": 120, "stop_timeout_s": 10,
        }
        self.fleet_path = self.root / "fleet.json"
        self.fleet_path.write_text(json.dumps(fleet, indent=1))
        ssh_var = f"AIRFLOW_CONN_{self.sshd.conn_id.upper()}"
        self.cluster = AirflowCluster(self.root / "cluster", workers=args.workers,
                                      worker_concurrency=args.worker_concurrency, extra_env={
            ssh_var: os.environ[ssh_var], "TRACEGEN_FLEET": str(self.fleet_path),
            "TRACEGEN_WRITE_PREFIXES": str(self.root),  # its dataset and root (tracegen.common.locations)
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "60",
        })  # fmt: skip
        self.stack.callback(self.cluster.stop)
        self.stack.callback(self._teardown_fleet)
        self.cluster.start(wait_s=300)
        self.api = self.cluster.api()
        self.api.wait_for_dag(GENERATE, timeout=300)
        self.api.unpause(GENERATE)
        self.api.set_variable("tracegen_output_roots", json.dumps([str(self.output)]))

    def _teardown_fleet(self) -> None:
        for pid_file in self.fleet_work.glob("*.pid"):
            values = dict(line.split("=", 1) for line in pid_file.read_text().splitlines() if "=" in line)
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(int(values["pgid"]), signal.SIGKILL)

    def close(self) -> None:
        self.stack.close()

    # ---- watching ------------------------------------------------------------------------------------

    def _fresh_api(self) -> AirflowApi:
        for _ in range(30):
            with contextlib.suppress(Exception):
                self.api = self.cluster.api()
                return self.api
            time.sleep(2)
        return self.api

    def _tis(self) -> list[dict[str, Any]]:
        for _ in range(5):
            try:
                return self.api.task_instances(GENERATE, self.run_id)
            except Exception:  # noqa: BLE001 - a busy api-server, or an expired token
                time.sleep(2)
                self._fresh_api()
        return []

    def _sample_rss(self) -> None:
        for name, component in self.cluster.components.items():
            group = "worker" if name.startswith("worker-") else name
            pids = component.session_pids()
            total = sum(_proc_kib(p, "VmRSS") for p in pids)
            single = max((_proc_kib(p, "VmHWM") for p in pids), default=0)
            peak = self.rss.setdefault(group, {"sum_kib": 0, "process_kib": 0})
            peak["sum_kib"] = max(peak["sum_kib"], total)
            peak["process_kib"] = max(peak["process_kib"], single)

    def _sample_cpu(self) -> None:
        """CPU seconds of every process on the machine so far, by what it is (the last reading per pid):
        where the two cores went."""
        tick = os.sysconf("SC_CLK_TCK")
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (proc / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
                if cpu < 0.05:
                    continue
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                self.cpu[int(proc.name)] = (_kind(cmd, stat), cpu)

    def _db_bytes(self) -> int:
        sql = f"SELECT pg_database_size('{self.cluster.database}')"
        pg = self.cluster.services  # the cluster's own private PostgreSQL (or the one TRACEGEN_PG_PORT names)
        out = subprocess.run(["psql", "-h", pg.pg_host, "-p", str(pg.pg_port), "-U", pg.pg_user, "-d", "postgres",
                              "-tAc", sql],
                             capture_output=True, text=True, check=False,
                             env={**os.environ, **({"PGPASSWORD": pg.pg_password} if pg.pg_password else {})})
        return int(out.stdout.strip() or 0)

    def _status(self) -> dict[str, Any]:
        result = timed([sys.executable, "-m", "tracegen", "status", str(self.output), "--json"], self.env)
        with contextlib.suppress(ValueError):
            body = json.loads(result["stdout"])
            result["done"], result["left"] = body.get("done"), body.get("left")
        result.pop("stdout", None)
        return result

    def _hitl(self) -> str:
        import urllib.parse

        return (f"/dags/{GENERATE}/dagRuns/{urllib.parse.quote(self.run_id, safe='')}/taskInstances/review_cap/"
                "-1/hitlDetails")

    def _answer(self, tis: list[dict[str, Any]]) -> None:
        review = [t for t in tis if t["task_id"] == "review_cap" and t["map_index"] == -1]
        if not review or review[0]["state"] != "awaiting_input":
            return
        detail = self.api._call("GET", self._hitl())
        if detail["response_received"]:
            return
        recommended = detail["options"][0]
        self.event("question asked", subject=detail["subject"], recommended=recommended)
        self.result["question"] = {"subject": detail["subject"], "options": detail["options"],
                                   "body": detail["body"], "asked_t": time.time() - self.t0}
        chosen = int(recommended.split()[2].replace(",", "")) if recommended.endswith("(recommended)") else None
        option, cap = (recommended, None) if chosen == self.decided_cap else (OTHER, self.decided_cap)
        self.api._call("PATCH", self._hitl(), json={"chosen_options": [option], "params_input": {"cap": cap}})
        self.result["question"].update(answered_t=time.time() - self.t0, option=option, cap=self.decided_cap)
        self.event("answered", option=option, cap=self.decided_cap)
        self.answered = True

    def _kill_worker(self, tis: list[dict[str, Any]]) -> None:
        """SIGKILL the worker running the most chunk tasks, once half of the decided cap's chunks are done."""
        chunks = [t for t in tis if t["task_id"] == "generate_at_decided_cap" and t["map_index"] >= 0]
        if not chunks or sum(t["state"] == "success" for t in chunks) < self.args.kill_at * len(chunks):
            return
        names = [n for n in self.cluster.worker_names if self.cluster.components[n].alive]
        running = {n: self.cluster.components[n].running_tasks() for n in names}
        name = max(names, key=lambda n: len(running[n]))
        if not running[name]:
            return  # between tasks: try at the next poll
        self.cluster.components[name].kill()
        self.killed = True
        pause = self.rng.uniform(2, 5)
        self.event("worker SIGKILL", worker=name, running=sorted(running[name]), restart_after_s=round(pause, 1))
        self.result["kill"] = {"worker": name, "tasks": sorted(running[name]), "t": time.time() - self.t0,
                               "restart_after_s": pause}
        time.sleep(pause)
        self.cluster.restart(name)
        self.event("worker restarted", worker=name)

    # ---- the run -----------------------------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        self.result["db_bytes_before"] = self._db_bytes()
        conf = {"dataset_uri": str(self.dataset), "output_uri": str(self.output), "fleet": str(self.fleet_path),
                "max_tokens": self.pilot_cap, "pilot_size": args.pilot, "chunk_size": 0, "gate_mode": "ask",
                "measure_tail": "auto", "teardown": False}
        self.t0 = time.time()
        self.run_id = self.api.trigger(GENERATE, conf)
        self.event("triggered", run_id=self.run_id, conf=conf)
        self.answered = self.killed = False
        sampler: Sampler | None = None
        last_status = next_tis = 0.0
        deadline = time.monotonic() + args.timeout
        state = "running"
        while True:
            time.sleep(args.poll_s)
            self._sample_rss()
            self._sample_cpu()
            try:
                state = self.api.run(GENERATE, self.run_id)["state"]
            except Exception:  # noqa: BLE001
                self._fresh_api()
                continue
            if state in ("success", "failed") or time.monotonic() > deadline:
                break
            if time.monotonic() < next_tis:
                continue
            # A reference-job-sized run lists ~1,000 task instances in 10 pages: every 20 s once the question is answered.
            next_tis = time.monotonic() + (args.poll_s if not self.answered or sampler is None else 20.0)
            tis = self._tis()
            if sampler is None and any(t["task_id"] == "provision_fleet" and t["state"] == "success" for t in tis):
                servers = self.api.xcom(GENERATE, self.run_id, "provision_fleet")
                # The SSH host is this machine and the servers bind loopback: read them directly, not through
                # a tunnel whose CPU would be charged to the run.
                self.fleet = running_fleet([f"http://127.0.0.1:{self.base_port + g}" for g in range(args.gpus)])
                sampler = Sampler(self.fleet.urls, interval_s=1.0)
                sampler.start()
                self.event("fleet up", servers=len(servers))
            if not self.answered:
                self._answer(tis)
            elif not self.killed and args.kill_at > 0:
                self._kill_worker(tis)
            if time.time() - last_status > args.status_every_s and self.output.exists():
                last_status = time.time()
                sample = self._status()
                sample["t"] = round(time.time() - self.t0, 1)
                self.status_samples.append(sample)
        self.result["state"] = "timeout" if state not in ("success", "failed") else state
        run = self.api.run(GENERATE, self.run_id)
        self.result["run_wall_s"] = (epoch(run["end_date"]) or time.time()) - self.t0
        self.samples: list[Sample] = sampler.stop() if sampler else []
        ended = epoch(run["end_date"]) or time.time()
        self.samples = [s for s in self.samples if s.t <= ended]
        self.event(f"run {self.result['state']}", wall_s=round(self.result["run_wall_s"], 1))
        self.result["db_bytes_after"] = self._db_bytes()
        self.tis = self._tis()

    # ---- after the run -----------------------------------------------------------------------------------

    def measure(self) -> None:
        tis = self.tis
        r = self.result
        r["rss_mib"] = {k: {"sum": round(v["sum_kib"] / 1024, 1), "process": round(v["process_kib"] / 1024, 1)}
                        for k, v in self.rss.items()}
        r["status_during_run"] = self.status_samples
        cpu: dict[str, float] = {}
        for kind, seconds in self.cpu.values():
            cpu[kind] = cpu.get(kind, 0.0) + seconds
        r["cpu_s"] = dict(sorted(((k, round(v, 1)) for k, v in cpu.items() if v >= 1), key=lambda kv: -kv[1]))
        by_task: dict[str, list[dict[str, Any]]] = {}
        for t in tis:
            by_task.setdefault(t["task_id"], []).append(t)
        r["tasks"] = {k: {"n": len(v), "states": sorted({t["state"] or "none" for t in v}),
                          "retried": sum(t["try_number"] > 1 for t in v)} for k, v in by_task.items()}
        mapped = [t for t in tis if t["map_index"] >= 0]
        r["mapped"] = {k: sum(1 for t in mapped if t["task_id"] == k) for k in {t["task_id"] for t in mapped}}
        cfg = self.cluster.airflow("config", "get-value", "core", "max_map_length")
        r["max_map_length"] = int(cfg.stdout.strip() or 0)
        r["failures"] = [{"task": t["task_id"], "map_index": t["map_index"], "try_number": t["try_number"],
                          "state": t["state"]} for t in tis if t["try_number"] > 1 or t["state"] == "failed"]
        r["failure_reasons"] = self._failure_reasons(r["failures"])
        self._occupancy(tis)
        self._chunk_overhead(by_task)
        r["chunk_phases"] = chunk_phases(self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={self.run_id}")
        parts = [p for p in (self.output / "parts").rglob("*") if p.is_file()] if (self.output / "parts").exists() else []
        ledger = [p for p in (self.output / "ledger").rglob("*") if p.is_file()] if (self.output / "ledger").exists() else []
        r["ledger"] = {"parts": len(parts), "part_bytes": sum(p.stat().st_size for p in parts),
                       "entries": len(ledger), "entry_bytes": sum(p.stat().st_size for p in ledger),
                       "root_bytes": sum(p.stat().st_size for p in self.output.rglob("*") if p.is_file())}
        cli = [sys.executable, "-m", "tracegen"]
        r["status_full"] = timed_rss(cli + ["status", str(self.output), "--json"], self.env)
        with contextlib.suppress(ValueError):
            r["final_status"] = json.loads(r["status_full"]["stdout"])
        r["status_full"].pop("stdout", None)
        r["audit_full"] = timed_rss(cli + ["audit", str(self.output), "--name", "rehearsal-audit"], self.env)
        export = self.root / "export"
        r["export_full"] = timed_rss(cli + ["export", str(self.output), str(export), "--overwrite"], self.env)
        with contextlib.suppress(OSError, ValueError):
            manifest = json.loads((export / "manifest.json").read_text())
            r["export_manifest"] = {k: manifest.get(k) for k in ("rows", "dataset_rows", "finish_reasons",
                                                                  "extended_rows", "left_out", "max_tokens")}
            r["export_manifest"]["shards"] = len(manifest.get("shards", []))
        r["verify"] = timed(cli + ["verify", str(self.output), "--quick"], self.env)

    def _failure_reasons(self, failures: list[dict[str, Any]]) -> list[str]:
        """The last error line of each failed try's log, as the task logged it."""
        logs = self.cluster.home / "logs" / f"dag_id={GENERATE}" / f"run_id={self.run_id}"
        reasons = []
        for f in failures:
            sub = f"task_id={f['task']}" + (f"/map_index={f['map_index']}" if f["map_index"] >= 0 else "")
            for attempt in sorted((logs / sub).glob("attempt=*.log")) if (logs / sub).exists() else []:
                text = attempt.read_text(errors="replace")
                errors = [line for line in text.splitlines() if '"level":"error"' in line or "ERROR" in line]
                reasons.append(f"{sub} {attempt.name}: {errors[-1][:400] if errors else 'no error logged'}")
        return reasons

    def _occupancy(self, tis: list[dict[str, Any]]) -> None:
        r, samples = self.result, self.samples
        if len(samples) < 2:
            return
        cap = self.fleet.capacity_tokens_per_wall_s()

        def window(a: float, b: float) -> dict[str, float]:
            inside = [s for s in samples if a <= s.t <= b]
            if len(inside) < 2:
                return {}
            first, last = inside[0], inside[-1]
            busy, avail = last.busy - first.busy, last.available - first.available
            tokens = last.tokens - first.tokens
            return {"wall_s": round(last.t - first.t, 1), "busy_slot_s": round(busy), "available_slot_s": round(avail),
                    "occupancy": round(busy / avail, 4) if avail else 0.0, "tokens": int(tokens),
                    "ideal_s": round(tokens / cap, 1)}

        q = r.get("question", {})
        asked, answered = self.t0 + q.get("asked_t", 0), self.t0 + q.get("answered_t", 0)
        chunk_tis = [t for t in tis if t["task_id"] == "generate_at_decided_cap" and t["start_date"]]
        last_start = max((epoch(t["start_date"]) for t in chunk_tis), default=samples[-1].t)
        last_end = max((epoch(t["end_date"]) or 0 for t in chunk_tis), default=samples[-1].t)
        first, last = samples[0], samples[-1]
        whole = window(first.t, last.t)
        r["occupancy"] = {
            "capacity_tokens_per_wall_s": round(cap, 1),
            "fleet_up_t": round(first.t - self.t0, 1),
            "whole": whole,
            "before_question": window(first.t, asked),
            "question_open": window(asked, answered),
            "fan_out": window(answered, last_start),
            "end_tail": window(last_start, last_end),
            "after_generation": window(last_end, last.t),
        }
        total_ideal = whole.get("ideal_s", 0.0)
        r["wall_vs_ideal"] = {"run_wall_s": round(r["run_wall_s"], 1), "ideal_s": total_ideal,
                              "ratio": round(r["run_wall_s"] / total_ideal, 3) if total_ideal else None,
                              "simulated_gpu_hours": round(whole.get("busy_slot_s", 0) / self.args.slots / 3600, 2)}

    def _chunk_overhead(self, by_task: dict[str, list[dict[str, Any]]]) -> None:
        """Per chunk task at the decided cap: queued -> started, started -> ended, and the hand-off: how long
        a slot under max_active_tis_per_dagrun stood empty between one chunk's end and the next one's start
        while chunks were still to start."""
        chunks = sorted((t for t in by_task.get("generate_at_decided_cap", []) if t["start_date"] and t["end_date"]),
                        key=lambda t: epoch(t["start_date"]))
        if not chunks:
            return
        starts = [epoch(t["start_date"]) for t in chunks]
        ends = sorted(epoch(t["end_date"]) for t in chunks)
        queued = [epoch(t["start_date"]) - (epoch(t["queued_when"]) or epoch(t["start_date"])) for t in chunks]
        durations = [epoch(t["end_date"]) - epoch(t["start_date"]) for t in chunks]
        limit = max(1, self._concurrency(chunks))
        handoffs = [starts[i] - ends[i - limit] for i in range(limit, len(starts)) if i - limit < len(ends)]
        handoffs = [h for h in handoffs if h >= 0]
        idle_fanout = self.result.get("occupancy", {}).get("fan_out", {})
        busy_total = self.result.get("occupancy", {}).get("whole", {}).get("busy_slot_s", 0)
        idle = idle_fanout.get("available_slot_s", 0) - idle_fanout.get("busy_slot_s", 0)
        self.result["chunks"] = {
            "n": len(chunks), "concurrency": limit,
            "duration_s": {"median": round(statistics.median(durations), 1), "max": round(max(durations), 1)},
            "queued_to_start_s": {"median": round(statistics.median(queued), 2), "max": round(max(queued), 2)},
            "slot_handoff_s": {"median": round(statistics.median(handoffs), 2) if handoffs else None,
                               "max": round(max(handoffs), 2) if handoffs else None},
            "fan_out_idle_slot_s": round(idle),
            "fan_out_idle_per_chunk_slot_s": round(idle / len(chunks), 1),
            "orchestration_overhead_share": round(idle / busy_total, 5) if busy_total else None,
        }

    def _concurrency(self, chunks: list[dict[str, Any]]) -> int:
        """The most chunk tasks that ran at once (max_active_tis_per_dagrun, as it played out)."""
        events = sorted([(epoch(t["start_date"]), 1) for t in chunks] + [(epoch(t["end_date"]), -1) for t in chunks])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        return peak


def chunk_phases(logs: Path) -> dict[str, Any]:
    """From each decided-cap chunk task's first attempt's log: seconds from the task's start to its first
    request ("N to generate"), generating, and from its last commit to the end of the task; by chunk
    order, so a start-up that grows with the run shows (each chunk start reads the ledger)."""
    rows = []
    for path in logs.glob("task_id=generate_at_decided_cap/map_index=*/attempt=1.log"):
        marks: dict[str, float] = {}
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                doc = json.loads(line)
                event, at = str(doc["event"]), datetime.fromisoformat(doc["timestamp"].replace("Z", "+00:00"))
                for mark, needle in (("start", "Pre Execute"), ("generating", " to generate"),
                                     ("generated", "Done. Returned"), ("end", "Post Execute")):
                    if needle in event and mark not in marks:
                        marks[mark] = at.timestamp()
        if {"start", "generating", "generated"} <= marks.keys():
            rows.append((int(path.parent.name.split("=")[1]), marks))
    rows.sort()
    if not rows:
        return {}

    def stats(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 1), "max": round(max(values), 1)}

    tenth = max(1, len(rows) // 10)
    startup = [m["generating"] - m["start"] for _, m in rows]
    return {
        "n": len(rows),
        "startup_s": stats(startup),
        "startup_first_tenth_s": stats(startup[:tenth]),
        "startup_last_tenth_s": stats(startup[-tenth:]),
        "generating_s": stats([m["generated"] - m["generating"] for _, m in rows]),
        "wind_down_s": stats([m.get("end", m["generated"]) - m["generated"] for _, m in rows]),
    }


def summary(r: dict[str, Any]) -> str:
    occ = r.get("occupancy", {})
    ch = r.get("chunks", {})
    lines = [
        f"run: {r.get('state')} in {r.get('run_wall_s', 0):.0f} s wall; rows {r.get('final_status', {}).get('done')}"
        f" of {r['args']['rows']:,}, left {r.get('final_status', {}).get('left')}",
        f"wall vs ideal: {json.dumps(r.get('wall_vs_ideal'))}",
        "| phase | wall s | occupancy | tokens | ideal s |",
        "|---|---|---|---|---|",
    ]
    for phase in ("whole", "before_question", "question_open", "fan_out", "end_tail", "after_generation"):
        w = occ.get(phase) or {}
        lines.append(f"| {phase} | {w.get('wall_s', '-')} | {w.get('occupancy', '-')} | {w.get('tokens', '-')} |"
                     f" {w.get('ideal_s', '-')} |")
    lines += [
        f"chunk tasks: {json.dumps(ch)}",
        f"chunk task phases (from their logs): {json.dumps(r.get('chunk_phases'))}",
        f"peak RSS (MiB; sum of a component's processes / largest single process): {json.dumps(r.get('rss_mib'))}",
        f"CPU seconds during the run, by process kind: {json.dumps(r.get('cpu_s'))}",
        f"metadata DB: {r.get('db_bytes_before', 0) / 2**20:.1f} -> {r.get('db_bytes_after', 0) / 2**20:.1f} MiB",
        f"ledger: {json.dumps(r.get('ledger'))}",
        "status during the run (s): " + " ".join(f"{s['wall_s']}" for s in r.get("status_during_run", [])),
        *(f"{k}: rc {r[k]['rc']}, {r[k]['wall_s']} s, peak RSS {r[k].get('peak_rss_mib')} MiB"
          for k in ("status_full", "audit_full", "export_full") if k in r),
        f"export manifest: {json.dumps(r.get('export_manifest'))}",
        f"verify --quick: rc {r.get('verify', {}).get('rc')}",
        f"mapped task instances: {json.dumps(r.get('mapped'))}; max_map_length {r.get('max_map_length')}",
        f"tasks: {json.dumps(r.get('tasks'))}",
        f"worker kill: {json.dumps(r.get('kill'))}",
        f"failures: {json.dumps(r.get('failures'))}",
        *(f"  {reason}" for reason in r.get("failure_reasons", [])),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=REFERENCE_PROMPTS, help=f"prompts (default {REFERENCE_PROMPTS:,}, the reference job's)")
    parser.add_argument("--gpus", type=int, default=7, help="stand-in servers on the SSH host (default 7)")
    parser.add_argument("--slots", type=int, default=32, help="--max-running-requests of each (default 32)")
    parser.add_argument("--length-scale", type=int, default=32, help="output lengths and caps divided by this")
    parser.add_argument("--time-scale", type=float, default=2.5, help="the stand-ins' --sim-time-scale")
    parser.add_argument("--prompt-chars", type=int, default=256, help="each prompt's last message cut to this")
    parser.add_argument("--pilot", type=int, default=1500, help="pilot_size (default 1500, the DAG's)")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers")
    parser.add_argument("--worker-concurrency", type=int, default=3, help="Celery slots per worker")
    parser.add_argument("--kill-at", type=float, default=0.5,
                        help="SIGKILL a worker once this share of the decided cap's chunks is done (0: never)")
    parser.add_argument("--poll-s", type=float, default=5.0)
    parser.add_argument("--status-every-s", type=float, default=120.0, help="`tracegen status` during the run")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0, help="wall seconds the run may take")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--root", default=str(PROJECT / ".state" / "rehearsal"))
    parser.add_argument("--out", default=str(PROJECT / ".state" / "rehearsal" / "results.json"))
    args = parser.parse_args(argv)
    if args.root and Path(args.root).exists():
        import shutil

        shutil.rmtree(args.root)
    rehearsal = Rehearsal(args)
    began = time.monotonic()
    interrupt_on_signals()
    try:
        rehearsal.start()
        print(f"set-up in {time.monotonic() - began:.0f} s ({args.rows:,} prompts, {args.gpus} stand-ins over SSH)",
              flush=True)
        rehearsal.run()
        rehearsal.measure()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        rehearsal.result["events"] = rehearsal.events
        rehearsal.result["total_wall_s"] = round(time.monotonic() - began, 1)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rehearsal.result, indent=1, default=str))
        rehearsal.close()
    print("\n" + summary(rehearsal.result))
    print(f"\ntotal wall time: {(time.monotonic() - began) / 60:.1f} min; results: {args.out}")
    r = rehearsal.result
    ok = r.get("state") == "success" and r.get("final_status", {}).get("left") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
