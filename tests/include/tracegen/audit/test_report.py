"""render_report(): report.json schema, section order, and that hostile model text stays text."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from tracegen.audit.capfit import Throughput, cap_table
from tracegen.audit.gate import CapSuggestion, GateInputs, GateRule, decide
from tracegen.audit.length_fit import fit_lengths
from tracegen.audit.report import (
    EXAMPLES_PER_OUTCOME,
    REPORT_SCHEMA,
    SCHEMA_VERSION,
    classify_example,
    render_report,
    summary_text,
    validate_report_json,
)
from tracegen.audit.stats import audit, censoring_arrays, gate_counts
from tracegen.store.records import GeneratedRow

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(document.cookie)>',
    "' onmouseover='alert(1)' x='",
    "<iframe src=\"https://evil.example/\"></iframe>",
    "</pre></div><a href=\"http://evil.example\">click</a>",
    "<style>@import url(http://evil.example/x.css)</style>",
]
PAYLOAD = "\n".join(HOSTILE)


def ledger(n: int = 1500, hostile: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    lengths = np.ceil(np.exp(rng.normal(np.log(2300), 0.63, n))).astype(int)
    rows = []
    for i, length in enumerate(lengths):
        server = f"http://127.0.0.1:{30000 + i % 3}"
        if i % 100 == 0:
            row = GeneratedRow(index=i, status="failed", max_tokens=4096, run_id="r1", chunk=i // 500, server=server,
                               error=PAYLOAD if hostile else f"HTTP 503 after {i} s")
        else:
            cut = length > 4096
            tokens = min(length, 4096)
            row = GeneratedRow(index=i, status="ok", max_tokens=4096, run_id="r1", chunk=i // 500, server=server,
                               finish_reason="length" if cut else "stop", completion_tokens=int(tokens),
                               reasoning_tokens=int(tokens * 0.7), content="" if cut and i % 2 else "a",
                               reasoning_content="t", latency_s=float(tokens) / 50, prompt_tokens=800,
                               category=PAYLOAD if hostile and i % 7 == 0 else ("bug" if i % 2 else "refactor"))
        rows.append(row.ledger_values() | {"part": f"p{i // 500}", "committed_at": "2026-05-01T00:00:00"})
    return pd.DataFrame(rows)


def examples(hostile: bool) -> list[dict]:
    text = PAYLOAD if hostile else "let me think about the stack trace"
    return [
        {"index": 1, "status": "ok", "finish_reason": "length", "content": "", "reasoning_content": text * 200,
         "completion_tokens": 4096, "reasoning_tokens": 4096, "max_tokens": 4096, "server": text},
        {"index": 2, "status": "ok", "finish_reason": "length", "content": text, "reasoning_content": text,
         "completion_tokens": 4096, "reasoning_tokens": 3000, "max_tokens": 4096},
        {"index": 3, "status": "failed", "error": text},
        {"index": 4, "status": "ok", "finish_reason": "stop", "content": "done", "reasoning_content": "x"},
    ]


def build(hostile: bool = False):
    f = ledger(hostile=hostile)
    result = audit(f, 4096, run_id="r1")
    table = cap_table(fit_lengths(*censoring_arrays(f), bootstrap=50), 4096,
                      throughput=Throughput(1500.0, 7, 900_000), context_length=32768)
    gate = decide(GateInputs(*gate_counts(f, 4096), GateRule(0.05), max_tokens=4096,
                             suggestion=CapSuggestion(table.recommended_cap, table.recommended_truncation)))
    meta = {"run_id": "r1", "model": PAYLOAD if hostile else "Qwen3.6-27B", "max_tokens": 4096,
            "fleet": {"gpus": 7}, PAYLOAD if hostile else "dataset": "s3://bucket/prompts.jsonl"}
    return result, table, gate, render_report(result, table, gate, meta, examples(hostile))


class Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend((tag, k, v) for k, v in attrs)

    def handle_data(self, data):
        self.text.append(data)


def parse(html_text: str) -> Collector:
    c = Collector()
    c.feed(html_text)
    c.close()
    return c


def test_report_json_schema_and_round_trip():
    result, table, gate, (report, _) = build()
    validate_report_json(report)
    assert report["schema_version"] == SCHEMA_VERSION == 1
    assert set(report) == set(REPORT_SCHEMA)
    # Strict JSON: no NaN/Infinity sneaks in.
    back = json.loads(json.dumps(report, allow_nan=False))
    assert back["verdict"]["verdict"] == "stop"
    assert back["audit"]["truncation"]["at_cap_rows"] == result.truncation["at_cap_rows"]
    assert [r["cap"] for r in back["cap_table"]["rows"]] == [4096, 5120, 6144, 8192, 12288, 16384]
    assert back["cap_table"]["recommended_cap"] == table.recommended_cap
    assert {e["outcome"] for e in back["examples"]} == {"truncated_in_thinking", "truncated_in_answer", "error"}
    assert len(back["examples"]) == 3  # the complete row is not an example
    assert isinstance(back["audit"]["tokens"]["mean"], float)
    assert back["run"]["fleet"] == {"gpus": 7}
    for key in ("schema_version", "verdict", "examples"):
        broken = dict(report)
        broken[key] = "oops" if key != "schema_version" else 2
        with pytest.raises(ValueError, match=key if key != "schema_version" else "schema_version"):
            validate_report_json(broken)
    missing = {k: v for k, v in report.items() if k != "audit"}
    with pytest.raises(ValueError, match="missing key 'audit'"):
        validate_report_json(missing)


def test_html_sections_in_order_and_plots():
    *_, (report, page) = build()
    order = ['class="verdict stop"', "<h2>Cap table", "<h2>Completion tokens", "<h2>Finish reasons",
             "<h2>Breakdowns", "<h2>Examples"]
    positions = [page.index(s) for s in order]
    assert positions == sorted(positions)
    assert page.count("<svg") == 3  # cap curve, histogram, finish reasons
    assert "cap 4,096" in page
    assert "What to do:" in page and "max_tokens=8192" in page
    assert 'class="rec"' in page  # the recommended cap row is highlighted
    assert "GPU time" in page


def test_no_external_resources():
    *_, (_, page) = build()
    doc = parse(page)
    assert not {"script", "img", "link", "iframe", "object", "embed", "image", "use", "a", "form"} & set(doc.tags)
    for tag, name, value in doc.attrs:
        assert name not in ("src", "href", "xlink:href", "action", "srcset", "background"), (tag, name)
        assert "http" not in (value or "") and "//" not in (value or ""), (tag, name, value)
    assert "url(" not in page and "@import" not in page
    # The only "http" in the page is server names shown as text.
    texts = "".join(doc.text)
    assert page.count("http") == texts.count("http")


def test_hostile_text_is_escaped_everywhere():
    *_, (report, page) = build(hostile=True)
    for payload in HOSTILE:
        assert payload not in page
    doc = parse(page)
    # Parsed as HTML, no element or attribute came from the payloads...
    assert not {"script", "img", "iframe", "a"} & set(doc.tags)
    assert all(not n.startswith("on") for _, n, _ in doc.attrs)
    assert [t for t in doc.tags if t == "style"] == ["style"]  # only our own stylesheet
    # ...and the payloads survive as text a reviewer can read.
    texts = "".join(doc.text)
    assert "<script>alert(1)</script>" in texts
    assert '"><img src=x onerror=alert(document.cookie)>' in texts
    # The JSON keeps the raw text (it is data, not markup).
    assert any("<script>" in (e["error"] or "") for e in report["examples"])


def test_long_texts_are_excerpted_and_examples_capped():
    result, table, gate, _ = build()
    many = [{"index": i, "status": "failed", "error": "boom"} for i in range(10)]
    long_row = {"index": 99, "status": "ok", "finish_reason": "length", "content": "",
                "reasoning_content": "A" * 5000 + "THE-END"}
    report, page = render_report(result, table, gate, {"run_id": "r"}, many + [long_row])
    outcomes = [e["outcome"] for e in report["examples"]]
    assert outcomes.count("error") == EXAMPLES_PER_OUTCOME
    thinking = next(e for e in report["examples"] if e["outcome"] == "truncated_in_thinking")
    assert thinking["reasoning_excerpt"].endswith("THE-END") and "characters …]" in thinking["reasoning_excerpt"]
    assert len(thinking["reasoning_excerpt"]) < 2500
    # Examples may also come grouped by outcome.
    grouped, _ = render_report(result, None, None, None, {"error": many[:2]})
    assert [e["outcome"] for e in grouped["examples"]] == ["error", "error"]
    with pytest.raises(ValueError, match="outcome 'bogus'"):
        render_report(result, None, None, None, {"bogus": many[:1]})


def test_without_gate_or_cap_table_and_empty_audit():
    empty = audit(pd.DataFrame(columns=ledger(2).columns), 4096)
    report, page = render_report(empty, None, None, {}, [])
    validate_report_json(report)
    assert report["verdict"] is None and report["cap_table"] is None
    assert "no gate" in page and "no completed rows" in page


def test_summary_text_for_the_task_log():
    result, table, gate, (report, _) = build()
    text = summary_text(result, table, gate)
    lines = text.splitlines()
    assert 3 <= len(lines) <= 8
    assert lines[0].startswith("gate: STOP")
    assert "8192:" in text and "P90 4,096" in text
    assert report["summary"] == text


def test_classify_example():
    assert classify_example({"status": "ok", "finish_reason": "length", "content": "", "reasoning_content": "t"}) == (
        "truncated_in_thinking")
    assert classify_example({"status": "ok", "finish_reason": "length", "content": "x"}) == "truncated_in_answer"
    assert classify_example({"status": "rejected"}) == "error"
    assert classify_example({"status": "ok", "finish_reason": "stop"}) is None
