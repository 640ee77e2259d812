"""A generation streamed and watched: stopped once it loops instead of running to the cap.

SGLang's chat route streams text, and its token ids only with the last event, too late to judge a loop by. So
where the servers stream incrementally (and the run's `stop_loops` is on) a first generation goes the way a
continuation does (`tracegen.generate.extend`):
- `/v1/tokenize` of the row's messages and tools: the prompt ids the chat route would generate from;
- `/generate` from them, streamed, each new id fed to a `LoopWatch`; once it says the output loops, the
  request is aborted (`SGLangClient.generate`), which frees the server's slot at once;
- the output split into thinking, answer and tool calls by the server's own parsers (`/separate_reasoning`,
  `/parse_function_call`), exactly as the chat route splits it.

Both routes sample alike because every sampling param the chat route would take from the model's
generation config is sent explicitly (`Sampling.params`). A stopped row is committed with what it generated,
finish `loop`, and its provenance says where it was stopped (`loop_stopped`): a runaway, never continued.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tracegen.audit.loop_stop import LoopWatch
from tracegen.sglang.affinity import prefix_key
from tracegen.sglang.client import ChatRequest, Outcome, SGLangClient
from tracegen.sglang.stream import STOPPED
from tracegen.sglang.wire import Generated, ServerParsers
from tracegen.store.records import FAILED, LOOP, OK, REJECTED, GeneratedRow, pack_token_ids

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """A request of a multi-request generation that gave no answer: the row left says which step and why."""

    def __init__(self, outcome: Outcome[Any], step: str) -> None:
        super().__init__(step)
        self.outcome = outcome
        self.step = step


def step_value(outcome: Outcome[Any], step: str) -> Any:
    if outcome.value is None:
        raise StepFailed(outcome, step)
    return outcome.value


def streams_watched(parsers: ServerParsers, stop_loops: bool) -> bool:
    """Whether generations are streamed and stopped when they loop: the run asks for it and the servers stream
    incrementally (a cumulative stream repeats the whole output in every event: quadratic bytes)."""
    return stop_loops and parsers.incremental_stream


async def watching(client: SGLangClient, stop_loops: bool) -> ServerParsers | None:
    """The servers' parsers when generations are to be streamed and watched (`streams_watched`), else None;
    also None, with a warning, when the servers do not say how they stream (`/server_info` failed): the rows
    are then asked of the chat route whole, as from servers that do not stream incrementally."""
    if not stop_loops:
        return None
    parsers = await client.server_parsers()
    if parsers.value is None:
        log.warning("the servers' /server_info gave no answer (%s): rows are generated whole, loops not stopped",
                    parsers.failed or parsers.rejected)
        return None
    return parsers.value if streams_watched(parsers.value, stop_loops) else None


def loop_stopped(generated: Generated, *, before: int = 0) -> dict[str, Any] | None:
    """What a request the client stopped in a loop says of it, as its row's provenance keeps it (None: it
    was not stopped): the response token it was stopped at, where the loop began, its period and score.
    `before`: response tokens the row had before this request."""
    verdict = generated.stopped
    if generated.finish_reason != STOPPED or verdict is None:
        return None
    return {"at_token": before + generated.completion_tokens, "onset": before + verdict.onset,
            "period": verdict.period, "score": round(verdict.score, 4)}


async def split_output(client: SGLangClient, parsers: ServerParsers, text: str, finish: str,
                       tools: list[dict[str, Any]] | None) -> tuple[str, str, Any, str]:
    """(reasoning, content, tool calls, finish reason) of a whole raw output, by the server's own parsers."""
    reasoning, content = "", text
    if parsers.reasoning:
        # A failure here loses the new tokens, paid for: rare (the parser runs on the server's CPU), and a
        # later run generates the row again.
        reasoning, content = step_value(await client.separate_reasoning(text, parsers.reasoning),
                                        "/separate_reasoning")
    tool_calls = None
    if parsers.tool_call and tools:
        content_left, calls = step_value(await client.parse_function_call(content, tools, parsers.tool_call),
                                         "/parse_function_call")
        if calls:
            content, tool_calls = content_left, calls
            # As the chat route does: a parsed call turns a natural stop into `tool_calls`, never a cut.
            finish = "tool_calls" if finish == "stop" else finish
    return reasoning, content, tool_calls, finish


async def watched_row(client: SGLangClient, request: ChatRequest, parsers: ServerParsers, *, run_id: str,
                      chunk: int, category: str | None) -> GeneratedRow:
    """`request` generated through `/generate`, streamed and stopped once it loops, recorded as its row."""
    started = time.monotonic()
    cap = request.sampling.max_tokens

    def row(status: str, out: Outcome[Any], **fields: Any) -> GeneratedRow:
        return GeneratedRow(index=request.index, status=status, max_tokens=cap, run_id=run_id, chunk=chunk,
                            category=category, attempt=out.attempt, **fields)

    try:
        prompt_ids: list[int] = step_value(await client.tokenize(request), "/v1/tokenize")
        generated = await client.generate(prompt_ids, max_new_tokens=cap, sampling=request.sampling,
                                          watch=LoopWatch, affinity=prefix_key(request.messages, request.tools))
        new: Generated = step_value(generated, "/generate")
        reasoning, content, tool_calls, finish = await split_output(client, parsers, new.text,
                                                                    new.finish_reason, request.tools)
    except StepFailed as failed:
        out = failed.outcome
        # Refused for good (a context overflow, a prompt the template refuses) as the chat route would be.
        if out.rejected is not None and failed.step in ("/v1/tokenize", "/generate"):
            return row(REJECTED, out, server=out.server, error=f"{failed.step}: {out.rejected}")
        return row(FAILED, out, server="", error=f"{failed.step}: {out.failed or out.rejected}")
    stopped = loop_stopped(new)
    return row(
        OK,
        generated,
        server=generated.server,
        content=content,
        reasoning_content=reasoning or None,
        tool_calls=tool_calls,
        finish_reason=LOOP if stopped else finish,
        runaway_score=stopped["score"] if stopped else None,
        prompt_tokens=len(prompt_ids),
        completion_tokens=new.completion_tokens,
        reasoning_tokens=new.reasoning_tokens,
        cached_tokens=new.cached_tokens,
        latency_s=time.monotonic() - started,
        prompt_token_ids=pack_token_ids(prompt_ids) if new.output_ids is not None else None,
        response_token_ids=pack_token_ids(new.output_ids) if new.output_ids is not None else None,
        provenance={"stopped": stopped} if stopped else None,
    )
