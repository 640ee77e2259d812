"""The online loop stop (`tracegen.audit.loop_stop.LoopWatch`) against the after-the-fact score judged online.

Baseline, same process, same judging points: `runaway_score` called on the whole tail (the last TAIL_WINDOW ids)
every `judge_every` tokens, stopping at RUNAWAY_THRESHOLD. Both are run on
- the test set (`tracegen.simulator.loop_cases`): legitimate repetition and loops, exact and near, periods 1-1,000;
- the SGLang stand-in's own rows (its length law, 3% runaways, cap 16384), as the fleet would stream them.

Prints false positives (legit or natural rows stopped), false negatives (loops not stopped), the median and p95
tokens from a loop's onset to its stop per period band, and CPU (time.process_time) per 1,000 tokens fed, in
chunks of 1, 8 and 64 ids (the server's stream interval).

    .venv/bin/python bench/bench_loop_stop.py [--prompts 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "include"))

from tracegen.audit.loop_stop import DEFAULT_RULE, LoopWatch  # noqa: E402
from tracegen.audit.runaway import RUNAWAY_THRESHOLD, TAIL_WINDOW, runaway_score  # noqa: E402
from tracegen.simulator import loop_cases  # noqa: E402
from tracegen.simulator.lengths import build_model, fresh_sample  # noqa: E402
from tracegen.simulator.protocol import output_ids, plan_request  # noqa: E402

CAP = 16_384
BANDS = ((1, 8), (9, 64), (65, 256), (257, 1000))


def watch_stop(prefix, response, chunk):
    """Response tokens seen when the watch stopped it, or None."""
    w = LoopWatch(prefix)
    for i in range(0, len(response), chunk):
        verdict = w.feed(response[i : i + chunk])
        if verdict is not None:
            return verdict.at_token
    return None


def baseline_stop(prefix, response, chunk):
    """The same with runaway_score on the whole tail at every judging point."""
    ids = list(prefix)
    step, seen = DEFAULT_RULE.judge_every, 0
    for i in range(0, len(response), chunk):
        block = response[i : i + chunk]
        ids.extend(block)
        before, seen = seen, seen + len(block)
        for at in range((before // step + 1) * step, seen + 1, step):
            tail = np.asarray(ids[: len(prefix) + at][-TAIL_WINDOW:])
            if runaway_score(tail) >= RUNAWAY_THRESHOLD:
                return at
    return None


def stand_in_rows(prompts: int):
    """(response ids, onset or None, period or None) of the stand-in's rows at CAP, 3% of them runaways."""
    model = build_model("reference", runaway_rate=0.03)  # the reference law: 18% past 4096
    rows = []
    for i in range(prompts):
        drawn = fresh_sample([11, i, 99], 5, model, 0, True)
        plan = plan_request(drawn, CAP, False)
        ids = output_ids(plan, plan.target)
        loop = plan.loop
        rows.append((ids, None if loop is None else loop[0] + 2, None if loop is None else loop[1]))  # <think>\n
    return rows


def judge(name, stop, cases, chunk=8, cap=None):
    """cases: (prefix, response, onset in response coordinates or None, period or None)."""
    fp = fn = legit = loops = fed = 0
    spent: list[int] = []
    delays: dict[tuple[int, int], list[int]] = {b: [] for b in BANDS}
    t0 = time.process_time()
    for prefix, response, onset, period in cases:
        at = stop(prefix, response, chunk)
        fed += len(response) if at is None else at
        if onset is None:
            legit += 1
            fp += at is not None
        else:
            loops += 1
            if at is None:
                fn += 1
            else:
                band = next(b for b in BANDS if b[0] <= period <= b[1])
                delays[band].append(at - onset)
                spent.append(at)
    cpu = time.process_time() - t0
    print(f"  {name:10s} FP {fp}/{legit} ({100 * fp / max(legit, 1):.2f}%)  FN {fn}/{loops} "
          f"({100 * fn / max(loops, 1):.2f}%)  CPU {1e6 * cpu / fed * 1000:,.0f} µs per 1k tokens fed")
    for (lo, hi), d in delays.items():
        if d:
            q = np.percentile(d, [50, 95])
            print(f"    period {lo:4d}-{hi:<4d} onset->stop median {q[0]:6.0f}  p95 {q[1]:6.0f}  (n={len(d)})")
    if cap and spent:
        print(f"    a stopped loop ran {statistics.mean(spent):,.0f} tokens on average: "
              f"{100 * statistics.mean(spent) / cap:.1f}% of the {cap} it runs to without the stop")


def cpu_per_1k(stop, responses, chunk):
    t0 = time.process_time()
    for r in responses:
        stop((), r, chunk)
    return 1e6 * (time.process_time() - t0) / sum(map(len, responses)) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    args = ap.parse_args()
    cases = [(c.ids[: c.prefix], c.response, None if c.onset is None else c.onset - c.prefix, c.period)
             for c in loop_cases.all_cases()]
    print(f"test set: {sum(c[2] is None for c in cases)} legit, {sum(c[2] is not None for c in cases)} loops "
          f"(judge every {DEFAULT_RULE.judge_every} tokens, streamed in chunks of 8)")
    judge("LoopWatch", watch_stop, cases)
    judge("baseline", baseline_stop, cases)
    rows = stand_in_rows(args.prompts)
    lengths = [len(r[0]) for r in rows]
    print(f"stand-in rows: {len(rows)} at cap {CAP}, {sum(r[1] is not None for r in rows)} runaways, "
          f"mean {statistics.mean(lengths):,.0f} tokens")
    judge("LoopWatch", watch_stop, [((), ids, onset, period) for ids, onset, period in rows], cap=CAP)
    natural = [ids for ids, onset, _ in rows if onset is None][:200]
    print(f"CPU per 1k tokens on {len(natural)} natural stand-in rows ({sum(map(len, natural)):,} tokens), by chunk:")
    for chunk in (1, 8, 64):
        w, b = cpu_per_1k(watch_stop, natural, chunk), cpu_per_1k(baseline_stop, natural, chunk)
        print(f"  chunk {chunk:3d}: LoopWatch {w:6,.0f} µs  baseline {b:7,.0f} µs  ({b / w:.1f}x)")
    joined = [t for r in natural[:20] for t in r]
    tracemalloc.start()
    watches = [LoopWatch(joined[k * 1000 : k * 1000 + 3 * TAIL_WINDOW]) for k in range(20)]
    print(f"memory per watch after {3 * TAIL_WINDOW} ids: {tracemalloc.get_traced_memory()[0] / len(watches) / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
