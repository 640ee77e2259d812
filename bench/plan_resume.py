"""Benchmark: planning/resume over 1,000,000 indices, and reading a 1,000,000-row ledger.

Prints absolute times and ratios against baselines run in the same process:
- plan: vectorised `done_mask` + `remaining` + `remaining_per_chunk` + `current_rows` vs a plain Python
  loop that builds a set of done indices and filters the index range (the reference job's approach);
- ledger read: `Snapshots.frame()` from the compaction snapshot vs from the ~2,000 raw entries.

    .venv/bin/python bench/plan_resume.py [--rows 1000000] [--segment 500]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
import pandas as pd

from tracegen.run.plan import choose_chunk_size, chunks, done_mask, remaining, remaining_per_chunk
from tracegen.store.current import current_rows
from tracegen.store.entries import SCHEMA, entry_key, part_key
from tracegen.store.records import LEDGER_COLUMNS
from tracegen.store.root import OutputRoot
from tracegen.store.storage import LocalStorage


def synthetic_columns(n: int, rng: np.random.Generator) -> dict[str, list]:
    """Reference-job-like ledger: ~18% truncated at 4096, a few failures, and a 8192 regeneration of some truncations."""
    status = rng.choice(["ok", "failed", "rejected", "invalid"], size=n, p=[0.96, 0.025, 0.01, 0.005])
    length = rng.random(n) < 0.18
    finish = np.where(status == "ok", np.where(length, "length", "stop"), None)
    cap = np.full(n, 4096)
    index = rng.permutation(n)
    # the last 5% of rows are regenerations at 8192 of earlier truncated indices
    k = n // 20
    trunc_idx = index[: n - k][(finish[: n - k] == "length")]
    index[n - k :] = rng.choice(trunc_idx, size=k, replace=False) if trunc_idx.size >= k else index[n - k :]
    cap[n - k :] = 8192
    finish[n - k :] = "stop"
    status[n - k :] = "ok"
    tokens = np.where(finish == "length", cap, rng.integers(50, 4000, size=n))
    return {
        "index": index.tolist(),
        "status": status.tolist(),
        "finish_reason": finish.tolist(),
        "prompt_tokens": rng.integers(100, 20000, size=n).tolist(),
        "completion_tokens": tokens.tolist(),
        "reasoning_tokens": (tokens // 2).tolist(),
        "cut_in_reasoning": (finish == "length").tolist(),
        "max_tokens": cap.tolist(),
        "run_id": ["run1"] * (n - k) + ["run2"] * k,
        "chunk": (np.arange(n) // 2000).tolist(),
        "attempt": [1] * n,
        "server": ["http://127.0.0.1:30000"] * n,
        "latency_s": np.round(rng.random(n) * 60, 4).tolist(),
        "category": ["bugfix"] * n,
        "error": [None] * n,
        "pivot": [None] * (n - k) + ["regenerated"] * k,
        "prefix_tokens": [0] * n,
        "text_joined": [False] * n,
    }


def write_entries(root: OutputRoot, cols: dict[str, list], segment: int) -> int:
    """Write ledger entries directly (frame() never reads parts, so the bench skips generating text)."""
    n = len(cols["index"])
    now = datetime.now(UTC).isoformat()
    count = 0
    for seg, start in enumerate(range(0, n, segment)):
        stop = min(start + segment, n)
        run = cols["run_id"][start]
        chunk = cols["chunk"][start]
        entry = {
            "schema": SCHEMA, "run_id": run, "chunk": chunk, "segment": f"s{seg:06d}",
            "part": part_key(run, chunk, f"s{seg:06d}"), "n_rows": stop - start, "committed_at": now,
            "columns": {c: cols[c][start:stop] for c in LEDGER_COLUMNS},
        }
        root.storage.put(entry_key(run, chunk, f"s{seg:06d}"), json.dumps(entry).encode())
        count += 1
    return count


def naive_plan(frame: pd.DataFrame, n_rows: int, cap: int, policy: str, chunk_size: int) -> list[list[int]]:
    done: set[int] = set()
    for idx, st, fin, mt in zip(frame["index"].tolist(), frame["status"].tolist(),
                                frame["finish_reason"].tolist(), frame["max_tokens"].tolist(), strict=True):
        if (st == "invalid" or (st == "rejected" and mt <= cap) or (st == "ok" and fin in ("stop", "tool_calls"))
                or (st == "ok" and fin == "length" and (policy == "keep" or mt >= cap))):
            done.add(idx)
    return [[i for i in range(s, min(s + chunk_size, n_rows)) if i not in done] for s in range(0, n_rows, chunk_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--segment", type=int, default=500)
    args = ap.parse_args()
    n = args.rows
    rng = np.random.default_rng(0)
    cols = synthetic_columns(n, rng)

    with tempfile.TemporaryDirectory() as tmp:
        root = OutputRoot(LocalStorage(tmp))
        n_entries = write_entries(root, cols, args.segment)
        t = time.perf_counter()
        raw_frame = root.snapshots.frame()
        t_raw = time.perf_counter() - t
        t = time.perf_counter()
        root.snapshots.compact()
        t_compact = time.perf_counter() - t
        t = time.perf_counter()
        frame = root.snapshots.frame()
        t_snap = time.perf_counter() - t
        assert len(frame) == len(raw_frame) == n

    chunk_size = choose_chunk_size(n, 2000)
    plan = chunks(n, chunk_size)
    t = time.perf_counter()
    mask = done_mask(frame, n, 8192, "regenerate")
    left = remaining_per_chunk(mask, plan)
    todo = remaining(frame, np.arange(n), 8192, "regenerate")
    t_plan = time.perf_counter() - t
    t = time.perf_counter()
    best = current_rows(frame)
    t_best = time.perf_counter() - t

    t = time.perf_counter()
    naive = naive_plan(frame, n, 8192, "regenerate", chunk_size)
    t_naive = time.perf_counter() - t
    assert [len(x) for x in naive] == left.tolist() and sum(left) == todo.size, "vectorised plan disagrees"

    print(f"ledger rows: {n:,} in {n_entries:,} entries; {len(plan)} chunks of {chunk_size}")
    print(f"ledger.frame() from entries:  {t_raw:6.2f} s")
    print(f"ledger.compact():             {t_compact:6.2f} s")
    print(f"ledger.frame() from snapshot: {t_snap:6.2f} s   ratio: {t_raw / t_snap:5.1f}x faster than from entries")
    print(f"plan (done_mask + per-chunk counts + remaining over {n:,} indices): {t_plan:6.3f} s")
    print(f"naive Python-set plan:        {t_naive:6.2f} s   ratio: {t_naive / t_plan:5.1f}x faster vectorised")
    print(f"current_rows ({len(best):,} indices):  {t_best:6.3f} s")
    print(f"plan + current_rows + frame from snapshot: {t_plan + t_best + t_snap:6.2f} s (target < 2 s)")
    print(f"remaining under 8192/regenerate: {todo.size:,} of {n:,}")


if __name__ == "__main__":
    main()
