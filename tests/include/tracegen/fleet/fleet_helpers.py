"""Helpers for the fleet tests: probe-server specs and /proc inspection."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fixtures.procs import proc_stat

from tracegen.fleet import FleetSpec

HERE = Path(__file__).resolve().parent


def live_group_members(pgid: int) -> list[int]:
    """Non-zombie processes of a process group, read straight from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st and st[1] == pgid and st[0] != "Z":
                members.append(int(entry))
    return members


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def probe_spec(tmp_path: Path, conn_id: str = "local", **over) -> FleetSpec:
    """A fleet whose launched program is fleet_probe_server (records argv, never serves)."""
    data = {
        "hosts": [{"conn_id": conn_id, "gpus": [2], "base_port": 31000}],
        "model_path": "Qwen/Qwen3-8B",
        "python": sys.executable,
        "launch_module": "fleet_probe_server",
        "work_dir": str(tmp_path / "work"),
        "env": {"PYTHONPATH": str(HERE), "PROBE_OUT": str(tmp_path / "probe.json")},
        "health_timeout_s": 2,
        "stop_timeout_s": 2,
    }
    data.update(over)
    return FleetSpec.from_dict(data)

