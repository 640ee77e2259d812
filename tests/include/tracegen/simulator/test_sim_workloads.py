"""The benchmarks' agentic workload: sizes within their bounds, each prompt row the one before plus a turn, and
ids equal to the stand-in's chat route's."""

from __future__ import annotations

from tracegen.dataset.turns import prompt_messages
from tracegen.simulator.tokens import chat_prompt_ids
from tracegen.simulator.workloads import (
    GROWTH_TOKENS,
    SHARED_TOKENS,
    agentic_conversations,
    prompt_ids,
    prompt_rows,
)


def test_conversations_share_a_prefix_and_grow_a_turn_at_a_time():
    workload = agentic_conversations(2, seed=3)
    # The shared prefix is drawn in tokens from a character budget: within 15% of its bounds.
    assert SHARED_TOKENS[0] * 0.85 <= workload.shared_tokens <= SHARED_TOKENS[1] * 1.15
    rows = list(prompt_rows(workload))
    assert [r.turn for r in rows if r.turn == 1] == [1, 1]
    first = {r.conversation: r.ids[: workload.shared_tokens] for r in rows}
    assert len(set(map(tuple, first.values()))) == 1  # every conversation starts with the same prefix
    for a, b in zip(rows, rows[1:], strict=False):
        if a.conversation != b.conversation:
            continue
        head = len(a.ids) - 3  # less the generation prompt `<|im_start|>assistant\n`
        assert b.ids[:head] == a.ids[:head]
        assert GROWTH_TOKENS[0] * 0.5 <= len(b.ids) - len(a.ids) <= GROWTH_TOKENS[1] * 1.3


def test_prompt_ids_are_the_chat_routes():
    row = agentic_conversations(1, seed=1).rows[0]
    for messages in prompt_messages(row["messages"], "each")[:3]:
        assert prompt_ids(messages, row["tools"]) == chat_prompt_ids(messages, row["tools"])
