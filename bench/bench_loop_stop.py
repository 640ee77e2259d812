"""The loop judge (`tracegen.audit.loop_stop.LoopWatch`) against the same rule judged afresh at every judging point.

Baseline, same process, same judging points: `loop_stop.judge` on the whole history every `judge_every` tokens
(no novelty skip, no incremental keys): what the watch must agree with, at its cost. Both are run on
- real text (`tracegen.simulator.real_text`): 200+ documents no one on the team wrote, cut at 32,768 ids, and
  loops built from them (periods 1-8,192, exact and near-exact, early and late);
- the stand-in's test set (`tracegen.simulator.loop_cases`): legitimate repetition and loops, periods 1-1,000;
- the SGLang stand-in's own rows (its length law, 3% runaways, cap 16384), as the fleet would stream them.

Prints false positives (legit or natural rows stopped), false negatives (loops not stopped), the tokens from a
loop's onset to its stop past two periods per period band (median and worst; the bound is 512), CPU
(time.process_time) per 1,000 tokens fed in chunks of 1, 8 and 64 ids, and memory per watched row.

    .venv/bin/python bench/bench_loop_stop.py [--prompts 2000] [--baseline-docs 40]
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
from tracegen.audit.loop_stop import judge as judge_rule  # noqa: E402
from tracegen.simulator import loop_cases, real_text  # noqa: E402
from tracegen.simulator.lengths import build_model, fresh_sample  # noqa: E402
from tracegen.simulator.protocol import output_ids, plan_request  # noqa: E402

CAP = 16_384
BANDS = ((1, 8), (9, 64), (65, 256), (257, 1000), (1001, 8192))


def watch_stop(prefix, response, chunk):
    """Response tokens seen when the watch stopped it, or None."""
    w = LoopWatch(prefix)
    for i in range(0, len(response), chunk):
        verdict = w.feed(response[i : i + chunk])
        if verdict is not None:
            return verdict.at_token
    return None


def baseline_stop(prefix, response, chunk):
    """The same rule judged afresh on the whole history at every judging point."""
    ids = list(prefix)
    step, seen, history = DEFAULT_RULE.judge_every, 0, DEFAULT_RULE.history
    for i in range(0, len(response), chunk):
        block = response[i : i + chunk]
        ids.extend(block)
        before, seen = seen, seen + len(block)
        for at in range((before // step + 1) * step, seen + 1, step):
            end = len(prefix) + at
            if judge_rule(np.asarray(ids[max(0, end - history) : end], dtype=np.uint32)) is not None:
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
    """cases: (prefix, response, onset in response coordinates or None, period or None, near)."""
    fp = fn = legit = loops = fed = 0
    spent: list[int] = []
    delays: dict[tuple[int, int, bool], list[int]] = {}
    t0 = time.process_time()
    for prefix, response, onset, period, near in cases:
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
                delays.setdefault((*band, near), []).append(at - onset - 2 * period)
                spent.append(at)
    cpu = time.process_time() - t0
    print(f"  {name:10s} FP {fp}/{legit} ({100 * fp / max(legit, 1):.2f}%)  FN {fn}/{loops} "
          f"({100 * fn / max(loops, 1):.2f}%)  CPU {1e6 * cpu / max(fed, 1) * 1000:,.0f} µs per 1k tokens fed")
    for (lo, hi, near), d in sorted(delays.items()):
        print(f"    {'near' if near else 'exact'} period {lo:4d}-{hi:<4d} onset->stop past 2 periods: median "
              f"{np.median(d):6.0f}  worst {max(d):6.0f}  within 512: {sum(x <= 512 for x in d)}/{len(d)}")
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
    ap.add_argument("--baseline-docs", type=int, default=40, help="real documents the slow baseline also judges")
    args = ap.parse_args()
    t0 = time.process_time()
    docs = real_text.documents()
    print(f"real text: {len(docs)} documents, {sum(len(d.ids()) for d in docs):,} ids "
          f"(built and tokenized in {time.process_time() - t0:.1f} s of CPU), cut at {real_text.MAX_TOKENS}")
    real = [((), d.ids(), None, None, False) for d in docs]
    real_loops = [(c.ids[: c.prefix], c.response, c.onset - c.prefix, c.period, c.near) for c in real_text.loops(docs)]
    judge("LoopWatch", watch_stop, real + real_loops)
    judge("baseline", baseline_stop, real[:: max(1, len(real) // args.baseline_docs)])
    cases = [(c.ids[: c.prefix], c.response, None if c.onset is None else c.onset - c.prefix, c.period, c.near)
             for c in loop_cases.all_cases()]
    print(f"stand-in test set: {sum(c[2] is None for c in cases)} legit, {sum(c[2] is not None for c in cases)} loops "
          f"(judge every {DEFAULT_RULE.judge_every} tokens, streamed in chunks of 8)")
    judge("LoopWatch", watch_stop, cases)
    judge("baseline", baseline_stop, cases)
    rows = stand_in_rows(args.prompts)
    lengths = [len(r[0]) for r in rows]
    print(f"stand-in rows: {len(rows)} at cap {CAP}, {sum(r[1] is not None for r in rows)} runaways, "
          f"mean {statistics.mean(lengths):,.0f} tokens")
    judge("LoopWatch", watch_stop, [((), ids, onset, period, False) for ids, onset, period in rows], cap=CAP)
    natural = [ids for ids, onset, _ in rows if onset is None][:200]
    print(f"CPU per 1k tokens on {len(natural)} natural stand-in rows ({sum(map(len, natural)):,} tokens), by chunk:")
    for chunk in (1, 8, 64):
        w, b = cpu_per_1k(watch_stop, natural, chunk), cpu_per_1k(baseline_stop, natural[:20], chunk)
        print(f"  chunk {chunk:3d}: LoopWatch {w:6,.0f} µs  baseline {b:7,.0f} µs  ({b / w:.1f}x)")
    tables = [d.ids() for d in docs if d.kind in ("lock", "table", "listing", "csv")]
    print(f"CPU per 1k tokens on {len(tables)} real listings, tables, lock and data files, chunk 8: "
          f"{cpu_per_1k(watch_stop, tables, 8):,.0f} µs")
    joined = [t for r in natural[:20] for t in r]
    history = DEFAULT_RULE.history
    tracemalloc.start()
    watches = [LoopWatch(joined[k * 1000 : k * 1000 + history]) for k in range(20)]
    per_watch = tracemalloc.get_traced_memory()[0] / len(watches) / 1e3
    print(f"memory per watch holding a full history ({history:,} ids): {per_watch:.0f} KB")


if __name__ == "__main__":
    main()
