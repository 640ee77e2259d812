"""A dataset file's bytes as rows: the scan that hashes every byte as it reads, multi-member gzip
decompression, and the non-blank lines of a byte stream. The index pass and the block reads share them, so a
row is the same row to both."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from tracegen.dataset.source import ByteSource, DatasetError

SCAN_BLOCK = 8 << 20
_WS = frozenset(b" \t\r\n\f\v")


def is_row(line: bytes) -> bool:
    # Almost every line starts with '{': skip the strip() copy for those.
    return bool(line) and (line[0] not in _WS or bool(line.strip()))


def scan(src: ByteSource, hasher: Any) -> Iterator[bytes]:
    """Every byte of `src`, a block at a time, each block fed to `hasher` as it is read."""
    size = src.size()
    pos = 0
    while pos < size:
        block = src.read(pos, min(SCAN_BLOCK, size - pos))
        if not block:
            raise DatasetError(f"dataset {src.uri}: short read at byte {pos} of {size}")
        hasher.update(block)
        pos += len(block)
        yield block


def fingerprint_source(src: ByteSource) -> str:
    """sha256 of every byte of `src`, as the index pass computes it."""
    hasher = hashlib.sha256()
    for _ in scan(src, hasher):
        pass
    return "sha256:" + hasher.hexdigest()


def gunzip_stream(uri: str, blocks: Iterable[bytes], on_member_end: Any = None) -> Iterator[bytes]:
    """Decompress a (multi-member) gzip stream; on_member_end(compressed_end_offset) at each member end."""
    d = zlib.decompressobj(31)
    fed = False  # the current member has seen input: ending now means the file was cut short
    consumed = 0
    try:
        for block in blocks:
            data = block
            while data:
                fed = True
                out = d.decompress(data)
                if out:
                    yield out
                if d.eof:
                    rest = d.unused_data
                    consumed += len(data) - len(rest)
                    if on_member_end is not None:
                        on_member_end(consumed)
                    d = zlib.decompressobj(31)
                    fed = False
                    data = rest
                else:
                    consumed += len(data)
                    data = b""
    except zlib.error as exc:
        raise DatasetError(f"dataset {uri}: corrupt gzip data near compressed byte {consumed} ({exc})") from None
    if fed:
        raise DatasetError(f"dataset {uri}: truncated gzip stream (ends inside a member at byte {consumed})")


def split_rows(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Non-blank lines of a byte stream cut at arbitrary places."""
    carry = b""
    for chunk in chunks:
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        for line in lines:
            if is_row(line):
                yield line
    if is_row(carry):
        yield carry
