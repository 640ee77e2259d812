"""Provision / reuse / restart / status / teardown of SGLang stand-ins, over real SSH and locally."""

import json
import os
import stat
import sys
from pathlib import Path

import httpx
import pytest
from fixtures.ports import free_port
from fixtures.procs import is_alive
from fleet_helpers import live_group_members

from tracegen.fleet import FleetConnection, FleetError, FleetSpec, provision, status, teardown
from tracegen.fleet.server import model_matches


def sim_spec(tmp_path, conn_id: str, gpus=(0, 1), **over) -> FleetSpec:
    data = {
        "hosts": [{"conn_id": conn_id, "gpus": list(gpus), "base_port": free_port(max(gpus) + 1)}],
        "model_path": "Qwen/Qwen3-8B",
        "served_model_name": "qwen3-8b",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {
            "--speculative-algorithm": "EAGLE3",
            "--speculative-num-steps": 3,
            "--sim-warmup-s": 0.3,  # /health answers 503 first: the wait has to poll through it
            "--sim-drain-timeout-s": 2,
        },
        "work_dir": str(tmp_path / "fleet"),
        "health_timeout_s": 60,
        "stop_timeout_s": 5,
    }
    data.update(over)
    return FleetSpec.from_dict(data)


def test_provision_reuse_restart_status_teardown_over_ssh(sshd, tmp_path, stray_groups):
    spec = sim_spec(tmp_path, sshd.conn_id)
    with FleetConnection(spec) as fleet:
        try:
            first = provision(spec, fleet)
            stray_groups.extend(h.pgid for h in first)
            assert [(h.gpu, h.reused) for h in first] == [(0, False), (1, False)]
            assert len({h.pid for h in first}) == 2
            for handle in first:
                # Loopback bind: the client URL is a local SSH tunnel, not the remote port.
                assert handle.url.startswith("http://127.0.0.1:") and not handle.url.endswith(
                    f":{handle.port}"
                )
                info = httpx.get(f"{handle.url}/server_info", timeout=10).json()
                assert info["port"] == handle.port and info["speculative_algorithm"] == "EAGLE3"
                assert info["served_model_name"] == "qwen3-8b"

            # Same model and flags: reused, not restarted.
            second = provision(spec, fleet)
            assert [(h.pid, h.reused) for h in second] == [(h.pid, True) for h in first]

            # A flag change restarts every server; the old process groups are gone.
            changed = FleetSpec.from_dict(
                {**spec.to_dict(), "sglang_flags": {**spec.sglang_flags, "--max-running-requests": 64}}
            )
            with FleetConnection(changed) as fleet2:
                before = status(changed, fleet2)
                assert [(s.state, s.config_matches, s.healthy) for s in before] == [
                    ("running", False, True)
                ] * 2
                third = provision(changed, fleet2)
                stray_groups.extend(h.pgid for h in third)
                assert all(not h.reused for h in third)
                assert not {h.pid for h in third} & {h.pid for h in first}
                for handle in first:
                    assert live_group_members(handle.pgid) == [] and not is_alive(handle.pid)
                for handle in third:
                    info = httpx.get(f"{handle.url}/server_info", timeout=10).json()
                    assert info["max_running_requests"] == 64
                after = status(changed, fleet2)
                assert [(s.state, s.config_matches, s.healthy) for s in after] == [
                    ("running", True, True)
                ] * 2
        finally:
            results = teardown(spec, fleet)
    assert {r.result for r in results} <= {"stopped", "killed"}
    for pgid in stray_groups:
        assert live_group_members(pgid) == []
    assert [s.state for s in status(spec)] == ["absent", "absent"]


def test_local_fleet_with_api_key_keeps_the_key_out_of_argv(tmp_path, monkeypatch, stray_groups):
    key = "k-123-not-for-ps"
    monkeypatch.setenv("AIRFLOW_CONN_FLEET_TEST_KEY", json.dumps({"conn_type": "generic", "password": key}))
    spec = sim_spec(tmp_path, "local", gpus=(4,), api_key_conn_id="fleet_test_key")
    with FleetConnection(spec) as fleet:
        try:
            [handle] = provision(spec, fleet)
            stray_groups.append(handle.pgid)
            assert handle.url == f"http://127.0.0.1:{handle.port}"
            # Every local user can read /proc/PID/cmdline (what `ps` shows): the key is not there.
            for pid in live_group_members(handle.pgid):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert not any(key.encode() in arg for arg in cmdline), cmdline
            assert b"--config" in Path(f"/proc/{handle.pid}/cmdline").read_bytes()
            # It is in a file only the server's user can read.
            config = tmp_path / "fleet" / f"sglang-gpu4-port{handle.port}.config.yaml"
            assert key in config.read_text()
            assert stat.S_IMODE(config.stat().st_mode) == 0o600 and config.stat().st_uid == os.getuid()
            # The server demands the key it read from that file; the fleet's headers carry it.
            assert httpx.get(f"{handle.url}/model_info", timeout=10).status_code == 401
            assert (
                httpx.get(f"{handle.url}/model_info", headers=fleet.headers(), timeout=10).status_code == 200
            )
            pid_file = tmp_path / "fleet" / f"sglang-gpu4-port{handle.port}.pid"
            assert key not in pid_file.read_text()
            assert provision(spec, fleet)[0].pid == handle.pid
        finally:
            teardown(spec, fleet)
    assert live_group_members(handle.pgid) == []
    assert not config.exists()  # a stopped server leaves no key behind


def test_port_held_by_another_server_is_an_error(tmp_path, stray_groups):
    """A server of the same model on our port, but not launched by this spec's pid file, is not ours."""
    spec = sim_spec(tmp_path, "local", gpus=(0,))
    squatter = FleetSpec.from_dict({**spec.to_dict(), "work_dir": str(tmp_path / "other")})
    with FleetConnection(squatter) as fleet:
        try:
            [handle] = provision(squatter, fleet)
            stray_groups.append(handle.pgid)
            with pytest.raises(
                FleetError, match=r"held by a process outside|exited before becoming healthy"
            ) as info:
                provision(spec)
            assert str(handle.port) in str(info.value)
            assert is_alive(handle.pid)  # the other server is reported, never touched
        finally:
            teardown(squatter, fleet)
            teardown(spec)


def test_model_info_must_name_the_configured_model():
    spec = sim_spec(Path("/tmp"), "local", gpus=(0,))
    assert model_matches(spec, {"model_path": "Qwen/Qwen3-8B", "served_model_name": "qwen3-8b"})
    assert not model_matches(spec, {"model_path": "Qwen/Qwen3-8B", "served_model_name": "other"})
    assert not model_matches(spec, {"model_path": "other", "served_model_name": "qwen3-8b"})
    assert not model_matches(spec, {})


def test_concurrent_provisions_converge_on_one_server(tmp_path, stray_groups):
    """Mapped chunk tasks provision at the same time: they must share one server per GPU."""
    from concurrent.futures import ThreadPoolExecutor

    spec = sim_spec(tmp_path, "local", gpus=(0,))
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: provision(spec), range(4)))
        pids = {handles[0].pid for handles in results}
        assert len(pids) == 1
        stray_groups.append(results[0][0].pgid)
        assert live_group_members(results[0][0].pgid)
    finally:
        teardown(spec)
