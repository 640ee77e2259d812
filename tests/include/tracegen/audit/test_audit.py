"""audit(): statistics checked against small frames computed by hand, and the no-double-count rules."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from tracegen.audit.loop_stop import LOOP_JUDGE
from tracegen.audit.pivot import pivot_summary, pivot_text
from tracegen.audit.stats import AuditResult, audit, censoring_arrays, gate_counts
from tracegen.store.current import current_mask
from tracegen.store.records import LEDGER_COLUMNS, GeneratedRow


def row(index, status="ok", finish="stop", tokens=100, cap=4096, *, reasoning=None, cut=False, run="r1", chunk=0,
        server="http://127.0.0.1:30000", latency=1.0, category=None, error=None, prompt=500, at="2026-05-01T00:00:00",
        pivot=None, prefix=0, joined=False, asking=False, score=None, cached=None):
    values = {
        "index": index, "status": status, "finish_reason": finish if status == "ok" else None,
        "prompt_tokens": prompt, "completion_tokens": tokens if status == "ok" else 0,
        "reasoning_tokens": (tokens // 2 if reasoning is None else reasoning) if status == "ok" else 0,
        "cut_in_reasoning": cut, "max_tokens": cap, "run_id": run, "chunk": chunk, "attempt": 1,
        "server": server, "latency_s": latency, "category": category, "error": error,
        "pivot": pivot, "prefix_tokens": prefix, "text_joined": joined, "while_asking": asking,
        "runaway_score": score, "loop_judge": LOOP_JUDGE, "cached_tokens": cached,
    }
    assert set(values) == set(LEDGER_COLUMNS)
    return values | {"part": f"parts/{run}/c{chunk:05d}", "committed_at": at}


def frame(rows):
    return pd.DataFrame(rows)


def test_hand_computed_distribution_and_buckets():
    tokens = [50, 150, 700, 1500, 2500, 3500, 4050]
    rows = [row(i, tokens=t, reasoning=t - 10) for i, t in enumerate(tokens)]
    rows += [row(7, finish="length", tokens=4096, cut=True, reasoning=4096),
             row(8, finish="length", tokens=4096, cut=False, reasoning=4000)]
    r = audit(frame(rows), 4096)
    all_tokens = np.array(tokens + [4096, 4096])
    assert r.tokens["count"] == 9
    assert r.tokens["mean"] == pytest.approx(all_tokens.mean())
    assert r.tokens["median"] == 2500
    assert r.tokens["max"] == 4096 and r.tokens["min"] == 50
    assert r.tokens["p90"] == 4096  # the reference job's signature: P90 at the cap
    assert r.finish_reasons == {"stop": 7, "length": 2}
    assert r.truncation["truncated"] == 2 and r.truncation["rate"] == pytest.approx(2 / 9)
    assert r.truncation["cut_in_reasoning"] == 1 and r.truncation["cut_in_answer"] == 1
    assert r.tokens["reasoning_sum"] == sum(t - 10 for t in tokens) + 4096 + 4000
    assert r.tokens["answer_sum"] == all_tokens.sum() - r.tokens["reasoning_sum"]
    buckets = {b["label"]: b["count"] for b in r.buckets}
    assert buckets == {"<100": 1, "100–499": 1, "500–999": 1, "1000–1999": 1, "2000–2999": 1, "3000–3999": 1,
                       "4000–4095": 1, "hit cap (length)": 2}
    assert sum(r.histogram["counts"]) == 9
    assert 4096 in r.histogram["edges"]


def test_superseded_rows_are_counted_once():
    rows = [
        # index 0: truncated at 4096, then regenerated at 8192 and complete.
        row(0, finish="length", tokens=4096, cap=4096, run="r1", at="2026-05-01T00:00:00"),
        row(0, finish="stop", tokens=5000, cap=8192, run="r2", at="2026-05-02T00:00:00"),
        # index 1: two failures then a success.
        row(1, status="failed", error="HTTP 503", run="r1"),
        row(1, status="failed", error="HTTP 503", run="r2", at="2026-05-02T00:00:00"),
        row(1, tokens=300, cap=8192, run="r2", at="2026-05-02T00:00:01"),
        # index 2: truncated at 4096 and kept (not regenerated yet).
        row(2, finish="length", tokens=4096, cap=4096),
        # index 3: still failing.
        row(3, status="failed", error="timeout after 600 s"),
        # index 4: the dataset row is malformed.
        row(4, status="invalid", error="row 4: missing 'messages'"),
    ]
    r = audit(frame(rows), 8192)
    assert r.rows["ledger_rows"] == 8
    assert r.rows["indices"] == 5 and r.rows["superseded_rows"] == 3
    assert r.rows["current_by_status"] == {"ok": 3, "invalid": 1, "rejected": 0, "failed": 1}
    assert r.rows["superseded_truncated"] == 1 and r.rows["superseded_failed"] == 2
    assert r.rows["truncated_under_lower_cap"] == 1
    assert r.tokens["count"] == 3 and r.tokens["sum"] == 5000 + 300 + 4096
    assert r.truncation["truncated"] == 1
    # The gate judges what cap 8192 did: two rows generated under it, none truncated.
    assert gate_counts(frame(rows), 8192) == (0, 2)
    assert r.errors["failed_rows"] == 3 and r.errors["current_failed"] == 1
    assert r.errors["top_messages"][0] == {"status": "failed", "message": "HTTP N", "count": 2}
    assert r.invalid["rows"] == 1
    assert any("cap below 8192" in n for n in r.notes)
    # The censored-fit input uses the 8192 row for index 0: complete at 5000, not censored at 4096.
    lengths, censored = censoring_arrays(frame(rows))
    assert sorted(zip(lengths.tolist(), censored.tolist(), strict=True)) == [(300, False), (4096, True),
                                                                            (5000, False)]


def test_current_row_order_complete_then_cap_then_newest():
    rows = [
        # A complete row beats a truncated one even under a lower cap: it is what the drafter needs.
        row(0, finish="stop", tokens=10, cap=4096, at="2026-05-03T00:00:00"),
        row(0, finish="length", tokens=8192, cap=8192, at="2026-05-01T00:00:00"),
        row(1, finish="length", tokens=100, cap=100, at="2026-05-01T00:00:00"),
        row(1, finish="stop", tokens=90, cap=100, at="2026-05-01T00:00:00"),
        row(2, tokens=1, at="2026-05-01T00:00:00"),
        row(2, tokens=2, at="2026-05-02T00:00:00"),
        row(3, status="ok", tokens=7, at="2026-05-01T00:00:00"),
        row(3, status="failed", at="2026-05-09T00:00:00"),
        row(4, finish="length", tokens=4096, cap=4096, at="2026-05-01T00:00:00"),
        row(4, finish="length", tokens=8192, cap=8192, at="2026-05-01T00:00:00"),
    ]
    f = frame(rows)
    picked = f[current_mask(f)].set_index("index")["completion_tokens"].to_dict()
    assert picked == {0: 10, 1: 90, 2: 2, 3: 7, 4: 8192}


def test_breakdowns_by_prompt_category_chunk_and_server():
    rows = []
    for i in range(200):
        bad = i % 4 == 0  # server 1 gets every fourth row: errors and slowness
        server = "http://127.0.0.1:30001" if bad else "http://127.0.0.1:30000"
        if bad and i % 8 == 0:
            rows.append(row(i, status="failed", server=server, error=f"HTTP 500 request {i}", chunk=i // 100))
        else:
            rows.append(row(i, tokens=100 + i, server=server, latency=50.0 if bad else 5.0, chunk=i // 100,
                            category="bug" if i < 30 else "refactor", prompt=20000 if i >= 180 else 500,
                            finish="length" if i >= 180 else "stop"))
    r = audit(frame(rows), 4096)
    servers = {s["server"]: s for s in r.by_server}
    good, bad = servers["http://127.0.0.1:30000"], servers["http://127.0.0.1:30001"]
    assert good["rows"] == 150 and good["errors"] == 0 and good["flags"] == []
    assert bad["rows"] == 50 and bad["errors"] == 25 and bad["error_rate"] == pytest.approx(0.5)
    assert any("error rate" in f for f in bad["flags"]) and any("latency" in f for f in bad["flags"])
    assert good["latency_p50_s"] == pytest.approx(5.0) and bad["latency_p50_s"] == pytest.approx(50.0)
    chunks = {c["chunk"]: c for c in r.by_chunk}
    assert chunks[0]["rows"] == 100 and chunks[0]["failed"] == 13 and chunks[1]["failed"] == 12
    assert chunks[1]["truncated"] == 18 and chunks[0]["truncated"] == 0
    prompt = {p["prompt_tokens"]: p for p in r.by_prompt_length}
    assert prompt["16000–31999"]["rows"] == 18 and prompt["16000–31999"]["truncation_rate"] == 1.0
    assert prompt["<1000"]["truncated"] == 0
    cats = {c["category"]: c for c in r.by_category}
    assert cats["bug"]["rows"] + cats["refactor"]["rows"] == 175
    assert cats["refactor"]["truncated"] == 18


def test_run_id_scopes_operational_figures_only():
    rows = [row(0, run="r1", status="failed", error="x"), row(0, run="r2", tokens=10), row(1, run="r1", tokens=20)]
    r = audit(frame(rows), 4096, run_id="r2")
    assert r.errors["failed_rows"] == 0
    assert sum(c["rows"] for c in r.by_chunk) == 1
    assert r.rows["indices"] == 2  # the dataset view is still the whole ledger


def test_rows_from_generated_row_contract_and_json():
    rows = [
        GeneratedRow(index=0, status="ok", max_tokens=64, run_id="r", chunk=0, finish_reason="length",
                     content="", reasoning_content="think", completion_tokens=64, reasoning_tokens=64),
        GeneratedRow(index=1, status="ok", max_tokens=64, run_id="r", chunk=0, finish_reason="stop",
                     content="answer", reasoning_content="t", completion_tokens=10, reasoning_tokens=3),
    ]
    f = pd.DataFrame([r.ledger_values() | {"part": "p", "committed_at": "2026-05-01T00:00:00"} for r in rows])
    r = audit(f, 64)
    assert r.truncation["cut_in_reasoning"] == 1
    text = r.dumps()
    assert json.loads(text)["truncation"]["truncated"] == 1


def test_empty_ledger_and_bad_input():
    empty = pd.DataFrame({c: [] for c in [*LEDGER_COLUMNS, "part", "committed_at"]})
    r = audit(empty, 4096)
    assert isinstance(r, AuditResult)
    assert r.rows["indices"] == 0 and r.tokens["mean"] is None and r.truncation["rate"] is None
    with pytest.raises(ValueError, match="missing columns.*'server'"):
        audit(frame([row(0)]).drop(columns=["server"]), 4096)
    with pytest.raises(ValueError, match="unknown status"):
        audit(frame([row(0, status="weird")]), 4096)
    with pytest.raises(TypeError, match="DataFrame"):
        audit([row(0)], 4096)


def test_pivot_figures_count_new_tokens_and_the_prefixes_not_paid_again():
    rows = [
        row(0, finish="length", tokens=4096, cap=4096, run="r1"),
        row(0, finish="stop", tokens=6000, cap=8192, run="r2", pivot="extended", prefix=4096),
        row(1, finish="length", tokens=4096, cap=4096, run="r1"),
        # Extended by a server without /detokenize: its text joins two decodings.
        row(1, finish="length", tokens=8192, cap=8192, run="r2", pivot="extended", prefix=4096, joined=True),
        row(2, finish="length", tokens=4096, cap=4096, run="r1"),
        row(2, finish="stop", tokens=3000, cap=8192, run="r2", pivot="fallback-regenerated"),
        row(3, finish="length", tokens=4096, cap=4096, run="r1"),
        row(3, status="failed", cap=8192, run="r2"),  # a failed extension is no pivot row
        row(4, finish="stop", tokens=700, cap=8192, run="r2"),  # a first generation
    ]
    p = pivot_summary(frame(rows))
    assert p == {"extended": 2, "extended_measuring": 0, "extended_finished": 1, "extended_new_tokens": (6000 - 4096) + (8192 - 4096),
                 "regenerated": 0, "fallback_regenerated": 1, "regenerated_tokens": 3000,
                 "tokens_spent": 1904 + 4096 + 3000, "tokens_saved": 2 * 4096, "joined_seams": 1}
    assert pivot_summary(frame(rows), run_id="r1")["extended"] == 0
    r = audit(frame(rows), 8192, run_id="r2")
    assert r.pivot == p
    text = pivot_text(p)
    assert "2 rows extended" in text and "8,192 saved" in text and "1 rows regenerated because they had no token ids" in text
    # Frames from before the pivot columns existed hold no pivot rows.
    old = frame(rows).drop(columns=["pivot", "prefix_tokens"])
    assert pivot_summary(old)["extended"] == 0 and pivot_text(pivot_summary(old)) is None
    assert audit(old, 8192).pivot["extended"] == 0
