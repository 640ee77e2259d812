"""A dataset row's id as everything downstream names it, and the check, in the index pass, that no two rows
share one.

A row's id is its own `id` (a string or an integer, as text), or `index-<n>` for a row without one: the id a
trainer's file names it by. Two rows with one id would be exported as one prompt twice, or a prompt and its
neighbour's completion mixed by any reader joining on it, so a dataset where two rows share an id, their own
or a fallback (`index-3` given to row 7 while row 3 has none), is refused when indexed, naming both rows.

The pass sees every row anyway; it keeps 17 bytes a row plus the ids' text (tens of MB for a million rows), and
reads each row's `id` with msgspec, which skips the rest of the row without building it (several times faster
than json.loads on long prompts). A row whose id cannot be read is left to the row checks, which refuse it
when it is read (`dataset.reader.parse_row`); its fallback id still takes part, as its id would if it had one.
"""

from __future__ import annotations

import json
from array import array
from typing import Any

import msgspec
import numpy as np

from tracegen.dataset.source import DatasetError

FALLBACK_PREFIX = "index-"
# How many clashes the refusal lists: the first names the rows, the count says how many more there are.
_SHOWN = 5


def row_id(own_id: str | int | None, index: int) -> str:
    """The id a row is named by: its own, or `index-<n>` when it has none."""
    return str(own_id) if own_id is not None else f"{FALLBACK_PREFIX}{index}"


class _IdOnly(msgspec.Struct):
    id: str | int | None = None


_DECODE_ID = msgspec.json.Decoder(_IdOnly)
_DECODERS: dict[str, msgspec.json.Decoder] = {"id": _DECODE_ID}


def _decoder(field: str) -> msgspec.json.Decoder:
    """A decoder of one row's id, read from `field` (`dataset_fields` may name the dataset's own)."""
    if field not in _DECODERS:
        struct = msgspec.defstruct("IdOnly", [("id", str | int | None, None)], rename={"id": field})
        _DECODERS[field] = msgspec.json.Decoder(struct)
    return _DECODERS[field]


def _own_id(value: Any) -> str | int | None:
    """A row's own id as `parse_row` accepts it (a string or an integer, never a bool); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return value


def line_id(line: bytes, field: str = "id") -> str | int | None:
    """The id of one JSONL row (its `field`), as json.loads would read it (the last of repeated keys)."""
    try:
        return _decoder(field).decode(line).id
    except msgspec.ValidationError:
        return None  # not an object, or an id of another type: an invalid row, id-less
    except Exception:  # noqa: BLE001 - JSON msgspec refuses (NaN, a lone surrogate, nesting past its limit)
        pass  # is read as the rows are, and what json.loads refuses too is the row checks' to name
    try:
        obj = json.loads(line)
    except Exception:  # noqa: BLE001 - a malformed row is the row checks' to name
        return None
    return _own_id(obj.get(field)) if isinstance(obj, dict) else None


class RowIds:
    """Every row's id, added in row order during the index pass; `check()` refuses a clash. `field` is where
    a row holds its id."""

    def __init__(self, uri: str, field: str = "id") -> None:
        self.uri = uri
        self.field = field
        self.clear()

    def clear(self) -> None:
        """Forget every id added (a pass that starts again)."""
        self.rows = 0
        # Python's hash of each id's bytes (8 bytes a row): equal ids hash alike, and the pass needs the hashes
        # only while it runs, in this process.
        self._hashes = array("q")
        self._own = bytearray()  # 1 where the row has its own id, 0 where it has the fallback
        self._text = bytearray()  # the ids' UTF-8, one after another (to name a clash, and rule out a digest's)
        self._ends = array("q")

    def add_line(self, line: bytes) -> None:
        self.add(line_id(line, self.field))

    def add(self, own_id: Any) -> None:
        own = _own_id(own_id)
        # surrogatepass: an id with a lone surrogate is refused by the row checks; here it is still an id.
        text = row_id(own, self.rows).encode("utf-8", "surrogatepass")
        self._hashes.append(hash(text))
        self._own.append(own is not None)
        self._text += text
        self._ends.append(len(self._text))
        self.rows += 1

    def _text_of(self, row: int) -> str:
        begin = self._ends[row - 1] if row else 0
        return bytes(self._text[begin : self._ends[row]]).decode("utf-8", "surrogatepass")

    def _describe(self, row: int) -> str:
        return f"row {row}" if self._own[row] else f"row {row} (no id of its own, so named {self._text_of(row)!r})"

    def check(self) -> None:
        """Raise `DatasetError` naming the first two rows that share an id (and how many more clashes)."""
        if self.rows < 2:
            return
        hashes = np.frombuffer(self._hashes, dtype=np.int64)
        order = np.argsort(hashes, kind="stable")
        same = np.flatnonzero(hashes[order[1:]] == hashes[order[:-1]])
        clashes = []
        for k in same.tolist():
            a, b = sorted((int(order[k]), int(order[k + 1])))
            if self._text_of(a) == self._text_of(b):  # equal hashes of different ids are not a clash
                clashes.append((b, a))
        if not clashes:
            return
        clashes.sort()
        shown = "; ".join(f"{self._describe(a)} and {self._describe(b)} are both {self._text_of(a)!r}"
                          for b, a in clashes[:_SHOWN])
        more = f" (and {len(clashes) - _SHOWN} more)" if len(clashes) > _SHOWN else ""
        raise DatasetError(
            f"dataset {self.uri}: rows share an id: {shown}{more}. Rows are counted from 0, blank lines not "
            "counted. An export names each row by its id, so the ids must be unique: give each row its own id, "
            f"and none of the form {FALLBACK_PREFIX}<n> that a row without an id is named by"
        )
