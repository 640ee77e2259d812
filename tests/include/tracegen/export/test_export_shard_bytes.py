"""A shard encoded row by row as its rows are shaped holds the bytes the shard's whole text compressed at
once holds (the export's encoding before rows were streamed into their shard): same gzip framing, same
deflate stream, so shards and their sha256 in the manifest do not change. On the demo-sized root, with
token ids (long lines) and without."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from tracegen.export import export_dataset


def _at_once(lines: list[bytes]) -> bytes:
    """The shard as the export encoded it before: its rows' JSON text joined, then gzip.compress(mtime=0)."""
    docs = [json.loads(line) for line in lines]
    text = "".join(json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n" for d in docs)
    return gzip.compress(text.encode("utf-8"), mtime=0)


@pytest.mark.parametrize("with_token_ids", [False, True])
def test_a_streamed_shard_is_byte_identical_to_the_shard_compressed_at_once(demo_run, tmp_path, with_token_ids):
    dest = tmp_path / "export"
    export_dataset(str(demo_run.root), str(dest), shard_rows=1_000, with_token_ids=with_token_ids)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2 and manifest["rows"] > 2_000
    for shard in manifest["shards"]:
        data = (dest / shard["name"]).read_bytes()
        lines = gzip.decompress(data).splitlines()
        assert len(lines) == shard["rows"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert data == _at_once(lines), shard["name"]
