"""The one TLS context tracegen's HTTP clients verify servers with.

httpx builds a context per client or transport unless it is handed one, loading the CA store each time (20
to 50 ms of CPU). The fleet's health probes open a client per probe, a chunk's client a transport per pool:
hundreds of loads a task. One context per process serves them all (an `ssl.SSLContext` is safe to share
across threads), and every client verifies against the same store: the system's, or what `SSL_CERT_FILE` /
`SSL_CERT_DIR` name.
"""

from __future__ import annotations

import ssl
from functools import cache


@cache
def client_tls() -> ssl.SSLContext:
    return ssl.create_default_context()
