"""The online loop stop on its test set (`tracegen.simulator.loop_cases`, the stand-in's BPE ids): no legitimate
repetition is stopped, every loop is, soon after its onset, with the after-the-fact rule's own score, and the
verdict does not depend on how the stream is chunked."""

from __future__ import annotations

import numpy as np
import pytest

from tracegen.audit.loop_stop import DEFAULT_RULE, REPEATED_NEEDED, LoopRule, LoopWatch, repeated_share
from tracegen.audit.runaway import NGRAM, RUNAWAY_THRESHOLD, TAIL_WINDOW, is_runaway, runaway_score
from tracegen.fleet.sources import STREAM_INTERVAL
from tracegen.simulator import loop_cases
from tracegen.simulator.lengths import build_model, fresh_sample
from tracegen.simulator.protocol import output_ids, plan_request

STREAM_CHUNK = 8  # ids per streamed chunk in the set-wide tests (any size gives the same verdict, tested below)
# A loop is stopped once a full window's worth of its n-grams repeat: about one period plus half a window
# after its onset, plus up to one judging step, plus the n-grams near-variants break.
ONSET_TO_STOP = lambda period: 2 * period + TAIL_WINDOW // 2 + 2 * DEFAULT_RULE.judge_every  # noqa: E731


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
        if stop - case.onset > ONSET_TO_STOP(case.period):
            late.append((case.name, stop - case.onset))
        # The score is the after-the-fact rule's on the same tail: the row it leaves is a runaway to the audit.
        assert verdict.score == runaway_score(case.ids[:stop][-TAIL_WINDOW:]) >= RUNAWAY_THRESHOLD
        assert verdict.period == case.period, case.name
        assert abs(case.prefix + verdict.onset - case.onset) <= 2 * NGRAM, case.name
        assert verdict.at_token % DEFAULT_RULE.judge_every == 0
    assert missed == [] and late == []


def test_at_the_bundled_fleets_stream_interval_every_loop_ends_within_two_periods_and_a_window(loops):
    # The client reads an event per STREAM_INTERVAL ids and stops the request at the end of the event in which
    # the watch fires, up to an interval past the verdict: the interval chosen for the client's CPU must still
    # end every loop within two periods plus the judging window of its onset.
    late = []
    for case in loops:
        w, response = LoopWatch(case.ids[: case.prefix]), case.response
        ends = range(STREAM_INTERVAL, len(response) + STREAM_INTERVAL, STREAM_INTERVAL)
        stop = next((min(end, len(response)) for end in ends if w.feed(response[end - STREAM_INTERVAL : end])), None)
        assert stop is not None, case.name
        if case.prefix + stop - case.onset > 2 * case.period + TAIL_WINDOW:
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
        assert verdict.at_token - onset <= ONSET_TO_STOP(period)
        # What the client commits at the stop is a runaway to the after-the-fact audit.
        assert is_runaway(ids[: verdict.at_token])
        stopped.append(verdict.at_token)
    assert natural >= 150 and runaways >= 60 and len(stopped) == runaways


def test_a_loop_that_began_before_the_continuation_is_stopped_at_the_first_judgement(loops):
    case = by_name(loops, "continued loop 3")
    # The earlier output already holds a full window of the loop.
    long_prefix = loop_cases.LoopCase(case.name, case.ids, prefix=case.onset + 3 * TAIL_WINDOW // 2,
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


def test_a_short_tail_needs_a_full_windows_worth_of_repetition(legit):
    # A traceback quoted three times at the start of a response: the after-the-fact rule, judging the short
    # tail on its own length, would call it a runaway at some judging point; the watch waits for a window's worth.
    case = by_name(legit, "same failure thrice 8 start")
    ids = np.asarray(case.ids)
    step = DEFAULT_RULE.judge_every
    assert max(runaway_score(ids[:t][-TAIL_WINDOW:]) for t in range(step, ids.size + 1, step)) >= RUNAWAY_THRESHOLD
    assert watch(case) is None


def test_repetition_between_fresh_cells_is_not_a_loop(legit):
    # Sixty read_file calls: most 8-grams repeat, but every call names its own path, so no stretch as long
    # as a call recurs. Without the whole-period check the watch would stop it.
    case = by_name(legit, "similar calls 60 late")
    assert watch(case, rule=LoopRule(span_share=0.0)) is not None
    assert watch(case) is None
    # JSON records of about 200 tokens, alike but for their id and name: the longer n-grams must be longer
    # than a record, or the stretch between two ids passes for a whole period.
    case = by_name(legit, "records 60 of 20 fields late")
    assert watch(case, rule=LoopRule(span_cap=64)) is not None
    assert watch(case) is None


def test_judging_points_skipped_could_not_have_fired(loops):
    # The watch skips judging points the repeated-n-gram count cannot reach the bar by (it rises by one a
    # token at most). An exact loop of a short period passes every other check at once: it fires at the
    # first judging point where the count of the whole tail, judged at every point, reaches the bar.
    step = DEFAULT_RULE.judge_every
    for case in loops:
        if not case.name.startswith("exact loop") or case.period > 300:
            continue
        ids = np.asarray(case.ids)
        first = next(t for t in range(step, ids.size + 1, step)
                     if round(runaway_score(ids[:t][-TAIL_WINDOW:]) * (min(t, TAIL_WINDOW) - NGRAM + 1))
                     >= REPEATED_NEEDED)
        assert watch(case).at_token == first, case.name
    assert REPEATED_NEEDED == 1021


def test_repeated_share_is_runaway_scores_quantity_at_any_length(loops):
    ids = np.asarray(by_name(loops, "near loop 89 late").ids[-TAIL_WINDOW:])
    assert repeated_share(ids, NGRAM) == pytest.approx(runaway_score(ids), abs=1e-9)
    # A longer n-gram repeats only where a whole stretch does: never more often than a shorter one.
    shares = [repeated_share(ids, n) for n in (8, 16, 64, 128)]
    assert shares == sorted(shares, reverse=True) and shares[-1] > 0.3
    assert repeated_share([1, 2, 3], 8) == 0.0


def test_ids_out_of_range_are_refused():
    # Ids are checked as they are taken in, at the next judging point (the first once the tail could hold the
    # repeated n-grams the bar asks for: about half a window).
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(ValueError):
            LoopWatch().feed([5] * (TAIL_WINDOW - 1) + [bad])
    with pytest.raises(ValueError):
        LoopWatch([2**64])


def test_a_watch_holds_a_bounded_state_however_long_the_row(legit):
    # One watch per request in flight: its state must not grow with the row.
    w = LoopWatch()
    row = by_name(legit, "plain long row 0").ids
    for _ in range(3):
        assert w.feed(row) is None
    assert w._ids.size <= DEFAULT_RULE.history and len(w._pending) < DEFAULT_RULE.judge_every


@pytest.mark.parametrize("where", ["early", "late"])
def test_a_long_block_written_twice_is_not_a_loop_of_its_length(legit, where):
    # A test run of about 1,040 tokens written out twice: its copies fill a window, and its lines share a few
    # n-grams of their own, so it repeats as many n-grams as a loop of that period would. A loop goes on.
    case = by_name(legit, f"long run twice back to back {where}")
    assert watch(case, rule=LoopRule(min_copies=0)) is not None
    assert watch(case) is None
