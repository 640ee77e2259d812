"""The 4096 -> 8192 pivot: extending truncated rows from their tokens against regenerating them.

On one fleet of SGLang stand-ins (reference-job-calibrated lengths, a fresh sample per request as SGLang draws
one, time-scaled) and one dataset, each arm from a fresh output root, through tracegen's own functions
(`run.prepare.prepare_run` + `generate.chunk.run_chunk` on the stand-ins' endpoints):

  (a) one uninterrupted run at 8192;
  (b) a run at 4096, then the pivot to 8192 with truncated_policy=extend;
  (c) a run at 4096, then the pivot to 8192 with truncated_policy=regenerate.

Printed: the completion tokens the pivot spent in (b) and (c) (from the servers' own counters, checked
against the ledger) and their ratio; for (b) and (c) against (a), the two-sample KS statistic and p-value
of the final completion lengths, the share of rows longer than 4096, and the truncation left at 8192.

    .venv/bin/python bench/pivot.py [--rows 4000] [--sim-seed 0] [--servers 2] [--time-scale 50]

Seeds: `--sim-seed` fixes each prompt's difficulty on the stand-ins; the sample noise is fresh on every
request (drawn from the OS, as SGLang samples without deterministic inference), so a rerun draws new
samples and the figures move within their sampling error. About 3 minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))

from occupancy_support.fleet import MODEL, Fleet, start_fleet  # noqa: E402

from tracegen.audit.pivot import pivot_summary  # noqa: E402
from tracegen.config import SAMPLE_DATASET, RunConfig  # noqa: E402
from tracegen.fleet import FleetSpec  # noqa: E402
from tracegen.fleet.spec import HostSpec  # noqa: E402
from tracegen.generate.chunk import run_chunk  # noqa: E402
from tracegen.generate.engine import ChunkOptions  # noqa: E402
from tracegen.run.prepare import prepare_run  # noqa: E402
from tracegen.run.run_spec import FleetRef  # noqa: E402
from tracegen.sglang.autotune import parse_metrics  # noqa: E402
from tracegen.sglang.routing import ServerEndpoint  # noqa: E402
from tracegen.store.current import current_mask  # noqa: E402
from tracegen.store.records import OK  # noqa: E402
from tracegen.store.root import open_root  # noqa: E402

LOW, HIGH = 4096, 8192


def write_dataset(path: Path, n: int) -> None:
    """`n` distinct prompts from the bundled agentic-coding sample (each its own difficulty)."""
    with gzip.open(SAMPLE_DATASET, "rt") as f:
        sample = [json.loads(line) for line in f]
    with path.open("w") as out:
        for i in range(n):
            messages = [dict(m) for m in sample[i % len(sample)]["messages"]]
            messages[-1]["content"] = f"[{i}] " + str(messages[-1]["content"])
            out.write(json.dumps({"id": f"pivot-{i:06d}", "messages": messages}) + "\n")


def generated_tokens(fleet: Fleet) -> int:
    """Tokens the fleet has generated so far, from its own counters."""
    return int(sum(parse_metrics(httpx.get(u + "/metrics", timeout=10).text).get("sglang:generation_tokens_total", 0)
                   for u in fleet.urls))


def run(fleet: Fleet, dataset: Path, out: Path, run_id: str, cap: int, policy: str, spool: Path) -> int:
    """One run over the whole dataset through tracegen's own functions; the tokens the fleet generated."""
    config = RunConfig.from_params({
        "dataset_uri": str(dataset), "output_uri": str(out), "max_tokens": cap, "truncated_policy": policy,
        "pilot_size": 0, "autotune_in_flight": False, "max_in_flight_per_server": fleet.max_running,
        "part_rows": 2000, "part_seconds": 30.0,
    })  # fmt: skip
    fleet_spec = FleetSpec(hosts=(HostSpec("local", tuple(range(len(fleet.urls)))),), model_path=MODEL,
                           launch_module="tracegen.simulator")
    spec, work = prepare_run(config, run_id, FleetRef.of(fleet_spec, "bench-fleet"))
    endpoints = [ServerEndpoint(u, max_in_flight=fleet.max_running, name=f"sim:gpu{i}")
                 for i, u in enumerate(fleet.urls)]
    before = generated_tokens(fleet)
    root = open_root(config.output_uri, config.aws_conn_id)
    for w in work:
        run_chunk(spec, root=root, chunk=w.chunk, label=f"{run_id} {w.label}", indices=np.arange(w.start, w.stop),
                  endpoints=endpoints, options=ChunkOptions(spool_dir=str(spool)))
    return generated_tokens(fleet) - before


def final(out: Path) -> tuple[np.ndarray, float, dict]:
    """(completion lengths of the current rows, truncation left at 8192, the pivot's ledger figures)."""
    frame = open_root(str(out)).snapshots.frame()
    cur = frame[current_mask(frame) & (frame["status"] == OK).to_numpy()]
    lengths = cur["completion_tokens"].to_numpy(np.int64)
    left = float((cur["finish_reason"] == "length").mean())
    return lengths, left, pivot_summary(frame, run_id="pivot")


def seams(out: Path) -> dict[str, int]:
    """Of the rows the pivot extended: how many were cut at 4096 inside a character (their first text ends in
    U+FFFD), how many got their text from /detokenize, and the current rows whose text holds U+FFFD."""
    root = open_root(str(out))
    first, extended, current = {}, {}, 0
    frame = root.snapshots.frame()
    cur = set(zip(frame.loc[current_mask(frame), "part"], frame.loc[current_mask(frame), "index"], strict=True))
    for part in sorted(set(frame["part"])):
        for row in root.commits.read_part(part):
            text = (row.reasoning_content or "") + (row.content or "")
            current += (part, row.index) in cur and "\ufffd" in text
            if row.run_id == "first" and row.finish_reason == "length":
                first[row.index] = text.endswith("\ufffd")
            elif row.run_id == "pivot" and row.pivot == "extended":
                extended[row.index] = (row.provenance or {}).get("text")
    return {"extended": len(extended), "cut_inside": sum(first.get(i, False) for i in extended),
            "decoded": sum(v == "decoded" for v in extended.values()), "fffd_rows": current}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--time-scale", type=float, default=50.0)
    args = p.parse_args()
    if args.rows < 3000:
        raise SystemExit("--rows must be at least 3,000 for the KS test to tell the arms apart")

    work = Path(tempfile.mkdtemp(prefix="tracegen-pivot-"))
    os.environ["TRACEGEN_WRITE_PREFIXES"] = str(work)  # the bench writes its roots here (tracegen.common.locations)
    fleet = start_fleet(args.servers, args.max_running, args.time_scale, seed=args.sim_seed)
    try:
        dataset = work / "prompts.jsonl"
        write_dataset(dataset, args.rows)
        print(f"pivot bench: {args.rows:,} prompts, {args.servers} stand-ins (--sim-seed {args.sim_seed}, "
              f"reference-job calibration, fresh sample noise per request), time scale {args.time_scale:g}", flush=True)
        started = time.monotonic()
        spent: dict[str, int] = {}
        runs: dict[str, tuple[np.ndarray, float, dict]] = {}
        marks: dict[str, dict[str, int]] = {}
        arms = {"a": [("direct", HIGH, "extend")],
                "b": [("first", LOW, "extend"), ("pivot", HIGH, "extend")],
                "c": [("first", LOW, "regenerate"), ("pivot", HIGH, "regenerate")]}
        for arm, steps in arms.items():
            out = work / f"out-{arm}"
            for run_id, cap, policy in steps:
                t0 = time.monotonic()
                tokens = run(fleet, dataset, out, run_id, cap, policy, work / f"spool-{arm}")
                print(f"  ({arm}) {run_id:>6} at {cap}, {policy:<10}: {tokens:>12,} tokens generated "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                if run_id == "pivot":
                    spent[arm] = tokens
            runs[arm] = final(out)
            if arm in ("a", "b"):
                marks[arm] = seams(out)
        elapsed = time.monotonic() - started
    finally:
        fleet.stop()

    direct = runs["a"][0]

    def past(lengths: np.ndarray) -> int:
        return int(np.clip(lengths - LOW, 0, None).sum())

    print("\nthe pivot's spend (completion tokens the fleet generated for it; the ledger agrees):")
    for arm, name in (("b", "extend"), ("c", "regenerate")):
        figures = runs[arm][2]
        print(f"  ({arm}) {name:<10}: {spent[arm]:>12,} tokens for {figures['extended'] + figures['regenerated']:,} "
              f"rows truncated at {LOW} (ledger: {figures['tokens_spent']:,})")
    print(f"  regenerate / extend: {spent['c'] / spent['b']:.2f}x")
    print(f"  (b) spent the tokens its rows hold past {LOW}: {past(runs['b'][0]):,} "
          f"((a) holds {past(direct):,} past {LOW}); its {runs['b'][2]['tokens_saved']:,} prefix tokens were "
          "reused, where (c) paid its rows' prefixes again")
    print(f"\nfinal completion lengths against (a), one uninterrupted run at {HIGH} ({direct.size:,} rows):")
    print(f"  {'arm':<16} {'KS stat':>8} {'KS p':>10} {'> 4096':>8} {'left at 8192':>13} {'mean':>7}")
    for arm, name in (("a", "uninterrupted"), ("b", "extend"), ("c", "regenerate")):
        lengths, left, _ = runs[arm]
        ks = stats.ks_2samp(lengths, direct) if arm != "a" else None
        cells = f"{ks.statistic:8.4f} {ks.pvalue:10.2e}" if ks else f"{'-':>8} {'-':>10}"
        print(f"  ({arm}) {name:<12} {cells} {np.mean(lengths > LOW):8.1%} {left:13.2%} {lengths.mean():7.0f}")
    b = marks["b"]
    print(f"\nseams: (b) extended {b['extended']:,} rows, {b['cut_inside']:,} cut at {LOW} inside a character; "
          f"{b['decoded']:,} texts decoded from all their ids (/detokenize); current rows holding U+FFFD: "
          f"(a) {marks['a']['fffd_rows']:,}, (b) {b['fffd_rows']:,}")
    print(f"\n{elapsed:.0f} s in all; --sim-seed {args.sim_seed} (prompt difficulties), sample noise fresh per request")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
