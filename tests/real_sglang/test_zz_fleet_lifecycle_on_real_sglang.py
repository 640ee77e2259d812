"""The fleet's lifecycle with real SGLang: the server fixtures.real_sglang launched (the fleet's own argv, over SSH
to the tests' sshd) is healthy, a second provision reuses it, and teardown stops its whole process group.

Named to run last of tests/real_sglang (pytest takes a folder's modules in name order): it stops the server the
other modules share.
"""

from __future__ import annotations

import os

import httpx
import pytest
from fixtures.procs import proc_stat
from fixtures.real_sglang import SERVED_MODEL, group_cpu_seconds

from tracegen.fleet import FleetConnection, provision, status, teardown

pytestmark = pytest.mark.real_sglang


def group_members(pgid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (st := proc_stat(int(e))) and st[1] == pgid
            and st[0] != "Z"]  # fmt: skip


def test_the_server_is_real_sglang_healthy_reused_then_stopped_by_process_group(real_sglang):
    spec = real_sglang.spec
    # It is SGLang itself, on the CPU engine, launched from the fleet's argv with the fleet's env.
    with open(f"/proc/{real_sglang.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert argv[1:3] == [b"-m", b"sglang.launch_server"] and b"--device" in argv
    info = httpx.get(f"{real_sglang.url}/server_info", timeout=30).json()
    assert info["device"] == "cpu" and info["served_model_name"] == SERVED_MODEL and "sim_occupancy" not in info
    assert "Uvicorn running" in real_sglang.log()
    # SGLang's scheduler and detokenizer are processes of the server's group: a stop must reach them too.
    members = group_members(real_sglang.pgid)
    assert len(members) >= 3, members

    with FleetConnection(spec) as fleet:
        (now,) = status(spec, fleet)
        assert now.state == "running" and now.config_matches and now.healthy
        (again,) = provision(spec, fleet)
        assert again.reused and again.pid == real_sglang.pid
        cpu = group_cpu_seconds(real_sglang.pgid)
        print(f"\nreal SGLang: healthy {real_sglang.started_in_s:.0f} s after launch, {cpu:.0f} CPU-s so far")
        (stopped,) = teardown(spec, fleet)
    assert stopped.result in ("stopped", "killed") and stopped.pid == real_sglang.pid
    assert group_members(real_sglang.pgid) == []
