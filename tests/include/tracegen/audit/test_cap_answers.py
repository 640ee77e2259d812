"""The reviewer's typed cap through the path an answer takes: the HITL task's
`execute_complete` (what runs when the REST handler or the UI records a response) and the answer parsing
it calls (`audit.cap_question.decision_of_answer`). A cap the run cannot act on is refused and the question asked again,
never a failed run and never a run continuing at it; the refusals are `tracegen.common.cap_rule`'s, the same
for a reviewer's answer and an operator's raise."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tracegen.audit.cap_question import (
    CURRENT,
    OTHER,
    PILOT,
    RECOMMENDED,
    STOP,
    AnswerRefused,
    CapQuestion,
    decision_of_answer,
)
from tracegen.common.cap_rule import CapRefused, check_cap

CONTEXT = 40_960
WHEN = dt.datetime(2026, 3, 1, 12, 30, tzinfo=dt.UTC)


def question(**overrides: Any) -> CapQuestion:
    fields: dict[str, Any] = dict(
        run_id="run-1", trigger=PILOT, current_cap=4096, recommended_cap=8192, max_cap=CONTEXT - 1,
        context_length=CONTEXT, truncated_policy="extend", verdict={"verdict": "stop"}, cap_rows=[],
        confidence=0.95, throughput=None, report_uri="file:///out/runs/run-1/pilot-report.html", report_url=None,
        timeout_minutes=60.0,
    )
    return CapQuestion(**{**fields, **overrides})


def answer(q: CapQuestion, cap: Any, kind: str = OTHER):
    return decision_of_answer(q, [q.option_label(kind)], {"cap": cap}, responded_by="reviewer", responded_at=WHEN)


class _TI:
    def __init__(self) -> None:
        self.pushed: list[tuple[str, Any]] = []

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed.append((key, value))


def _review_task(q: CapQuestion):
    """The DAG's HITL task for `q`, whose re-posing of the question is recorded instead of waiting."""
    from tracegen.review_gate import REFUSED_KEY, CapReviewOperator

    task = CapReviewOperator(task_id="review_cap", question=q.to_json())
    asked_again: list[Any] = []
    object.__setattr__(task, "execute", lambda context: asked_again.append(context) or "waiting again")
    return task, asked_again, REFUSED_KEY


def _respond(task, cap: Any, option: str) -> tuple[Any, _TI]:
    ti = _TI()
    event = {"chosen_options": [option], "params_input": {"cap": cap}, "responded_at": WHEN,
             "responded_by_user": {"id": "ada", "name": "Ada Reviewer"}, "timedout": False}
    return task.execute_complete({"ti": ti}, event), ti


# ---- a typed cap of 10**400 -------------------------------------------------------------


def test_a_huge_typed_cap_is_refused_and_asked_again_not_a_failed_run() -> None:
    q = question()
    task, asked_again, refused_key = _review_task(q)
    # The attack: float(10**400) raises OverflowError, which out of the handler would fail the run.
    result, ti = _respond(task, 10**400, q.option_label(OTHER))
    assert result == "waiting again" and len(asked_again) == 1
    [(key, refused)] = ti.pushed
    assert key == refused_key and refused["responded_by"] == "Ada Reviewer"
    assert refused["refused"] == ("cap of about 401 digits is too large: the servers' context length is 40,960 "
                                  "tokens (prompt + completion must fit); enter at most 40,959")


@pytest.mark.parametrize("typed", [10**400, -(10**400), 10**5000, "1" * 5000, "9" * 60, 1e308, float("inf"),
                                   "1e400", "nan"],
                         ids=["10^400", "-10^400", "10^5000", "5000-digit-str", "60-digit-str", "1e308", "inf",
                              "str-1e400", "str-nan"])
def test_numbers_of_any_size_or_kind_are_refused_by_the_answer_parsing(typed) -> None:
    with pytest.raises(AnswerRefused) as info:
        answer(question(), typed)
    message = str(info.value)
    assert message.startswith("cap ") and len(message) < 300, message
    assert ("too large" in message or "not a whole number" in message or "below 1 token" in message), message


def test_integral_numbers_of_either_json_kind_are_taken_as_exact_integers() -> None:
    q = question()
    for typed in (9000, 9000.0, "9000", " 9000 ", "9000.0", 40_959):
        decision = answer(q, typed)
        assert decision.cap == int(float(typed)) and type(decision.cap) is int


# ---- a typed cap below the current one ---------------------------------------------------


def test_a_typed_cap_below_or_at_the_current_one_is_refused_and_asked_again() -> None:
    q = question()
    task, asked_again, refused_key = _review_task(q)
    # The attack: 100 at a 4096 question, taken, would have the run go on at 100.
    result, ti = _respond(task, 100, q.option_label(OTHER))
    assert result == "waiting again" and len(asked_again) == 1
    [(key, refused)] = ti.pushed
    assert key == refused_key
    assert refused["refused"] == (
        "cap 100 is refused: the run's cap is already 4,096; a new cap must go above it (a lower one would cut "
        "rows already done at that cap); to go on at 4,096, choose 'Continue at 4,096 tokens, accepting the "
        "truncation', or choose 'Stop the run'")
    for typed in (4096, 4095, 1):
        with pytest.raises(AnswerRefused, match="the run's cap is already 4,096; a new cap must go above it"):
            answer(q, typed)
    assert answer(q, 4097).cap == 4097
    accepted, _ = _respond(task, 4097, q.option_label(OTHER))
    assert (accepted["cap"], accepted["responded_by"], len(asked_again)) == (4097, "Ada Reviewer", 1)
    # The two ways to stay at (or leave) the current cap are the question's own options.
    assert answer(q, None, CURRENT).cap == 4096 and answer(q, None, STOP).cap is None


def test_the_form_and_the_question_say_the_range_above_the_current_cap() -> None:
    q = question()
    assert q.min_cap == 4097
    assert "from 4,097 to 40,959" in q.body and "a cap outside 4,097 to 40,959" in q.body
    task, _, _ = _review_task(q)
    task._pose()
    assert "4,097 to 40,959" in task.params.get_param("cap").description


def test_a_recommended_cap_not_above_the_current_one_is_not_offered_or_taken() -> None:
    q = question(recommended_cap=2048)
    assert [o.kind for o in q.options] == [OTHER, CURRENT, STOP]
    # A question whose options were written elsewhere (an XCom) is held to the same rule when answered.
    forged = CapQuestion.from_json({**question().to_json(), "options": [
        {"kind": RECOMMENDED, "label": "Continue at 100 tokens (recommended)", "cap": 100},
        *[o for o in question().to_json()["options"] if o["kind"] != RECOMMENDED]]})
    with pytest.raises(AnswerRefused, match="cap 100 is refused: the run's cap is already 4,096"):
        decision_of_answer(forged, ["Continue at 100 tokens (recommended)"], {}, responded_by="r", responded_at=WHEN)


def test_no_typed_cap_is_offered_when_none_fits_above_the_current_one() -> None:
    q = question(current_cap=40_959)
    assert [o.kind for o in q.options] == [CURRENT, STOP]
    with pytest.raises(AnswerRefused, match="clear the field"):
        answer(q, 50_000, STOP)


@pytest.mark.parametrize("typed", [100, 4096, 40_960, 10**400, 0, True], ids=["100", "4096", "40960", "10^400", "0", "True"])
def test_one_rule_a_reviewer_and_an_operator_are_refused_the_same_cap_for_the_same_reason(typed, tmp_path) -> None:
    from engine_support.helpers import make_config, prepare, write_dataset

    from tracegen.run.cap_raise import RaiseRefused, check_raise

    spec = prepare(make_config(write_dataset(tmp_path / "d.jsonl", 20), tmp_path / "out", max_tokens=4096), "run-1")
    with pytest.raises(CapRefused) as rule:
        check_cap(typed, current=4096, context_length=CONTEXT, name="X")
    reason = str(rule.value).removeprefix("X ").split("; to ")[0]
    with pytest.raises(AnswerRefused) as reviewer:
        answer(question(), typed)
    with pytest.raises(RaiseRefused) as operator:
        check_raise(spec, typed, context_length=CONTEXT, earlier=None)
    assert reason in str(reviewer.value) and reason in str(operator.value)


def test_a_huge_cap_typed_with_another_option_is_refused_not_a_crash() -> None:
    q = question()
    with pytest.raises(AnswerRefused, match=r"a cap \(of about 5,001 digits\) was typed but 'Stop the run'"):
        answer(q, 10**5000, STOP)
