"""`python -m tracegen` as an operator uses it: verify, export without clobbering, fleet validate, and errors
that come back as one line naming the culprit (exit 2), never a traceback.

The output root: 10 prompts; run A committed indices 0-4 (entry seg-a) and 5-7 (seg-b), all `stop`.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support.helpers import ROOT, make_config, prepare, root_of, write_dataset

from tracegen.cli import main
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
    config = make_config(dataset, tmp_path / "out")
    prepare(config, "run-a")
    output_root = root_of(config)
    first = output_root.commits.commit([_row(i) for i in range(5)], "run-a", 0, "seg-a")
    second = output_root.commits.commit([_row(i) for i in range(5, 8)], "run-a", 0, "seg-b")
    return tmp_path / "out", output_root, first, second


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _status(capsys, out: Path) -> dict:
    code, text, _ = run(capsys, "status", str(out), "--json")
    assert code == 0
    return json.loads(text)


# ---- verify --------------------------------------------------------------------------------------


def test_verify_names_damaged_parts_and_retire_makes_their_rows_work_again(root, capsys):
    out, output_root, first, second = root
    code, text, _ = run(capsys, "verify", str(out))
    assert code == 0 and "2 committed parts match their ledger entries (size and sha256)" in text

    part = out / second.part
    part.write_bytes(part.read_bytes()[:-7])  # truncated after its commit
    # Not silent: status checks sizes too, and neither counts the part's rows as done nor exits 0.
    code, text, _ = run(capsys, "status", str(out), "--json")
    assert code == 1 and json.loads(text)["done"] == 5

    code, text, _ = run(capsys, "verify", str(out))
    assert code == 1
    assert f"damaged: {second.part}: the part has" in text and f"(entry {second.entry}, 3 rows)" in text
    assert first.part not in text
    code, text, _ = run(capsys, "verify", str(out), "--quick")  # sizes from the listing find it too
    assert code == 1 and second.part in text

    code, text, _ = run(capsys, "verify", str(out), "--retire")
    assert code == 1 and "retired 1 of 2 entries: their 3 rows are work again" in text
    status = _status(capsys, out)
    assert (status["done"], status["left"]) == (5, 5)  # rows 5-7 are work again, derived from the ledger
    code, text, _ = run(capsys, "verify", str(out))
    assert code == 0 and "1 committed parts match" in text
    assert (out / second.entry).exists() and part.exists()  # retired, not deleted


# ---- export never clobbers -----------------------------------------------------------------------


def _manifest_and_files(dest: Path) -> tuple[dict, set[str]]:
    manifest = json.loads((dest / "manifest.json").read_text())
    for shard in manifest["shards"]:
        assert hashlib.sha256((dest / shard["name"]).read_bytes()).hexdigest() == shard["sha256"]
    return manifest, {p.name for p in dest.iterdir()}


def test_reexport_needs_overwrite_and_removes_stale_shards_only_after_publishing(root, tmp_path, capsys):
    out, *_ = root
    dest = tmp_path / "export"
    assert run(capsys, "export", str(out), str(dest), "--shard-rows", "3")[0] == 0
    first, files = _manifest_and_files(dest)
    assert len(first["shards"]) == 3 and files == {"manifest.json", *(s["name"] for s in first["shards"])}

    code, _, err = run(capsys, "export", str(out), str(dest), "--shard-rows", "100")
    assert code == 2 and "is not empty" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert _manifest_and_files(dest) == (first, files)  # untouched

    (dest / "NOTES.txt").write_text("the operator's own file")
    assert run(capsys, "export", str(out), str(dest), "--shard-rows", "100", "--overwrite")[0] == 0
    second, files = _manifest_and_files(dest)
    # One shard now; the three of the previous export are gone, a file that is not a shard is not.
    assert len(second["shards"]) == 1 and second["rows"] == first["rows"] == 8
    assert files == {"manifest.json", "NOTES.txt", second["shards"][0]["name"]}


def test_a_failed_export_leaves_the_previous_one_intact(root, tmp_path, capsys):
    out, _, _, second = root
    dest = tmp_path / "export"
    assert run(capsys, "export", str(out), str(dest), "--shard-rows", "3")[0] == 0
    before = _manifest_and_files(dest)
    (out / second.part).write_bytes(b"not gzip")  # feeds the last shards: the export fails midway
    code, _, err = run(capsys, "export", str(out), str(dest), "--shard-rows", "3", "--overwrite")
    assert code == 2 and second.part in err and "Traceback" not in err
    assert _manifest_and_files(dest) == before  # the old manifest, its shards whole, no half-written ones


@pytest.mark.parametrize("inside", ["ledger", "exports/final", "."])
def test_export_into_the_output_root_is_refused_and_the_root_still_works(root, capsys, inside):
    out, *_ = root
    code, _, err = run(capsys, "export", str(out), str(out / inside), "--overwrite")
    assert code == 2 and "is inside the output root" in err
    assert not (out / "exports").exists() and not (out / "ledger" / "manifest.json").exists()
    assert _status(capsys, out)["done"] == 8
    assert run(capsys, "verify", str(out))[0] == 0


def test_export_to_a_directory_holding_the_output_root_is_refused(root, capsys):
    out, *_ = root
    # --overwrite there would remove what is not the new export's: never offer that over a root.
    code, _, err = run(capsys, "export", str(out), str(out.parent), "--overwrite")
    assert code == 2 and "(or holds it)" in err
    assert (out / "dataset.json").exists()


# ---- errors: one line naming the culprit, exit 2 -------------------------------------------------


def test_a_corrupt_ledger_entry_is_one_line_naming_the_file(root):
    out, _, first, _ = root
    entry = json.loads((out / first.entry).read_text())
    entry["columns"]["index"][2] = "two"
    (out / first.entry).write_text(json.dumps(entry))
    for command in ("status", "export"):
        argv = [command, str(out)] + ([str(out.parent / "export")] if command == "export" else [])
        proc = subprocess.run(
            [sys.executable, "-m", "tracegen", *argv], capture_output=True, text=True,
            cwd=ROOT, env={"PYTHONPATH": str(ROOT / "include"), "PATH": "/usr/bin:/bin"}, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert first.entry in line and "row 2 column index holds 'two'" in line


def test_a_missing_part_and_a_missing_dataset_are_one_line_each(root, tmp_path, capsys):
    out, _, first, _ = root
    kept = (out / first.part).read_bytes()
    (out / first.part).unlink()
    code, _, err = run(capsys, "export", str(out), str(tmp_path / "e1"))  # a damaged part
    assert code == 2 and f"part {(out / first.part).as_uri()} is not what" in err and "the part is missing" in err
    assert len(err.splitlines()) == 1
    (out / first.part).write_bytes(kept)
    (tmp_path / "prompts.jsonl").unlink()
    code, _, err = run(capsys, "export", str(out), str(tmp_path / "e2"))  # DatasetError
    assert code == 2 and err.startswith("error: dataset ") and "prompts.jsonl" in err and len(err.splitlines()) == 1


# ---- a root that is not there: read-only commands create nothing ---------------


@pytest.mark.parametrize("command", ["status", "audit", "verify", "export"])
def test_a_mistyped_root_is_an_error_naming_it_and_nothing_is_created(tmp_path, capsys, command):
    typo = tmp_path / "ouput"
    argv = [command, str(typo)] + ([str(tmp_path / "export")] if command == "export" else [])
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"error: output root {typo} does not exist (nothing was created; check the path)\n"
    assert not typo.exists() and not (tmp_path / "export").exists()


def test_a_root_linked_to_a_missing_directory_is_named_not_file_exists(tmp_path, capsys):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "unmounted" / "out")
    for command in ("status", "verify"):
        code, _, err = run(capsys, command, str(link))
        assert code == 2 and "File exists" not in err
        assert err.startswith(f"error: output root {link} does not exist: it is a symbolic link to ")
        assert "unmounted/out" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "unmounted").exists()


def test_status_of_a_root_that_exists_but_holds_nothing_says_no_runs_yet(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, text, _ = run(capsys, "status", str(tmp_path / "empty"))
    assert code == 0 and "no runs yet" in text
    assert list((tmp_path / "empty").iterdir()) == []


def test_status_watch_of_a_run_with_nothing_left_prints_one_look_and_says_why_it_ended(root, capsys):
    """The live run is tests/include/tracegen/test_watch.py's; here: --json, and a log rather than a terminal."""
    out, output_root, _, _ = root
    output_root.commits.commit([_row(i) for i in (8, 9)], "run-a", 0, "seg-c")
    code, text, _ = run(capsys, "status", str(out), "--watch", "--json")
    looks = [json.loads(line) for line in text.splitlines()]
    assert code == 0 and len(looks) == 1, text
    assert (looks[0]["done"], looks[0]["total"], looks[0]["ended"]) == (10, 10, "done: nothing left at its cap")
    assert looks[0]["truncation_figures"] == _status(capsys, out)["truncation_figures"]
    code, text, _ = run(capsys, "status", str(out), "--watch")
    assert code == 0 and text.splitlines() == [
        f"run-a: 10/10 rows done · {text.splitlines()[0].split(' · ', 1)[1]}", "run-a: done: nothing left at its cap"]
    assert "ETA done" in text


def test_status_watch_ends_with_the_final_report_even_with_rows_left(root, capsys):
    out, output_root, _, _ = root
    output_root.run_files.put("run-a", "report.json", b"{}")  # the final audit ran: the run is over
    code, text, _ = run(capsys, "status", str(out), "--watch", "--json")
    assert code == 0 and json.loads(text)["ended"] == "ended: its final report is written, 2 rows left", text


# ---- fleet validate ------------------------------------------------------------------------------


def _fleet_file(tmp_path: Path, **over) -> Path:
    data = {"hosts": [{"conn_id": "gpu_a", "gpus": [0, 1]}], "model_path": "Qwen/Qwen3-8B",
            "sglang_flags": {"--max-running-requests": 64}}
    data.update(over)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(data))
    return path


def test_fleet_validate_accepts_a_good_file(tmp_path, capsys):
    code, text, _ = run(capsys, "fleet", "validate", str(_fleet_file(tmp_path)))
    assert code == 0 and "valid: 2 servers of Qwen/Qwen3-8B on gpu_a (GPUs 0, 1)" in text


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"sglang_flags": {"--cuda-graph-bs-decode": [8, "--host=0.0.0.0"]}}, "sglang_flags[--cuda-graph-bs-decode]"),
        ({"sglang_flags": {"--hos": "0.0.0.0"}}, "--hos abbreviates --host"),
        ({"bind_host": "0.0.0.0"}, "bind_host"),
        ({"hosts": [{"conn_id": "gpu_a", "gpus": [0, 0]}]}, "hosts[gpu_a].gpus"),
        ({"model_path": "a; rm -rf /"}, "model_path"),
        ({"unknown_field": 1}, "unknown field(s) ['unknown_field']"),
    ],
)
def test_fleet_validate_names_the_bad_field(tmp_path, capsys, over, needle):
    path = _fleet_file(tmp_path, **over)
    code, _, err = run(capsys, "fleet", "validate", str(path))
    assert code == 2 and needle in err and str(path) in err and len(err.splitlines()) == 1


def test_fleet_validate_of_a_file_that_is_not_json(tmp_path, capsys):
    path = tmp_path / "fleet.json"
    path.write_text('{"hosts": [')
    code, _, err = run(capsys, "fleet", "validate", str(path))
    assert code == 2 and "not valid JSON" in err
    code, _, err = run(capsys, "fleet", "validate", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err
