"""Reading an Airflow connection's fields strictly: its extra, a flag in it, its port, and the http(s) URL an
HTTP connection names. The notification channels (`review.notify`) and the API user a raise answers as
(`run.api_answer`) read their connections through these, so a field means the same in both and a
malformed one is named the same way."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from tracegen.common.locations import shown_location

HTTP_TYPES = ("http", "https")


class ConnectionMisconfigured(ValueError):
    """A connection that cannot be used; the message names the field and what it needs."""


def connection_extra(conn: Any) -> dict[str, Any]:
    try:
        extra = conn.extra_dejson
    except Exception as exc:  # noqa: BLE001 - the SDK's own parse error; its message is what matters
        raise ConnectionMisconfigured(f"extra is not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConnectionMisconfigured(f"extra must be a JSON object, got {type(extra).__name__}")
    return extra


def connection_flag(extra: dict[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ConnectionMisconfigured(f"extra {key!r} must be true or false, got {value!r}")
    return value


def connection_port(conn: Any, default: int) -> int:
    port = conn.port if conn.port not in (None, "") else default
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConnectionMisconfigured(f"port {port!r} is not a TCP port")
    return port


def http_url(conn: Any) -> str:
    """The http(s) URL an HTTP connection names: its whole URL in host, as Airflow's HTTP connections allow,
    or host, schema (http or https), port and extra `path`. `ConnectionMisconfigured` names what is missing."""
    extra = connection_extra(conn)
    host = (conn.host or "").strip()
    if not host:
        raise ConnectionMisconfigured("no host (a URL, or a host name with schema, port and extra 'path')")
    if "://" in host:
        url = host
    else:
        scheme = conn.schema or conn.conn_type
        if scheme not in HTTP_TYPES:
            # Shown up to its first '/' only: a URL's path put here is a webhook's secret.
            raise ConnectionMisconfigured(
                f"schema {shown_location(scheme, with_path=False)!r} is not http or https (a connection given "
                "as a URI puts the URL's path in schema: give the whole URL as host instead)")
        path = extra.get("path", "")
        if not isinstance(path, str):
            raise ConnectionMisconfigured(f"extra 'path' must be a string, got {path!r}")
        port = f":{connection_port(conn, 0)}" if conn.port else ""
        url = f"{scheme}://{host}{port}/{path.lstrip('/')}"
    if urlsplit(url).scheme not in HTTP_TYPES or not urlsplit(url).hostname:
        raise ConnectionMisconfigured("the URL is not an http(s) URL with a host")
    return url
