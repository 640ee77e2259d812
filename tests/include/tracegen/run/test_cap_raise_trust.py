"""Whether a raise Variable is the run's decision, through the task callables that
read it: a chunk task (`cap_raise.at_current_cap`), the question task (`steps.ask_about_cap`) and the raise
task itself (`steps.raise_cap`), on a stand-in for the Airflow task API (Variables, XComs, task states:
what `airflow.sdk` gives a running task). A Variable is taken only when the tracegen_raise_cap run it
names succeeded and returned exactly it, and its cap passes the one cap rule against the run's cap and
the servers' context; by whom and when are the raising DagRun's. Anything else is ignored and logged."""

from __future__ import annotations

import json
import logging
from typing import Any

import airflow.sdk as airflow_sdk
import pytest
from airflow.sdk.exceptions import AirflowSkipException
from engine_support.helpers import make_config, prepare, write_dataset

from tracegen import steps
from tracegen.audit.cap_question import CAP_FIELD, OTHER, PILOT, CapQuestion, decision_of_answer
from tracegen.common import dag_ids
from tracegen.run.cap_raise import (
    ANSWERING_KEY,
    RAISE_DAG,
    RAISE_TASK,
    CapRaise,
    RaiseFacts,
    at_current_cap,
    decode,
    encode,
    variable_key,
)
from tracegen.tasks.api import TaskApi

CONTEXT = 40_960
GENERATE_RUN = "manual__2026-11-30T09:00:00+00:00"  # the tracegen_generate run (Airflow's id)
RAISE_RUN = "manual__2026-11-30T10:00:00.123456+00:00"  # a tracegen_raise_cap run


class Airflow:
    """The Airflow metadata a task reads: Variables, the generate run's XComs, raise runs' states and results."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.variables: dict[str, str] = {}
        self.servers = [{"server": "gpu0", "context_length": CONTEXT}, {"server": "gpu1", "context_length": CONTEXT}]
        self.raise_runs: dict[str, tuple[str, Any]] = {}  # run id -> (raise_cap's state, its return value)
        self.context: dict[str, Any] = {}
        self.pushed: dict[str, Any] = {}  # what the task pushed as XComs, by key
        self.answering: dict[str, Any] = {}  # raise run id -> its XCom `answering`

    # -- airflow.sdk.Variable
    def variable(self) -> type:
        store = self.variables

        class Variable:
            @staticmethod
            def get(key: str, default: Any = None) -> Any:
                return store.get(key, default)

            @staticmethod
            def set(key: str, value: str, description: str | None = None) -> None:
                store[key] = value

            @staticmethod
            def delete(key: str) -> None:
                store.pop(key, None)

        return Variable

    # -- the task instance's API
    def xcom_pull(self, task_ids=None, dag_id=None, key="return_value", include_prior_dates=False, *,
                  map_indexes=None, default=None, run_id=None) -> Any:
        if dag_id in (None, dag_ids.GENERATE) and run_id in (None, GENERATE_RUN):
            if task_ids == "prepare_run" and key == "run":
                return self.spec.to_json()
            if task_ids == "provision_fleet":
                return self.servers
            if task_ids == "ask_about_cap":
                return None
        if dag_id == RAISE_DAG and task_ids == RAISE_TASK and key == "return_value":
            return self.raise_runs.get(run_id, (None, None))[1]
        if dag_id == RAISE_DAG and task_ids == RAISE_TASK and key == ANSWERING_KEY:
            return self.answering.get(run_id)
        raise AssertionError(f"unexpected xcom_pull {task_ids=} {dag_id=} {key=} {run_id=}")

    def get_task_states(self, dag_id, map_index=None, task_ids=None, task_group_id=None, logical_dates=None,
                        run_ids=None) -> dict[str, Any]:
        if dag_id == RAISE_DAG:
            return {r: {RAISE_TASK: self.raise_runs[r][0]} for r in run_ids or [] if r in self.raise_runs}
        return {r: {"ask_about_cap": None} for r in run_ids or []}  # the run has not decided yet

    def get_dagrun_state(self, dag_id: str, run_id: str) -> str:
        return "running"

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value

    # -- running a task
    def in_generate_task(self) -> None:
        self.context = {"ti": self, "run_id": GENERATE_RUN, "params": {}}

    def run_raise_task(self, cap: int, *, user: str, run_id: str = RAISE_RUN) -> dict[str, Any]:
        """`steps.raise_cap` as the raise DAG runs it, triggered by `user`; recorded as that run's result."""
        class DagRun:
            triggering_user_name = user

        self.context = {"ti": self, "run_id": run_id, "dag_run": DagRun(),
                        "params": {"run_id": GENERATE_RUN, "max_tokens": cap}}
        self.raise_runs[run_id] = ("running", None)
        result = steps.raise_cap()
        self.raise_runs[run_id] = ("success", result)
        return result


@pytest.fixture
def spec(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 60)
    return prepare(make_config(dataset, tmp_path / "out", max_tokens=4096, gate_mode="warn"), "run-1")


@pytest.fixture
def af(spec, monkeypatch) -> Airflow:
    from tracegen.run import raise_request

    monkeypatch.setattr(raise_request, "SETTLE_S", 0.0)  # no chunk here skips the question task
    fake = Airflow(spec)
    monkeypatch.setattr(airflow_sdk, "get_current_context", lambda: fake.context)
    monkeypatch.setattr(airflow_sdk, "Variable", fake.variable())
    return fake


def _hand_written(**fields: Any) -> str:
    raised = dict(run_id="run-1", cap=1_048_576, from_cap=4096, requested_by="the-ceo",
                  requested_at="2020-01-01T00:00:00+00:00", raised_in="manual__made-up")
    return encode(CapRaise(**{**raised, **fields}))


def _what_the_run_does(af: Airflow, spec) -> tuple[int, dict[str, Any] | None]:
    """The cap a chunk task starting now generates at, and the decision the question task takes (None:
    it has nothing to decide, as under gate_mode=warn without a raise)."""
    af.in_generate_task()
    cap = at_current_cap(TaskApi.current(), spec).config.max_tokens
    try:
        af.pushed = {}
        assert steps.ask_about_cap(spec.to_json(), {}, af.servers) == []  # nothing to generate while asking
        decided = af.pushed[dag_ids.QUESTION_KEY]["decided"]
    except AirflowSkipException:
        decided = None
    return cap, decided


def test_a_hand_written_raise_is_ignored_by_the_chunks_and_the_question(af, spec, caplog) -> None:
    # The attack: taken at its word, the Variable has chunks generate at 1,048,576 (the context is 40,960)
    # and the run record it as decided by "the-ceo" in 2020.
    af.variables[variable_key("run-1")] = _hand_written()
    with caplog.at_level(logging.WARNING, logger="tracegen.run.cap_raise"):
        assert _what_the_run_does(af, spec) == (4096, None)
    assert (f"Airflow Variable {variable_key('run-1')} ignored, not a raise this run takes: it names "
            f"{RAISE_DAG} run 'manual__made-up', whose {RAISE_TASK} task is not found") in caplog.text
    # One within the context fares no better: by whom and when cannot be taken from a Variable.
    af.variables[variable_key("run-1")] = _hand_written(cap=8192)
    assert _what_the_run_does(af, spec) == (4096, None)


def test_a_raise_the_raise_task_made_is_taken_with_its_dagruns_user(af, spec) -> None:
    made = af.run_raise_task(8192, user="alice")
    assert made["raised_in"] == RAISE_RUN and made["requested_by"] == "alice"  # the raising DagRun's
    cap, decided = _what_the_run_does(af, spec)
    assert cap == 8192 and decided is not None
    assert (decided["cap"], decided["from_cap"], decided["responded_by"], decided["responded_at"]) == (
        8192, 4096, "alice", made["requested_at"])


@pytest.mark.parametrize("edit", [
    {"requested_by": "the-ceo"}, {"requested_at": "2020-01-01T00:00:00+00:00"}, {"cap": 1_048_576},
    {"cap": 12288}, {"from_cap": 2048},
])
def test_a_real_raise_edited_by_hand_is_ignored(af, spec, edit, caplog) -> None:
    made = af.run_raise_task(8192, user="alice")
    af.variables[variable_key("run-1")] = encode(CapRaise(**{**made, **edit}))
    with caplog.at_level(logging.WARNING, logger="tracegen.run.cap_raise"):
        assert _what_the_run_does(af, spec) == (4096, None)
    assert f"it differs from what {RAISE_DAG} run '{RAISE_RUN}' raised" in caplog.text


def test_a_raise_is_not_taken_before_its_task_has_succeeded(af, spec, caplog) -> None:
    made = af.run_raise_task(8192, user="alice")
    for state in ("running", "failed"):
        af.raise_runs[RAISE_RUN] = (state, made)
        with caplog.at_level(logging.WARNING, logger="tracegen.run.cap_raise"):
            assert _what_the_run_does(af, spec) == (4096, None)
        assert f"whose {RAISE_TASK} task is {state}, not success" in caplog.text


def test_the_reader_checks_the_cap_again_by_the_one_rule(spec) -> None:
    raised = CapRaise(run_id="run-1", cap=12288, from_cap=4096, requested_by="alice",
                      requested_at="2026-11-30T10:00:00+00:00", raised_in=RAISE_RUN)

    def facts(run_cap: int, context_length: int | None):
        return lambda r: RaiseFacts(run_cap=run_cap, context_length=context_length, raise_state="success",
                                    record=raised.to_json())

    assert decode(encode(raised), "run-1", facts(4096, CONTEXT)) == raised
    assert decode(encode(raised), "run-1", facts(4096, 8192)) is None  # over the servers' context
    assert decode(encode(raised), "run-1", facts(12288, CONTEXT)) is None  # not above the run's cap
    assert decode(encode(raised), "run-1", facts(16384, CONTEXT)) is None


def test_the_raise_task_ignores_a_hand_written_earlier_raise(af, spec, caplog) -> None:
    # The attack: taken at its word, the forged 1,048,576 counts as the run's cap, and an honest raise to
    # 8192 is refused as "already raised to 1,048,576 by the-ceo".
    af.variables[variable_key("run-1")] = _hand_written()
    with caplog.at_level(logging.WARNING, logger="tracegen.run.cap_raise"):
        made = af.run_raise_task(8192, user="alice")
    assert (made["cap"], made["from_cap"], made["requested_by"]) == (8192, 4096, "alice")
    assert "ignored" in caplog.text
    assert _what_the_run_does(af, spec)[0] == 8192
    # A second raise goes up from a real first one, and is refused below it, naming who made it.
    second = af.run_raise_task(12288, user="bob", run_id="manual__second")
    assert (second["from_cap"], second["cap"]) == (8192, 12288)
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="already raised to 12,288 by bob"):
        af.run_raise_task(10_000, user="carol", run_id="manual__third")


# ---- a raise that answered the question: who review_cap records -----------------------------------------

RAISE_USER = "tracegen-raise"  # the login of the operator's API connection


def _answered(af: Airflow, monkeypatch, *, by: str, cap: int = 12_000) -> dict[str, Any]:
    """review_cap's decision when `by` answers the pilot gate's question with `cap` typed in the form."""
    from tracegen.review_gate import CapReviewOperator

    monkeypatch.setenv("AIRFLOW_CONN_TRACEGEN_API", json.dumps(
        {"conn_type": "http", "host": "127.0.0.1", "port": 8080, "login": RAISE_USER, "password": "secret-pw"}))
    question = CapQuestion(run_id="run-1", trigger=PILOT, current_cap=4096, recommended_cap=9216, max_cap=40_959,
                           context_length=CONTEXT, truncated_policy="extend", verdict={}, cap_rows=[],
                           confidence=0.95, throughput=None, report_uri="", report_url=None, timeout_minutes=60.0)
    answer = decision_of_answer(question, [question.option_label(OTHER)], {CAP_FIELD: cap}, responded_by=by,
                    responded_at="2026-11-30T10:00:05+00:00")
    af.in_generate_task()
    return CapReviewOperator(task_id="review_cap", question=None)._as_raise(answer, {"id": by, "name": by},
                                                                              "run-1").to_json()


def _raising(af: Airflow, cap: int = 12_000, *, announced: bool = True) -> CapRaise:
    """A raise task that is answering: the run's Variable written, its raise pushed as `answering`."""
    raised = CapRaise(run_id="run-1", cap=cap, from_cap=4096, requested_by="alice",
                      requested_at="2026-11-30T10:00:00+00:00", raised_in=RAISE_RUN)
    af.variables[variable_key("run-1")] = encode(raised)
    af.raise_runs[RAISE_RUN] = ("running", None)
    if announced:
        af.answering[RAISE_RUN] = raised.to_json()
    return raised


def test_an_answer_the_raise_gave_is_recorded_as_the_raise_by_who_triggered_it(af, monkeypatch) -> None:
    _raising(af)
    decided = _answered(af, monkeypatch, by=RAISE_USER)
    assert (decided["responded_by"], decided["cap"], decided["kind"], decided["trigger"]) == ("alice", 12_000, OTHER,
                                                                                            PILOT)
    assert decided["option"] == f"Raised to 12,000 with {RAISE_DAG} (run {RAISE_RUN}), answered as {RAISE_USER}"
    # Once the raise task has returned, the same holds.
    af.raise_runs[RAISE_RUN] = ("success", af.answering[RAISE_RUN])
    assert _answered(af, monkeypatch, by=RAISE_USER)["responded_by"] == "alice"


@pytest.mark.parametrize("case", ["hand-written", "not announced", "raise task failed", "another cap"])
def test_an_answer_as_the_raise_user_without_a_raise_behind_it_is_that_users_answer(af, monkeypatch, case,
                                                                                    capsys) -> None:
    if case == "hand-written":
        af.variables[variable_key("run-1")] = _hand_written(cap=12_000)
    else:
        _raising(af, 16_384 if case == "another cap" else 12_000, announced=case != "not announced")
        if case == "raise task failed":
            af.raise_runs[RAISE_RUN] = ("failed", None)
    decided = _answered(af, monkeypatch, by=RAISE_USER)
    assert (decided["responded_by"], decided["option"]) == (RAISE_USER, "Continue at the cap typed below")
    # The operator's log goes to the task log (structlog's stdout here), not through the root logger.
    assert "answered as 'tracegen-raise', the raise user, but not by a raise this run can vouch for" in (
        capsys.readouterr().out)


def test_a_person_answering_for_themselves_is_never_taken_for_a_raise(af, monkeypatch) -> None:
    _raising(af)
    decided = _answered(af, monkeypatch, by="alice")
    assert (decided["responded_by"], decided["option"]) == ("alice", "Continue at the cap typed below")
