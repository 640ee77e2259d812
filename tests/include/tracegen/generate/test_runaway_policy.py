"""runaway_policy against the stand-in, whose runaway samples loop until the cap: the export leaves runaway
rows out (drop) or keeps them (keep) among the truncated rows it writes; resample generates each once more
from scratch under the same cap, the fresh sample replacing it, and never again.
"""

from __future__ import annotations

import gzip
import json

import pytest
from engine_support.helpers import (
    FAST_CLIENT,
    endpoints,
    make_config,
    metric,
    prepare,
    root_of,
    run_engine,
    write_dataset,
)

from tracegen.audit.runaway_rows import TAILS, find_runaways
from tracegen.export import export_dataset
from tracegen.generate.engine import ChunkOptions
from tracegen.generate.resample import resample_runaways
from tracegen.run import RESAMPLE_CHUNK, plan
from tracegen.run.run_report import audit_and_report
from tracegen.sglang.client import ClientConfig
from tracegen.store.commits import Commits
from tracegen.store.current import current_rows
from tracegen.store.records import OK

SIM = dict(sim_time_scale=20000, log_level="warning", enable_metrics=True, sim_length_model="short",
           sim_runaway_rate=0.2, sim_truncated_share=0.6, sim_truncated_at=1024, reasoning_parser="qwen3")
N_ROWS, CAP = 160, 1024  # a loop is judged once it has run two periods and 384 ids: a cap that holds one
REQS = "sglang:num_requests_total"


@pytest.fixture
def generated(tmp_path, sim_server):
    """160 rows at 1024 on a stand-in with 20% runaways: (sim, dataset, output, runaways, other truncated)."""
    sim = sim_server(**SIM)
    dataset = write_dataset(tmp_path / "prompts.jsonl", N_ROWS)
    out = tmp_path / "out"
    config = make_config(dataset, out, max_tokens=CAP)
    prepare(config, "run-1024")
    run_engine(config, "run-1024", endpoints(sim, in_flight=32), tmp_path / "spool", range(N_ROWS))
    frame = root_of(config).snapshots.frame()
    runaways = set(find_runaways(root_of(config), frame))
    truncated = set(frame.loc[frame["finish_reason"] == "length", "index"].tolist())
    assert runaways and runaways < truncated, "the stand-in should cut both loops and long rows at the cap"
    return sim, dataset, out, runaways, truncated - runaways


def test_the_engine_scores_each_truncated_row_once_and_the_ledger_decides_without_reading_parts(
        tmp_path, generated, monkeypatch):
    _, dataset, out, runaways, others = generated
    root = root_of(make_config(dataset, out, max_tokens=CAP))
    frame = root.snapshots.frame()
    cut = frame["finish_reason"] == "length"
    assert frame.loc[cut, "runaway_score"].notna().all() and frame.loc[~cut, "runaway_score"].isna().all()
    read: list[str] = []
    read_part = root.commits.read_part
    monkeypatch.setattr(root.commits, "read_part", lambda part: read.append(part) or read_part(part))
    found = find_runaways(root, frame)
    assert set(found) == runaways and list(found) == sorted(found)
    # Parts are read only for the end of the first runaways' text, the reports' examples.
    assert len(read) <= TAILS and all(found[i].tail for i in sorted(found)[:TAILS])
    assert not any(r.tail for r in list(found.values())[TAILS:])
    # An entry from before the score (the column missing, NaN in the frame) is judged from its part, alike.
    read.clear()
    unscored = frame.assign(runaway_score=float("nan"))
    assert {i: r.score for i, r in find_runaways(root, unscored).items()} == {i: r.score for i, r in found.items()}
    assert read and set(read) >= set(frame.loc[cut, "part"])


def _export(tmp_path, out, name, **kw):
    result = export_dataset(str(out), str(tmp_path / name), **kw)
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += [json.loads(line) for line in gzip.decompress((tmp_path / name / shard["name"]).read_bytes()).splitlines()]
    assert result.rows == len(rows)
    return manifest, {r["index"] for r in rows}


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_export_drops_or_keeps_runaway_rows(tmp_path, generated, policy, monkeypatch):
    _, dataset, out, runaways, others = generated
    config = make_config(dataset, out, max_tokens=CAP, runaway_policy=policy)
    prepare(config, f"run-{policy}")
    found = find_runaways(root_of(config), root_of(config).snapshots.frame())
    read: list[str] = []
    read_part = Commits.read_part
    monkeypatch.setattr(Commits, "read_part", lambda self, part: read.append(part) or read_part(self, part))
    manifest, exported = _export(tmp_path, out, "with-truncated", include_truncated=True)
    # The export reads the ledger's runaway scores: the judgement reads only the parts of the examples' text,
    # never every truncated row's part (the rows it writes are read apart, verified).
    assert sorted(read) == sorted({found[i].part for i in sorted(found)[:TAILS]})
    assert others <= exported
    assert manifest["runaway_policy"] == policy and manifest["runaway_rows"] == len(runaways)
    assert manifest["runaway_indices"] == sorted(runaways)
    if policy == "drop":
        assert not exported & runaways and manifest["left_out"]["runaway"] == len(runaways)
    else:
        assert runaways <= exported and manifest["left_out"]["runaway"] == 0
    # Without the truncated rows, runaways are left out with them and not judged.
    manifest, exported = _export(tmp_path, out, "complete")
    assert not exported & (runaways | others) and manifest["left_out"]["truncated"] == len(runaways | others)
    assert manifest["runaway_rows"] is None and manifest["left_out"]["runaway"] == 0


def test_the_report_counts_runaways_as_a_floor(tmp_path, generated):
    _, dataset, out, runaways, _ = generated
    spec = prepare(make_config(dataset, out, max_tokens=CAP), "run-report")
    audit_and_report(spec, name="report")
    report = json.loads(root_of(spec.config).run_files.get(spec.run_id, "report.json"))
    r = report["measurement"]["runaway"]
    assert r["rows"] == len(runaways) and r["by_cap"] == {str(CAP): len(runaways)} and r["policy"] == "drop"
    assert 0 < len(r["examples"]) <= 3 and r["examples"][0]["index"] in runaways
    html = root_of(spec.config).run_files.get(spec.run_id, "report.html").decode()
    assert "Runaway rows" in html


def test_a_raised_cap_continues_the_truncated_rows_and_never_a_runaway(tmp_path, generated):
    """The pivot to twice the cap extends the rows it cut and sends nothing for a runaway: its loop would run to
    any cap. The plan, the pivot's sources and the tail measurement's rows all leave runaways out, read from
    the score the ledger keeps."""
    from tracegen.generate.measure import truncated_rows

    sim, dataset, out, runaways, others = generated
    frame = root_of(make_config(dataset, out, max_tokens=CAP)).snapshots.frame()
    raised = make_config(dataset, out, max_tokens=2 * CAP, truncated_policy="extend")
    todo = set(plan.remaining(frame, range(N_ROWS), raised.max_tokens, "extend").tolist())
    assert others <= todo and not runaways & todo
    assert not runaways & set(plan.superseded_rows(frame, sorted(runaways | others), raised.max_tokens)["index"])
    assert set(truncated_rows(frame)["index"]) == others
    prepare(raised, "run-2048")
    sent = metric(sim.url, REQS)
    summary = run_engine(raised, "run-2048", endpoints(sim, in_flight=32), tmp_path / "spool2048", range(N_ROWS))
    assert summary.extended == len(others) and metric(sim.url, REQS) - sent == len(others)
    current = current_rows(root_of(raised).snapshots.frame())
    kept = current[current["index"].isin(runaways)]
    assert (kept["max_tokens"] == CAP).all() and len(kept) == len(runaways)


def test_resample_generates_each_runaway_once_and_the_fresh_sample_replaces_it(tmp_path, generated):
    sim, dataset, out, runaways, _ = generated
    config = make_config(dataset, out, max_tokens=CAP, runaway_policy="resample")
    spec = prepare(config, "run-resample")
    cc = ClientConfig(request_deadline_s=config.request_deadline_s, max_attempts=config.max_attempts, **FAST_CLIENT)
    options = ChunkOptions(spool_dir=str(tmp_path / "spool"), client_config=cc, progress_interval_s=3600)
    sent = metric(sim.url, REQS)
    done = resample_runaways(spec, endpoints=endpoints(sim, in_flight=32), options=options)
    assert metric(sim.url, REQS) - sent == len(runaways) == done["rows"] == done["generated"]
    root = root_of(config)
    frame = root.snapshots.frame()
    fresh = frame[frame["chunk"] == RESAMPLE_CHUNK]
    assert set(fresh["index"]) == runaways and (fresh["max_tokens"] == CAP).all() and (fresh["status"] == OK).all()
    assert set(fresh["pivot"]) == {"resampled"}
    # One fresh sample beside the looping row under the same cap is expected, not duplicated work ...
    assert root.repair.check_invariants() == []
    # The fresh sample is the current row; nothing is left to generate at the cap.
    current = current_rows(frame)
    assert set(current.loc[current["index"].isin(runaways), "chunk"]) == {RESAMPLE_CHUNK}
    assert plan.remaining(frame, range(N_ROWS), CAP, "extend").size == 0
    # A higher cap later continues the fresh sample, not the row it replaced (both cut at the cap), unless the
    # fresh sample loops too: a runaway is never continued.
    cut = fresh["finish_reason"] == "length"
    looped_again = set(fresh.loc[cut & (fresh["runaway_score"] >= 0.5), "index"])
    cut_again = set(fresh.loc[cut, "index"]) - looped_again
    todo = set(plan.remaining(frame, range(N_ROWS), 2 * CAP, "extend").tolist())
    assert cut_again <= todo and not looped_again & todo
    if cut_again:
        sources = plan.superseded_rows(frame, sorted(cut_again), 2 * CAP)
        assert set(sources["part"]) <= set(fresh["part"]) and set(sources["index"]) == cut_again
    # Once each: a second call (a retried task, a later run) sends nothing.
    sent = metric(sim.url, REQS)
    again = resample_runaways(spec, endpoints=endpoints(sim, in_flight=32), options=options)
    assert again["rows"] == 0 and metric(sim.url, REQS) == sent
    # ... and a second fresh sample of the same row would be: the invariant check names it.
    resampled = next(k for k in root.commits.entries() if f"c{RESAMPLE_CHUNK:05d}" in k)
    entry = root.commits.read_entry(resampled)
    root.storage.put(resampled.replace(entry["segment"], entry["segment"] + "x"),
                       root.storage.get(resampled))
    assert any("resampled twice under max_tokens" in p for p in root.repair.check_invariants())
    root.storage.delete(resampled.replace(entry["segment"], entry["segment"] + "x"))
    # The export keeps the fresh samples that finished, and leaves out those that loop again.
    looping = set(find_runaways(root, frame))
    manifest, exported = _export(tmp_path, out, "resampled", include_truncated=True)
    assert not exported & looping and manifest["left_out"]["runaway"] == len(looping)
    finished = set(fresh.loc[fresh["finish_reason"] != "length", "index"])
    assert finished <= exported and looping <= runaways
