"""The benchmark's simulated fleet: SGLang stand-ins as subprocesses, and a sampler of their accounting.

Occupancy comes from the stand-ins' own counters (`tracegen_sim:busy_slot_seconds_total` and
`tracegen_sim:available_slot_seconds_total`, simulated seconds), sampled a few times a second, so idle
slot-time can be attributed to whatever the orchestrator was doing at that moment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from fixtures.ports import free_port  # noqa: E402  (re-exported for the benches that start stand-ins)

MODEL = "qwen3.6-27b-sim"


def parse_metrics(text: str) -> dict[str, float]:
    from tracegen.sglang.autotune import parse_metrics as parse

    return parse(text)


@dataclass
class Fleet:
    """Running stand-ins: urls, processes, and the step model they were started with."""

    urls: list[str]
    procs: list[subprocess.Popen]
    max_running: int
    time_scale: float
    step_base_s: float = 0.015
    step_per_req_s: float = 0.00015
    accept_length: float = 3.0

    @property
    def slots(self) -> int:
        return self.max_running * len(self.urls)

    def capacity_tokens_per_wall_s(self) -> float:
        """Fleet decode throughput with every slot busy: the denominator of the ideal wall time."""
        step = self.step_base_s + self.step_per_req_s * self.max_running
        return len(self.urls) * self.max_running * self.accept_length / step * self.time_scale

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(10)


def start_fleet(n: int, max_running: int, time_scale: float, seed: int = 0) -> Fleet:
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    for _ in range(n):
        port = free_port()
        argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", "Qwen/Qwen3.6-27B",
                "--served-model-name", MODEL, "--port", str(port), "--max-running-requests", str(max_running),
                "--speculative-algorithm", "NEXTN", "--reasoning-parser", "qwen3", "--context-length", "40960",
                "--enable-metrics", "--sim-time-scale", str(time_scale), "--sim-seed", str(seed),
                "--sim-warmup-s", "0.05", "--log-level", "warning"]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    wait_healthy(procs, urls)
    return Fleet(urls, procs, max_running, time_scale)


def wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout_s: float = 60.0) -> None:
    """Until every stand-in answers /health; exits naming the one that died or never answered."""
    deadline = time.monotonic() + timeout_s
    for proc, url in zip(procs, urls, strict=True):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"stand-in {url} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"stand-in {url} not healthy after {timeout_s:g} s")
            time.sleep(0.05)


def running_fleet(urls: list[str]) -> Fleet:
    """A `Fleet` for stand-ins launched by someone else (e.g. tracegen's own fleet provisioning).

    Slots, time scale and step model come from each server's /server_info, so the ideal wall time is
    computed with the same step model the servers run; `stop()` is a no-op (no processes of ours).
    """
    infos = [httpx.get(url + "/server_info", timeout=10).json() for url in urls]
    keys = ("sim_time_scale", "sim_step_base_ms", "sim_step_per_req_ms")
    # The batch each server runs, as SGLang reports it (`max_running_requests` is null without the flag).
    models = {(info["internal_states"][0]["effective_max_running_requests_per_dp"], *(info[k] for k in keys),
               info["internal_states"][0]["avg_spec_accept_length"]) for info in infos}  # fmt: skip
    if len(models) != 1:
        raise SystemExit(f"stand-ins run different step models: {sorted(models)}")
    max_running, time_scale, base_ms, per_req_ms, accept = models.pop()
    return Fleet(urls, [], int(max_running), float(time_scale), base_ms / 1000.0, per_req_ms / 1000.0,
                 float(accept or 1.0))  # fmt: skip


@dataclass
class Sample:
    t: float  # wall time.time()
    busy: float  # summed over servers, simulated slot-seconds
    available: float
    tokens: float
    running: int
    queued: int


@dataclass
class Sampler:
    """Polls every server's /metrics every `interval_s` on a thread; `samples` is the time series."""

    urls: list[str]
    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client = httpx.Client(timeout=5)

    def read(self) -> Sample:
        busy = avail = tokens = 0.0
        running = queued = 0
        for url in self.urls:
            m = parse_metrics(self._client.get(url + "/metrics").text)
            busy += m["tracegen_sim:busy_slot_seconds_total"]
            avail += m["tracegen_sim:available_slot_seconds_total"]
            tokens += m["tracegen_sim:generated_tokens_total"]
            running += int(m["sglang:num_running_reqs"])
            queued += int(m["sglang:num_queue_reqs"])
        return Sample(time.time(), busy, avail, tokens, running, queued)

    def start(self) -> None:
        self.samples.append(self.read())
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.read())
        return self.samples

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.read())
