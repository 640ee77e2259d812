"""Every value the gate's question shows is text, never markup: its Markdown body is rendered with a
CommonMark parser (markdown-it, with GFM's tables and strikethrough, as the Required Actions page renders
it), and a value built to close a code span, open a link, end a table row or start a list shows as it is."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

import pytest
from markdown_it import MarkdownIt

from tracegen.audit.cap_question import PILOT, CapQuestion, markdown_text

HOSTILE_KEY = "runs/x`](https://evil.test/)` *b* <img src=x> | ~~s~~ &amp;/pilot-report.html"
HOSTILE_URI = f"s3://bucket/{HOSTILE_KEY}"


def render(markdown: str) -> str:
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, Any]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Any]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parsed(markdown: str) -> _Tags:
    tags = _Tags()
    tags.feed(render(markdown))
    return tags


@pytest.mark.parametrize("value", [
    "a`b", "``", "*bold* _it_ **x**", "[link](https://evil.test/)", "![img](x)", "<b>html</b>", "a | b | c",
    "~~struck~~", "&amp; &#96;", "# heading", "- list item", "+ item", "1. first", "7) seventh", "=== setext",
    "line one\n\n---\nline two", "    indented code", "back\\slash\\`", HOSTILE_KEY,
])
def test_a_value_renders_as_exactly_its_text(value: str) -> None:
    tags = parsed(markdown_text(value))
    assert [t for t, _ in tags.tags] == ["p"], render(markdown_text(value))
    assert "".join(tags.text).strip() == " ".join(value.split())


def question(**overrides: Any) -> CapQuestion:
    fields: dict[str, Any] = dict(
        run_id="run-1", trigger=PILOT, current_cap=4096, recommended_cap=8192, max_cap=40_959,
        context_length=40_960, truncated_policy="extend",
        verdict={"verdict": "stop", "reason": "over `the` threshold | *really*\n# not a heading", "truncated": 4,
                 "total": 10},
        cap_rows=[{"cap": 4096, "truncation": 0.4, "truncation_low": 0.2, "truncation_high": 0.6,
                   "expected_tokens_per_row": 3000, "basis": "observed"}],
        confidence=0.95, throughput=None, report_uri=HOSTILE_URI,
        report_url="https://airflow.example.test/tracegen/roots/r0/runs/a b)(c/pilot-report.html",
        timeout_minutes=60.0,
        while_asking={"statement": "- 12 rows `generated` | meanwhile"},
    )
    return CapQuestion(**{**fields, **overrides})


def test_an_s3_key_with_a_backtick_does_not_close_a_code_span_in_the_question() -> None:
    body = question().body
    tags = parsed(body)
    text = "".join(tags.text)
    assert f"stored at {HOSTILE_URI}" in " ".join(text.split())
    assert "over `the` threshold | *really* # not a heading" in text
    assert "- 12 rows `generated` | meanwhile" in text
    # The only markup is the body's own: no code span, image or HTML from a value, one link, one table row.
    kinds = [t for t, _ in tags.tags]
    assert not {"img", "b", "s", "del", "h1"} & set(kinds), kinds
    assert kinds.count("code") == 1 and "`refused_answer`" in body  # the body's own, naming the XCom
    links = [a["href"] for t, a in tags.tags if t == "a"]
    assert links == ["https://airflow.example.test/tracegen/roots/r0/runs/a%20b%29%28c/pilot-report.html"]
    assert kinds.count("tr") == 2 and kinds.count("ul") == 1  # the cap table's head and row; the options


def test_a_location_in_the_question_holds_no_credentials() -> None:
    body = question(report_uri="s3://bucket/runs/r/pilot-report.html?X-Amz-Signature=s1gnature",
                    report_url="https://user:pw@airflow.example.test/tracegen/r.html?token=t0ken").body
    assert "s1gnature" not in body and "user:pw" not in body and "t0ken" not in body
    assert "[Open the report](https://airflow.example.test/tracegen/r.html)" in body


def test_figures_are_shown_as_written() -> None:
    # Escaping what is no markup would make the Markdown unreadable as text (the notification's twin).
    assert [markdown_text(v) for v in ("36.7%", "1.5 GPU-h", "4,096 (current)", "2.3–7.1%")] == [
        "36.7%", "1.5 GPU-h", "4,096 (current)", "2.3–7.1%"]
