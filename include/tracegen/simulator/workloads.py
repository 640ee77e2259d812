"""The benchmarks' workloads, as datasets of conversations: agentic-coding conversations, and the single-turn prompts of
the bundled sample.

An agentic conversation is what a coding agent sends: one system prompt and one set of tool schemas that every conversation
of the workload shares (3,000-8,000 tokens together), a task from the user, then turns of an assistant message
with a tool call and the tool's result, the history growing 200-3,000 tokens a turn. Read with `turns=each`
(`tracegen.dataset.turns`) a conversation of k assistant turns is k prompt rows, each the one before plus a turn:
their prompts share everything up to the previous turn, which is what a server's prefix cache can keep.

Sizes are drawn in the stand-in's tokens (its byte-level BPE: about 4.8 characters a token of its English
text), log-uniformly between the bounds, from `seed`.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tracegen.dataset.reading import EACH
from tracegen.dataset.turns import prompt_messages, turn_id
from tracegen.simulator import corpus
from tracegen.simulator.chat_template import render_chat
from tracegen.simulator.tokens import text_ids

SHARED_TOKENS = (3_000, 8_000)  # system prompt and tool schemas, shared by every conversation
TASK_TOKENS = (100, 600)
GROWTH_TOKENS = (200, 3_000)  # one turn: the assistant's message and call, and the tool's result
TURNS = (4, 24)  # assistant turns a conversation
CHARS_PER_TOKEN = 4.8
SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "agentic_coding_prompts.jsonl.gz"
_TOOL_NAMES = ("read_file", "write_file", "edit_file", "run_tests", "run_shell", "grep", "list_dir", "git_diff",
               "git_log", "search_docs", "open_url", "apply_patch")  # fmt: skip


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _text(tokens: float, seed: int) -> str:
    return corpus.text("en", max(1, int(tokens * CHARS_PER_TOKEN)), seed=seed).strip()


@dataclass(frozen=True)
class Workload:
    """Rows of a dataset (`{"id", "messages", "tools"}`), each a whole conversation, and what they share."""

    rows: list[dict[str, Any]]
    shared_tokens: int  # the system prompt and tool schemas, as every prompt row starts


def agentic_conversations(conversations: int, seed: int = 0) -> Workload:
    """`conversations` agentic-coding conversations sharing one system prompt and tool set."""
    rng = random.Random(f"agentic-{seed}")
    shared = _log_uniform(rng, *SHARED_TOKENS)
    # A third of the shared prefix is the system prompt, the rest the tools' descriptions.
    system = _text(shared / 3, seed=seed * 1_000_003 + 1)
    per_tool = shared * 2 / 3 / len(_TOOL_NAMES)
    tools = [{"type": "function", "function": {
        "name": name, "description": _text(per_tool, seed=seed * 1_000_003 + 2 + k),
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "argument": {"type": "string"}},
                       "required": ["path"]}}} for k, name in enumerate(_TOOL_NAMES)]  # fmt: skip
    rows = [_conversation(i, system, tools, random.Random(f"agentic-{seed}-{i}")) for i in range(conversations)]
    shared_ids = prompt_ids([{"role": "system", "content": system}], tools)
    header = len(prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": "x"}], tools))
    return Workload(rows, min(len(shared_ids), header))


def _conversation(i: int, system: str, tools: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": _text(_log_uniform(rng, *TASK_TOKENS), rng.randrange(1 << 30))}]  # fmt: skip
    turns = rng.randint(*TURNS)
    for t in range(turns):
        growth = _log_uniform(rng, *GROWTH_TOKENS)
        said = growth * rng.uniform(0.1, 0.4)
        if t == turns - 1:  # the conversation ends with the assistant's answer
            messages.append({"role": "assistant", "content": _text(said, rng.randrange(1 << 30))})
            break
        call = {"id": f"call_{i}_{t}", "type": "function", "function": {
            "name": rng.choice(_TOOL_NAMES), "arguments": json.dumps({"path": f"src/module_{rng.randrange(100)}.py"})}}  # fmt: skip
        messages.append({"role": "assistant", "content": _text(said, rng.randrange(1 << 30)), "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": _text(growth - said, rng.randrange(1 << 30))})  # fmt: skip
    return {"id": f"conversation-{i:05d}", "messages": messages, "tools": tools}


def single_turn(rows: int) -> Workload:
    """`rows` distinct one-turn prompts from the bundled sample (674 tokens on average): the workload of every
    other benchmark."""
    with gzip.open(SAMPLE, "rt") as f:
        sample = [json.loads(line) for line in f]
    out = []
    for i in range(rows):
        messages = [dict(m) for m in sample[i % len(sample)]["messages"]]
        messages[-1]["content"] = f"[{i}] " + str(messages[-1]["content"])
        out.append({"id": f"single-{i:07d}", "messages": messages})
    return Workload(out, 0)


@dataclass(frozen=True)
class PromptRow:
    """One prompt row as `turns=each` reads it, with the ids the stand-in's chat template makes of it."""

    row_id: str
    conversation: str
    turn: int
    ids: list[int]


def prompt_rows(workload: Workload) -> Iterator[PromptRow]:
    """Every conversation expanded one prompt row per assistant turn, in order."""
    for row in workload.rows:
        for turn, messages in enumerate(prompt_messages(row["messages"], EACH), start=1):
            yield PromptRow(turn_id(row["id"], turn), row["id"], turn, prompt_ids(messages, row.get("tools")))


_SPLIT = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")


def prompt_ids(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
    """The chat prompt's ids as the stand-in's chat route makes them (`tokens.chat_prompt_ids`), each message's
    text encoded once however many prompts repeat it: the tokenizer splits at the added tokens first, so the
    pieces between them encode alone as they do within the whole."""
    text, after = render_chat(messages, tools)
    ids = [i for part in _SPLIT.split(text) if part for i in _piece(part)]
    return ids + (text_ids(after) if after else [])


@lru_cache(maxsize=1 << 16)
def _piece(text: str) -> tuple[int, ...]:
    return tuple(text_ids(text))
