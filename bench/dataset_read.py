"""Benchmark: what one chunk task reads, against reading the whole dataset (same process, same file).

Builds a synthetic JSONL dataset from the bundled sample (repeated to --rows), indexes it once,
then reads one chunk through a byte-counting source. Prints bytes and time as ratios against a
full sequential scan, plus the index build cost and the saved index size.

    .venv/bin/python bench/dataset_read.py [--rows 200000] [--chunk 2000] [--format jsonl|gz|parquet]
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

from tracegen.dataset.reader import CountingSource, build_index, open_source, read_rows
from tracegen.sample_data import SAMPLE_DATASET


def make_dataset(tmp: Path, rows: int, fmt: str) -> Path:
    base = gzip.decompress(SAMPLE_DATASET.read_bytes()).splitlines()
    lines = [base[i % len(base)] for i in range(rows)]
    if fmt == "jsonl":
        path = tmp / "data.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
    elif fmt == "gz":
        path = tmp / "data.jsonl.gz"
        path.write_bytes(gzip.compress(b"\n".join(lines) + b"\n", compresslevel=6))  # one stream: needs a copy
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "data.parquet"
        table = pa.table({"messages": [json.dumps(json.loads(x)["messages"]) for x in lines]})
        pq.write_table(table, path, row_group_size=1024)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--chunk", type=int, default=2000)
    ap.add_argument("--format", choices=["jsonl", "gz", "parquet"], default="jsonl")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = make_dataset(tmp, args.rows, args.format)
        t0 = time.perf_counter()
        index = build_index(str(path), cache_uri=str(tmp / "cache"))
        t_index = time.perf_counter() - t0
        size_index = len(index.to_bytes())

        full = CountingSource(open_source(index.data_uri))
        t0 = time.perf_counter()
        n_full = sum(1 for _ in read_rows(index, 0, index.n_rows, source=full))
        t_full = time.perf_counter() - t0

        start = index.n_rows // 2 + 7  # not block-aligned
        chunk = CountingSource(open_source(index.data_uri))
        t0 = time.perf_counter()
        n_chunk = sum(1 for _ in read_rows(index, start, start + args.chunk, source=chunk))
        t_chunk = time.perf_counter() - t0

    share = n_chunk / n_full
    print(f"dataset: {args.rows:,} rows, {args.format}, {index.data_size:,} bytes read side, {index.n_blocks:,} blocks")
    print(f"index: built in {t_index:.2f}s ({t_index / t_full:.2f}x a full read), saved size {size_index:,} bytes "
          f"({size_index / index.data_size:.5f} of the data)")
    print(f"chunk of {n_chunk:,} rows = {share:.4f} of rows")
    print(f"  bytes read: {chunk.bytes_read:,} = {chunk.bytes_read / full.bytes_read:.4f} of a full read "
          f"({chunk.bytes_read / full.bytes_read / share:.2f}x its row share), {chunk.requests} requests")
    print(f"  time: {t_chunk * 1000:.1f} ms = {t_chunk / t_full:.4f} of a full read")


if __name__ == "__main__":
    main()
