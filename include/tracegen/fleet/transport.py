"""How the fleet reaches a host: run a shell script there, and get a URL for one of its ports.

`LocalTransport` runs scripts with a local `sh` (the embedded default: servers on this machine).
`SSHTransport` runs them through `SSHHook` from apache-airflow-providers-ssh, with host-key
verification forced on, and reaches loopback-bound servers through SSH port forwards on the hook's connection (fleet/tunnel.py).
Scripts travel on the remote shell's stdin (`sh -s`), so neither the script nor a secret in it
appears in the remote process list or in the hook's "Running command" log line.

A script that overruns its timeout is stopped on the host with its whole process group: abandoning
it would leave it running there, holding a GPU slot's lock for the next provisioner.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import tenacity

from tracegen.fleet.spec import LOCAL, is_loopback
from tracegen.fleet.tunnel import PortForward

# Without them a host that drops SYNs takes the OS default (~2 min) and one that accepts TCP but never
# speaks SSH takes paramiko's 30 s, per attempt. A connection's `conn_timeout` / `banner_timeout`
# extras override them.
SSH_CONNECT_TIMEOUT_S = 10
SSH_BANNER_TIMEOUT_S = 10.0
GROUP_STOP_GRACE_S = 2.0  # SIGTERM to a timed-out script's group, then SIGKILL

# Sent ahead of every remote script: the shell names its process group, the group leader's start time,
# its own pid and its parent's, so a timed-out script's group can be stopped without ever signalling a
# recycled pid. sshd starts each session in a new session and group, led by the login shell (which runs
# `sh -s` in place or as its child), so the group is ours only when it is led by the shell or its parent.
_GROUP_MARKER = "tracegen-script-group"
_ANNOUNCE_GROUP = (
    "tg_stat() { tg_s=''; read -r tg_s < \"/proc/$1/stat\" 2>/dev/null; printf '%s' \"${tg_s##*) }\"; }\n"
    "set -- $(tg_stat $$); tg_pgid=${3:-}\n"
    "set -- $(tg_stat \"$tg_pgid\")\n"
    "printf '" + _GROUP_MARKER + "=%s %s %s %s\\n' \"$tg_pgid\" \"${20:-}\" \"$$\" \"$PPID\" >&2\n"
    "set --\n"
)
_GROUP_LINE = re.compile(rf"^{_GROUP_MARKER}=(\d*) (\d*) (\d+) (\d+)\n", re.MULTILINE)


class FleetError(RuntimeError):
    """A fleet operation failed; the message names the host, the GPU and what went wrong."""


@dataclass(frozen=True)
class ScriptResult:
    exit_status: int
    stdout: str
    stderr: str


class Transport(Protocol):
    """One host: run a script, map a server port to a URL this process can reach."""

    name: str

    def run(self, script: str, timeout: float) -> ScriptResult: ...

    def url(self, bind_host: str, port: int) -> str: ...

    def close(self) -> None: ...


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class LocalTransport:
    """This machine: `sh -s` in a subprocess; servers are reached directly."""

    name = LOCAL

    def run(self, script: str, timeout: float) -> ScriptResult:
        # Its own process group: on timeout the whole script (sleeps, flock waits) is stopped, and
        # never the worker that runs it.
        proc = subprocess.Popen(
            ["sh", "-s"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(script, timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_local_group(proc)
            raise FleetError(
                f"host local: script did not finish within {timeout:.0f} s; "
                f"stopped its process group {proc.pid}"
            ) from None
        return ScriptResult(proc.returncode, stdout, stderr)

    def url(self, bind_host: str, port: int) -> str:
        # A wildcard bind is reachable on loopback; anything else at the address it binds.
        host = (
            "127.0.0.1"
            if bind_host in ("0.0.0.0", "localhost")
            else "::1"
            if bind_host == "::"
            else bind_host
        )
        return f"http://{_url_host(host)}:{port}"

    def close(self) -> None:
        return None


def _stop_local_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(GROUP_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    # Members that outlive the leader (or ignore SIGTERM) still hold the group id.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _stop_group_script(pgid: int, start: int) -> str:
    """Stops the process group led by `pgid` if its leader still has start time `start`."""
    return (
        f"G={pgid}\n"
        "s=''; read -r s < /proc/$G/stat 2>/dev/null; set -- ${s##*) }\n"
        f'[ -n "$s" ] && [ "${{20:-}}" = {start} ] || {{ echo result=gone; exit 0; }}\n'
        'kill -s TERM -- "-$G" 2>/dev/null\n'
        f"i=0; while [ -e /proc/$G ] && [ $i -lt {int(GROUP_STOP_GRACE_S * 10)} ]; do sleep 0.1; i=$((i + 1)); done\n"
        'kill -s KILL -- "-$G" 2>/dev/null\n'
        "echo result=stopped\n"
    )


def _known_hosts_key(path: str, host: str, port: int) -> Any:
    """The host key recorded for host:port in an OpenSSH known_hosts file, or None."""
    import paramiko

    entry = host if port == 22 else f"[{host}]:{port}"
    try:
        keys = paramiko.HostKeys(os.path.expanduser(path))
    except OSError as exc:
        raise FleetError(f"known_hosts file {path!r} cannot be read: {exc}") from None
    found = keys.lookup(entry)
    if not found:
        return None
    return next(iter(found.values()))


class _Transient(Exception):
    """A connect failure worth retrying (network, sshd throttling); the cause is chained."""


class SSHTransport:
    """A host behind an Airflow SSH connection.

    Host keys are always verified: from the connection's `host_key` extra, from a `known_hosts`
    extra (a file path, the same extra `SSHHookAsync` reads) or from ~/.ssh/known_hosts. A
    connection asking for `no_host_key_check` or `allow_host_key_change` is refused.
    """

    def __init__(self, conn_id: str, cmd_timeout: float = 120.0, connect_attempts: int = 3) -> None:
        from airflow.providers.ssh.hooks.ssh import SSHHook

        self.name = conn_id
        self.connect_attempts = max(1, connect_attempts)
        # no_host_key_check=False as a constructor argument wins over the connection's extra. The
        # hook's own retry is off: it would also retry a wrong host key; `_client` retries only
        # what can be transient.
        self.hook = SSHHook(
            ssh_conn_id=conn_id, cmd_timeout=cmd_timeout, no_host_key_check=False, conn_retry_attempts=1
        )
        if self.hook.allow_host_key_change:
            raise FleetError(
                f"connection {conn_id}: allow_host_key_change=true disables host-key verification; "
                "remove it (tracegen never connects without verifying the host key)"
            )
        extra = self.hook.get_connection(conn_id).extra_dejson
        if self.hook.conn_timeout is None:  # the hook leaves it unset unless the connection's extra sets it
            self.hook.conn_timeout = SSH_CONNECT_TIMEOUT_S
        try:
            self.hook.banner_timeout = float(extra.get("banner_timeout", SSH_BANNER_TIMEOUT_S))
        except (TypeError, ValueError):
            raise FleetError(
                f"connection {conn_id}: extra banner_timeout {extra.get('banner_timeout')!r} is not a number "
                "of seconds"
            ) from None
        known_hosts = extra.get("known_hosts")
        if self.hook.host_key is None and known_hosts:
            key = _known_hosts_key(str(known_hosts), self.hook.remote_host, int(self.hook.port or 22))
            if key is None:
                raise FleetError(
                    f"connection {conn_id}: no entry for {self.hook.remote_host}:{self.hook.port} in "
                    f"known_hosts file {known_hosts!r}; add the host key (ssh-keyscan) before connecting"
                )
            self.hook.host_key = key
        self._tunnels = contextlib.ExitStack()
        self._urls: dict[int, str] = {}
        # Servers of one host are handled from several threads; they must share one SSH connection.
        self._connect_lock = threading.Lock()

    def _client(self) -> Any:
        # sshd's MaxStartups throttling and restarts are short-lived: back off (1, 2, 4, 8, 8 ... s) and retry.
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.connect_attempts),
            wait=tenacity.wait_exponential(multiplier=1.0, max=8.0),
            retry=tenacity.retry_if_exception_type(_Transient),
            reraise=True,
        )
        try:
            return retrying(self._connect_locked)
        except _Transient as exc:
            raise FleetError(
                f"connection {self.name}: cannot reach SSH server after {self.connect_attempts} attempts: "
                f"{exc.__cause__}"
            ) from None

    def _connect_locked(self) -> Any:
        with self._connect_lock:
            return self._connect_once()

    def _connect_once(self) -> Any:
        import paramiko

        try:
            return self.hook.get_conn()
        except paramiko.BadHostKeyException as exc:
            raise FleetError(
                f"connection {self.name}: host key of {exc.hostname} does not match the recorded key "
                f"(got {exc.key.get_name()} {exc.key.get_fingerprint().hex()}); refusing to connect"
            ) from None
        except paramiko.AuthenticationException as exc:
            raise FleetError(f"connection {self.name}: SSH authentication failed: {exc}") from None
        except paramiko.SSHException as exc:
            if "banner" in str(exc).lower():
                if isinstance(exc.__context__, TimeoutError):
                    # Something accepts TCP there but does not speak SSH: another try waits as long again.
                    raise FleetError(
                        f"connection {self.name}: {self.hook.remote_host}:{self.hook.port} accepted the TCP "
                        f"connection but sent no SSH banner within {self.hook.banner_timeout:g} s"
                    ) from None
                raise _Transient() from exc  # sshd dropped us before the handshake (MaxStartups)
            raise FleetError(f"connection {self.name}: SSH connection refused: {exc}") from None
        except TimeoutError:
            raise FleetError(
                f"connection {self.name}: TCP connect to {self.hook.remote_host}:{self.hook.port} timed out "
                f"after {self.hook.conn_timeout:g} s"
            ) from None
        except OSError as exc:
            raise _Transient() from exc

    def run(self, script: str, timeout: float) -> ScriptResult:
        client = self._client()
        result, timed_out = self._run_channel(client, _ANNOUNCE_GROUP + script, timeout)
        found = _GROUP_LINE.search(result.stderr)
        if not timed_out:
            stderr = _GROUP_LINE.sub("", result.stderr, count=1)
            return ScriptResult(result.exit_status, result.stdout, stderr)
        outcome = self._stop_remote_group(client, found)
        raise FleetError(f"host {self.name}: script did not finish within {timeout:.0f} s; {outcome}")

    def _stop_remote_group(self, client: Any, found: re.Match[str] | None) -> str:
        if found is None or not found[1].isdigit() or not found[2].isdigit():
            return "it never named its process group, so it may still be running there"
        pgid = int(found[1])
        if pgid <= 1 or pgid not in (int(found[3]), int(found[4])):
            return f"its process group {pgid} is not led by its own shell, so it was left alone"
        try:
            result, timed_out = self._run_channel(
                client, _stop_group_script(pgid, int(found[2])), GROUP_STOP_GRACE_S + 10
            )
        except Exception as exc:  # the connection itself may be what hung
            return f"stopping its process group {pgid} failed: {exc}"
        if timed_out or result.exit_status != 0:
            return f"stopping its process group {pgid} did not finish: {result.stderr.strip()[-200:]}"
        if "result=gone" in result.stdout:
            return f"its process group {pgid} had already ended"
        return f"stopped its process group {pgid} on the host"

    def _run_channel(self, client: Any, script: str, timeout: float) -> tuple[ScriptResult, bool]:
        """Runs `script` with `sh -s`; the flag says it overran `timeout` (the result is partial then)."""
        deadline = time.monotonic() + timeout
        channel = client.get_transport().open_session(timeout=timeout)
        timed_out = False
        try:
            channel.settimeout(min(timeout, 5.0))
            channel.exec_command("sh -s")
            channel.sendall(script.encode())
            channel.shutdown_write()
            out, err = bytearray(), bytearray()
            # Read both streams as they come: a full stderr window would otherwise stall stdout.
            while True:
                progressed = False
                while channel.recv_ready():
                    out += channel.recv(65536)
                    progressed = True
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                    progressed = True
                if (
                    channel.exit_status_ready()
                    and not channel.recv_ready()
                    and not channel.recv_stderr_ready()
                ):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if not progressed:
                    time.sleep(0.01)
            status = -1 if timed_out else channel.recv_exit_status()
        finally:
            channel.close()
        return ScriptResult(status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")), timed_out

    def url(self, bind_host: str, port: int) -> str:
        if port in self._urls:
            return self._urls[port]
        if is_loopback(bind_host):
            # The server only listens on the remote loopback: forward a local port through SSH, with
            # tracegen's forwarder, not the provider's `get_tunnel` (fleet/tunnel.py says why).
            client = self._client()
            tunnel = self._tunnels.enter_context(
                PortForward(client, "127.0.0.1" if bind_host == "localhost" else bind_host, port)
            )
            url = f"http://127.0.0.1:{tunnel.local_bind_port}"
        else:
            host = self.hook.remote_host if bind_host in ("0.0.0.0", "::") else bind_host
            url = f"http://{_url_host(host)}:{port}"
        self._urls[port] = url
        return url

    def close(self) -> None:
        self._tunnels.close()
        self._urls.clear()
        if self.hook.client is not None:
            self.hook.client.close()
            self.hook.client = None


def open_transport(conn_id: str, cmd_timeout: float = 120.0) -> Transport:
    """The transport for a host id: `local` or an Airflow SSH connection id."""
    if conn_id == LOCAL:
        return LocalTransport()
    return SSHTransport(conn_id, cmd_timeout)
