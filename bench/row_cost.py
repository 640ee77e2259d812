"""Where a streamed row's client CPU goes, request by request, against the whole row the chat route answers.

Two stand-ins (their own processes), reasoning parser qwen3, streaming incrementally every --stream-interval tokens,
no loops, rows of the reference length law (18% past 4096) at max_tokens 16384: one paced (--time-scale 10: its
events arrive one by one, as a GPU's do), one answering at once (its events arrive together). This process's CPU
time (time.process_time) per row, rounds interleaved so drift hits all alike:

  whole      `SGLangClient.complete` (the chat route, unstreamed, its ids in the answer): the baseline;
  watched    `generate.watched.watched_row`, the streamed row as the chunk engine runs it, in its three requests:
  tokenize   `/v1/tokenize` of the row's messages alone;
  stream     `/generate` streamed with its `LoopWatch`, from the prompt ids, alone;
  unwatched  the same stream with a watch that judges nothing (the watch's share is stream - unwatched);
  unpaced    the unwatched stream from the stand-in answering at once: unwatched - unpaced is what reading the
             events one wake-up each costs;
  separate   `/separate_reasoning` of a row's text alone.

Then, offline on the texts the streamed rows brought back: the cost of judging text instead of ids, which a row
streamed from the chat route would pay (that route streams text, and its ids only once it has ended): the text
view of the after-the-fact rule (`audit.runaway.text_token_ids` over the whole text), against the LoopWatch fed the
same rows' ids in chunks of the stream interval.

    .venv/bin/python bench/row_cost.py [--rows 256] [--rounds 2] [--concurrency 128] [--stream-interval 256] [--time-scale 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))

from client_overhead import MODEL, messages  # noqa: E402  (the same prompts as the whole-row CPU bench)
from occupancy_support.fleet import free_port, wait_healthy  # noqa: E402

from tracegen.audit.loop_stop import LoopWatch  # noqa: E402
from tracegen.audit.runaway import text_token_ids  # noqa: E402
from tracegen.generate.watched import watched_row, watching  # noqa: E402
from tracegen.sglang.client import ChatRequest, ClientConfig, Sampling, ServerEndpoint, SGLangClient  # noqa: E402

CAP = 16_384
NATURAL_PAST_4096 = 0.18  # the reference job's length law
INSTANT = 100_000.0  # a time scale at which a whole row's events are written before the client reads the first


class _Blind:
    """A watch that never judges: what reading the stream costs without the loop stop."""

    def feed(self, new_ids: object) -> None:
        return None


def start_stand_in(max_running: int, interval: int, time_scale: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", "Qwen/Qwen3.6-27B", "--served-model-name",
            MODEL, "--port", str(port), "--max-running-requests", str(max_running), "--reasoning-parser", "qwen3",
            "--context-length", "40960", "--sim-time-scale", str(time_scale), "--sim-runaway-rate", "0",
            "--sim-truncated-share", str(NATURAL_PAST_4096),
            "--incremental-streaming-output", "--stream-interval", str(interval), "--sim-warmup-s", "0.05",
            "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([proc], [url])
    except SystemExit:
        proc.kill()
        raise
    return proc, url


def request(i: int) -> ChatRequest:
    return ChatRequest(i, messages(i), sampling=Sampling(max_tokens=CAP), model=MODEL)


async def run(kind: str, url: str, rows: int, concurrency: int, texts: list[tuple[str, list[int]]]) -> float:
    """CPU ms per row of `rows` rows of `kind`, `concurrency` at once (the client's setup excluded)."""
    gate = asyncio.Semaphore(concurrency)
    async with SGLangClient([ServerEndpoint(url, max_in_flight=concurrency)], ClientConfig()) as client:
        parsers = await watching(client, True)
        if parsers is None:
            raise SystemExit("the stand-in does not stream incrementally")
        prompt_ids = (await client.tokenize(request(0))).value

        async def one(i: int) -> None:
            async with gate:
                if kind == "whole":
                    out = await client.complete(request(i))
                elif kind == "watched":
                    row = await watched_row(client, request(i), parsers, run_id="bench", chunk=0, category=None)
                    if row.status != "ok":
                        raise SystemExit(f"row {i}: {row.status} {row.error}")
                    return
                elif kind == "tokenize":
                    out = await client.tokenize(request(i))
                elif kind in ("stream", "unwatched", "unpaced"):
                    out = await client.generate(prompt_ids, max_new_tokens=CAP, sampling=request(i).sampling,
                                                watch=LoopWatch if kind == "stream" else _Blind)
                    if out.value is not None and len(texts) < rows:
                        texts.append((out.value.text, out.value.output_ids))
                else:
                    out = await client.separate_reasoning(texts[i % len(texts)][0], parsers.reasoning)
                if out.value is None:
                    raise SystemExit(f"{kind} row {i}: {out.failed or out.rejected}")

        cpu0 = time.process_time()
        await asyncio.gather(*(one(i) for i in range(rows)))
        return (time.process_time() - cpu0) / rows * 1000.0


def offline(texts: list[tuple[str, list[int]]], interval: int) -> tuple[float, float, float]:
    """(ms per row: text view of the whole text, LoopWatch fed the ids by interval; units per token)."""
    cpu0 = time.process_time()
    units = sum(text_token_ids(text, last=None).size for text, _ in texts)
    text_ms = (time.process_time() - cpu0) / len(texts) * 1000.0
    cpu0 = time.process_time()
    for _, ids in texts:
        watch = LoopWatch()
        for k in range(0, len(ids), interval):
            watch.feed(ids[k : k + interval])
    ids_ms = (time.process_time() - cpu0) / len(texts) * 1000.0
    return text_ms, ids_ms, units / sum(len(ids) for _, ids in texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--stream-interval", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=10.0)
    args = parser.parse_args()
    kinds = ("whole", "watched", "tokenize", "stream", "unwatched", "unpaced", "separate")
    paced = start_stand_in(max(args.concurrency, 64), args.stream_interval, args.time_scale)
    at_once = start_stand_in(max(args.concurrency, 64), args.stream_interval, INSTANT)
    texts: list[tuple[str, list[int]]] = []
    try:
        asyncio.run(run("stream", at_once[1], 100, args.concurrency, texts))  # warm-up
        texts.clear()
        cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind in kinds:
                url = at_once[1] if kind == "unpaced" else paced[1]
                cpu[kind].append(asyncio.run(run(kind, url, args.rows, args.concurrency, texts)))
    finally:
        for proc, _ in (paced, at_once):
            proc.kill()
            proc.wait()
    ms = {kind: statistics.median(values) for kind, values in cpu.items()}
    base = ms["whole"]
    tokens = statistics.mean(len(ids) for _, ids in texts)
    print(f"{args.rows} rows x {args.rounds} rounds per kind, concurrency {args.concurrency}, stream interval "
          f"{args.stream_interval}, {tokens:,.0f} tokens a row on average; median CPU ms per row (x the whole row)")
    for kind in kinds:
        print(f"  {kind:10s} {ms[kind]:6.3f} ms  ({ms[kind] / base:.2f}x)   rounds: "
              + " ".join(f"{v:.3f}" for v in cpu[kind]))
    parts = ms["tokenize"] + ms["stream"] + ms["separate"]
    events = tokens / args.stream_interval
    print(f"  the three requests alone add up to {parts:.3f} ms ({parts / base:.2f}x); the watch's share of the "
          f"stream: {ms['stream'] - ms['unwatched']:+.3f} ms; reading the ~{events:.0f} events a row one wake-up "
          f"each: {ms['unwatched'] - ms['unpaced']:+.3f} ms ({1000 * (ms['unwatched'] - ms['unpaced']) / events:.0f} µs "
          f"an event)")
    text_ms, ids_ms, ratio = offline(texts, args.stream_interval)
    print(f"judging text instead of ids, offline on {len(texts)} of those rows ({ratio:.2f} text units a token):")
    print(f"  text view of the whole text {text_ms:.3f} ms a row; LoopWatch on the ids {ids_ms:.3f} ms a row "
          f"({text_ms / ids_ms:.1f}x): a chat-route stream spares tokenize + separate "
          f"({ms['tokenize'] + ms['separate']:.3f} ms) and pays at least the text view before judging anything")


if __name__ == "__main__":
    main()
