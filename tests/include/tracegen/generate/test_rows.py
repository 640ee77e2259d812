"""A server's answer recorded as a ledger row (`generate.rows`): what each outcome becomes, and that every
finish reason the client accepts is one the ledger stores."""

from __future__ import annotations

import pytest

from tracegen.generate.rows import chat_row
from tracegen.sglang import wire
from tracegen.sglang.client import ChatRequest, Completion, Outcome, Sampling
from tracegen.store import records
from tracegen.store.records import GeneratedRow, unpack_token_ids

REQUEST = ChatRequest(4, [{"role": "user", "content": "hi"}], model="m", sampling=Sampling(max_tokens=64))


def completion(prompt_ids: list[int] | None = None, response_ids: list[int] | None = None) -> Completion:
    return Completion(id="chatcmpl-1", content="42", reasoning_content="think", tool_calls=None,
                      finish_reason="length", prompt_tokens=3, completion_tokens=2, reasoning_tokens=1,
                      prompt_token_ids=prompt_ids, response_token_ids=response_ids)


def row_of(out: Outcome[Completion]) -> GeneratedRow:
    return chat_row(out, REQUEST, run_id="r", chunk=7, category="code")


def test_every_finish_reason_the_client_accepts_is_one_the_ledger_stores() -> None:
    # The ledger's own besides the server's: a row the client stopped in its loop.
    assert set(wire.FINISH_REASONS) == set(records.FINISH_REASONS) - {records.LOOP}
    assert wire.SERVER_FINISH_REASONS - set(records.FINISH_REASONS) == {"abort"}


def test_an_answer_becomes_an_ok_row_with_its_ids_packed() -> None:
    row = row_of(Outcome(completion([1, 2, 3], [9, 151645]), attempt=2, server="http://s:1", latency_s=0.5))
    assert (row.index, row.status, row.max_tokens, row.run_id, row.chunk, row.category) == (4, "ok", 64, "r", 7, "code")
    assert (row.attempt, row.server, row.latency_s, row.id) == (2, "http://s:1", 0.5, "chatcmpl-1")
    assert (row.content, row.reasoning_content, row.finish_reason) == ("42", "think", "length")
    assert (row.prompt_tokens, row.completion_tokens, row.reasoning_tokens) == (3, 2, 1)
    assert unpack_token_ids(row.prompt_token_ids) == [1, 2, 3]
    assert unpack_token_ids(row.response_token_ids) == [9, 151645]
    assert row.has_token_ids


@pytest.mark.parametrize("ids", [([1, 2, 3], None), (None, [9, 151645])])
def test_ids_are_kept_both_or_neither(ids: tuple[list[int] | None, list[int] | None]) -> None:
    row = row_of(Outcome(completion(*ids), attempt=1, server="http://s:1"))
    assert row.status == "ok" and row.prompt_token_ids is None and row.response_token_ids is None


def test_a_refusal_keeps_the_server_that_refused_and_a_failure_names_none() -> None:
    rejected = row_of(Outcome(rejected="HTTP 400: too long", attempt=1, server="http://s:1"))
    assert (rejected.status, rejected.server, rejected.error, rejected.attempt) == (
        "rejected", "http://s:1", "HTTP 400: too long", 1)
    failed = row_of(Outcome(failed="6 attempts failed; last: boom", attempt=6, server="http://s:1"))
    assert (failed.status, failed.server, failed.error, failed.attempt) == ("failed", "", "6 attempts failed; last: boom", 6)
    for row in (rejected, failed):
        assert (row.content, row.completion_tokens, row.max_tokens, row.run_id, row.chunk) == (None, 0, 64, "r", 7)
