"""The trainer layouts on a small root worked out by hand, the bounded ledger read against the
whole frame, and a trainer layout's file streamed to S3.

The root: 6 prompts; run A (4096) committed 0-3 `stop` with token ids, 4 `length`, 5 `stop` without ids
(a server that did not return them); run B (8192, extend) continued 4 from its ids to `stop`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_support.helpers import make_config, prepare, prompt, root_of, write_dataset

from tracegen.export import EXPORT_COLUMNS, ExportError, export_dataset
from tracegen.export.layouts import mask_json
from tracegen.store.current import current_mask, current_rows
from tracegen.store.ledger_rows import ledger_rows
from tracegen.store.records import OK, GeneratedRow, pack_token_ids

EOT = 151645


def _row(i: int, run: str, cap: int, n: int, finish: str = "stop", ids: bool = True, **kw) -> GeneratedRow:
    row = GeneratedRow(index=i, status=OK, max_tokens=cap, run_id=run, chunk=0, finish_reason=finish,
                       content=f"answer {i}", reasoning_content=f"thinking {i}", prompt_tokens=4 + i,
                       completion_tokens=n, reasoning_tokens=n // 2, attempt=1, **kw)
    if ids:
        row.prompt_token_ids = pack_token_ids(range(10, 14 + i))
        row.response_token_ids = pack_token_ids([*range(1000, 1000 + n - 1), EOT if finish == "stop" else 7])
    return row


@pytest.fixture
def root(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 6)
    out = tmp_path / "out"
    a = make_config(dataset, out, max_tokens=4096)
    prepare(a, "run-a")
    output_root = root_of(a)
    rows = [_row(i, "run-a", 4096, 5 + i) for i in range(4)]
    rows += [_row(4, "run-a", 4096, 4096, finish="length"), _row(5, "run-a", 4096, 9, ids=False)]
    output_root.commits.commit(rows, "run-a", 0, "seg-a")
    prepare(make_config(dataset, out, max_tokens=8192), "run-b")
    whole = _row(4, "run-b", 8192, 5000, provenance={"action": "extended", "tokens_before": 4096})
    output_root.commits.commit([whole], "run-b", 0, "seg-b")
    return out, output_root


def test_tokens_rows_are_prompt_then_response_ids_with_the_mask_at_the_boundary(root, tmp_path):
    out, _ = root
    dest = tmp_path / "tokens"
    result = export_dataset(str(out), str(dest), layout="tokens")
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    assert result.rows == manifest["rows"] == 5 and manifest["left_out"]["no_token_ids"] == 1
    assert [r["id"] for r in rows] == ["p0", "p1", "p2", "p3", "p4"]
    for i, r in enumerate(rows):
        n = 5000 if i == 4 else 5 + i
        assert r["input_ids"] == [*range(10, 14 + i), *range(1000, 1000 + n - 1), EOT]
        assert r["loss_mask"] == [0] * (4 + i) + [1] * n
    assert manifest["provenance_counts"] == {"first_generation": 4, "extended": 1, "measured": 0,
                                             "regenerated": 0, "resampled": 0}
    assert manifest["end_of_turn"]["token_id"] == EOT and manifest["end_of_turn"]["all_finished_rows_end_with_it"]
    assert manifest["lengths"]["total"]["max"] == 8 + 5000 == manifest["trainers"]["specforge"]["data.max_length"]
    assert manifest["lengths"]["prompt"]["max"] == 8 and manifest["lengths"]["response"]["min"] == 5
    assert manifest["provenance"]["servers"] is None and "servers.json" in manifest["provenance"]["servers_note"]
    assert manifest["provenance"]["runs"] == ["run-a", "run-b"]


def test_conversations_rows_carry_the_generated_turn_and_nothing_else(root, tmp_path):
    out, _ = root
    dest = tmp_path / "conv"
    export_dataset(str(out), str(dest), layout="conversations")
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"id", "conversations", "tools"} for r in rows)
    # Part by part, a part's rows in index order: run A's part, then run B's extension of index 4.
    assert [r["id"] for r in rows] == ["p0", "p1", "p2", "p3", "p5", "p4"]
    assert rows[-1]["conversations"] == [*prompt(4)["messages"], {
        "role": "assistant", "content": "answer 4", "reasoning_content": "thinking 4"}]
    assert manifest["prompts"] == {"rows_without_system_prompt": 0, "rows_with_assistant_history": 0,
                                   "max_turns": 3}
    assert manifest["trainers"]["specforge"]["data.train_only_last_turn"] is True


def test_a_trainer_layout_is_plain_jsonl_and_replaces_the_previous_export_whole(root, tmp_path):
    out, _ = root
    dest = tmp_path / "dest"
    with pytest.raises(ExportError, match="trainers read plain JSONL"):
        export_dataset(str(out), str(dest), layout="tokens", fmt="parquet")
    first = export_dataset(str(out), str(dest), layout="tokens")
    second = export_dataset(str(out), str(dest), layout="conversations", overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["data-" + second.export_id, "manifest.json"]
    assert first.export_id != second.export_id
    export_dataset(str(out), str(dest), overwrite=True)  # back to the messages shards: the folder goes too
    assert not [p for p in dest.iterdir() if p.name.startswith("data-")]


def test_the_bounded_read_chooses_the_rows_the_whole_frame_chooses(root):
    _, output_root = root
    output_root.snapshots.compact()  # a snapshot, and one entry on top of it
    output_root.commits.commit([_row(2, "run-b", 8192, 11)], "run-b", 0, "seg-b2")
    small, whole = ledger_rows(output_root, EXPORT_COLUMNS), output_root.snapshots.frame()
    assert len(small) == len(whole) == 8
    got = small.loc[current_mask(small)].sort_values("index")
    want = current_rows(whole).sort_values("index")
    for column in ("index", "max_tokens"):
        assert np.array_equal(got[column].to_numpy(np.int64), want[column].to_numpy(np.int64)), column
    for column in ("status", "finish_reason", "run_id", "part"):
        assert got[column].astype(object).tolist() == want[column].astype(object).tolist(), column


def test_mask_json_is_the_json_of_the_mask():
    for zeros, ones in [(0, 1), (3, 2), (2, 0), (0, 0), (1000, 7)]:
        assert json.loads(mask_json(zeros, ones)) == [0] * zeros + [1] * ones


def test_a_trainer_layout_streams_to_s3(root, s3, s3_uri):
    out, _ = root
    dest = s3_uri + "trainer-export/"
    result = export_dataset(str(out), dest, layout="tokens")
    import hashlib

    import boto3

    client = boto3.client("s3", endpoint_url=s3.direct_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket, prefix = dest.removeprefix("s3://").split("/", 1)
    manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
    body = client.get_object(Bucket=bucket, Key=prefix + manifest["data_file"])["Body"].read()

    assert hashlib.sha256(body).hexdigest() == manifest["shards"][0]["sha256"] and len(body.splitlines()) == 5
    assert result.data_uri == dest + manifest["data_file"]


def test_the_cli_exports_a_layout_and_names_its_file(root, tmp_path, capsys):
    from tracegen.cli import main

    out, _ = root
    assert main(["export", str(out), str(tmp_path / "cli"), "--layout", "tokens"]) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert f"exported 5 rows (tokens) to {(tmp_path / 'cli' / manifest['data_file']).as_uri()}" in printed
    assert main(["export", str(out), str(tmp_path / "cli2"), "--layout", "tokens", "--format", "parquet"]) == 2
    assert "trainers read plain JSONL" in capsys.readouterr().err


def test_a_final_assistant_message_is_exported_as_the_user_turn_sglang_served():
    # SGLang's chat route serves a prompt's final assistant message as a user message (its tool calls
    # dropped); a trainer re-rendering the export must get that prompt, and the manifest counts history as served.
    from types import SimpleNamespace

    from tracegen.export.layouts import prompt_shape, prompt_turns

    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "Assistant", "content": "Prefilled", "tool_calls": [call]}]
    turns = prompt_turns(messages)
    assert turns[2]["tool_calls"][0]["function"]["arguments"] == '{"path": "."}'  # JSON text for Arrow
    assert turns[-1] == {"role": "user", "content": "Prefilled"} and len(turns) == 5
    assert prompt_shape(SimpleNamespace(messages=messages)) == (True, 1)


def _sft_dataset(path, n: int):
    """SFT rows: two user/assistant exchanges each, ending with the dataset's own answer."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"conv{i}", "messages": [
                {"role": "system", "content": "agent"},
                {"role": "user", "content": f"first {i}"}, {"role": "assistant", "content": f"old first {i}"},
                {"role": "user", "content": f"second {i}"}, {"role": "assistant", "content": f"old second {i}"},
            ]}) + "\n")
    return path


def _generated(config, run_id: str, n: int) -> None:
    spec = prepare(config, run_id)
    rows = [_row(i, run_id, config.max_tokens, 5) for i in range(spec.dataset.n_rows)]
    root_of(config).commits.commit(rows, run_id, 0, "seg")


def _exported(out, dest, layout: str) -> list[dict]:
    export_dataset(str(out), str(dest), layout=layout)
    if layout == "messages":
        import gzip

        return [json.loads(line) for shard in sorted(dest.glob("*.jsonl.gz"))
                for line in gzip.decompress(shard.read_bytes()).splitlines()]
    manifest = json.loads((dest / "manifest.json").read_text())
    return [json.loads(line) for line in (dest / manifest["data_file"]).read_text().splitlines()]


def test_an_sft_row_exports_its_regenerated_last_turn_after_the_history_the_model_saw(tmp_path):
    # The row's own final answer is the turn generated again: never in the prompt, never beside the new one.
    out = tmp_path / "out"
    _generated(make_config(_sft_dataset(tmp_path / "sft.jsonl", 3), out), "run-a", 3)
    rows = _exported(out, tmp_path / "messages", "messages")
    assert len(rows) == 3
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert r["messages"][-1]["content"] == f"answer {r['index']}"
        assert all(not m["content"].startswith("old second") for m in r["messages"])
    conv = _exported(out, tmp_path / "conv", "conversations")
    assert [m["role"] for m in conv[0]["conversations"]] == ["system", "user", "assistant", "user", "assistant"]


def test_each_turn_exports_its_own_history_and_regenerated_turn_under_an_id_naming_both(tmp_path):
    out = tmp_path / "out"
    _generated(make_config(_sft_dataset(tmp_path / "sft.jsonl", 3), out, turns="each"), "run-a", 6)
    conv = _exported(out, tmp_path / "conv", "conversations")
    assert [r["id"] for r in conv] == [f"conv{i}#turn-{t}" for i in range(3) for t in (1, 2)]
    first, second = conv[0]["conversations"], conv[1]["conversations"]
    assert [m["role"] for m in first] == ["system", "user", "assistant"]
    assert first[-1]["content"] == "answer 0"
    assert [m["content"] for m in second] == ["agent", "first 0", "old first 0", "second 0", "answer 1"]
    tokens = _exported(out, tmp_path / "tokens", "tokens")
    assert [r["id"] for r in tokens] == [r["id"] for r in conv]
    manifest = json.loads((tmp_path / "conv" / "manifest.json").read_text())
    assert manifest["rows"] == 6
