"""How the fleet reaches a host: run a shell script there, and get a URL for one of its ports.

`LocalTransport` runs scripts with a local `sh` (the embedded default: servers on this machine).
`SSHTransport` runs them through `SSHHook` from apache-airflow-providers-ssh, with host-key
verification forced on, and reaches loopback-bound servers through the hook's SSH tunnels.
Scripts travel on the remote shell's stdin (`sh -s`), so neither the script nor a secret in it
appears in the remote process list or in the hook's "Running command" log line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from tracegen.fleet.spec import LOCAL, is_loopback

TUNNEL_BACKLOG = 1024


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
        try:
            proc = subprocess.run(
                ["sh", "-s"], input=script, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise FleetError(f"host local: script did not finish within {timeout:.0f} s") from None
        return ScriptResult(proc.returncode, proc.stdout, proc.stderr)

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

        for attempt in range(1, self.connect_attempts + 1):
            try:
                with self._connect_lock:
                    return self._connect_once()
            except _Transient as exc:
                if attempt == self.connect_attempts:
                    raise FleetError(
                        f"connection {self.name}: cannot reach SSH server after {attempt} attempts: {exc.__cause__}"
                    ) from None
                # sshd's MaxStartups throttling and restarts are short-lived: back off and retry.
                time.sleep(min(8.0, 1.0 * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")

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
            if "banner" in str(exc).lower():  # sshd dropped us before the handshake (MaxStartups)
                raise _Transient() from exc
            raise FleetError(f"connection {self.name}: SSH connection refused: {exc}") from None
        except OSError as exc:
            raise _Transient() from exc

    def run(self, script: str, timeout: float) -> ScriptResult:
        client = self._client()
        deadline = time.monotonic() + timeout
        channel = client.get_transport().open_session(timeout=timeout)
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
                    raise FleetError(f"host {self.name}: script did not finish within {timeout:.0f} s")
                if not progressed:
                    time.sleep(0.01)
            status = channel.recv_exit_status()
        finally:
            channel.close()
        return ScriptResult(status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def url(self, bind_host: str, port: int) -> str:
        if port in self._urls:
            return self._urls[port]
        if is_loopback(bind_host):
            # The server only listens on the remote loopback: forward a local port through SSH.
            self._client()
            tunnel = self._tunnels.enter_context(
                self.hook.get_tunnel(port, remote_host="127.0.0.1" if bind_host == "localhost" else bind_host)
            )
            # The provider's tunnel listens with a backlog of 5: a client opening ~128 connections
            # at once has its SYNs dropped and stalls for seconds (measured: 13 of 384 requests
            # timed out at 128-way concurrency). Re-listening on the bound socket only raises it.
            listener = getattr(tunnel, "_server_socket", None)
            if listener is not None:
                listener.listen(TUNNEL_BACKLOG)
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
