"""Shared set-up for the chunk-engine tests: small datasets, run configs, prepared output roots, and
the checks every fault test ends with (ledger invariants, and done == unique committed indices: docs/architecture.md).

Imported by the tests as `engine_support.helpers` (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tracegen.config import RunConfig
from tracegen.dataset.stored import load_index
from tracegen.fleet import FleetSpec
from tracegen.fleet.spec import HostSpec
from tracegen.generate.engine import ChunkEngine, ChunkJob, ChunkOptions, ChunkSummary
from tracegen.run import plan
from tracegen.run.prepare import prepare_run
from tracegen.run.run_spec import FleetRef, RunSpec
from tracegen.sglang.client import ClientConfig
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.records import FAILED
from tracegen.store.root import OutputRoot, open_root

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "chunk_driver.py"
MODEL = "sim/Qwen3-test"

# Fast retries so a fault test spends its time on faults, not on production-sized backoffs.
FAST_CLIENT = dict(backoff_base_s=0.02, backoff_max_s=0.2, probe_interval_s=0.1, probe_timeout_s=5.0,
                   connect_timeout_s=2.0)


def prompt(i: int) -> dict[str, Any]:
    return {"id": f"p{i}", "category": "code" if i % 2 else "chat",
            "messages": [{"role": "system", "content": "You are a careful coding assistant."},
                         {"role": "user", "content": f"Task {i}: explain function f{i}.\ndef f{i}(x):\n    return x * {i}\n"}]}


def write_dataset(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """A JSONL dataset of `n` prompts; `bad` replaces line i with the given raw text (malformed rows)."""
    bad = bad or {}
    with open(path, "w") as f:
        for i in range(n):
            f.write((bad[i] if i in bad else json.dumps(prompt(i))) + "\n")
    return path


def fleet() -> FleetSpec:
    # Only recorded in runs/<run_id>/run.json: the tests hand the engine their stand-ins' endpoints.
    return FleetSpec(hosts=(HostSpec("local", (0,)),), model_path=MODEL, launch_module="tracegen.simulator")


def make_config(dataset: Path, output: Path | str, **params: Any) -> RunConfig:
    base = dict(dataset_uri=str(dataset), output_uri=str(output), max_tokens=4096, chunk_size=100_000,
                pilot_size=0, part_rows=20, part_seconds=0.2, request_deadline_s=30.0, max_attempts=8)
    return RunConfig.from_params({**base, **params})


def fleet_ref(spec: FleetSpec | None = None) -> FleetRef:
    return FleetRef.of(spec or fleet(), "test-fleet")


def prepare(config: RunConfig, run_id: str) -> RunSpec:
    return prepare_run(config, run_id, fleet_ref())[0]


def root_of(config: RunConfig) -> OutputRoot:
    return open_root(config.output_uri, config.aws_conn_id)


def endpoints(*sims: Any, in_flight: int = 16) -> list[ServerEndpoint]:
    return [ServerEndpoint(s.url, max_in_flight=in_flight) for s in sims]


def engine(config: RunConfig, run_id: str, servers: Sequence[ServerEndpoint], spool_dir: Path, *,
           chunk: int = 0, root: OutputRoot | None = None, **client: Any) -> ChunkEngine:
    root = root or root_of(config)
    cc = ClientConfig(request_deadline_s=config.request_deadline_s, max_attempts=config.max_attempts,
                      **{**FAST_CLIENT, **client})
    job = ChunkJob(config=config, run_id=run_id, model=MODEL, chunk=chunk, label=f"test chunk {chunk}")
    options = ChunkOptions(spool_dir=str(spool_dir), client_config=cc, progress_interval_s=3600)
    return ChunkEngine(job, root=root, dataset=load_index(root), servers=servers, options=options)


def run_engine(config: RunConfig, run_id: str, servers: Sequence[ServerEndpoint], spool_dir: Path,
               indices: Sequence[int] | np.ndarray, **kw: Any) -> ChunkSummary:
    return engine(config, run_id, servers, spool_dir, **kw).run(np.asarray(indices, dtype=np.int64))


def direct_and_pivot(dataset: Path, tmp_path: Path, servers: Sequence[ServerEndpoint],
                     n_rows: int) -> tuple[RunConfig, RunConfig, ChunkSummary]:
    """The same prompts generated once at 8192 (root `direct`, run `run-8192`), and at 4096 then pivoted
    to 8192 (root `pivot`, runs `run-4096`, `run-pivot`). Returns both 8192 configs and the pivot's summary."""
    direct = make_config(dataset, tmp_path / "direct", max_tokens=8192)
    prepare(direct, "run-8192")
    run_engine(direct, "run-8192", servers, tmp_path / "spool", range(n_rows))
    low = make_config(dataset, tmp_path / "pivot", max_tokens=4096)
    prepare(low, "run-4096")
    run_engine(low, "run-4096", servers, tmp_path / "spool", range(n_rows))
    pivot = make_config(dataset, tmp_path / "pivot", max_tokens=8192)
    prepare(pivot, "run-pivot")
    return direct, pivot, run_engine(pivot, "run-pivot", servers, tmp_path / "spool", range(n_rows))


def committed_indices(root: OutputRoot) -> list[int]:
    """Every index in every committed part (read from the parts, not the entries)."""
    out: list[int] = []
    for key in root.commits.entries():
        out += [r.index for r in root.commits.read_part(root.commits.read_entry(key)["part"])]
    return out


def assert_healthy(root: OutputRoot, n_rows: int, config: RunConfig) -> pd.DataFrame:
    """Ledger invariants, and (docs/architecture.md) done indices == unique non-failed indices across committed parts,
    and no index committed twice (other than as a failure) under one cap. Returns the frame."""
    problems = root.repair.check_invariants()
    assert problems == [], problems
    frame = root.snapshots.frame()
    done = set(np.flatnonzero(plan.done_mask(frame, n_rows, config.max_tokens, config.truncated_policy)).tolist())
    parts: list[int] = []
    for key in root.commits.entries():
        parts += [r.index for r in root.commits.read_part(root.commits.read_entry(key)["part"]) if r.status != FAILED]
    if config.truncated_policy == "keep" or frame.empty or (frame["max_tokens"] >= config.max_tokens).all():
        assert done == set(parts), (sorted(done ^ set(parts))[:10])
    live = frame[frame["status"] != FAILED]
    dup = live.duplicated(["index", "max_tokens"], keep=False)
    assert not dup.any(), live[dup][["index", "max_tokens", "run_id", "part"]].head()
    return frame


def metric(url: str, name: str) -> float:
    """One counter from the stand-in's Prometheus /metrics (needs --enable-metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


@dataclass
class Driver:
    """A chunk run in a subprocess (engine_support/chunk_driver.py), as an Airflow worker would run it."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    ready: Path

    def wait_ready(self, timeout: float = 60) -> None:
        """Block until the driver has imported everything and is about to open the ledger."""
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited with {self.proc.returncode}: {self.err.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"driver not ready after {timeout} s")
            time.sleep(0.02)

    def wait(self, timeout: float = 120) -> tuple[int, dict[str, Any] | None, str]:
        rc = self.proc.wait(timeout)
        text = self.out.read_text()
        summary = json.loads(text.splitlines()[-1]) if text.strip() else None
        return rc, summary, self.err.read_text()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


def start_driver(config: RunConfig, run_id: str, servers: Sequence[ServerEndpoint], spool_dir: Path,
                 start: int, stop: int, log_dir: Path, *, chunk: int = 0, tag: str = "run",
                 client: dict[str, Any] | None = None, writer: str | None = None, lease_wait_s: float | None = None,
                 env: dict[str, str] | None = None) -> Driver:
    ready = log_dir / f"{tag}.ready"
    job = {"ready_file": str(ready), "config": config.to_json(), "run_id": run_id, "chunk": chunk, "start": start, "stop": stop,
           "spool_dir": str(spool_dir), "model": MODEL, "client": {**FAST_CLIENT, **(client or {})},
           "servers": [{"url": s.url, "max_in_flight": s.max_in_flight} for s in servers],
           "writer": writer, "lease_wait_s": lease_wait_s}
    out, err = log_dir / f"{tag}.out", log_dir / f"{tag}.err"
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "include"), os.environ.get("PYTHONPATH", "")])}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(job)], stdout=o, stderr=e, env=env)
    return Driver(proc, out, err, ready)


class KnownRuns:
    """Airflow's metadata as the scheduled rerun reads it (`run.rerun.AirflowRuns`), for tests without a
    scheduler: the runs it knows, their DagRun states, and each run as Airflow handed it to its tasks
    (given, or as `prepare_run` recorded it in `root`)."""

    def __init__(self, root: OutputRoot, states: dict[str, str], specs: dict[str, RunSpec] | None = None) -> None:
        from tracegen.run.run_record import read_run_record

        self.states = dict(states)
        self.specs = {run_id: read_run_record(root, run_id) for run_id in states if run_id not in (specs or {})}
        self.specs.update(specs or {})

    def state(self, run_id: str) -> str | None:
        return self.states.get(run_id)

    def spec(self, run_id: str) -> RunSpec | None:
        return self.specs.get(run_id)


def rerun_work(output_uri: str, states: dict[str, str] | None = None) -> list[Any]:
    """What the scheduled rerun finds in `output_uri` when Airflow knows every run recorded there, in
    `states` (default: each run ended, failed), as they recorded themselves."""
    from tracegen.run.rerun import unfinished_work

    root = open_root(output_uri)
    known = KnownRuns(root, states if states is not None else dict.fromkeys(root.run_files.runs(), "failed"))
    return unfinished_work(output_uri, known)
