"""The TLS contexts tracegen's HTTP clients verify servers with.

httpx builds a context per client or transport unless it is handed one, loading the CA store each time (20
to 50 ms of CPU). The fleet's health probes open a client per probe, a chunk's client a transport per pool:
hundreds of loads a task. One context per process serves them all (an `ssl.SSLContext` is safe to share
across threads), and every client verifies against the same store: the system's, or what `SSL_CERT_FILE` /
`SSL_CERT_DIR` name.

A client that only ever speaks plain HTTP (a server on loopback or through an SSH tunnel: `tls_for`) never
uses its context, yet httpx wants one: it gets one that loads no store. That context still requires a
certificate and checks host names, against an empty store, so it trusts no server: were it ever used for
an https URL, the handshake would fail rather than go unverified. A task that probes a plain-HTTP fleet
from two threads spent 132 ms of CPU on it with each thread loading the store (45 ms a load on a 2-core VM),
44 ms without.
"""

from __future__ import annotations

import ssl
import threading

_lock = threading.Lock()
_verified: ssl.SSLContext | None = None
_plain: ssl.SSLContext | None = None


def client_tls() -> ssl.SSLContext:
    """The process's context that verifies servers against the CA store (loaded once, whichever thread asks
    first; the others wait for it instead of loading it again)."""
    global _verified
    if _verified is None:
        with _lock:
            if _verified is None:
                _verified = ssl.create_default_context()
    return _verified


def tls_for(url: str) -> ssl.SSLContext:
    """The context for a client of `url`: `client_tls()` for https, else one that trusts nothing (see the
    module's docstring), which a plain-HTTP client never uses."""
    if url.lower().startswith("https:"):
        return client_tls()
    global _plain
    if _plain is None:
        with _lock:
            if _plain is None:
                _plain = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked, no CA
    return _plain
