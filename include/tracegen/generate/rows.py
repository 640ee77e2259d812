"""A server's answer to a chat request, recorded as a ledger row.

`SGLangClient.complete()` returns what the server said: an `Outcome` holding a `Completion`, or why it holds
none (`rejected`: the server refused the request for good; `failed`: the retries ran out). This module is
where that meets the ledger's format: the row's status, its run, chunk and category (which the client never
sees) and its token ids packed for the part (`pack_token_ids`). The chunk engine, and through it the tail
measurement and the resample, record every first generation here, and so does the pivot's generation again
of a row that cannot be extended (`tracegen.generate.extend`). Where the run stops loops and the servers
stream incrementally, `complete_row` is told so and generates the row streamed (`tracegen.generate.watched`).
"""

from __future__ import annotations

from tracegen.generate.thinking import TEMPLATE_KWARGS
from tracegen.generate.watched import watched_row
from tracegen.sglang.client import ChatRequest, Completion, Outcome, SGLangClient
from tracegen.sglang.wire import ServerParsers
from tracegen.store.records import FAILED, OK, REJECTED, GeneratedRow, pack_token_ids


def chat_row(out: Outcome[Completion], request: ChatRequest, *, run_id: str, chunk: int,
             category: str | None) -> GeneratedRow:
    """The ledger row of `request`'s answer `out`: ok with the completion, else rejected or failed with why."""
    index, cap = request.index, request.sampling.max_tokens
    if out.failed is not None:
        return GeneratedRow(index=index, status=FAILED, max_tokens=cap, run_id=run_id, chunk=chunk,
                            category=category, attempt=out.attempt, server="", error=out.failed)
    if out.rejected is not None:
        return GeneratedRow(index=index, status=REJECTED, max_tokens=cap, run_id=run_id, chunk=chunk,
                            category=category, attempt=out.attempt, server=out.server, error=out.rejected)
    result = out.value
    assert result is not None
    prompt_ids, response_ids = result.prompt_token_ids, result.response_token_ids
    # Both or neither: a continuation needs the prompt and the response.
    both = prompt_ids is not None and response_ids is not None
    return GeneratedRow(
        index=index,
        status=OK,
        max_tokens=cap,
        run_id=run_id,
        chunk=chunk,
        category=category,
        attempt=out.attempt,
        server=out.server,
        id=result.id,
        content=result.content,
        reasoning_content=result.reasoning_content,
        tool_calls=result.tool_calls,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        reasoning_tokens=result.reasoning_tokens,
        cached_tokens=result.cached_tokens,
        latency_s=out.latency_s,
        prompt_token_ids=pack_token_ids(prompt_ids) if both else None,
        response_token_ids=pack_token_ids(response_ids) if both else None,
    )


async def complete_row(client: SGLangClient, request: ChatRequest, *, run_id: str, chunk: int,
                       category: str | None = None, watch_with: ServerParsers | None = None) -> GeneratedRow:
    """`request` sent through `client`, its answer recorded as the row of `run_id`'s chunk `chunk`. With
    `watch_with` (the servers' parsers, given where the run stops loops and the servers stream incrementally:
    `watched.streams_watched`) it is streamed through `/generate` and stopped once it loops
    (`tracegen.generate.watched`); without, asked of the chat route whole. The chat template arguments the
    prompt was rendered with are kept in the row's provenance."""
    if watch_with is not None:
        row = await watched_row(client, request, watch_with, run_id=run_id, chunk=chunk, category=category)
    else:
        row = chat_row(await client.complete(request), request, run_id=run_id, chunk=chunk, category=category)
    if request.template_kwargs:
        row.provenance = {**(row.provenance or {}), TEMPLATE_KWARGS: request.template_kwargs}
    return row
