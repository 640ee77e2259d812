"""Local port forwarding over an SSH connection (`ssh -L`), for servers bound to a remote host's loopback.

Why not the SSH provider's own tunnel (`SSHHook.get_tunnel`, `airflow.providers.ssh.tunnel.SSHTunnel`): it
waits on `select()`, which cannot watch a file descriptor numbered 1024 or above. Its loop then stops for
good and every connection through it hangs. A chunk task reaching a reference-job-sized fleet (7 servers x 32-128
requests in flight, three descriptors per forwarded connection) passes that: at 512 concurrent requests
through one tunnel every request timed out, and at 7 servers the first requests failed with "Server
disconnected without sending a response" until the servers were quarantined. It also finds a ready
connection by scanning all of them, O(n) per chunk of data.

Why not the provider's asyncio tunnel either (`SSHHookAsync.get_tunnel`, asyncssh 2.24's
`forward_local_port`): its loop has no descriptor limit, but it listens with asyncio's default backlog of
100, which the provider cannot raise. Through the same test this forwarder passes (600 concurrent
connections past descriptor 1,024, `tests/include/tracegen/fleet/test_fleet_ssh.py`, against the test
sshd) it carried 404 and then 504 of the 600; the rest were reset by the listener. It would also need an
event loop thread and a second SSH connection beside the paramiko one the fleet's commands use.

This one waits with the platform's selector (epoll on Linux, no descriptor limit), keeps each forwarded
connection in a dict by descriptor, and listens with a backlog for a whole fleet's worth of connects.
Data is copied both ways in 64 KiB reads; a connection ends when either side closes, as HTTP needs.

One thread serves every connection, so it never waits on one of them: a channel is read only when it holds
data or has ended. paramiko wakes a selector through a pipe of its own, which can be readable while the
channel holds nothing yet; a blocking read there stopped every connection of the tunnel (seen with real
SGLang behind it: a run's requests waited until their 30-minute timeout, two runs in six).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

BACKLOG = 1024
READ_BYTES = 65536


class PortForward:
    """Forwards connections to 127.0.0.1:<local_bind_port> to `remote_host:remote_port` as seen from the
    SSH server, over the SSH connection of `ssh_client` (a connected paramiko.SSHClient). A context manager:
    forwarding runs on one daemon thread between enter and exit."""

    def __init__(self, ssh_client: Any, remote_host: str, remote_port: int) -> None:
        self._client = ssh_client
        self._remote = (remote_host, remote_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(BACKLOG)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        # descriptor -> (the object registered under it, its peer)
        self._pairs: dict[int, tuple[Any, Any]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def local_bind_port(self) -> int:
        return self._listener.getsockname()[1]

    def __enter__(self) -> PortForward:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name=f"ssh-forward:{self._remote[1]}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=1.0):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._copy(key.fd)
        except Exception:  # noqa: BLE001 - a forwarder that dies silently hangs every request: say why
            log.exception("SSH port forward to %s:%s stopped", *self._remote)
        finally:
            for fd in list(self._pairs):
                self._close(fd)
            with contextlib.suppress(Exception):
                self._selector.close()

    def _accept(self) -> None:
        while True:  # every connect waiting in the backlog
            try:
                local, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: this connect is refused, the others go on
                log.warning("SSH port forward to %s:%s: accept failed: %s", *self._remote, exc)
                return
            transport = self._client.get_transport()
            channel = None
            if transport is not None and transport.is_active():
                try:
                    channel = transport.open_channel("direct-tcpip", self._remote, addr, timeout=30)
                except Exception as exc:  # noqa: BLE001 - refused by sshd or by the remote port
                    log.warning("SSH port forward to %s:%s: channel refused: %s", *self._remote, exc)
            else:
                log.warning("SSH port forward to %s:%s: the SSH connection is closed", *self._remote)
            if channel is None:
                local.close()
                continue
            local.setblocking(True)
            self._pairs[local.fileno()] = (local, channel)
            self._pairs[channel.fileno()] = (channel, local)
            self._selector.register(local, selectors.EVENT_READ)
            self._selector.register(channel, selectors.EVENT_READ)

    def _copy(self, fd: int) -> None:
        pair = self._pairs.get(fd)
        if pair is None:
            return
        source, sink = pair
        if not isinstance(source, socket.socket) and not _ready(source):
            return  # woken with nothing to read yet: the data, or the channel's end, wakes it again
        try:
            data = source.recv(READ_BYTES)
            if data:
                sink.sendall(data)
                return
        except OSError:
            pass
        self._close(fd)

    def _close(self, fd: int) -> None:
        pair = self._pairs.pop(fd, None)
        if pair is None:
            return
        for end in pair:
            self._pairs.pop(_fileno(end), None)  # the peer's entry
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(end)
            with contextlib.suppress(OSError):
                end.close()


def _ready(channel: Any) -> bool:
    """Whether a paramiko channel's `recv` returns at once: it holds data, or the remote end has ended it."""
    return bool(channel.recv_ready() or channel.eof_received or channel.closed)


def _fileno(end: Any) -> int:
    with contextlib.suppress(OSError, ValueError):
        return end.fileno()
    return -1
