"""The audit report read through the lean ledger read (`store.ledger_rows`: the report's columns, strings as
codes) says exactly what it said from the whole ledger frame (`Snapshots.frame()`), figure for figure, on a
ledger with every kind of row a long run leaves: failures and their retries, rejected and invalid rows,
several servers (one slow, one unnamed), more categories than the report lists, truncation cut in thinking
and in the answer, runaways scored by the ledger and runaways only their parts show, the pivot's extended,
regenerated, measured and resampled rows, rows generated while the question waited, a snapshot with entries
on top, a retired entry and a damaged part."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_support.helpers import make_config, prepare, root_of, write_dataset

import tracegen.run.run_report as report_module
from tracegen.audit.cap_question import PILOT, CapDecision
from tracegen.run.run_record import read_run_record
from tracegen.store.layout import MEASURE_CHUNK, RESAMPLE_CHUNK
from tracegen.store.records import FAILED, INVALID, OK, REJECTED, GeneratedRow, pack_token_ids

N = 2_400
SERVERS = ("http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000", "http://10.0.0.4:30000")
LOOP = "again and again " * 200  # a tail that loops: a runaway by its text


def _row(i: int, run: str, cap: int, rng: np.random.Generator, *, chunk: int, scored: bool = True,
         **kw) -> GeneratedRow:
    """A generated row as a real run's: its length, cut, server, latency, category drawn from `rng`."""
    tokens = int(min(cap, rng.lognormal(7.2, 0.9)))
    cut = tokens >= cap
    thinking = cut and rng.random() < 0.6
    loops = cut and rng.random() < 0.2
    server = SERVERS[int(rng.integers(0, len(SERVERS)))]
    row = GeneratedRow(
        index=i, status=OK, max_tokens=cap, run_id=run, chunk=chunk, finish_reason="length" if cut else "stop",
        content="" if thinking else f"answer {i}", reasoning_content=(LOOP if loops else f"thinking about {i} ") * 2,
        prompt_tokens=int(rng.integers(200, 40_000)), completion_tokens=tokens,
        reasoning_tokens=tokens if thinking else tokens // 2, attempt=int(rng.integers(1, 3)), server=server,
        latency_s=float(rng.gamma(2.0, 6.0)) * (3.0 if server == SERVERS[3] else 1.0),
        category=None if i % 13 == 0 else f"cat-{int(rng.integers(0, 40)):02d}",
    )
    if cut and scored:  # judged as it was generated; an older row's is judged from its part
        row.runaway_score = 0.9 if loops else round(float(rng.random()) * 0.3, 4)
    for k, v in kw.items():
        setattr(row, k, v)
    return row


def _failure(i: int, run: str, cap: int, status: str, chunk: int, server: str = SERVERS[0]) -> GeneratedRow:
    error = {FAILED: f"timed out after {30 + i % 7} s on {server} (attempt {i % 5})",
             REJECTED: f"context overflow: {40_000 + i} prompt tokens + {cap} > 40960",
             INVALID: f"row {i}: messages[{i % 3}] has no role"}[status]
    return GeneratedRow(index=i, status=status, max_tokens=cap, run_id=run, chunk=chunk, server=server,
                        error=error, attempt=3, latency_s=0.0)


def _commit(root, rows: list[GeneratedRow], run: str, size: int) -> list:
    """`rows` committed in parts of at most `size`, a chunk's rows at a time, in order."""
    commits = []
    for chunk in dict.fromkeys(r.chunk for r in rows):
        mine = [r for r in rows if r.chunk == chunk]
        for start in range(0, len(mine), size):
            commits.append(root.commits.commit(mine[start : start + size], run, chunk, f"s{chunk}-{start:05d}"))
    return commits


@pytest.fixture
def ledger(tmp_path):
    """(root, the final run's spec with its answer): run A at 4096, then run B at 8192 (extend)."""
    rng = np.random.default_rng(30)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N)
    out = tmp_path / "out"
    prepare(make_config(dataset, out, max_tokens=4096), "run-a")
    root = root_of(make_config(dataset, out))
    rows_a: list[GeneratedRow] = []
    for i in range(N - 100):  # the last 100 indices are left for run B's while-asking chunk
        chunk = i // 500
        if i % 97 == 0:  # failed, then generated again: the failure superseded
            rows_a.append(_failure(i, "run-a", 4096, FAILED, chunk, server=SERVERS[i % 2] if i % 3 else ""))
        if i % 211 == 5:
            rows_a.append(_failure(i, "run-a", 4096, REJECTED, chunk))
        elif i % 307 == 7:
            rows_a.append(_failure(i, "run-a", 4096, INVALID, chunk, server=""))
        elif i % 389 == 11:
            rows_a.append(_failure(i, "run-a", 4096, FAILED, chunk, server=SERVERS[2]))  # still failed
        else:
            rows_a.append(_row(i, "run-a", 4096, rng, chunk=chunk, scored=chunk != 0))
    commits = _commit(root, rows_a, "run-a", 100)
    root.snapshots.compact()
    # Retired after the snapshot: its rows are in the snapshot and count nowhere.
    (out / commits[7].part).unlink()
    root.repair.retire(root.repair.verify_parts(deep=False))

    spec = prepare(make_config(dataset, out, max_tokens=8192), "run-b")
    cut = [r for r in rows_a if r.status == OK and r.finish_reason == "length"]
    rows_b: list[GeneratedRow] = []
    for n, r in enumerate(cut[:-40]):
        how = "regenerated" if n % 9 == 0 else "extended"
        chunk = MEASURE_CHUNK if n < 30 else r.chunk
        again = _row(r.index, "run-b", 8192, rng, chunk=chunk)
        again.completion_tokens = max(again.completion_tokens, r.completion_tokens + 1) if how == "extended" else \
            again.completion_tokens
        again.provenance = {"action": how, "tokens_before": r.completion_tokens if how == "extended" else 0,
                            **({"text": "joined"} if n % 4 == 1 else {})}
        rows_b.append(again)
    for n, r in enumerate(cut[-40:]):  # runaways generated once more at the same cap
        if n % 2:
            rows_b.append(_row(r.index, "run-b", 4096, rng, chunk=RESAMPLE_CHUNK,
                               provenance={"action": "resampled"}))
    # While the question waited: run B's last chunk at the recommended cap, some still cut.
    rows_b += [_failure(i, "run-b", 8192, FAILED, 4, server=SERVERS[i % 4] if i % 2 else "")
               for i in range(N - 100, N, 17)]  # then generated again below
    rows_b += [_failure(N - 99, "run-b", 8192, REJECTED, 4), _failure(N - 98, "run-b", 8192, INVALID, 4, server="")]
    rows_b += [_row(i, "run-b", 8192, rng, chunk=4, while_asking=True) for i in range(N - 100, N) if i not in
               (N - 99, N - 98)]
    pivot_ids = pack_token_ids(range(8))
    for r in rows_b[:50]:
        r.prompt_token_ids, r.response_token_ids = pivot_ids, pack_token_ids(range(r.completion_tokens % 50 + 1))
    _commit(root, rows_b, "run-b", 60)
    (out / commits[11].part).unlink()  # damaged, not retired: the final report names it
    answer = CapDecision(trigger=PILOT, option="8192", kind="recommended", from_cap=4096, cap=8192,
                         responded_by="reviewer", responded_at="2026-12-01T10:00:00+00:00", timed_out=False,
                         verdict={}, cap_rows=[], report_uri="")
    return root, replace(read_run_record(root, spec.run_id), decisions=(answer,))


def _report(spec, monkeypatch, *, whole: bool, **kw) -> tuple[dict, str]:
    """report.json (without its time of writing) and report.html, read through the lean read or the whole
    frame (the report's read as it was)."""
    with monkeypatch.context() as m:
        if whole:
            m.setattr(report_module, "ledger_rows", lambda root, columns: root.snapshots.frame())
        outcome = report_module.audit_and_report(spec, **kw)
    doc = json.loads(Path(outcome.json_uri.removeprefix("file://")).read_text())
    html = Path(outcome.html_uri.removeprefix("file://")).read_text()
    stamp = doc.pop("generated_at")
    return doc, html.replace(stamp, "")


@pytest.mark.parametrize("scope", ["final", "pilot"])
def test_the_report_is_the_same_through_the_lean_read(ledger, monkeypatch, scope):
    root, spec = ledger
    kw = {"name": f"{scope}-report", "tokens_per_s_per_gpu": 900.0}
    if scope == "pilot":
        kw["indices"] = np.arange(0, N, 3)
    lean, lean_html = _report(spec, monkeypatch, whole=False, **kw)
    whole, whole_html = _report(spec, monkeypatch, whole=True, **kw)
    for key in whole:
        assert lean[key] == whole[key], key
    assert lean == whole and lean_html == whole_html

    # The ledger exercised what it was built for: each figure below is one a wrong column would change.
    a = lean["audit"]
    assert a["rows"]["superseded_failed"] > 0 and a["errors"]["top_messages"]
    assert any(s["flags"] for s in a["by_server"]) and "(none)" in {s["server"] for s in a["by_server"]}
    assert "(other)" in {c["category"] for c in a["by_category"]} and "(none)" in {c["category"] for c in
                                                                                  a["by_category"]}
    assert a["truncation"]["cut_in_reasoning"] > 0 and a["truncation"]["cut_in_answer"] > 0
    assert lean["measurement"]["runaway"]["rows"] > 0 and lean["cap_table"] is not None
    if scope == "final":
        p = a["pivot"]
        assert p["extended"] and p["regenerated"] and p["extended_measuring"] and p["joined_seams"]
        assert lean["run"]["while_asking"]["rows"] == 98 and lean["measurement"]["runaway"]["resampled"] == 20
        assert a["invalid"]["rows"] > 0 and any("verify" in note for note in a["notes"])
        assert lean["verdict"]["verdict"] == "damaged"
        assert {"truncated_in_thinking", "truncated_in_answer", "error"} <= {e["outcome"] for e in lean["examples"]}
