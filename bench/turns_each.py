"""Benchmark: a dataset of conversations expanded with `turns=each`, one prompt row per assistant turn.

Writes --conversations SFT conversations of --turns user/assistant exchanges each (JSONL), indexes them under
`turns=each` (the pass decodes every conversation to count its turns), then measures what the run's tasks do
with the expanded rows: planning and resume over all of them (chunk ends moved to conversation starts,
`done_mask` and per-chunk work against a ledger frame with half the rows done, as `plan_resume.py` does for
plain rows), the stored index's size and load, and
one chunk's read through a byte-counting source (its bytes against its share of the file), with peak RSS
before and after reading chunks of growing size.

    .venv/bin/python bench/turns_each.py [--conversations 100000] [--turns 10] [--chunk 2000]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tracegen.config import RunConfig
from tracegen.dataset.index import DatasetIndex, build_index
from tracegen.dataset.reader import CountingSource, open_source, read_rows
from tracegen.dataset.reading import Reading
from tracegen.run import plan


def write_conversations(path: Path, conversations: int, turns: int) -> None:
    with open(path, "w") as out:
        for i in range(conversations):
            messages = [{"role": "system", "content": "You are a careful coding agent."}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"step {t} of task {i}: " + "x" * (40 + (i * 7 + t) % 200)})
                messages.append({"role": "assistant", "content": f"done step {t}: " + "y" * (80 + (i * 3 + t) % 300)})
            out.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=100_000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sft.jsonl"
        write_conversations(path, args.conversations, args.turns)
        size = path.stat().st_size
        t0 = time.perf_counter()
        index = build_index(str(path), reading=Reading(turns="each"))
        t_index = time.perf_counter() - t0
        stored = index.to_bytes()
        t0 = time.perf_counter()
        DatasetIndex.from_bytes(stored)
        t_load = time.perf_counter() - t0
        n = index.n_prompt_rows
        print(f"{args.conversations:,} conversations x {args.turns} turns = {n:,} prompt rows; file {size / 1e6:.0f} MB")
        print(f"index (turns=each): {t_index:.2f} s, {len(stored) / 1024:.0f} KiB stored, loaded in {t_load * 1000:.0f} ms")

        # Planning and resume: half the prompt rows done under the run's cap, the rest left.
        config = RunConfig(dataset_uri=str(path), output_uri=str(Path(d) / "out"), max_tokens=4096)
        done = np.arange(0, n, 2, dtype=np.int64)
        frame = pd.DataFrame({"index": done, "status": "ok", "finish_reason": "stop", "max_tokens": 4096,
                              "committed_at": 0.0})
        layout = plan.choose_layout(config, n, 512, 3)
        t0 = time.perf_counter()
        # As `prepare_run` plans an expanded reading: each chunk ends where a conversation starts.
        layout = plan.whole_conversations(layout, n, index.turn_starts, config.pilot_size, config.pilot_seed,
                                          whole_pilot=False)
        work = plan.chunks_with_work(frame, n, layout, config)
        t_plan = time.perf_counter() - t0
        left = sum(w.remaining for w in work)
        print(f"plan + resume over {n:,} prompt rows: {t_plan:.3f} s ({t_plan / (n / 1e6):.3f} s per million rows), "
              f"{len(work)} chunks, {left:,} rows left")

        # One chunk in the middle, through a byte-counting source.
        start = n // 2
        counting = CountingSource(open_source(str(path)))
        t0 = time.perf_counter()
        got = sum(1 for _ in read_rows(index, start, start + args.chunk, source=counting))
        t_chunk = time.perf_counter() - t0
        share = size * args.chunk / n
        print(f"chunk of {got:,} prompt rows: {counting.bytes_read / 1e6:.2f} MB read in {counting.requests} "
              f"request(s), {counting.bytes_read / share:.2f}x its row share, {t_chunk * 1000:.0f} ms")
        before = rss_mib()
        for size_rows in (args.chunk, 4 * args.chunk, 16 * args.chunk):
            for _ in read_rows(index, 0, min(n, size_rows)):
                pass
            print(f"peak RSS after streaming a chunk of {size_rows:,} prompt rows: {rss_mib():.0f} MiB "
                  f"(before any chunk: {before:.0f} MiB)")


if __name__ == "__main__":
    main()
