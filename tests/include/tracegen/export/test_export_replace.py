"""An export writes only under the operator's write prefixes, and replaces only an export of its own output root.

Before, `tracegen_export` replaced a published export of one root with another root's rows (and removed the old
files), and created a directory tree wherever its conf said. Now a destination outside TRACEGEN_WRITE_PREFIXES
(or a root outside the read prefixes) is refused with nothing written; a destination holding anything needs
`overwrite` (the DAG's `replace_existing_export`, the CLI's `--overwrite`), which replaces only an export whose
manifest names the same root; another root's export, or files that are no export, stay byte for byte unless the
operator forces it from a shell (`--force`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support.helpers import ROOT, make_config, prepare, root_of, write_dataset

from tracegen.export import ExportError, export_dataset
from tracegen.store.records import OK, GeneratedRow, pack_token_ids

ROWS = 6
WRITE = "TRACEGEN_WRITE_PREFIXES"


def _root(base: Path, name: str, rows: int = ROWS) -> Path:
    dataset = write_dataset(base / f"{name}.jsonl", rows)
    config = make_config(dataset, base / name)
    prepare(config, "run-a")
    root_of(config).commits.commit(
        [GeneratedRow(index=i, status=OK, max_tokens=4096, run_id="run-a", chunk=0, finish_reason="stop",
                      content=f"{name} {i}", reasoning_content="t", prompt_tokens=3, completion_tokens=4, attempt=1,
                      server="http://127.0.0.1:1", prompt_token_ids=pack_token_ids(range(3)),
                      response_token_ids=pack_token_ids([7, 8, 9, 151645])) for i in range(rows)], "run-a", 0, "seg-a")
    return base / name


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def allowed(tmp_path, monkeypatch) -> Path:
    base = tmp_path / "allowed"
    base.mkdir()
    monkeypatch.setenv(WRITE, str(base))
    return base


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracegen", "export", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "include"), **env}, timeout=180)


def test_a_destination_outside_the_write_prefixes_is_never_created(allowed, tmp_path):
    root = _root(allowed, "root-a")
    for dest in (tmp_path / "elsewhere" / "export", allowed / ".." / "escaped", Path("/proc/self/tracegen-export")):
        with pytest.raises(ExportError, match=r"dest_uri: .* outside the prefixes .*TRACEGEN_WRITE_PREFIXES"):
            export_dataset(str(root), str(dest), overwrite=True)
        assert not dest.exists()
    (allowed / "link").symlink_to(tmp_path)
    with pytest.raises(ExportError, match="dest_uri: .*resolved to"):
        export_dataset(str(root), str(allowed / "link" / "export"))
    assert not (tmp_path / "export").exists()


def test_a_root_outside_the_read_prefixes_is_not_exported(allowed, tmp_path, monkeypatch):
    monkeypatch.setenv(WRITE, str(tmp_path))
    root = _root(tmp_path, "root-a")
    monkeypatch.setenv(WRITE, str(allowed))
    with pytest.raises(ExportError, match="output_uri: .* outside the prefixes .*TRACEGEN_READ_PREFIXES"):
        export_dataset(str(root), str(allowed / "export"))
    assert not (allowed / "export").exists()


def test_another_roots_export_is_never_replaced_and_stays_byte_identical(allowed):
    dest = allowed / "export"
    published = export_dataset(str(_root(allowed, "root-a")), str(dest), layout="tokens")
    assert published.rows == ROWS
    before = _files(dest)
    other = _root(allowed, "root-b", rows=2)

    with pytest.raises(ExportError, match="is not empty .*replace_existing_export"):
        export_dataset(str(other), str(dest), layout="tokens")
    with pytest.raises(ExportError, match=r"holds the export of another output root .*root-a"):
        export_dataset(str(other), str(dest), layout="tokens", overwrite=True)
    assert _files(dest) == before


def test_the_same_roots_export_is_replaced_when_asked(allowed):
    root, dest = _root(allowed, "root-a"), allowed / "export"
    first = export_dataset(str(root), str(dest), layout="tokens")
    second = export_dataset(str(root), str(allowed / "." / "export"), layout="conversations", overwrite=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["export_id"] == second.export_id != first.export_id and manifest["layout"] == "conversations"
    assert not (dest / first.data_uri.rsplit("/", 2)[-2]).exists()  # the replaced export's files are gone


def test_files_that_are_no_export_are_not_written_over(allowed):
    dest = allowed / "someones-data"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="objects that are no export .*notes.txt"):
        export_dataset(str(_root(allowed, "root-a")), str(dest), overwrite=True)
    assert _files(dest) == {"notes.txt": b"mine"}


def test_the_cli_is_the_operators_it_overwrites_its_own_roots_export_and_forces_another(allowed, tmp_path):
    # Not bound by the prefixes (the operator's shell may write where its user can), but --overwrite still
    # refuses another root's export; --force replaces it.
    env = {WRITE: str(allowed)}
    dest = tmp_path / "exports" / "drafter"
    a, b = _root(allowed, "root-a"), _root(allowed, "root-b", rows=2)
    assert _cli(str(a), str(dest), "--layout", "tokens", env=env).returncode == 0
    assert _cli(str(a), str(dest), "--layout", "tokens", "--overwrite", env=env).returncode == 0
    before = _files(dest)
    refused = _cli(str(b), str(dest), "--layout", "tokens", "--overwrite", env=env)
    assert refused.returncode == 2 and "another output root" in refused.stderr and "--force" in refused.stderr
    assert _files(dest) == before
    forced = _cli(str(b), str(dest), "--layout", "tokens", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["rows"] == 2 and manifest["source"] == b.as_uri() + "/"
