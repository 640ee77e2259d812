"""Every row of a chunk's scope ends committed or recorded; a chunk reports success only when it counts so.

A row whose spool write failed used to vanish: `spool.append` raised inside an asyncio done-callback, the
loop only logged it, and the chunk succeeded without the row (a dataset `id` holding a lone UTF-16
surrogate: 8 of 10 rows committed and a success; a full disk took the same path). Now text no UTF-8 file can
hold is refused when the row is read, named like any invalid row; any other failure to spool a row fails the
chunk naming the row, after committing what the spool holds; and a chunk counts, in the ledger, that every
index it set out to generate has a row in a part it committed. Checked against a real stand-in over HTTP.
"""

from __future__ import annotations

import errno
import json

import pytest
from engine_support.helpers import (
    assert_healthy,
    endpoints,
    make_config,
    prepare,
    prompt,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.generate import engine as engine_module
from tracegen.generate.engine import InvalidRowError, RowNotSpooled, RowsUnaccounted
from tracegen.store.records import INVALID, OK
from tracegen.store.spool import Spool

FAST = dict(sim_time_scale=2000, sim_length_model="short", log_level="warning")
N = 10
# Valid JSON, as json.dumps writes a lone surrogate: `"\ud800"`.
SURROGATES = {3: json.dumps({**prompt(3), "id": "p3-\ud800"}), 7: json.dumps({**prompt(7), "category": "x\udfff"})}


def _committed_indices(config) -> list[int]:
    return sorted(root_of(config).snapshots.frame()["index"].tolist())


def test_a_row_with_a_lone_surrogate_is_refused_naming_the_row(tmp_path, sim_server):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N, bad=SURROGATES)
    config = make_config(dataset, tmp_path / "out", invalid_rows="record")
    prepare(config, "run-text")
    summary = run_engine(config, "run-text", endpoints(sim), tmp_path / "spool", range(N))
    assert summary.statuses == {OK: 8, INVALID: 2}
    frame = assert_healthy(root_of(config), N, config)
    assert sorted(frame["index"].tolist()) == list(range(N)), "every row of the chunk is committed or recorded"
    invalid = frame[frame["status"] == INVALID].set_index("index")["error"]
    assert sorted(invalid.index) == [3, 7]
    assert invalid[3].startswith("id holds a lone UTF-16 surrogate")
    assert invalid[7].startswith("category holds a lone UTF-16 surrogate")

    strict = make_config(dataset, tmp_path / "strict", invalid_rows="fail")
    prepare(strict, "run-strict")
    with pytest.raises(InvalidRowError, match=r"row 3: id holds a lone UTF-16 surrogate"):
        run_engine(strict, "run-strict", endpoints(sim), tmp_path / "spool", range(N))


class _FullDiskAt(Spool):
    """A spool whose disk is full when row 5 is written (the row's tokens were paid for; its line is not)."""

    def append(self, row):
        if row.index == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().append(row)


def test_a_spool_write_failure_fails_the_chunk_naming_the_row_and_loses_nothing(tmp_path, sim_server, monkeypatch):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N)
    config = make_config(dataset, tmp_path / "out", part_rows=3)
    prepare(config, "run-full")
    monkeypatch.setattr(engine_module, "Spool", _FullDiskAt)
    with pytest.raises(RowNotSpooled, match=r"row 5 could not be written to the spool \(OSError: .*No space left"):
        run_engine(config, "run-full", endpoints(sim), tmp_path / "spool", range(N))
    first = _committed_indices(config)
    assert 5 not in first and first, "what was spooled before the failure is committed"
    monkeypatch.setattr(engine_module, "Spool", Spool)

    again = run_engine(config, "run-full", endpoints(sim), tmp_path / "spool", range(N))
    assert again.already_done == len(first) and again.generated == N - len(first)
    frame = assert_healthy(root_of(config), N, config)
    assert sorted(frame["index"].tolist()) == list(range(N)), "nothing lost, nothing twice"
    assert (frame["status"] == OK).all()


class _SilentlyDrops(Spool):
    """A spool that says it stored row 5 and did not: only the chunk's own count can notice."""

    def append(self, row):
        if row.index != 5:
            super().append(row)


def test_a_chunk_succeeds_only_when_its_ledger_counts_every_row(tmp_path, sim_server, monkeypatch):
    sim = sim_server(**FAST)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N)
    config = make_config(dataset, tmp_path / "out")
    prepare(config, "run-count")
    monkeypatch.setattr(engine_module, "Spool", _SilentlyDrops)
    with pytest.raises(RowsUnaccounted, match=r"1 of the 10 rows it generated are neither committed nor recorded "
                                              r"in the ledger \(rows 5\)"):
        run_engine(config, "run-count", endpoints(sim), tmp_path / "spool", range(N))
    assert _committed_indices(config) == [i for i in range(N) if i != 5]
