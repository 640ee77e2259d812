"""Where a run may read and write: the prefixes the operator configured, never what a trigger names.

Two settings, read from the environment of the process that checks (the Airflow workers' and the
dag-processor's; airflow.cfg and the environment are the operator's, an Airflow Variable would be any UI
user's with Variable permissions, so there is no Variable for this):

- `TRACEGEN_WRITE_PREFIXES`: where output roots and export destinations may be. Unset (or empty): the
  state directory (`TRACEGEN_STATE_DIR`, by default the project's `.state`), where the demo writes.
- `TRACEGEN_READ_PREFIXES`: where datasets and exported roots may be read from, besides every write
  prefix. Unset (or empty): the bundled sample data (`include/tracegen/sample_data`).

Each is a comma-separated list of absolute local paths, file:///... or s3://bucket[/prefix]. A local URI is
compared by its real path (links and `..` resolved, the prefix's too), so no `..` or link leads out of a
prefix; an S3 URI by bucket, then key prefix on a `/` boundary (`s3://b/team` holds `s3://b/team/x`, not
`s3://b/team-b`), and a key with a `.` or `..` segment is refused. URIs are read the way
`tracegen.store.storage.open_storage` and `tracegen.dataset.source` open them.

`shown_location` is how any location (a storage URI, a server's or a webhook's URL) is written into a log, a
report, a manifest or the question: without the credentials or tokens a URL can carry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

READ_SETTING = "TRACEGEN_READ_PREFIXES"
WRITE_SETTING = "TRACEGEN_WRITE_PREFIXES"
READ, WRITE = "read", "write"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # include/tracegen
SAMPLE_DATA_DIR = _PACKAGE_DIR / "sample_data"


def state_dir() -> Path:
    """Local state of the embedded default (demo output, simulated fleet's pid/log files, spool)."""
    return Path(os.environ.get("TRACEGEN_STATE_DIR") or _PACKAGE_DIR.parents[1] / ".state")


class LocationRefused(ValueError):
    """A URI outside the configured prefixes, or one that cannot be compared with them; the message names
    the param and the setting."""


@dataclass(frozen=True)
class Location:
    """A storage location as the storage opens it: `space` is 'file' or 's3://bucket', `path` a local real
    path or an S3 key prefix, without a trailing '/'."""

    space: str
    path: str

    def within(self, prefix: Location) -> bool:
        if self.space != prefix.space:
            return False
        if not prefix.path or self.path == prefix.path:
            return True
        return self.path.startswith(prefix.path.rstrip("/") + "/")

    def nests(self, other: Location) -> bool:
        """One of the two holds the other (or they are the same place)."""
        return self.within(other) or other.within(self)

    def __str__(self) -> str:
        return self.path if self.space == "file" else f"{self.space}/{self.path}"


def shown_location(uri: str, *, with_path: bool = True) -> str:
    """`uri` as it may be shown to whoever reads a log, a report, a manifest or the question: without
    userinfo (`user:password@`), query (a presigned URL's signature, a webhook's `?token=`) or fragment, and
    control characters escaped so a value cannot forge a log line. `with_path=False` keeps scheme and host
    only (an incoming webhook's path is its secret). A local path is shown as it is. Never raises: whatever
    `uri` is, the answer is a string that holds none of those parts."""
    if not isinstance(uri, str):
        return f"<{type(uri).__name__}, not a location>"
    text = uri.strip()
    if "://" in text:
        scheme, _, rest = text.partition("://")
        rest = rest.split("#", 1)[0].split("?", 1)[0]
        # Up to the first '/' is the authority; its userinfo ends at the last '@' in it.
        authority, slash, path = rest.partition("/")
        after_colon = authority.rpartition(":")[2]
        if "@" not in authority and ":" in authority and not after_colon.isdigit() and "@" in path:
            # `user:pass/word@host`: a password holding a '/' makes the authority look cut short; what
            # follows the last '@' is the host and path.
            authority, slash, path = rest.rpartition("@")[2].partition("/")
        authority = authority.rpartition("@")[2]
        text = f"{scheme}://{authority}" + (slash + path if with_path else "")
    elif not text.startswith("/"):
        # No scheme and not a path (`user:pw@host/x`, `host:8080?token=`): the same parts dropped.
        text = text.split("#", 1)[0].split("?", 1)[0]
        head, slash, tail = text.partition("/")
        text = head.rpartition("@")[2] + (slash + tail if with_path else "")
    return "".join(c if c.isprintable() else f"%{ord(c):02X}" for c in text)


def location(uri: str) -> Location:
    """The place `uri` names: a local path resolved (realpath), or an S3 bucket and key. ValueError for
    anything the storage would not open."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"expected a storage URI, got {uri!r}")
    uri = uri.strip()
    if uri.startswith("/"):
        return Location("file", os.path.realpath(uri))
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names a host; use file:///absolute/path")
        path = unquote(parsed.path)
        if not path.startswith("/"):
            raise ValueError(f"file URI {uri!r} is not absolute")
        return Location("file", os.path.realpath(path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"S3 URI {uri!r} has no bucket")
        key = parsed.path.strip("/")
        if any(p in (".", "..") for p in key.split("/")):
            raise ValueError(f"S3 URI {uri!r} has a '.' or '..' segment")
        return Location(f"s3://{parsed.netloc}", key)
    raise ValueError(f"{uri!r} is not an absolute local path, file:///... or s3://bucket/...")


def same_place(a: str, b: str) -> bool:
    """Whether two URIs name one location (a local one by real path)."""
    try:
        return location(a) == location(b)
    except ValueError:
        return False


def _defaults(setting: str) -> list[str]:
    return [str(state_dir())] if setting == WRITE_SETTING else [str(SAMPLE_DATA_DIR)]


def configured(setting: str) -> list[tuple[str, Location]]:
    """The prefixes `setting` lists (its default when unset or empty), each as written and as a place."""
    raw = os.environ.get(setting, "")
    entries = [e.strip() for e in raw.split(",") if e.strip()] or _defaults(setting)
    out = []
    for entry in entries:
        try:
            out.append((entry, location(entry)))
        except ValueError as exc:
            raise LocationRefused(f"{setting}: entry {entry!r} is not a prefix ({exc}); the operator must fix "
                                  "the setting") from None
    return out


def allowed(access: str) -> list[tuple[str, Location]]:
    """The prefixes under which `access` ('read' or 'write') is allowed: reading is allowed under every
    write prefix too."""
    if access == WRITE:
        return configured(WRITE_SETTING)
    if access == READ:
        return configured(READ_SETTING) + configured(WRITE_SETTING)
    raise ValueError(f"access must be {READ!r} or {WRITE!r}, got {access!r}")


def check(uri: str, *, access: str, name: str) -> Location:
    """The place `uri` names, if `access` is allowed there; else LocationRefused naming `name` (the param or
    setting the URI came from) and the setting that decides."""
    try:
        place = location(uri)
    except ValueError as exc:
        raise LocationRefused(f"{name}: {exc}") from None
    prefixes = allowed(access)
    if any(place.within(p) for _, p in prefixes):
        return place
    verb = "writing" if access == WRITE else "reading"
    settings = WRITE_SETTING if access == WRITE else f"{READ_SETTING} or {WRITE_SETTING}"
    shown = f" (resolved to {place})" if place.space == "file" and str(place) != uri.strip().removeprefix("file://") \
        else ""
    raise LocationRefused(
        f"{name}: {uri!r}{shown} is outside the prefixes the operator allows for {verb} ({settings}: "
        f"{', '.join(e for e, _ in prefixes)}); refused before anything was written"
    )
