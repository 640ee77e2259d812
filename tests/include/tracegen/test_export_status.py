"""`tracegen.status` and `tracegen.export` against a small output root whose answers are worked out by hand.

The root: 10 prompts; run A (max_tokens=4096) committed indices 0-5 `stop`, 6 `length`, 7 `failed`,
8 `rejected`; run B (8192, regenerate) committed index 6 again, now `stop`. Index 9 was never generated.
By hand, for the newest run (B, cap 8192): done = 0-6 and 8 (a context overflow at 4096 overflows at
8192 too) = 8, left = 7 and 9 = 2; current rows ok = 0-6 = 7; failed 1, rejected 1, truncated 0.
Export: rows 0-6, row 6 from run B; three shards of 3, 3, 1 rows.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path

import pandas as pd
import pytest
from engine_support.helpers import make_config, prepare, prompt, root_of, write_dataset

from tracegen.export import ExportError, export_dataset
from tracegen.status import dataset_status, format_status
from tracegen.store.records import FAILED, OK, REJECTED, GeneratedRow


def _row(i: int, run: str, cap: int, status: str = OK, finish: str | None = "stop", tokens: int = 100) -> GeneratedRow:
    ok = status == OK
    return GeneratedRow(
        index=i, status=status, max_tokens=cap, run_id=run, chunk=0, finish_reason=finish if ok else None,
        content=f"answer {i} under {cap}" if ok else None, reasoning_content=f"thinking {i}" if ok else None,
        prompt_tokens=30 if ok else 0, completion_tokens=tokens if ok else 0, reasoning_tokens=tokens // 2 if ok else 0,
        attempt=1, server="http://127.0.0.1:1", error=None if ok else f"{status} on purpose",
    )


@pytest.fixture
def root(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 10)
    out = tmp_path / "out"
    a = make_config(dataset, out, max_tokens=4096)
    prepare(a, "run-a")
    output_root = root_of(a)
    rows_a = [_row(i, "run-a", 4096, tokens=100 + i) for i in range(6)]
    rows_a += [_row(6, "run-a", 4096, finish="length", tokens=4096), _row(7, "run-a", 4096, status=FAILED),
               _row(8, "run-a", 4096, status=REJECTED)]
    output_root.commits.commit(rows_a[:5], "run-a", 0, "seg-a1")
    output_root.commits.commit(rows_a[5:], "run-a", 0, "seg-a2")
    b = make_config(dataset, out, max_tokens=8192, truncated_policy="regenerate")
    prepare(b, "run-b")
    output_root.commits.commit([_row(6, "run-b", 8192, tokens=5000)], "run-b", 0, "seg-b1")
    assert output_root.repair.check_invariants() == []
    return out, output_root


def test_status_counts_agree_with_the_hand_count_and_the_ledger(root):
    out, output_root = root
    s = dataset_status(str(out))
    assert s["newest_run"] == "run-b" and s["max_tokens"] == 8192 and s["truncated_policy"] == "regenerate"
    assert (s["total"], s["done"], s["left"]) == (10, 8, 2)
    assert (s["completed"], s["failed"], s["rejected"], s["invalid"], s["truncated"]) == (7, 1, 1, 0, 0)
    assert s["finish_reasons"] == {"stop": 7}
    assert s["completion_tokens"] == sum(100 + i for i in range(6)) + 5000
    assert s["ledger_rows"] == len(output_root.snapshots.frame()) == 10
    runs = {r["run_id"]: r for r in s["runs"]}
    assert [r["run_id"] for r in s["runs"]] == ["run-a", "run-b"]
    assert (runs["run-a"]["rows"], runs["run-a"]["ok"], runs["run-a"]["length"], runs["run-a"]["failed"]) == (9, 7, 1, 1)
    assert (runs["run-b"]["rows"], runs["run-b"]["ok"], runs["run-b"]["max_tokens"]) == (1, 1, 8192)

    text = format_status(s)
    assert "done:        8 / 10 (80.0%), 2 left" in text
    assert "rows:        7 completed, 1 failed, 1 rejected, 0 invalid" in text
    assert "newest run:  run-b (max_tokens=8192, truncated rows: regenerate)" in text
    assert "(10 rows," in text


def test_run_progress_counts_the_truncation_figures_from_its_own_read(root):
    """The progress page's figures come with the progress, from its lean read of the ledger, and count what
    the whole frame counts (the page read the whole frame for them before: twice the memory)."""
    from tracegen.audit.figures import figures_from_ledger
    from tracegen.run.run_record import read_run_record
    from tracegen.status import run_progress

    _, output_root = root
    for run, cap in (("run-a", 4096), ("run-b", 8192)):
        progress = run_progress(output_root, read_run_record(output_root, run))
        want = figures_from_ledger(output_root.snapshots.frame(), cap)
        assert {k: tuple(v) for k, v in progress["truncation_figures"].items()} == want, run
    assert progress["truncation_figures"] != run_progress(output_root, read_run_record(output_root, "run-a"))[
        "truncation_figures"]  # index 6: cut at 4096, finished at 8192


def test_status_of_an_empty_root_says_so(tmp_path):
    s = dataset_status(str(tmp_path / "nothing"))
    assert s["runs"] == [] and s["ledger_rows"] == 0
    assert "no runs yet" in format_status(s)


def _shard_rows(dest, shard, fmt):
    data = (dest / shard["name"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == shard["sha256"], f"{shard['name']}: checksum mismatch"
    if fmt == "jsonl":
        return [json.loads(line) for line in gzip.decompress(data).splitlines()]
    frame = pd.read_parquet(io.BytesIO(data))
    rows = frame.to_dict("records")
    for r in rows:
        r["messages"] = json.loads(r["messages"])
    return rows


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_has_every_exportable_index_once_with_matching_checksums(root, tmp_path, fmt):
    out, _ = root
    dest = tmp_path / f"export-{fmt}"
    result = export_dataset(str(out), str(dest), fmt=fmt, shard_rows=3)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert (result.rows, result.shards) == (7, 3)
    assert manifest["rows"] == 7 and manifest["format"] == fmt and manifest["newest_run"] == "run-b"
    assert manifest["left_out"] == {"truncated": 0, "runaway": 0, "not_ok_or_missing": 3}
    assert manifest["superseded_ledger_rows"] == 1
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 1]
    assert [(s["first_index"], s["last_index"]) for s in manifest["shards"]] == [(0, 2), (3, 5), (6, 6)]
    rows = [r for shard in manifest["shards"] for r in _shard_rows(dest, shard, fmt)]
    assert [r["index"] for r in rows] == list(range(7))
    by_index = {r["index"]: r for r in rows}
    # Index 6: the 8192 `stop` row supersedes the 4096 truncation.
    assert (by_index[6]["run_id"], by_index[6]["max_tokens"], by_index[6]["finish_reason"]) == ("run-b", 8192, "stop")
    assert by_index[6]["messages"][-1] == {"role": "assistant", "content": "answer 6 under 8192",
                                           "reasoning_content": "thinking 6"}
    for i, r in by_index.items():
        assert r["messages"][:-1] == prompt(i)["messages"] and r["id"] == f"p{i}"
    assert manifest["finish_reasons"] == {"stop": 7}


def test_export_with_truncated_rows_and_without_runs(root, tmp_path):
    out, output_root = root
    # A 4096 truncation nobody regenerated yet (index 9) is left out unless asked for.
    output_root.commits.commit([_row(9, "run-b", 8192, finish="length", tokens=8192)], "run-b", 0, "seg-b2")
    plain = export_dataset(str(out), str(tmp_path / "e1"))
    assert plain.rows == 7
    manifest = json.loads((tmp_path / "e1" / "manifest.json").read_text())
    assert manifest["left_out"]["truncated"] == 1
    with_cut = export_dataset(str(out), str(tmp_path / "e2"), include_truncated=True, shard_rows=100)
    assert with_cut.rows == 8
    with pytest.raises(ExportError, match="no run has been planned"):
        export_dataset(str(tmp_path / "empty"), str(tmp_path / "e3"))
    with pytest.raises(ExportError, match="format 'csv'"):
        export_dataset(str(out), str(tmp_path / "e4"), fmt="csv")


def test_status_rate_and_eta_follow_recent_commits(root):
    import time

    out, output_root = root
    # run-b committed one row just now: a rate over the window, and an ETA for the 2 rows left.
    s = dataset_status(str(out), now=time.time() + 1.0)
    assert s["rows_per_s"] is not None and s["rows_per_s"] > 0
    assert s["eta_s"] == pytest.approx(2 / s["rows_per_s"])
    # An hour later nothing was committed within the window: idle, no made-up ETA.
    later = dataset_status(str(out), now=time.time() + 3600)
    assert later["rows_per_s"] is None and later["eta_s"] is None
    assert "idle" in format_status(later)


def test_the_rerun_retires_a_lost_part_and_the_final_report_names_it(root):
    """Silent loss is seen where it matters: the final report names a part that no longer matches its entry,
    and the scheduled rerun retires it, so its rows are work again instead of 'done' forever."""
    from engine_support.helpers import rerun_work

    from tracegen.run.run_record import read_run_record
    from tracegen.run.run_report import audit_and_report

    out, output_root = root
    (part,) = [output_root.commits.read_entry(k)["part"] for k in output_root.commits.entries() if "seg-a1" in k]
    (out / part).unlink()  # rows 0-4, committed
    status = dataset_status(str(out))  # status checks sizes: the lost rows are not done, and it says why
    assert status["done"] == 3 and [d["part"] for d in status["damaged"]] == [part]

    report = json.loads(Path(audit_and_report(read_run_record(output_root, "run-b"), name="report").json_uri
                             .removeprefix("file://")).read_text())
    assert any(part in note and "verify" in note for note in report["audit"]["notes"]), report["audit"]["notes"]

    work = rerun_work(str(out))
    assert [(w.work.start, w.work.remaining) for w in work] == [(0, 7)]  # 0-4 lost, 7 failed, 9 never sent
    assert dataset_status(str(out))["done"] == 3


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_status_report_and_export_say_what_the_extend_pivot_did(tmp_path, fmt):
    """Run A (4096) cut index 1; run C (8192, extend) continued it from its tokens: 4096 reused, 1000 new."""
    from tracegen.run.run_record import read_run_record
    from tracegen.run.run_report import audit_and_report
    from tracegen.store.records import pack_token_ids

    dataset = write_dataset(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "out"
    prepare(make_config(dataset, out, max_tokens=4096), "run-a")
    output_root = root_of(make_config(dataset, out))
    prompt_ids = pack_token_ids([1, 2, 3])
    rows = [_row(0, "run-a", 4096), _row(1, "run-a", 4096, finish="length", tokens=4096), _row(2, "run-a", 4096)]
    for r in rows:
        r.prompt_token_ids, r.response_token_ids = prompt_ids, pack_token_ids(range(r.completion_tokens))
    output_root.commits.commit(rows, "run-a", 0, "seg-a")
    prepare(make_config(dataset, out, max_tokens=8192), "run-c")
    whole = _row(1, "run-c", 8192, tokens=5096)
    whole.prompt_token_ids, whole.response_token_ids = prompt_ids, pack_token_ids(range(5096))
    whole.provenance = {"action": "extended", "policy": "extend", "tokens_before": 4096, "tokens_after": 5096,
                        "new_tokens": 1000, "supersedes": {"part": "parts/run-a/c00000-seg-a.jsonl.gz", "index": 1,
                                                           "max_tokens": 4096}}
    output_root.commits.commit([whole], "run-c", 0, "seg-c")

    s = dataset_status(str(out))
    assert s["truncated_policy"] == "extend" and (s["done"], s["left"]) == (3, 0)
    assert s["pivot"]["extended"] == 1 and s["pivot"]["extended_new_tokens"] == 1000
    assert s["pivot"]["tokens_saved"] == 4096 and s["pivot"]["tokens_spent"] == 1000
    runs = {r["run_id"]: r for r in s["runs"]}
    assert runs["run-c"]["extended"] == 1 and runs["run-a"]["extended"] == 0
    text = format_status(s)
    assert "pivot:       1 rows extended from their tokens (1 now finish), 1,000 new tokens spent, 4,096 saved" in text
    assert "extended 1" in text

    report = audit_and_report(read_run_record(output_root, "run-c"), name="report")
    doc = json.loads(Path(report.json_uri.removeprefix("file://")).read_text())
    assert doc["audit"]["pivot"]["extended"] == 1 and "pivot: 1 rows extended" in doc["summary"]
    assert "The pivot" in Path(report.html_uri.removeprefix("file://")).read_text()

    dest = tmp_path / f"export-{fmt}"
    export_dataset(str(out), str(dest), fmt=fmt, with_token_ids=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    got = {r["index"]: r for shard in manifest["shards"] for r in _shard_rows(dest, shard, fmt)}
    assert manifest["extended_rows"] == 1 and manifest["with_token_ids"] is True
    assert got[1]["extended"] and not got[0]["extended"] and got[1]["run_id"] == "run-c"
    assert list(got[1]["prompt_token_ids"]) == [1, 2, 3] and list(got[1]["response_token_ids"]) == list(range(5096))
    plain = tmp_path / f"plain-{fmt}"
    export_dataset(str(out), str(plain), fmt=fmt)
    first = _shard_rows(plain, json.loads((plain / "manifest.json").read_text())["shards"][0], fmt)[0]
    assert "response_token_ids" not in first  # ids only when asked for: they double the export's size
