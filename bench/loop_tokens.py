"""Where the GPU time goes when rows loop: one load, three runs, tokens generated against tokens kept.

On SGLang stand-ins (reference-job length law: 18% of the natural rows past 4096; a fresh sample per request,
as SGLang draws one; time-scaled), launched streaming incrementally as the bundled fleet is (its `--stream-interval`),
the same dataset is generated at `max_tokens` 16384 with `runaway_policy=drop`, each run from a fresh output
root through tracegen's own functions (`run.prepare.prepare_run` + `generate.chunk.run_chunk`):

  (1) no loops (stand-ins launched with --sim-runaway-rate 0);
  (2) 3% loops (--sim-runaway-rate 0.03, --sim-loop-shape varied: periods 1 to ~1,000 tokens, near-variants,
      onsets early and late), the client asking the chat route for each row whole (stop_loops=false);
  (3) the same fleet as (2), every row streamed and stopped once it loops (stop_loops=true).

The natural rows follow one law in all three runs: (2) and (3) are launched with the truncated share that
puts 18% of the natural rows past 4096 once the loops are added.

Printed per run: tokens generated (the fleet's own counter) / tokens in the rows the export keeps; tokens spent
on runaways (the fleet's count less the ledger's non-runaway tokens: what a stopped loop generated before its
abort landed included); kept rows per second of fleet time (simulated seconds per stand-in with a request
running: the GPU time the run used; the mean batch beside it), and per wall second (on a 2-core machine the
client and the stand-ins share the CPU, so this one is the CPU's); client CPU per completion (this process's CPU
time: the stand-ins are subprocesses). Then the tokens from each stopped loop's onset to its stop (median, p95),
and the two targets for (3), each met or not.

    .venv/bin/python bench/loop_tokens.py [--rows 4000] [--servers 2] [--time-scale 10] [--sim-seed 0]

The time scale compresses the stand-ins' GPU time, not the client's: each wall second between a loop's token
arriving and its abort landing on the server costs `time scale` times the tokens it would on a GPU, and at 50 the
2-core machine's client can no longer keep the stand-ins' batches full; 10 is the default for both. So the tokens
generated past the client's stop are printed apart (3 a row at scale 10, about 280 at 50), with the tokens each stopped
row had before its loop began: what even a stop at a loop's first token would spend. Which rows loop differs
between runs (a fresh sample per request), so the runaway tokens are also printed per looping row.

Seeds: `--sim-seed` fixes each prompt's difficulty on the stand-ins; the sample noise is fresh on every request,
so a rerun draws new samples and the figures move within their sampling error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))
sys.path.insert(0, str(ROOT / "bench"))

from occupancy_support.fleet import MODEL, Fleet, free_port, wait_healthy  # noqa: E402
from pivot import write_dataset  # noqa: E402

from tracegen.audit.token_account import token_account  # noqa: E402
from tracegen.config import RunConfig  # noqa: E402
from tracegen.fleet import FleetSpec  # noqa: E402
from tracegen.fleet.sources import STREAM_INTERVAL  # noqa: E402
from tracegen.fleet.spec import HostSpec  # noqa: E402
from tracegen.generate.chunk import run_chunk  # noqa: E402
from tracegen.generate.engine import ChunkOptions  # noqa: E402
from tracegen.run.prepare import prepare_run  # noqa: E402
from tracegen.run.run_spec import FleetRef  # noqa: E402
from tracegen.sglang.autotune import parse_metrics  # noqa: E402
from tracegen.sglang.routing import ServerEndpoint  # noqa: E402
from tracegen.store.root import open_root  # noqa: E402

CAP = 16_384
LOOP_RATE = 0.03
NATURAL_PAST_4096 = 0.18


def start(n: int, max_running: int, time_scale: float, seed: int, runaway_rate: float, interval: int) -> Fleet:
    """`n` stand-ins streaming incrementally, `runaway_rate` of their samples looping."""
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    share = runaway_rate + (1 - runaway_rate) * NATURAL_PAST_4096
    for _ in range(n):
        port = free_port()
        argv = [sys.executable, "-m", "tracegen.simulator", "--model-path", "Qwen/Qwen3.6-27B",
                "--served-model-name", MODEL, "--port", str(port), "--max-running-requests", str(max_running),
                "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--context-length", "40960",
                "--enable-metrics", "--sim-time-scale", str(time_scale), "--sim-seed", str(seed),
                "--sim-runaway-rate", str(runaway_rate), "--sim-loop-shape", "varied",
                "--sim-truncated-share", f"{share:.6f}", "--incremental-streaming-output",
                "--stream-interval", str(interval), "--sim-warmup-s", "0.05", "--log-level", "warning"]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    wait_healthy(procs, urls)
    return Fleet(urls, procs, max_running, time_scale)


COUNTERS = ("sglang:generation_tokens_total", "sglang:num_aborted_requests_total",
            "tracegen_sim:busy_seconds_total", "tracegen_sim:busy_slot_seconds_total")


def counters(fleet: Fleet) -> dict[str, float]:
    """The fleet's COUNTERS, summed over its stand-ins: one /metrics read a stand-in."""
    pages = [parse_metrics(httpx.get(u + "/metrics", timeout=10).text) for u in fleet.urls]
    return {name: sum(page.get(name, 0.0) for page in pages) for name in COUNTERS}


def run(fleet: Fleet, dataset: Path, out: Path, run_id: str, stop_loops: bool, spool: Path) -> dict:
    config = RunConfig.from_params({
        "dataset_uri": str(dataset), "output_uri": str(out), "max_tokens": CAP, "runaway_policy": "drop",
        "stop_loops": stop_loops, "pilot_size": 0, "autotune_in_flight": False,
        "max_in_flight_per_server": fleet.max_running, "part_rows": 2000, "part_seconds": 30.0,
    })  # fmt: skip
    fleet_spec = FleetSpec(hosts=(HostSpec("local", tuple(range(len(fleet.urls)))),), model_path=MODEL,
                           launch_module="tracegen.simulator")
    spec, work = prepare_run(config, run_id, FleetRef.of(fleet_spec, "bench-fleet"))
    endpoints = [ServerEndpoint(u, max_in_flight=fleet.max_running, name=f"sim:gpu{i}")
                 for i, u in enumerate(fleet.urls)]
    root = open_root(config.output_uri, config.aws_conn_id)
    before = counters(fleet)
    cpu0, wall0 = time.process_time(), time.monotonic()
    for w in work:
        run_chunk(spec, root=root, chunk=w.chunk, label=f"{run_id} {w.label}", indices=np.arange(w.start, w.stop),
                  endpoints=endpoints, options=ChunkOptions(spool_dir=str(spool)))
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    delta = {name: value - before[name] for name, value in counters(fleet).items()}
    gpu_s, slot_s = delta["tracegen_sim:busy_seconds_total"], delta["tracegen_sim:busy_slot_seconds_total"]
    frame = root.snapshots.frame()
    account = token_account(frame)
    generated = int(delta["sglang:generation_tokens_total"])
    kept_rows = int(((frame["status"] == "ok") & frame["finish_reason"].isin(("stop", "tool_calls"))).sum())
    stops = [row.provenance["stopped"] for _, entry in root.commits.read_entries(root.commits.entries())
             for row in root.commits.read_part(entry["part"]) if row.provenance and "stopped" in row.provenance]
    onsets = [stop["onset"] for stop in stops]
    return {
        "generated": generated, "ledger": account, "kept_rows": kept_rows, "rows": len(frame), "wall_s": wall,
        "cpu_s": cpu, "aborted": int(delta["sglang:num_aborted_requests_total"]),
        # Tokens the stopped rows had before their loops began (the watch's onset; negative: inside a prefix).
        "onset_tokens": int(sum(max(onset, 0) for onset in onsets)),
        # Tokens each stopped row generated from its loop's onset to the client's stop (the watch's onset).
        "past_onset": [stop["at_token"] - max(stop["onset"], 0) for stop in stops],
        # The fleet's time, in simulated seconds per GPU with a request running: what the GPUs cost, whatever the
        # client's speed (on this 2-core machine the client and the stand-ins share the CPU, so wall time is the
        # CPU's). Not slot-seconds: a decode step costs every running request its step time, which grows with the
        # batch, so slot-seconds per token fall when the client leaves the batch part empty.
        "fleet_s": gpu_s / len(fleet.urls),
        # The mean batch: requests running on a GPU while it ran any.
        "batch": slot_s / max(gpu_s, 1e-9),
        # What the fleet generated that no kept, cut or superseded row holds: the runaways, as generated.
        "runaway": generated - account["kept"] - account["truncated_left_out"] - account["superseded"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--stream-interval", type=int, default=STREAM_INTERVAL)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tracegen-loop-tokens-"))
    os.environ["TRACEGEN_WRITE_PREFIXES"] = str(work)  # the bench writes its roots here (tracegen.common.locations)
    dataset = work / "prompts.jsonl"
    write_dataset(dataset, args.rows)
    print(f"loop tokens bench: {args.rows:,} prompts, cap {CAP:,}, runaway_policy=drop, {args.servers} stand-ins "
          f"x {args.max_running} slots (--sim-seed {args.sim_seed}, reference law, {NATURAL_PAST_4096:.0%} of natural "
          f"rows past 4096), stream interval {args.stream_interval}, time scale {args.time_scale:g}", flush=True)
    results: dict[str, dict] = {}
    runs = (("1 no loops", 0.0, True), ("2 loops, whole", LOOP_RATE, False), ("3 loops, stopped", LOOP_RATE, True))
    fleet, rate = None, None
    try:
        for name, loop_rate, stop_loops in runs:
            if loop_rate != rate:
                if fleet is not None:
                    fleet.stop()
                fleet, rate = start(args.servers, args.max_running, args.time_scale, args.sim_seed, loop_rate,
                                    args.stream_interval), loop_rate
            results[name] = r = run(fleet, dataset, work / f"out-{name[0]}", f"run{name[0]}", stop_loops,
                                    work / f"spool-{name[0]}")
            print(f"  ({name}): {r['wall_s']:.0f} s, {r['generated']:,} tokens, {r['ledger']['stopped_rows']:,} "
                  f"stopped, {r['aborted']:,} aborted on the servers", flush=True)
    finally:
        if fleet is not None:
            fleet.stop()

    print(f"\n  {'run':<18} {'gen/kept':>9} {'runaway tok':>12} {'(ledger)':>10} {'rows/fleet-s':>13} "
          f"{'batch':>6} {'rows/wall-s':>12} {'CPU ms/row':>11} {'kept rows':>10}")
    figures = {}
    for name, r in results.items():
        kept = r["ledger"]["kept"]
        figures[name] = f = {"ratio": r["generated"] / kept, "runaway": r["runaway"], "rate": r["kept_rows"] / r["fleet_s"],
                             "wall_rate": r["kept_rows"] / r["wall_s"], "cpu": 1000 * r["cpu_s"] / r["rows"]}
        print(f"  {name:<18} {f['ratio']:9.4f} {f['runaway']:12,} {r['ledger']['runaway']:10,} {f['rate']:13.2f} "
              f"{r['batch']:6.1f} {f['wall_rate']:12.1f} {f['cpu']:11.2f} {r['kept_rows']:10,}")
    base, whole, stopped = (figures[n] for n, _, _ in runs)
    # Gen/kept against the no-loop run and the client's CPU ratio are not targets: the tokens before each loop's
    # onset are a floor no stop removes, and client CPU is a share of a core (bench/client_overhead.py). What a
    # stop costs is the tokens past each loop's onset, printed below.
    checks = [
        ("runaway tokens <= 15% of the whole client's", stopped["runaway"] / max(whole["runaway"], 1), "<=", 0.15),
        ("kept rows per fleet-second >= 1.15x the whole client's", stopped["rate"] / whole["rate"], ">=", 1.15),
    ]
    print(f"\n  the whole client's gen/kept is {whole['ratio'] - base['ratio']:+.4f} from the no-loop run's")
    done, whole_run = results[runs[2][0]], results[runs[1][0]]
    stopped_rows = max(done["ledger"]["stopped_rows"], 1)
    capped_rows = max(whole_run["ledger"]["runaway"] // CAP, 1)  # run 2's runaways all run to the cap
    per_row = (done["runaway"] / stopped_rows) / (whole_run["runaway"] / capped_rows)
    print(f"  runaway tokens a looping row: run 3 {per_row:.1%} of run 2's ({done['ledger']['stopped_rows']:,} stopped rows"
          f" against {capped_rows:,} run to the cap)")
    print(f"  run 3's runaways: {done['ledger']['runaway'] / stopped_rows:,.0f} tokens a stopped row up to the client's "
          f"stop, {(done['runaway'] - done['ledger']['runaway']) / stopped_rows:,.0f} more generated before the abort landed;"
          f" {done['onset_tokens'] / stopped_rows:,.0f} of them before the loop began (the watch's estimate), so a stop at"
          f" each loop's first token would still leave gen/kept {done['onset_tokens'] / done['ledger']['kept']:+.4f}"
          f" above the no-loop run's")
    past = np.asarray(done["past_onset"] or [0])
    print(f"  tokens from each stopped loop's onset to its stop (the watch's onset, {len(done['past_onset']):,} rows): "
          f"median {np.median(past):,.0f}, p95 {np.percentile(past, 95):,.0f}, worst {past.max():,}")
    for what, value, op, bound in checks:
        met = value <= bound if op == "<=" else value >= bound
        print(f"  {'met    ' if met else 'NOT met'} {what}: {value:.4f} {op} {bound}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
