"""The loop judge on real text no one on the team wrote (`tracegen.simulator.real_text`: the standard library's tables,
the pinned packages' data files, schemas, RECORD and METADATA files, test data, code stubs; directory, `find` and
process listings; an import-time log; this repository's `git log --stat`), tokenized by the stand-in's BPE and fed
as a stream: none is stopped online, none is judged a runaway after the fact at any cap, and loops built from the
same texts (blocks of 1 to 8,192 ids, exact and near-exact, early and late) are all stopped.

The suite judges each document's first 8,192 ids; `make soak` (the `slow` test) and `bench/bench_loop_stop.py`
judge them to 32,768.
"""

from __future__ import annotations

import pytest

from tracegen.audit.loop_stop import DEFAULT_RULE, LoopWatch
from tracegen.audit.runaway import is_runaway
from tracegen.simulator import real_text

STREAM_CHUNK = 8
# A 0/1 matrix written as 24-character floats (`1.000000000000000000e+00`): about one bit of content per dozen
# ids, whose 8-grams recur as a near loop's do. The one real document the judge calls a loop: named so that
# any other one fails the test.
KNOWN_LOOKALIKES = {"site-packages:scipy/spatial/tests/data/pdist-boolean-inp.txt"}


@pytest.fixture(scope="module")
def docs() -> tuple[real_text.Document, ...]:
    return real_text.documents()


def _stop(ids, prefix=0, chunk=STREAM_CHUNK):
    w = LoopWatch(ids[:prefix])
    response = ids[prefix:]
    for i in range(0, len(response), chunk):
        if (verdict := w.feed(response[i : i + chunk])) is not None:
            return verdict
    return None


def test_the_set_is_real_text_of_every_kind(docs):
    assert len(docs) >= 200
    kinds = {d.kind for d in docs}
    assert {"data", "schema", "config", "lock", "metadata", "table", "code", "listing", "log", "csv"} <= kinds
    assert len({d.source for d in docs}) == len(docs)
    assert sum(len(d.ids()) >= 8_192 for d in docs) >= 100


def _judged(docs, cap: int, caps: tuple[int, ...]) -> set[str]:
    stopped = set()
    for doc in docs:
        ids = doc.ids()[:cap]
        verdict = _stop(ids)
        if verdict is not None:
            stopped.add(doc.source)
        for c in caps:
            # After the fact, the row cut at the cap: the same judge, so the same answer as online by then.
            assert is_runaway(ids[:c]) == (verdict is not None and verdict.at_token <= c), (doc.source, c)
    return stopped


def test_no_real_document_is_stopped_online_or_judged_a_runaway_at_any_cap(docs):
    assert _judged(docs, 8_192, (512, 2_048, 8_192)) == KNOWN_LOOKALIKES


@pytest.mark.slow
def test_no_real_document_is_stopped_up_to_the_longest_cap(docs):
    assert _judged(docs, real_text.MAX_TOKENS, (512, 1_024, 2_048, 4_096, 8_192, 16_384, 32_768)) == KNOWN_LOOKALIKES


def test_every_loop_built_from_real_text_is_stopped_soon_after_its_onset(docs):
    loops = list(real_text.loops(docs))
    assert {c.period for c in loops} >= {1, 8_192} and any(c.near for c in loops)
    missed, late = [], []
    for case in loops:
        verdict = _stop(list(case.ids))
        if verdict is None:
            missed.append(case.name)
            continue
        ran = verdict.at_token - case.onset
        # Two periods and 512 ids; a near loop's variants may be new, and so not yet a loop's, for up to four
        # periods (of at least two judging steps) more.
        bound = 2 * case.period + 512 + (4 * max(case.period, 2 * DEFAULT_RULE.judge_every) if case.near else 0)
        if ran > bound:
            late.append((case.name, ran, bound))
    assert missed == [] and late == []


def test_a_score_an_earlier_rule_gave_is_judged_again_never_trusted(tmp_path, docs):
    """Rows committed before this judge carry the earlier rule's score (`loop_judge` 0), which called listings
    loops. Such a row is judged again from its part: a real listing the earlier rule scored 0.9 is no runaway
    and a raised cap continues it; a real loop it scored so stays one; this judge's own scores are trusted."""
    from tracegen.audit.loop_stop import LOOP_JUDGE
    from tracegen.audit.runaway_rows import find_runaways
    from tracegen.run import plan
    from tracegen.simulator.tokens import decode
    from tracegen.store.records import OK, GeneratedRow, pack_token_ids
    from tracegen.store.root import OutputRoot
    from tracegen.store.storage import open_storage

    listing = next(d for d in docs if d.kind == "listing" and len(d.ids()) >= 4_096).ids()[:4_096]
    looping = next(c for c in real_text.loops(docs) if c.period == 89 and not c.near).ids[:4_096]

    def cut(index: int, ids, judge: int, score: float) -> GeneratedRow:
        return GeneratedRow(index=index, status=OK, max_tokens=4_096, run_id="run-old", chunk=0, finish_reason="length",
                            reasoning_content=decode(list(ids)), completion_tokens=len(ids),
                            prompt_token_ids=pack_token_ids([1, 2, 3]), response_token_ids=pack_token_ids(list(ids)),
                            runaway_score=score, loop_judge=judge)

    root = OutputRoot(open_storage(str(tmp_path / "out")))
    root.commits.commit([cut(0, listing, 0, 0.9), cut(1, looping, 0, 0.9), cut(2, listing, LOOP_JUDGE, 0.0)],
                        "run-old", 0, "seg")
    frame = root.snapshots.frame()
    assert set(find_runaways(root, frame)) == {1}
    # Planning reads no part: an earlier rule's score is no runaway to it, so a higher cap continues both old
    # rows (the continuation's watch, given the row's ids, stops the loop at its first judging point).
    assert set(plan.remaining(frame, range(3), 8_192, "extend").tolist()) == {0, 1, 2}
