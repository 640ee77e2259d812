"""Generated rows the output root's tests commit: every column filled, the run id shaped like Airflow's."""

from __future__ import annotations

from tracegen.store.records import OK, GeneratedRow

RUN = "manual__2026-11-29T19:22:10.576599+00:00"


def row(index: int, status: str = OK, finish: str | None = "stop", cap: int = 4096, run: str = RUN, chunk: int = 0,
        tokens: int = 100) -> GeneratedRow:
    return GeneratedRow(
        index=index, status=status, max_tokens=cap, run_id=run, chunk=chunk,
        finish_reason=finish if status == OK else None,
        content="answer" if finish != "length" else "", reasoning_content="thinking " * 3,
        completion_tokens=tokens, prompt_tokens=50, reasoning_tokens=tokens // 2, attempt=1,
        server="http://127.0.0.1:30000", latency_s=1.23456, category="bugfix",
        error=None if status == OK else "boom",
    )
