"""What an export may replace at its destination, and what it removes once its manifest is published: only an
export of its own output root (the published manifest's `source`), and only the files that manifest listed,
plus the leftovers of killed exports no manifest lists."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime

from tracegen.common import locations
from tracegen.export.errors import ExportError
from tracegen.export.lock import MANIFEST
from tracegen.store.root import OutputRoot
from tracegen.store.storage import LocalStorage, Storage

log = logging.getLogger(__name__)

# Files of any export: this version's shards (`shard-<export id>-00000`), earlier ones' (`shard-00000`), and
# a trainer layout's data file (`data-<export id>/<layout>.jsonl`).
SHARD_RE = re.compile(
    r"shard-(?:(?P<time>\d{8}T\d{6}Z)-[0-9a-f]{8}-)?\d{5}\.(?:jsonl\.gz|parquet)"
    r"|data-(?P<dtime>\d{8}T\d{6}Z)-[0-9a-f]{8}/(?:tokens|conversations)\.jsonl"
)


def check_replaceable(root: OutputRoot, dest: Storage, previous: bytes | None, before: list[str]) -> None:
    """An export replaces only an export of its own output root, as the published manifest's `source` names
    it, or the unpublished files of killed exports; anything else is refused (only `force` replaces it)."""
    forced = "; nothing was written (from a shell, the operator's --force replaces it)"
    if previous is None:
        other = [k for k in before if not SHARD_RE.fullmatch(k)]
        if other:
            raise ExportError(f"export destination {dest.uri} holds {len(other)} objects that are no export "
                              f"(e.g. {other[0]}) and no {MANIFEST}: not replaced{forced}")
        return
    try:
        source = json.loads(previous)["source"]
    except (ValueError, KeyError, TypeError):
        source = None
    if not isinstance(source, str):
        raise ExportError(f"{dest.uri_for(MANIFEST)} does not name the output root it exports: not replaced{forced}")
    if not locations.same_place(source, root.storage.uri):
        raise ExportError(
            f"export destination {dest.uri} holds the export of another output root ({source[:300]}), not of "
            f"{root.storage.uri}: an export replaces only an export of the same root; choose another "
            f"destination{forced}"
        )


def manifest_shards(dest: Storage, manifest: bytes | None) -> list[str]:
    """The shard names a published manifest lists (a name that is not a shard's is never removed)."""
    if manifest is None:
        return []
    try:
        names = [s["name"] for s in json.loads(manifest)["shards"]]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("export: %s does not parse (%s); only unlisted shards of killed exports are removed",
                    dest.uri_for(MANIFEST), exc)
        return []
    return [n for n in names if isinstance(n, str) and SHARD_RE.fullmatch(n)]


def older_export(key: str, cutoff: float) -> bool:
    """A shard whose export began before `cutoff` (epoch seconds); False for other keys and undated names."""
    m = SHARD_RE.fullmatch(key)
    stamp = m and (m["time"] or m["dtime"])
    if not stamp:
        return False
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp() < cutoff


def remove(dest: Storage, keys: list[str]) -> None:
    for key in keys:
        try:
            dest.delete(key)
            if "/" in key and isinstance(dest, LocalStorage):  # a data file's folder, now empty
                (dest.root / key.rsplit("/", 1)[0]).rmdir()
        except Exception as exc:  # a cleanup failure must not hide the export's own outcome
            log.warning("export: could not remove %s: %s", dest.uri_for(key), exc)


def nested(a: str, b: str) -> bool:
    try:
        return locations.location(a).nests(locations.location(b))
    except ValueError:
        return False
