"""The pivot without waste or bias: continue a row truncated under a lower cap from its exact tokens.

A row cut at cap C' holds the prompt's and the response's token ids (`GeneratedRow.prompt_token_ids`,
`response_token_ids`). Sending them back to `/generate` with `max_new_tokens = C - len(response ids)` and
the sampling params the row was generated with (its run's) finishes the same sample, so the dataset has the lengths of one uninterrupted
run at cap C and pays only for the tokens past C'. Regenerating instead pays the prefix again and keeps
only the samples that happened to come out short the second time.

The new row is the seamless whole: its text is the server's decoding of the whole id sequence (`/detokenize`
of the truncated row's response ids + the new ids), split into thinking, answer and tool calls by the
server's own parsers (`/separate_reasoning`, `/parse_function_call`), exactly as the chat route decodes and
splits an uninterrupted response. Joining the two texts instead is wrong wherever the cut fell inside a
character (byte-level BPE): SGLang ends the first text with U+FFFD there and starts the continuation's after
the character, so the joined text has U+FFFD where the character was. A server without `/detokenize` (or a
continuation without `output_ids`) leaves only the join: the row's provenance then says
`"text": "joined"` (its seam may hold U+FFFD) and the report counts such rows. Its
`completion_tokens` count the whole completion; its `provenance` names the row it extends and the
tokens before and after. A truncated row stored without token ids (committed before tracegen stored
them, or by a server that did not return them) cannot be continued: it is generated again instead, and
its provenance and the log say so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from tracegen.audit.loop_stop import LoopWatch
from tracegen.dataset.reader import DatasetIndex, InvalidRow, PromptRow, read_indices
from tracegen.generate.rows import complete_row
from tracegen.generate.thinking import TEMPLATE_KWARGS
from tracegen.generate.watched import (
    StepFailed,
    loop_stopped,
    split_output,
    step_value,
    streams_watched,
    watching,
)
from tracegen.run.run_record import read_run_record
from tracegen.run.run_spec import RunSpecError
from tracegen.sglang.affinity import prefix_key
from tracegen.sglang.client import ChatRequest, Outcome, Sampling, SGLangClient
from tracegen.sglang.wire import Generated, ServerParsers
from tracegen.store.entries import LedgerError
from tracegen.store.records import (
    EXTENDED,
    FAILED,
    FALLBACK_REGENERATED,
    LOOP,
    OK,
    REGENERATED,
    REJECTED,
    GeneratedRow,
    pack_token_ids,
    unpack_token_ids,
)
from tracegen.store.root import OutputRoot
from tracegen.store.storage import StorageKeyError

log = logging.getLogger(__name__)

# How an extended row's text was made (its provenance `text`): the server's decoding of all its ids, or the
# two texts joined (no /detokenize): then the seam may hold U+FFFD where the cut fell inside a character.
DECODED = "decoded"
JOINED = "joined"

# Qwen3-style reasoning markup: the chat route hands back the text between these as reasoning_content.
THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class Superseded:
    """The committed row, truncated under a lower cap, that a new row of this run replaces."""

    index: int
    max_tokens: int
    part: str

    def ref(self) -> dict[str, Any]:
        return {"part": self.part, "index": self.index, "max_tokens": self.max_tokens}


def superseded_map(frame: pd.DataFrame) -> dict[int, Superseded]:
    """`tracegen.run.plan.superseded_rows` keyed by index."""
    return {
        int(i): Superseded(int(i), int(c), str(p))
        for i, c, p in zip(frame["index"], frame["max_tokens"], frame["part"], strict=True)
    }


@dataclass(slots=True)
class Extension:
    """A truncated row to continue; `prompt` is its dataset row when continuing needs it (the row has no
    token ids and is generated again, or the server parses tool calls, which needs the row's tools).
    `sampling` is the one the row was sampled with (its run's): its continuation samples the same way."""

    source: GeneratedRow
    superseded: Superseded
    prompt: PromptRow | None
    sampling: Sampling


def _source_sampling(root: OutputRoot, run_id: str, current: Sampling) -> Sampling:
    """The sampling of the run that generated a row, from its record; this run's when it has none."""
    try:
        config = read_run_record(root, run_id).config
    except (StorageKeyError, RunSpecError) as exc:
        log.warning("run %s has no readable record (%s): its truncated rows are continued with this run's "
                    "sampling %s", run_id, exc, current.params())
        return current
    source = Sampling.of_config(config, current.max_tokens)
    if source.params() != current.params():
        log.warning("rows of run %s were sampled with %s: they are continued with those (a continuation "
                    "finishes the same sample), not this run's %s", run_id, source.params(), current.params())
    return source


def extension_jobs(
    root: OutputRoot,
    dataset: DatasetIndex,
    superseded: dict[int, Superseded],
    *,
    sampling: Sampling,
    need_prompts: bool,
    aws_conn_id: str = "aws_default",
) -> Iterator[Extension | InvalidRow]:
    """The truncated rows of `superseded`, read from their parts one part at a time (memory holds one
    part, not every truncated row of the chunk), in part then index order. `sampling`: this run's."""
    params: dict[str, Sampling] = {}
    by_part: dict[str, dict[int, Superseded]] = {}
    for item in superseded.values():
        by_part.setdefault(item.part, {})[item.index] = item
    for part in sorted(by_part):
        wanted = by_part[part]
        rows = {
            r.index: r for r in root.commits.read_part(part)
            if r.index in wanted and r.max_tokens == wanted[r.index].max_tokens and r.status == OK
            and r.finish_reason == "length"
        }  # fmt: skip
        if len(rows) != len(wanted):
            missing = sorted(set(wanted) - set(rows))[:5]
            raise LedgerError(f"part {part} lacks truncated rows its ledger entry lists (indices {missing})")
        bare = [i for i, r in rows.items() if not_extendable(r) is not None]
        if bare:
            log.warning(
                "%d of %d truncated rows in %s cannot be extended (%s): generating them again instead",
                len(bare), len(rows), part, not_extendable(rows[bare[0]]),
            )
        needed = sorted(rows) if need_prompts else sorted(bare)
        prompts = {p.index: p for p in read_indices(dataset, needed, aws_conn_id=aws_conn_id)}
        for index in sorted(rows):
            prompt = prompts.get(index)
            if isinstance(prompt, InvalidRow):
                yield prompt
                continue
            source = rows[index]
            if source.run_id not in params:
                params[source.run_id] = _source_sampling(root, source.run_id, sampling)
            yield Extension(source, wanted[index], prompt, params[source.run_id])


def not_extendable(row: GeneratedRow) -> str | None:
    """Why a truncated row cannot be continued from its tokens (None: it can)."""
    if not row.has_token_ids:
        return ("it has no token ids (committed before tracegen stored them, or by a server that did not "
                "return them)")
    # base64 of uint32: 4 bytes a token, 3 bytes per 4 characters, less the padding.
    packed = row.response_token_ids
    n = len(packed) * 3 // 4 - (len(packed) - len(packed.rstrip("=")))
    if n != 4 * row.completion_tokens:
        return f"its {n // 4:,} response token ids do not match its {row.completion_tokens:,} completion tokens"
    return None


def raw_text(row: GeneratedRow) -> str:
    """The raw model output a chat response was split from: `<think>` + reasoning_content, then
    `</think>` + content once the answer had begun (thinking inline in content when the server split
    nothing)."""
    reasoning, content = row.reasoning_content, row.content or ""
    if not reasoning:
        return content
    # The answer has begun when the server counted fewer thinking tokens than tokens (a parser that trims
    # whitespace can leave content "" right after </think>).
    answered = bool(content) or 0 < row.reasoning_tokens < row.completion_tokens
    return THINK_START + reasoning + (THINK_END + content if answered else "")


def regenerated_provenance(superseded: Superseded, policy: str, reason: str | None = None) -> dict[str, Any]:
    action = FALLBACK_REGENERATED if reason else REGENERATED
    out: dict[str, Any] = {"action": action, "policy": policy, "supersedes": superseded.ref()}
    if reason:
        out["reason"] = reason
    return out


async def extend_row(
    client: SGLangClient,
    job: Extension,
    *,
    sampling: Sampling,
    model: str,
    run_id: str,
    chunk: int,
    stop_loops: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> GeneratedRow:
    """The row that continues `job.source` up to `sampling.max_tokens` (a failed or rejected row when a
    request fails), or, for a source without token ids, the row generated again in its place. `stop_loops`:
    the run's (`RunConfig.stop_loops`); `template_kwargs`: the row's chat template arguments, for a row
    generated again (a continuation goes on from the ids its prompt was rendered to)."""
    source = job.source
    started = time.monotonic()
    reason = not_extendable(source)
    if reason is not None:
        return await _generate_again(client, job, reason, sampling=sampling, model=model, run_id=run_id,
                                     chunk=chunk, stop_loops=stop_loops, template_kwargs=template_kwargs)
    prompt_ids = unpack_token_ids(source.prompt_token_ids)
    response_ids = unpack_token_ids(source.response_token_ids)
    where = f"continuing the row cut at {len(response_ids):,} tokens ({job.superseded.part})"
    rows = _Rows(job, sampling.max_tokens, run_id, chunk, where)
    try:
        return await _continue(client, job, rows, prompt_ids, response_ids, sampling=sampling,
                               started=started, stop_loops=stop_loops)
    except StepFailed as failed:
        return rows.not_ok(failed.outcome, failed.step)


async def _generate_again(client: SGLangClient, job: Extension, reason: str, *, sampling: Sampling,
                          model: str, run_id: str, chunk: int, stop_loops: bool,
                          template_kwargs: dict[str, Any] | None) -> GeneratedRow:
    """A source without usable token ids: its row generated again under the new cap, provenance saying why."""
    source = job.source
    assert job.prompt is not None  # extension_jobs reads the dataset row of every such row
    log.debug("row %d: %s: generating it again under %d", source.index, reason, sampling.max_tokens)
    request = ChatRequest(source.index, job.prompt.messages, model=model, sampling=sampling, tools=job.prompt.tools,
                          template_kwargs=template_kwargs)
    row = await complete_row(client, request, run_id=run_id, chunk=chunk, category=source.category,
                             watch_with=await watching(client, stop_loops))
    if row.status == OK:
        row.provenance = {**(row.provenance or {}), **regenerated_provenance(job.superseded, "extend", reason)}
    return row


@dataclass(frozen=True, slots=True)
class _Rows:
    """The rows a continuation of `job` can end in, each carrying its source row's identity."""

    job: Extension
    cap: int
    run_id: str
    chunk: int
    where: str  # what was being done, for a failed row's error

    def row(self, status: str, out: Outcome[Any], **fields: Any) -> GeneratedRow:
        source = self.job.source
        return GeneratedRow(index=source.index, status=status, max_tokens=self.cap, run_id=self.run_id,
                            chunk=self.chunk, id=source.id, category=source.category, attempt=out.attempt,
                            **fields)

    def not_ok(self, out: Outcome[Any], step: str) -> GeneratedRow:
        # Only the generation can be refused for good (a context overflow, as chat would be under this
        # cap); a parsing step that fails leaves the row failed, so a later run extends it again.
        if out.rejected is not None and step == "/generate":
            return self.row(REJECTED, out, server=out.server, error=f"{self.where}: {step}: {out.rejected}")
        return self.row(FAILED, out, server="", error=f"{self.where}: {step}: {out.failed or out.rejected}")


async def _continue(client: SGLangClient, job: Extension, rows: _Rows, prompt_ids: list[int],
                    response_ids: list[int], *, sampling: Sampling, started: float,
                    stop_loops: bool) -> GeneratedRow:
    """The continuation's requests in order: the server's parsers, /generate, the whole text decoded and
    split as the chat route splits it. A request that gives no answer raises `StepFailed`."""
    source, cap = job.source, rows.cap
    parsers: ServerParsers = step_value(await client.server_parsers(), "/server_info")
    same = replace(job.sampling, max_tokens=cap, seed=sampling.seed)
    # A row cut inside its thinking continues its thinking: the server is told so, to count those tokens.
    # Streamed and watched where the servers stream incrementally: a continuation that loops is stopped at
    # once instead of running to the cap (the watch starts with the ids before it, so an old loop shows too).
    watch = (lambda: LoopWatch(response_ids)) if streams_watched(parsers, stop_loops) else None
    # The row's prompt and what it generated are cached where it was generated, if its prefix went there.
    affinity = prefix_key(job.prompt.messages, job.prompt.tools) if job.prompt is not None else None
    generated = await client.generate(prompt_ids + response_ids, max_new_tokens=cap - len(response_ids),
                                      sampling=same, require_reasoning=source.cut_in_reasoning, watch=watch,
                                      affinity=affinity)
    new = step_value(generated, "/generate")
    whole, text_from = await _whole_text(client, source, response_ids, new, generated.server)
    tools = job.prompt.tools if job.prompt is not None else None
    reasoning, content, tool_calls, finish = await split_output(client, parsers, whole, new.finish_reason, tools)
    total = len(response_ids) + new.completion_tokens
    stopped = loop_stopped(new, before=len(response_ids))
    return rows.row(
        OK,
        generated,
        server=generated.server,
        content=content,
        reasoning_content=reasoning or None,
        tool_calls=tool_calls,
        finish_reason=LOOP if stopped else finish,
        runaway_score=stopped["score"] if stopped else None,
        prompt_tokens=source.prompt_tokens,
        completion_tokens=total,
        reasoning_tokens=source.reasoning_tokens + new.reasoning_tokens,
        # The continuation's own: it sent the prompt and the kept ids (`GeneratedRow.prompt_sent`), and what
        # it found cached is what the prefix cache saved it; the source row keeps what its request found.
        cached_tokens=new.cached_tokens,
        latency_s=time.monotonic() - started,
        prompt_token_ids=source.prompt_token_ids,
        response_token_ids=None if new.output_ids is None else pack_token_ids(response_ids + new.output_ids),
        provenance={
            "action": EXTENDED,
            "policy": "extend",
            "supersedes": job.superseded.ref(),
            "tokens_before": len(response_ids),
            "tokens_after": total,
            "new_tokens": new.completion_tokens,
            "sampling": job.sampling.params(),
            "text": text_from,
            **({"stopped": stopped} if stopped else {}),
            # The template arguments its prompt ids were rendered with, as the row it continues says.
            **{k: v for k, v in (source.provenance or {}).items() if k == TEMPLATE_KWARGS},
        },
    )


async def _whole_text(client: SGLangClient, source: GeneratedRow, response_ids: list[int], new: Generated,
                      server: str) -> tuple[str, str]:
    """(the whole completion's text, how it was made): the server's decoding of all its ids, or, without
    /detokenize, the two texts joined at the seam."""
    if new.output_ids is not None:
        decoded = await client.detokenize(response_ids + new.output_ids)
        if decoded.value is not None:
            return decoded.value, DECODED
        if decoded.rejected is None:  # the route exists and kept failing: try the row again later
            raise StepFailed(decoded, "/detokenize")
    log.debug("row %d: text joined at the seam (no /detokenize on %s)", source.index, server)
    return raw_text(source) + new.text, JOINED
