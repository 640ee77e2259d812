"""The loop judge (`tracegen.audit.loop_stop`) on the stand-in's test set (`tracegen.simulator.loop_cases`, its BPE
ids): no legitimate repetition is stopped, every loop is, soon after its onset, the after-the-fact judgement is
the same watch replayed, and the verdict does not depend on how the stream is chunked. Real text:
test_loop_real_text.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tracegen.audit import loop_stop
from tracegen.audit.loop_stop import DEFAULT_RULE, MARGIN, NGRAM, LoopWatch, judge
from tracegen.audit.runaway import RUNAWAY_THRESHOLD, is_runaway, runaway_score
from tracegen.fleet.sources import STREAM_INTERVAL
from tracegen.simulator import loop_cases
from tracegen.simulator.lengths import build_model, fresh_sample
from tracegen.simulator.protocol import output_ids, plan_request

STREAM_CHUNK = 8  # ids per streamed chunk in the set-wide tests (any size gives the same verdict, tested below)


def onset_to_stop(case) -> int:
    """The most ids a loop may run past its onset: two periods and 512 ids; a near loop's variants may be new,
    and so not yet a loop's, for up to four periods (of at least two judging steps) more."""
    return 2 * case.period + 512 + (4 * max(case.period, 2 * DEFAULT_RULE.judge_every) if case.near else 0)


@pytest.fixture(scope="module")
def legit():
    return list(loop_cases.legit_cases())


@pytest.fixture(scope="module")
def loops():
    return list(loop_cases.loop_cases())


def watch(case, chunk=STREAM_CHUNK, rule=DEFAULT_RULE):
    w = LoopWatch(case.ids[: case.prefix], rule=rule)
    response = case.response
    for i in range(0, len(response), chunk):
        verdict = w.feed(response[i : i + chunk])
        if verdict is not None:
            return verdict
    return None


def by_name(cases, name):
    (case,) = [c for c in cases if c.name == name]
    return case


def test_the_set_covers_what_it_claims(legit, loops):
    kinds = {c.name.split(" ")[0] for c in legit}
    assert {"file", "three", "test", "long", "table", "similar", "log", "records", "same", "plain"} <= kinds
    assert {c.period for c in loops if not c.near} >= {1, 1000}
    assert min(c.period for c in loops if c.near) <= 8 and max(c.period for c in loops if c.near) >= 800
    assert {c.onset < 400 for c in loops} == {True, False}
    assert any(c.prefix > c.onset for c in loops)
    assert not any(c.is_loop for c in legit)


def test_no_legitimate_repetition_is_stopped(legit):
    stopped = [(c.name, v) for c in legit if (v := watch(c)) is not None]
    assert stopped == []


def test_every_loop_is_stopped_soon_after_its_onset(loops):
    missed, late = [], []
    for case in loops:
        verdict = watch(case)
        if verdict is None:
            missed.append(case.name)
            continue
        stop = case.prefix + verdict.at_token  # index in ids
        if stop - case.onset > onset_to_stop(case):
            late.append((case.name, stop - case.onset))
        assert verdict.score >= RUNAWAY_THRESHOLD and verdict.at_token % DEFAULT_RULE.judge_every == 0
        if case.prefix == 0:
            # After the fact, the same watch replayed: the row it leaves is a runaway, with the same score.
            assert runaway_score(case.ids[:stop]) == max(verdict.score, RUNAWAY_THRESHOLD), case.name
            assert not is_runaway(case.ids[: stop - DEFAULT_RULE.judge_every]), case.name
        if not case.near:
            assert verdict.period == case.period, case.name
            assert abs(case.prefix + verdict.onset - case.onset) <= 2 * NGRAM, case.name
    assert missed == [] and late == []


def test_at_the_bundled_fleets_stream_interval_every_loop_ends_within_its_bound_and_an_interval(loops):
    # The client reads an event per STREAM_INTERVAL ids and stops the request at the end of the event in which
    # the watch fires, up to an interval past the verdict.
    late = []
    for case in loops:
        w, response = LoopWatch(case.ids[: case.prefix]), case.response
        ends = range(STREAM_INTERVAL, len(response) + STREAM_INTERVAL, STREAM_INTERVAL)
        stop = next((min(end, len(response)) for end in ends if w.feed(response[end - STREAM_INTERVAL : end])), None)
        assert stop is not None, case.name
        if case.prefix + stop - case.onset > onset_to_stop(case) + STREAM_INTERVAL:
            late.append((case.name, case.prefix + stop - case.onset))
    assert late == []


def test_the_stand_ins_rows_streamed_at_a_high_cap():
    # The stand-in's own completions, as the fleet would stream them at 16384: a third of them runaways
    # (so a few hundred prompts give both kinds), the rest its natural rows, long ones included.
    model = build_model("reference", runaway_rate=0.3, truncated_share=0.5)  # long natural rows too
    stopped, natural, runaways = [], 0, 0
    for i in range(300):
        plan = plan_request(fresh_sample([17, i, 99], 5, model, 0, True), 16_384, False)
        ids = output_ids(plan, plan.target)
        verdict = watch(loop_cases.LoopCase("stand-in", tuple(ids)))
        if plan.loop is None:
            natural += 1
            assert verdict is None, (i, len(ids))
            continue
        runaways += 1
        onset, period = plan.loop[0] + 2, plan.loop[1]  # after <think>\n
        assert verdict is not None and verdict.period == period
        assert verdict.at_token - onset <= 2 * period + 512
        # What the client commits at the stop is a runaway to the after-the-fact audit.
        assert is_runaway(ids[: verdict.at_token])
        stopped.append(verdict.at_token)
    assert natural >= 150 and runaways >= 60 and len(stopped) == runaways


def test_a_loop_that_began_before_the_continuation_is_stopped_at_the_first_judgement(loops):
    case = by_name(loops, "continued loop 3")
    # The earlier output already holds a full window of the loop.
    long_prefix = loop_cases.LoopCase(case.name, case.ids, prefix=case.onset + 3 * MARGIN,
                                      onset=case.onset, period=case.period)
    verdict = watch(long_prefix)
    assert verdict is not None and verdict.at_token == DEFAULT_RULE.judge_every
    assert verdict.onset < 0 and verdict.period == 3


@pytest.mark.parametrize("name", ["exact loop 1 early", "exact loop 89 late", "near loop 21 late",
                                  "near loop 610 early", "exact loop 1000 late", "continued loop 377",
                                  "similar calls 60 late", "same failure thrice 8 start", "loop 55 after records",
                                  "loop 5 after table"])
def test_the_verdict_does_not_depend_on_the_stream_interval(loops, legit, name):
    case = by_name(loops + legit, name)
    verdicts = {chunk: watch(case, chunk) for chunk in (1, 7, 64, len(case.ids))}
    # numpy ids, as a client might hold them, give the same verdict as Python ints.
    verdicts["numpy"] = LoopWatch(np.asarray(case.ids[: case.prefix])).feed(np.asarray(case.response))
    assert len(set(verdicts.values())) == 1, verdicts
    assert (verdicts[1] is not None) == case.is_loop


def test_a_block_written_twice_is_not_a_loop_and_thrice_is(legit):
    # A traceback quoted three times, a test run given twice, a block of about 1,040 ids twice back to back:
    # none is stopped. The same long block a third time is a loop of its length.
    for name in ("same failure thrice 8 start", "test run twice 40 late", "long run twice back to back late",
                 "long file twice back to back early"):
        assert watch(by_name(legit, name)) is None, name
    rng = random.Random(5)
    pair = loop_cases.long_block_twice(rng, "run")
    block = pair[: len(pair) // 2]
    before = loop_cases.prose(rng, 3_000)
    assert watch(loop_cases.LoopCase("twice", tuple(before + block * 2 + loop_cases.prose(rng, 800)))) is None
    verdict = watch(loop_cases.LoopCase("thrice", tuple(before + block * 3)))
    assert verdict is not None and verdict.period == len(block)


def test_repetition_between_fresh_cells_is_not_a_loop(legit, monkeypatch):
    # Sixty read_file calls, records alike but for their id and name, tables of near-identical rows: most
    # n-grams repeat, but every call, record or row brings a name, a path, a number of its own. Without the bound
    # on new n-grams per period they would be stopped.
    names = ["similar calls 60 late", "records 60 of 20 fields late", "table 120 rows wide late"]
    assert [watch(by_name(legit, n)) for n in names] == [None] * 3
    monkeypatch.setattr(loop_stop, "NOVEL_PER_COPY", 10**9)
    monkeypatch.setattr(loop_stop, "NOVEL_SHARE", 1.0)
    monkeypatch.setattr(loop_stop, "NOVEL_RECENT", loop_stop.RECENT)
    assert any(watch(by_name(legit, n)) is not None for n in names)


def test_judging_points_skipped_could_not_have_fired(loops, legit):
    # The watch skips judging points whose recent novelty cannot fall to the bar by then, and keeps its
    # history's n-grams sorted as it goes: judged afresh at every point, on the same history, the rule fires
    # at the same point.
    step, history = DEFAULT_RULE.judge_every, DEFAULT_RULE.history
    cases = [c for c in loops if c.prefix == 0 and c.period <= 100][::3] + [by_name(legit, "table 30 rows late")]
    for case in cases:
        ids = np.asarray(case.ids, dtype=np.uint32)
        first = next((t for t in range(step, ids.size + 1, step) if judge(ids[max(0, t - history) : t])), None)
        verdict = watch(case)
        assert (verdict.at_token if verdict else None) == first, case.name


def test_ids_out_of_range_are_refused():
    # Ids are checked as they are taken in, at the next judging point.
    for bad in (-1, 2**32, 2**64, 1.5):
        with pytest.raises(ValueError):
            LoopWatch().feed([5] * (2 * DEFAULT_RULE.judge_every - 1) + [bad])
    with pytest.raises(ValueError):
        LoopWatch([2**64])


def test_a_watch_holds_a_bounded_state_however_long_the_row(legit):
    # One watch per request in flight: its state must not grow with the row.
    w = LoopWatch()
    row = by_name(legit, "plain long row 0").ids
    for _ in range(3):
        assert w.feed(row) is None
    limit = DEFAULT_RULE.history + DEFAULT_RULE.history // 4
    assert w._ids.size <= limit and w._keys.size <= limit and len(w._pending) < DEFAULT_RULE.judge_every
