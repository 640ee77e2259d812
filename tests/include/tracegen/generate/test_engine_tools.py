"""The 4096 -> 8192 pivot over prompts with tools on a stand-in launched with --tool-call-parser: extending
a truncated row parses its tool calls with the server's /parse_function_call, and a continued sample that
ends in a call ends in it as the uninterrupted completion of that sample does."""

from __future__ import annotations

import json

from engine_support.helpers import (
    assert_healthy,
    direct_and_pivot,
    endpoints,
    prompt,
    root_of,
)

from tracegen.store.records import OK

TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]  # fmt: skip
TOOL_SIM = dict(sim_time_scale=20000, log_level="warning", enable_metrics=True, max_running_requests=128,
                reasoning_parser="qwen3", tool_call_parser="qwen25", sim_tool_call_rate=0.5)  # fmt: skip


def _write_tool_dataset(path, n: int):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({**prompt(i), "tools": TOOLS}) + "\n")
    return path


def _rows(root, run_id: str) -> dict:
    out = {}
    for key in root.commits.entries():
        if f"/{run_id}/" in key:
            out.update({r.index: r for r in root.commits.read_part(root.commits.read_entry(key)["part"])})
    return out


def _calls(row) -> list | None:
    """A row's tool calls without their ids (SGLang names every call with a fresh uuid)."""
    if row.tool_calls is None:
        return None
    return [{k: v for k, v in call.items() if k != "id"} for call in row.tool_calls]


def test_extend_pivot_with_tools_equals_one_uninterrupted_run_row_for_row(tmp_path, sim_server):
    sim = sim_server(**TOOL_SIM, enable_deterministic_inference=True)
    n_rows = 160
    dataset = _write_tool_dataset(tmp_path / "prompts.jsonl", n_rows)
    c8, p8, s = direct_and_pivot(dataset, tmp_path, endpoints(sim, in_flight=64), n_rows)
    # Every truncated row was extended: no /parse_function_call failure left one failed or regenerated.
    assert s.extended > 10 and s.regenerated == 0
    assert_healthy(root_of(p8), n_rows, p8)

    uninterrupted = _rows(root_of(c8), "run-8192")
    extended = _rows(root_of(p8), "run-pivot")
    assert extended and all(r.status == OK and r.pivot == "extended" for r in extended.values())
    for i, b in extended.items():
        a = uninterrupted[i]
        for key in ("content", "reasoning_content", "finish_reason", "completion_tokens", "reasoning_tokens",
                    "response_token_ids"):  # fmt: skip
            assert getattr(b, key) == getattr(a, key), (i, key)
        assert _calls(b) == _calls(a), i
    # Continued samples did end in a tool call, as their uninterrupted completions do.
    called = [i for i, r in extended.items() if r.finish_reason == "tool_calls"]
    assert called, "no extended row ended in a tool call"
    for i in called:
        calls = extended[i].tool_calls
        assert calls and calls[0]["function"]["name"] in {"run_tests", "read_file"}
        assert "<tool_call>" not in extended[i].content
