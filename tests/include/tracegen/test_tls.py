"""The TLS contexts of tracegen's HTTP clients (`tracegen.common.tls`): the CA store is loaded once per
process whichever threads ask at once, and a plain-HTTP client's context trusts no server, so an https
server reached with it is refused, never talked to unverified."""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest
from fixtures.certs import self_signed

from tracegen.common import tls


@pytest.fixture
def https_server(tmp_path: Path):
    """An HTTPS server on loopback answering every request 200 'ok', and the certificate it presents."""
    import http.server

    cert, key = self_signed(tmp_path)

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()


def test_the_plain_http_context_trusts_no_server_and_an_https_url_gets_the_verified_one(https_server):
    url, cert = https_server
    plain = tls.tls_for("http://127.0.0.1:30000")
    assert plain.verify_mode == ssl.CERT_REQUIRED and plain.check_hostname
    assert plain.cert_store_stats()["x509_ca"] == 0
    assert tls.tls_for("HTTPS://gpu-host:30000") is tls.client_tls() is tls.tls_for(url)
    # The server is reachable by a client that trusts its certificate...
    trusting = ssl.create_default_context(cafile=str(cert))
    assert httpx.get(url, verify=trusting).text == "ok"
    # ...and refused by the plain-HTTP context, never talked to unverified.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url, verify=plain)


def test_threads_that_ask_at_once_load_the_ca_store_once(monkeypatch):
    monkeypatch.setattr(tls, "_verified", None)
    loads = []
    real = ssl.create_default_context

    def slow_load(*args, **kwargs):
        loads.append(threading.get_ident())
        time.sleep(0.05)  # long enough for every thread below to ask while the first is loading
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", slow_load)
    contexts: list[ssl.SSLContext] = []
    threads = [threading.Thread(target=lambda: contexts.append(tls.client_tls())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loads) == 1 and len(contexts) == 8 and all(c is contexts[0] for c in contexts)
