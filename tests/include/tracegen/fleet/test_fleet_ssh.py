"""The fleet over a real OpenSSH sshd on loopback: host-key checks, quoting, health timeouts, stop."""

import contextlib
import json
import os
import socket
import subprocess
import threading
import time

import pytest
from fleet_helpers import is_alive, live_group_members, probe_spec, wait_for

from tracegen.fleet import (
    FleetConnection,
    FleetError,
    LocalTransport,
    SSHTransport,
    launch_argv,
    provision,
    teardown,
)
from tracegen.fleet import server as fleet_server


def _other_host_key(tmp_path) -> str:
    key = tmp_path / "impostor"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return " ".join((tmp_path / "impostor.pub").read_text().split()[:2])


def test_runs_scripts_over_ssh(sshd):
    transport = SSHTransport(sshd.conn_id)
    try:
        result = transport.run('echo "user=$(id -un)"; echo oops >&2; exit 3', timeout=30)
    finally:
        transport.close()
    assert (result.exit_status, result.stdout, result.stderr) == (3, f"user={sshd.user}\n", "oops\n")


def test_host_key_mismatch_is_refused(sshd, tmp_path):
    conn_id = sshd.register_connection(
        "fleet_ssh_impostor", known_hosts=None, host_key=_other_host_key(tmp_path)
    )
    transport = SSHTransport(conn_id)
    with pytest.raises(FleetError, match="does not match the recorded key"):
        transport.run("touch /tmp/should-not-run", timeout=30)


def test_known_hosts_mismatch_is_refused(sshd, tmp_path):
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {_other_host_key(tmp_path)}\n")
    conn_id = sshd.register_connection("fleet_ssh_wrong_known_hosts", known_hosts=str(wrong))
    with pytest.raises(FleetError, match="does not match the recorded key"):
        SSHTransport(conn_id).run("true", timeout=30)


def test_unknown_host_is_refused_even_when_the_connection_asks_to_skip_checks(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    conn_id = sshd.register_connection("fleet_ssh_unknown", known_hosts=str(empty))
    with pytest.raises(FleetError, match="no entry for 127.0.0.1"):
        SSHTransport(conn_id)
    conn_id = sshd.register_connection("fleet_ssh_nocheck", known_hosts=None, no_host_key_check=True)
    with pytest.raises(FleetError, match="SSH connection refused"):
        SSHTransport(conn_id).run("true", timeout=30)
    conn_id = sshd.register_connection("fleet_ssh_allow_change", allow_host_key_change=True)
    with pytest.raises(FleetError, match="allow_host_key_change"):
        SSHTransport(conn_id)


def test_host_key_extra_is_accepted(sshd):
    conn_id = sshd.register_connection("fleet_ssh_host_key", known_hosts=None, host_key=sshd.host_public_key)
    transport = SSHTransport(conn_id)
    try:
        assert transport.run("echo ok", timeout=30).stdout == "ok\n"
    finally:
        transport.close()


def test_injection_over_ssh_runs_nothing_and_argv_arrives_verbatim(sshd, tmp_path, stray_groups):
    canary = tmp_path / "CANARY"
    flags = {
        "--speculative-algorithm": f"EAGLE3; touch {canary}",
        "--reasoning-parser": f"$(touch {canary})",
        "--tool-call-parser": f"`touch {canary}`",
        "--chat-template": f"'\"; touch {canary}; echo \"'",
    }
    spec = probe_spec(tmp_path, conn_id=sshd.conn_id, sglang_flags=flags)
    host = spec.hosts[0]
    with FleetConnection(spec) as fleet:
        state = fleet_server.launch(fleet, host, 2)
        stray_groups.append(state.pgid)
        assert wait_for((tmp_path / "probe.json").exists)
        record = json.loads((tmp_path / "probe.json").read_text())
        assert record["argv"] == launch_argv(spec, host, 2)[3:]
        assert record["pgid"] == record["sid"] == state.pid
        fleet_server.stop(fleet, host, 2)
    assert not canary.exists()


def test_health_timeout_reports_the_remote_log_tail_and_teardown_leaves_nothing(sshd, tmp_path, stray_groups):
    spec = probe_spec(tmp_path, conn_id=sshd.conn_id, health_timeout_s=1.5)
    with FleetConnection(spec) as fleet:
        with pytest.raises(FleetError) as info:
            provision(spec, fleet)
        state = fleet_server.inspect(fleet, spec.hosts[0], 2)
        stray_groups.append(state.pgid)
        message = str(info.value)
        assert "not healthy after" in message and "gpu2" in message
        # The tail of the host-side log: the server's stdout and stderr lines.
        assert "PROBE-LOADING-WEIGHTS shard 1/3 for Qwen/Qwen3-8B" in message
        assert "PROBE-STDERR-LINE" in message
        assert len(live_group_members(state.pgid)) == 2  # the probe and its child
        results = teardown(spec, fleet)
    assert [r.result for r in results] == ["stopped"]
    assert live_group_members(state.pgid) == []


def test_server_that_dies_at_start_fails_fast_with_its_log(sshd, tmp_path):
    # The stand-in rejects an unknown flag like SGLang does (argparse, exit 2).
    spec = probe_spec(
        tmp_path, conn_id=sshd.conn_id, launch_module="tracegen.simulator", env={},
        sglang_flags={"--no-such-flag": 1}, health_timeout_s=60,
    )  # fmt: skip
    with pytest.raises(FleetError) as info:
        provision(spec)
    message = str(info.value)
    assert "exited" in message and "--no-such-flag" in message


def test_unreachable_ssh_server_is_retried_then_named(sshd):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    conn_id = sshd.register_connection(
        "fleet_ssh_closed_port", known_hosts=None, host_key=sshd.host_public_key
    )
    conn = json.loads(os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"])
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps({**conn, "port": closed_port})
    with pytest.raises(FleetError, match="cannot reach SSH server after 2 attempts"):
        SSHTransport(conn_id, connect_attempts=2).run("true", timeout=10)


def test_client_urls_tunnel_loopback_and_go_direct_otherwise(sshd):
    transport = SSHTransport(sshd.conn_id)
    try:
        # A network bind (always with an API key) is reached directly, at the SSH host for 0.0.0.0.
        assert transport.url("0.0.0.0", 30001) == "http://127.0.0.1:30001"
        assert transport.url("10.1.2.3", 30002) == "http://10.1.2.3:30002"
        # A loopback bind is only reachable through a local tunnel, kept open until close().
        url = transport.url("127.0.0.1", 30003)
        assert url.startswith("http://127.0.0.1:") and url != "http://127.0.0.1:30003"
        assert transport.url("127.0.0.1", 30003) == url  # one tunnel per port, reused
    finally:
        transport.close()
    assert LocalTransport().url("0.0.0.0", 5) == "http://127.0.0.1:5"
    assert LocalTransport().url("127.0.0.1", 6) == "http://127.0.0.1:6"


def _point_at(sshd, conn_id: str, port: int, **extra) -> str:
    sshd.register_connection(conn_id, known_hosts=None, host_key=sshd.host_public_key, **extra)
    conn = json.loads(os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"])
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps({**conn, "port": port})
    return conn_id


def test_ssh_connections_get_connect_and_banner_timeouts_by_default(sshd):
    transport = SSHTransport(sshd.conn_id)
    assert (transport.hook.conn_timeout, transport.hook.banner_timeout) == (10, 10.0)


def test_a_host_that_accepts_tcp_but_sends_no_banner_fails_at_once_naming_it(sshd):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True)
    accepting.start()
    conn_id = _point_at(sshd, "fleet_ssh_silent", silent.getsockname()[1], banner_timeout=1)
    try:
        started = time.monotonic()
        with pytest.raises(FleetError, match=r"accepted the TCP connection but sent no SSH banner within 1 s"):
            SSHTransport(conn_id, connect_attempts=3).run("true", timeout=30)
        # One wait of the banner timeout, not three attempts with backoff in between.
        assert time.monotonic() - started < 3
    finally:
        for sock in [*held, silent]:
            sock.close()


def test_a_host_that_drops_syns_fails_after_the_connect_timeout(sshd):
    # A full accept queue makes Linux drop further SYNs: the connect hangs like a blackholed host.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    port = blackhole.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    conn_id = _point_at(sshd, "fleet_ssh_blackhole", port, conn_timeout=1)
    try:
        started = time.monotonic()
        with pytest.raises(FleetError, match=r"TCP connect to 127.0.0.1:\d+ timed out after 1 s"):
            SSHTransport(conn_id, connect_attempts=3).run("true", timeout=30)
        assert time.monotonic() - started < 3
    finally:
        for sock in [*fillers, blackhole]:
            sock.close()


TIMED_OUT_SCRIPT = 'sleep 300 & echo $! > "{pid_file}"; exec 9>>"{lock}"; flock 9; wait'


@pytest.mark.parametrize("where", ["ssh", "local"])
def test_a_script_that_times_out_is_stopped_with_its_process_group(sshd, tmp_path, where):
    pid_file, lock = tmp_path / "child.pid", tmp_path / "slot.lock"
    transport = SSHTransport(sshd.conn_id) if where == "ssh" else LocalTransport()
    try:
        with pytest.raises(FleetError, match=r"did not finish within 2 s; stopped its process group \d+") as info:
            transport.run(TIMED_OUT_SCRIPT.format(pid_file=pid_file, lock=lock), timeout=2)
    finally:
        transport.close()
    child = int(pid_file.read_text())
    assert wait_for(lambda: not is_alive(child), timeout=5), f"{info.value}: its child {child} still runs"
    # The lock it held is free again for the next provisioner of the slot.
    assert subprocess.run(["flock", "-w", "2", str(lock), "true"]).returncode == 0
