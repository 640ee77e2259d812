"""Damage shows wherever completeness is claimed, through `python -m tracegen`.

The output root: 10 prompts; run A committed indices 0-4 (entry seg-a) and 5-7 (seg-b), all `stop`, with a
truncation threshold of 50% (so 0 truncated of 8 is a clear pass). Damage is done to seg-b's part (3 rows)
after its commit: deleted, cut short, or re-written with other rows at the same size (still valid gzip).

- `status` runs the cheap verification (sizes, one listing), names a deleted or cut-short part and its rows,
  does not count them as done, and exits 1.
- `audit` cannot say pass over rows it cannot export: its verdict is `damaged`, naming the part.
- `export` hashes each part as it reads it and refuses one that differs from its ledger entry, naming it,
  before publishing a byte; the previous export in DEST stays as it was.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path

import pytest
from engine_support.helpers import make_config, prepare, root_of, write_dataset

from tracegen.cli import main
from tracegen.store.entries import decode_part
from tracegen.store.records import OK, GeneratedRow


def _row(i: int) -> GeneratedRow:
    return GeneratedRow(
        index=i, status=OK, max_tokens=4096, run_id="run-a", chunk=0, finish_reason="stop",
        content=f"answer {i}", reasoning_content=f"thinking {i}", prompt_tokens=30, completion_tokens=100,
        attempt=1, server="http://127.0.0.1:1",
    )  # fmt: skip


@pytest.fixture
def root(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 10)
    config = make_config(dataset, tmp_path / "out", truncation_threshold=0.5)
    prepare(config, "run-a")
    output_root = root_of(config)
    output_root.commits.commit([_row(i) for i in range(5)], "run-a", 0, "seg-a")
    second = output_root.commits.commit([_row(i) for i in range(5, 8)], "run-a", 0, "seg-b")
    return tmp_path / "out", second


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _damage(part: Path, how: str) -> None:
    if how == "deleted":
        part.unlink()
    elif how == "cut short":
        part.write_bytes(part.read_bytes()[:-7])
    else:
        raise AssertionError(how)


# ---- status and audit ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deleted", "cut short"])
def test_status_names_a_damaged_part_does_not_count_its_rows_and_exits_1(root, capsys, how):
    out, second = root
    code, text, _ = run(capsys, "status", str(out))
    assert code == 0 and "done:        8 / 10 (80.0%), 2 left" in text and "DAMAGED" not in text

    _damage(out / second.part, how)
    code, text, _ = run(capsys, "status", str(out))
    assert code == 1, text
    assert "done:        5 / 10 (50.0%), 5 left" in text  # rows 5-7 are not done: no export can write them
    assert "DAMAGED:     1 committed parts no longer match their ledger entries: their 3 rows" in text
    problem = "the part is missing" if how == "deleted" else "the part has"
    assert f"  {second.part}: {problem}" in text and "(3 rows)" in text
    assert f"python -m tracegen verify {out.as_uri()}/ --retire" in text

    code, raw, _ = run(capsys, "status", str(out), "--json")
    s = json.loads(raw)
    assert code == 1 and (s["done"], s["left"], s["completed"]) == (5, 5, 5)
    assert s["damaged_rows"] == 3
    assert [(d["part"], d["entry"], d["rows"]) for d in s["damaged"]] == [(second.part, second.entry, 3)]

    # Retired, the rows are work again and nothing is damaged any more: status agrees, and exits 0.
    assert run(capsys, "verify", str(out), "--retire")[0] == 1
    code, raw, _ = run(capsys, "status", str(out), "--json")
    s = json.loads(raw)
    assert code == 0 and (s["done"], s["left"], s["damaged"]) == (5, 5, [])


def _report(out: Path, name: str = "audit") -> dict:
    return json.loads((out / "runs" / "run-a" / f"{name}.json").read_text())


@pytest.mark.parametrize("how", ["deleted", "cut short"])
def test_the_audit_verdict_is_damaged_not_pass_naming_the_part(root, capsys, how):
    out, second = root
    code, text, _ = run(capsys, "audit", str(out))
    assert code == 0 and "gate: PASS" in text and _report(out)["verdict"]["verdict"] == "pass"

    _damage(out / second.part, how)
    code, text, _ = run(capsys, "audit", str(out))
    assert code == 1, text
    assert "gate: DAMAGED" in text and "gate: PASS" not in text
    assert second.part in text and "3 rows counted as done that cannot be exported" in text
    assert "verify OUTPUT_URI --retire" in text  # the `next:` line
    verdict = _report(out)["verdict"]
    assert verdict["verdict"] == "damaged" and verdict["blocks"] is False
    assert verdict["damaged_parts"] == [second.part] and verdict["damaged_rows"] == 3
    assert "truncation: pass" in verdict["reason"]  # what the truncation alone would have said
    html = (out / "runs" / "run-a" / "audit.html").read_text()
    assert 'class="verdict damaged"' in html and second.part in html


# ---- export checks every part's sha256 as it reads it ---------------------------------


def _same_size_forgery(part: Path) -> tuple[bytes, str]:
    """(the part's rows with the last one's answer changed, as valid gzip of exactly the part's size, that
    answer): sizes from a listing cannot tell it from the committed part. A few bytes short are made up
    with a gzip FNAME header field."""
    original = part.read_bytes()
    rows = [r.to_json() for r in decode_part(original, str(part))]
    for forged in ("answer 6", "answer 5", "", "forged"):
        rows[-1]["content"] = forged
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
        for level in range(9, 0, -1):
            data = gzip.compress(text, compresslevel=level, mtime=0)
            pad = len(original) - len(data) - 1  # FNAME: the name's bytes and a NUL
            if pad >= 1:
                buf = io.BytesIO()
                with gzip.GzipFile(filename="x" * pad, mode="wb", fileobj=buf, compresslevel=level, mtime=0) as f:
                    f.write(text)
                data = buf.getvalue()
            if len(data) == len(original):
                assert data != original
                assert decode_part(data, "forged")[-1].content == forged  # it decodes: only the hash can tell
                return data, forged
    raise AssertionError("no same-size forgery found")


def _files(dest: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.iterdir()}


def test_export_refuses_a_part_rewritten_at_the_same_size_and_keeps_the_previous_export(root, capsys, tmp_path):
    out, second = root
    dest = tmp_path / "export"
    assert run(capsys, "export", str(out), str(dest), "--shard-rows", "3")[0] == 0
    previous = _files(dest)

    part = out / second.part
    forged, answer = _same_size_forgery(part)
    part.write_bytes(forged)
    code, text, _ = run(capsys, "verify", str(out), "--quick")
    assert code == 0, text  # sizes from a listing cannot see it: that is what the export must catch

    code, _, err = run(capsys, "export", str(out), str(dest), "--shard-rows", "3", "--overwrite")
    assert code == 2, err
    assert f"part {part.as_uri()} is not what its ledger entry {second.entry} committed" in err
    assert "sha256 differs" in err and "nothing was published" in err and len(err.splitlines()) == 1
    assert _files(dest) == previous  # the previous manifest, its shards, nothing half-written, no lock
    for shard in json.loads((dest / "manifest.json").read_text())["shards"]:
        rows = [json.loads(line) for line in gzip.decompress((dest / shard["name"]).read_bytes()).splitlines()]
        assert all(r["messages"][-1]["content"] != answer for r in rows if r["index"] == 7)

    # Into a new destination too: nothing at all is left behind.
    code, _, err = run(capsys, "export", str(out), str(tmp_path / "fresh"), "--shard-rows", "3")
    assert code == 2 and second.part in err
    assert not (tmp_path / "fresh").exists() or list((tmp_path / "fresh").iterdir()) == []
