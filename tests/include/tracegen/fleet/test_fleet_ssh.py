"""The fleet over a real OpenSSH sshd on loopback: host-key checks, quoting, health timeouts, stop."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fixtures import sglang_reference as sglang_ref
from fixtures.ports import free_port
from fixtures.procs import is_alive
from fleet_helpers import live_group_members, probe_spec, wait_for

from tracegen.fleet import (
    FleetConnection,
    FleetError,
    FleetSpec,
    FleetSpecError,
    LocalTransport,
    SSHTransport,
    launch_argv,
    provision,
    teardown,
)
from tracegen.fleet import server as fleet_server
from tracegen.fleet.command import server_config, server_paths
from tracegen.fleet.server import served_context_length
from tracegen.fleet.tunnel import PortForward
from tracegen.run.run_spec import FleetRef


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
    flags = {  # free-text flags of SGLang: a flag with choices would not validate with such a value
        "--speculative-draft-model-path": f"EAGLE3; touch {canary}",
        "--tokenizer-path": f"$(touch {canary})",
        "--completion-template": f"`touch {canary}`",
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
    # The stand-in rejects an unknown flag like SGLang does (argparse, exit 2). Validation refuses it first;
    # added after validation it stands for any start-up failure validation cannot foresee.
    with pytest.raises(FleetSpecError, match="unrecognized arguments: --no-such-flag"):
        probe_spec(tmp_path, launch_module="tracegen.simulator", sglang_flags={"--no-such-flag": 1})
    spec = probe_spec(
        tmp_path, conn_id=sshd.conn_id, launch_module="tracegen.simulator", env={}, health_timeout_s=60,
    )  # fmt: skip
    spec.sglang_flags["--no-such-flag"] = 1
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


def test_a_transient_connect_failure_is_retried_after_1_2_4_8_8_s(monkeypatch):
    from tracegen.fleet import transport as transport_module

    monkeypatch.setenv("AIRFLOW_CONN_FLEET_SSH_FLAKY", json.dumps({"conn_type": "ssh", "host": "127.0.0.1"}))
    transport = SSHTransport("fleet_ssh_flaky", connect_attempts=6)
    tries, waits = [], []

    def refused():
        tries.append(1)
        raise transport_module._Transient() from ConnectionRefusedError("refused")

    monkeypatch.setattr(transport, "_connect_once", refused)
    monkeypatch.setattr(time, "sleep", waits.append)  # the waits asked for, none taken
    with pytest.raises(FleetError, match="cannot reach SSH server after 6 attempts: refused"):
        transport.run("true", timeout=10)
    assert len(tries) == 6 and waits == [1, 2, 4, 8, 8]


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


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that sends back whatever it reads, until the peer closes."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_a_tunnel_carries_hundreds_of_connections_past_descriptor_1024(sshd):
    """The provider's tunnel waits on select(), which fails for a descriptor numbered 1024 or above: its
    loop stopped and every request through it hung (512 concurrent requests: all timed out). A chunk task
    reaching 7 servers holds that many. tracegen's forwarder waits on epoll: 600 concurrent connections,
    opened while the process already holds 1,100 descriptors, each echoed back whole."""

    held = [os.pipe() for _ in range(550)]  # 1,100 descriptors: every new one is numbered above 1024

    async def scenario(url_port_of) -> tuple[int, int]:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = url_port_of(server.sockets[0].getsockname()[1])

        async def one(i: int) -> bool:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = f"{i}:".encode() + b"x" * 70_000 + b"\n"  # larger than one read: copied in pieces
            writer.write(payload)
            await writer.drain()
            got = await asyncio.wait_for(reader.readexactly(len(payload)), 60)
            writer.close()
            return got == payload

        results = await asyncio.gather(*(one(i) for i in range(600)), return_exceptions=True)
        server.close()
        return sum(r is True for r in results), len(results)

    transport = SSHTransport(sshd.conn_id)
    try:
        ok, total = asyncio.run(scenario(lambda port: int(transport.url("127.0.0.1", port).rsplit(":", 1)[1])))
        assert (ok, total) == (600, 600)
    finally:
        transport.close()
        for r, w in held:
            os.close(r)
            os.close(w)


def test_a_refused_forward_closes_that_connection_and_the_tunnel_serves_on(sshd):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    transport = SSHTransport(sshd.conn_id)
    try:
        url = transport.url("127.0.0.1", dead_port)
        # Closed at once (a read or protocol error), never left to hang until the client's timeout.
        refused = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError)
        with pytest.raises(refused):
            httpx.get(url + "/health", timeout=10)
        with pytest.raises(refused):  # the forwarder is still there, and still refuses
            httpx.get(url + "/health", timeout=10)
    finally:
        transport.close()


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


def _reference_fleet(conn_id: str, base_port: int, work_dir: str, **over) -> dict:
    """The reference job's kind of fleet: an EAGLE3 draft model, reasoning and tool-call parsers, an API key from a
    connection, a static memory fraction, a context length and CUDA-graph batch sizes."""
    return {
        "hosts": [{"conn_id": conn_id, "gpus": [0, 1], "base_port": base_port}],
        "model_path": "Qwen/Qwen3-30B-A3B",
        "served_model_name": "qwen3-30b-a3b",
        "api_key_conn_id": "seed_sglang_key",
        "work_dir": work_dir,
        "sglang_flags": {
            "--speculative-algorithm": "EAGLE3",
            "--speculative-draft-model-path": "Tengyunw/qwen3_30b_moe_eagle3",
            "--speculative-num-steps": 3,
            "--speculative-eagle-topk": 1,
            "--speculative-num-draft-tokens": 4,
            "--reasoning-parser": "qwen3",
            "--tool-call-parser": "qwen25",
            "--mem-fraction-static": 0.85,
            "--context-length": 40960,
            "--cuda-graph-bs-decode": [1, 2, 4, 8, 16, 32, 48],
            "--enable-metrics": True,
        },
        **over,
    }


def test_the_reference_fleet_validates_launches_over_ssh_and_sglang_starts_with_its_argv(
    sshd, tmp_path, monkeypatch, stray_groups
):
    key = "seed-key-7f3a"
    monkeypatch.setenv("AIRFLOW_CONN_SEED_SGLANG_KEY", json.dumps({"conn_type": "generic", "password": key}))
    base_port = free_port(2)
    work_dir = str(tmp_path / "fleet")

    # On a GPU host: validates, and SGLang's own parser starts from the exact argv of every server.
    real = FleetSpec.from_dict(_reference_fleet(sshd.conn_id, base_port, work_dir, python="/opt/sglang/bin/python"))
    assert real.launch_module == "sglang.launch_server" and real.max_running_requests == 48
    assert FleetRef.of(real, "reference.json").slots == 96  # SGLang's speculative cap, per server
    monkeypatch.chdir(tmp_path)
    for host, gpu in real.servers():
        argv = launch_argv(real, host, gpu, api_key=key)[3:]
        (tmp_path / server_paths(real, host, gpu).config_file).write_text(server_config(key))
        assert sglang_ref.launch_refusal(argv) is None
        args = sglang_ref.prepare_server_args(argv)
        assert (args.api_key, args.port, args.speculative_algorithm) == (key, host.port(gpu), "EAGLE3")
        assert args.context_length == 40960 and args.cuda_graph_bs_decode == [1, 2, 4, 8, 16, 32, 48]
        assert (args.reasoning_parser, args.tool_call_parser, args.mem_fraction_static) == ("qwen3", "qwen25", 0.85)

    # The same fleet on the stand-in, over SSH: it starts with SGLang's argv (plus --sim-* knobs) and reports
    # what SGLang reports.
    sim_flags = {"--sim-time-scale": 1000, "--sim-length-model": "short", "--sim-tool-call-rate": 1.0}
    reference = _reference_fleet(sshd.conn_id, base_port, work_dir, python=sys.executable, launch_module="tracegen.simulator")
    spec = FleetSpec.from_dict({**reference, "sglang_flags": {**reference["sglang_flags"], **sim_flags}})
    host = spec.hosts[0]
    stand_in_argv = launch_argv(spec, host, 0, api_key=key)[3:]
    for flag, value in sim_flags.items():
        at = stand_in_argv.index(flag)
        assert stand_in_argv[at + 1] == str(value)
        del stand_in_argv[at : at + 2]
    assert stand_in_argv == launch_argv(real, host, 0, api_key=key)[3:]
    with FleetConnection(spec) as fleet:
        try:
            handles = provision(spec, fleet)
            stray_groups.extend(h.pgid for h in handles)
            headers = fleet.headers()
            for handle in handles:
                assert served_context_length(handle.url, headers, spec.model_name) == 40960
                info = httpx.get(f"{handle.url}/server_info", headers=headers, timeout=10).json()
                assert info["max_running_requests"] == 48 and info["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16, 32, 48]
                assert info["api_key"] == key and info["tool_call_parser"] == "qwen"  # SGLang renames qwen25
                assert httpx.get(f"{handle.url}/v1/models", timeout=10).status_code == 401
                tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
                body = httpx.post(f"{handle.url}/v1/chat/completions", headers=headers, timeout=30, json={
                    "messages": [{"role": "user", "content": "fix the failing test"}], "tools": tools,
                    "max_tokens": 4096}).json()  # fmt: skip
                assert body["choices"][0]["finish_reason"] in ("tool_calls", "length")
                assert sglang_ref.as_sglang_serializes("ChatCompletionResponse", body) == body
        finally:
            results = teardown(spec, fleet)
    assert {r.result for r in results} <= {"stopped", "killed"}


def test_a_channel_woken_with_nothing_to_read_stops_no_other_connection(sshd):
    """paramiko wakes the forwarder through a pipe of its own, which can be readable while the channel holds
    nothing yet; the one forwarding thread must not wait on that channel while other connections need it."""

    async def main() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = SSHTransport(sshd.conn_id)
        forward = PortForward(transport._client(), "127.0.0.1", port).__enter__()
        try:
            host, local_port = "127.0.0.1", forward.local_bind_port
            idle_reader, idle_writer = await asyncio.open_connection(host, local_port)
            idle_writer.write(b"hello")
            await idle_writer.drain()
            assert await asyncio.wait_for(idle_reader.readexactly(5), 10) == b"hello"
            channel = next(end for end, _ in forward._pairs.values() if not isinstance(end, socket.socket))
            channel._pipe.set()  # readable, with nothing in the channel: what paramiko's pipe can say
            for i in range(5):  # every other connection still goes through
                reader, writer = await asyncio.open_connection(host, local_port)
                writer.write(f"ping {i}".encode())
                await writer.drain()
                assert await asyncio.wait_for(reader.readexactly(6), 10) == f"ping {i}".encode()
                writer.close()
            idle_writer.write(b"again")  # and the woken channel carries its next answer
            await idle_writer.drain()
            assert await asyncio.wait_for(idle_reader.readexactly(5), 10) == b"again"
            idle_writer.close()
        finally:
            forward.__exit__(None, None, None)
            transport.close()
            server.close()

    asyncio.run(main())
