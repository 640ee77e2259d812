"""Benchmark: what a chunk task reads from the ledger as it starts, late in a reference-job-sized fan-out.

A chunk task reads the ledger twice before it sends a request: the continuous gate's sample of the whole
dataset (`plan_frame(continuous_sample)`), then its own rows (`plan_frame(chunk)`). Each read takes the
newest snapshot (one Parquet GET, range-filtered) plus every entry committed since. If only the planner and
audit tasks wrote snapshots, the entries since the last one would pile up through a fan-out and every chunk
start would parse all of them, growing slower with every chunk done (docs/benchmarks.md, the full-scale
rehearsal). So chunk tasks fold those entries into a new snapshot first (`Snapshots.compact_loose`, streamed)
once there are more than COMPACT_OVER.

Same process, same ledger: a 1,000,000-row ledger in 2,000 entries of 500 rows (about the reference job's
913,786 rows in its ~2,300 parts), a snapshot covering the first `--snapshot-share` of them (what the
planner left), and the rest loose:
- before the fold: the two reads with the loose entries parsed;
- after the fold: `compact_loose` (timed, with its own peak RSS in a fresh process), then the same two reads.

    .venv/bin/python bench/chunk_start.py [--rows 1000000] [--segment 500] [--snapshot-share 0.05]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_resume import synthetic_columns, write_entries  # noqa: E402

from tracegen.generate.gate_watch import CONTINUOUS_GATE_SAMPLE  # noqa: E402
from tracegen.run.plan import choose_chunk_size, pilot_sample  # noqa: E402
from tracegen.store.root import OutputRoot  # noqa: E402
from tracegen.store.snapshots import COMPACT_OVER  # noqa: E402
from tracegen.store.storage import LocalStorage  # noqa: E402


def chunk_start_reads(output_root: OutputRoot, sample: list[int], chunk: np.ndarray) -> tuple[float, int]:
    started = time.perf_counter()
    rows = len(output_root.snapshots.plan_frame(sample)) + len(output_root.snapshots.plan_frame(chunk))
    return time.perf_counter() - started, rows


def compact_in_child(root: str) -> tuple[float, float]:
    """compact_loose in a fresh process: (seconds, that process's peak RSS above its start, MiB)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        OutputRoot(LocalStorage(root)).snapshots.compact_loose(COMPACT_OVER)
        seconds = time.perf_counter() - started
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        os.write(write, f"{seconds} {grown}".encode())
        os._exit(0)
    os.close(write)
    out = os.read(read, 200).decode().split()
    os.waitpid(pid, 0)
    return float(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--segment", type=int, default=500)
    ap.add_argument("--snapshot-share", type=float, default=0.05)
    args = ap.parse_args()
    n = args.rows
    cols = synthetic_columns(n, np.random.default_rng(0))
    sample = pilot_sample(n, min(n, CONTINUOUS_GATE_SAMPLE), 1)
    size = choose_chunk_size(n, 2000)
    chunk = np.arange(n // 2, n // 2 + size, dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        output_root = OutputRoot(LocalStorage(tmp))
        head = int(n * args.snapshot_share)
        write_entries(output_root, {c: v[:head] for c, v in cols.items()}, args.segment)
        output_root.snapshots.compact()
        tail = {c: v[head:] for c, v in cols.items()}
        tail["chunk"] = [c + 10_000 for c in tail["chunk"]]  # other entry names than the snapshot's
        loose = write_entries(output_root, tail, args.segment)
        before, rows_before = min(chunk_start_reads(output_root, sample, chunk) for _ in range(3))
        compact_s, compact_mib = compact_in_child(tmp)
        after, rows_after = min(chunk_start_reads(output_root, sample, chunk) for _ in range(3))
        assert rows_before == rows_after, (rows_before, rows_after)
        snap = output_root.snapshots.latest()
        assert snap is not None and snap["n_rows"] == n
    print(f"ledger: {n:,} rows; snapshot of the first {head:,}, then {loose:,} loose entries of {args.segment} rows")
    print(f"chunk start reads (continuous-gate sample of {len(sample):,} + a {size:,}-row chunk), best of 3:")
    print(f"  before (loose entries parsed):   {before:6.2f} s")
    print(f"  after compact_loose:             {after:6.2f} s   ratio: {before / after:5.1f}x faster")
    print(f"compact_loose itself: {compact_s:.2f} s once, peak RSS +{compact_mib:.0f} MiB in its process")
    print(f"rows read: {rows_before:,} (the same both ways)")


if __name__ == "__main__":
    main()
