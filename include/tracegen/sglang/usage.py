"""The one place a server's token counts are held to its own token ids and to the request's cap, however the
generation ended: a whole chat answer or `/generate` answer (`wire`), a finished stream, a stream the client
stopped (`stream`), and so a continuation, which is a `/generate` under what is left of the row's cap.

A server counting 10**12 tokens for a short answer, or 9,000 for two ids, or generating past the cap it was
given, or finding more of the prompt cached than the prompt holds, is broken: its row would corrupt every
statistic built on the counts, so the answer is refused (`InconsistentUsage`, retried like any bad body, never
committed).
"""

from __future__ import annotations

from tracegen.sglang.malformed import MalformedResponse


class InconsistentUsage(MalformedResponse):
    """A response whose token counts disagree with its own token ids or exceed the request's cap."""

    kind = "usage inconsistent with the response"


def check_usage(
    where: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int,
    prompt_ids: list[int] | None,
    output_ids: list[int] | None,
    cap: int | None,
    cap_name: str,
    cached_tokens: int | None = None,
    cached_name: str = "cached_tokens",
) -> None:
    """Counts the row is recorded with must agree with the ids returned beside them (when there are) and
    with the request's cap (when known); the prompt tokens the server found cached (`cached_tokens`, None: it
    did not say; `cached_name` is its field under `where`) are some of the prompt's, never more."""
    if output_ids is not None and completion_tokens != len(output_ids):
        raise InconsistentUsage(f"{where}completion_tokens is {completion_tokens:,} but the response returned "
                                f"{len(output_ids):,} output token ids")
    if prompt_ids is not None and prompt_tokens != len(prompt_ids):
        raise InconsistentUsage(f"{where}prompt_tokens is {prompt_tokens:,} but the response returned "
                                f"{len(prompt_ids):,} prompt token ids")
    if cached_tokens is not None and cached_tokens > prompt_tokens:
        raise InconsistentUsage(f"{where}{cached_name} is {cached_tokens:,}, above prompt_tokens "
                                f"({prompt_tokens:,})")
    check_cap(where, completion_tokens, cap, cap_name)
    if reasoning_tokens > completion_tokens:
        raise InconsistentUsage(f"{where}reasoning_tokens is {reasoning_tokens:,}, above completion_tokens "
                                f"({completion_tokens:,})")


def check_cap(where: str, completion_tokens: int, cap: int | None, cap_name: str) -> None:
    """No generation may hold more tokens than its request allowed (a server ignoring the cap loops on)."""
    if cap is not None and completion_tokens > cap:
        raise InconsistentUsage(f"{where}completion_tokens is {completion_tokens:,}, above the request's "
                                f"{cap_name} of {cap:,}")
