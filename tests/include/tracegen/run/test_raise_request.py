"""Making a raise (`run.raise_request.request_raise`) over a view of Airflow's metadata: when it is refused,
and how it settles the race with the run's deciding task, which reads a raise once, when it starts."""

from __future__ import annotations

from typing import Any

import pytest
from engine_support.helpers import make_config, prepare, write_dataset

from tracegen.audit.cap_question import CAP_FIELD, PILOT, CapQuestion
from tracegen.common.http_connection import ConnectionMisconfigured
from tracegen.review.notify import ASSIGNED_USERS_ENV, assigned_users
from tracegen.run.api_answer import AnswerFailed
from tracegen.run.cap_raise import CapRaise, RaiseFacts, parse, variable_key
from tracegen.run.raise_request import RaiseRefused, request_raise

TARGET = "manual__2026-12-01T09:00:00+00:00"


class Answerer:
    """The REST API as the raise's user sees it: records each answer, or fails as the api-server would."""

    login = "tracegen-raise"

    def __init__(self, fails: AnswerFailed | None = None) -> None:
        self.fails, self.answers = fails, []

    def answer(self, dag_id: str, run_id: str, task_id: str, option: str, params_input: dict[str, Any]) -> dict:
        if self.fails is not None:
            raise self.fails
        self.answers.append((dag_id, run_id, task_id, option, params_input))
        return {"responded_by_user": {"id": self.login, "name": self.login}}


def _asked(cap: int = 4096) -> dict[str, Any]:
    """What ask_about_cap pushes when the pilot gate asks (the run's cap 4096, the servers' context 40,960)."""
    return CapQuestion(run_id="run-1", trigger=PILOT, current_cap=cap, recommended_cap=9216, max_cap=40_959,
                       context_length=40_960, truncated_policy="extend", verdict={}, cap_rows=[], confidence=0.95,
                       throughput=None, report_uri="", report_url=None, timeout_minutes=60.0).to_json()


class View:
    """Airflow as the raise task sees it: the target run's state, XComs, deciding task, and the Variables."""

    def __init__(self, spec, *, state: str | None = "running", deciding: list[str] | None = None,
                 review: list[str] | None = None, answerer: Any = None) -> None:
        self.spec, self.state = spec, state
        self.deciding = deciding or ["none"]  # successive answers; the last one repeats
        self.review = review or ["none"]
        self.variables: dict[str, str] = {}
        self.decision: dict[str, Any] | None = None  # what ask_about_cap pushed as its question once finished
        self.withdrawn: list[str] = []
        self._answerer, self.announced = answerer, []

    def review_state(self, run_id: str) -> str:
        return self.review.pop(0) if len(self.review) > 1 else self.review[0]

    def answerer(self) -> Any:
        if isinstance(self._answerer, Exception):
            raise self._answerer
        return self._answerer

    def announce(self, raised: CapRaise) -> None:
        self.announced.append(raised.to_json())

    def assigned_users(self) -> Any:
        return assigned_users()

    def may_answer(self, user: str) -> bool | None:
        # Airflow's auth manager, as the raise task asks it.
        from tracegen.run.api_answer import hitl_permission

        return hitl_permission(user, "tracegen_generate")

    def run_state(self, run_id: str) -> str | None:
        return self.state

    def prepared_run(self, run_id: str) -> Any:
        return self.spec.to_json() if self.spec is not None else None

    def servers(self, run_id: str) -> Any:
        return [{"server": "gpu0", "context_length": 40_960}]

    def deciding_state(self, run_id: str) -> str:
        return self.deciding.pop(0) if len(self.deciding) > 1 else self.deciding[0]

    def decided(self, run_id: str) -> Any:
        return self.decision

    def facts(self, raised: CapRaise, *, run_cap: int, context_length: int | None) -> RaiseFacts:
        return RaiseFacts(run_cap=run_cap, context_length=context_length, raise_state="success",
                          record=raised.to_json())

    def stored(self, key: str) -> str | None:
        return self.variables.get(key)

    def store(self, key: str, text: str, description: str) -> None:
        self.variables[key] = text

    def withdraw(self, key: str) -> None:
        self.withdrawn.append(key)
        self.variables.pop(key, None)


@pytest.fixture(autouse=True)
def airflow_users(monkeypatch) -> None:
    """The simple auth manager's users, as every component reads them from the configuration; none assigned."""
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                       "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "alice:user,bob:user,vic:viewer")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
    monkeypatch.delenv(ASSIGNED_USERS_ENV, raising=False)


@pytest.fixture
def spec(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 20)
    return prepare(make_config(dataset, tmp_path / "out", max_tokens=4096, gate_mode="warn"), "run-1")


def _raise(view: View, cap: Any = 8192, by: str | None = "alice", **kwargs: Any) -> CapRaise:
    return request_raise(view, TARGET, cap, requested_by=by, raised_in="manual__raise", sleep=lambda s: None,
                         **kwargs)


def test_a_raise_before_the_run_decides_is_kept_with_who_and_where(spec) -> None:
    view = View(spec)
    raised = _raise(view)
    assert (raised.cap, raised.from_cap, raised.requested_by, raised.raised_in) == (8192, 4096, "alice", "manual__raise")
    assert parse(view.variables[variable_key("run-1")], "run-1") == raised


@pytest.mark.parametrize("state", [None, "success", "failed"])
def test_only_a_running_run_is_raised(spec, state) -> None:
    with pytest.raises(RaiseRefused, match=f"is {state or 'not found'}: only a running run"):
        _raise(View(spec, state=state))


def test_a_run_not_prepared_yet_is_refused(spec) -> None:
    view = View(spec)
    view.spec = None
    with pytest.raises(RaiseRefused, match="has not been prepared yet"):
        _raise(view)


@pytest.mark.parametrize("cap, why", [(4096, "above"), (1_000_000, "context"), ("abc", "whole number")])
def test_the_cap_is_refused_by_the_one_rule_before_anything_is_written(spec, cap, why) -> None:
    view = View(spec)
    with pytest.raises(RaiseRefused, match=why):
        _raise(view, cap)
    assert view.variables == {}


def test_a_run_whose_deciding_task_decided_without_asking_is_refused_and_nothing_written(spec) -> None:
    view = View(spec, deciding=["running", "success"])
    view.decision = {"decided": {"cap": 6144, "responded_at": "2026-12-01T09:00:00+00:00"}}
    with pytest.raises(RaiseRefused, match="already decided its cap"):
        _raise(view)
    assert view.variables == {}


def test_a_raise_read_too_late_is_withdrawn_and_refused(spec) -> None:
    # Not started when checked, then running (it read the Variables before the write), then done with
    # another decision: the raise must not stay behind as if taken.
    view = View(spec, deciding=["none", "running", "running", "success"])
    view.decision = {"decided": {"cap": 4096, "responded_at": "2026-12-01T09:00:00+00:00"}}
    with pytest.raises(RaiseRefused, match="already decided its cap"):
        _raise(view)
    assert view.withdrawn == [variable_key("run-1")] and view.variables == {}


def test_a_raise_written_as_the_last_chunk_skips_the_question_is_withdrawn_and_refused(spec) -> None:
    # The last chunk of the first fan-out looked at the Variables just before the write and found no raise:
    # the question task is skipped a moment after the raise first saw it not started.
    slept: list[float] = []
    view = View(spec, deciding=["none", "none", "skipped"])
    with pytest.raises(RaiseRefused, match="skipped with nothing to ask"):
        request_raise(view, TARGET, 8192, requested_by="alice", raised_in="manual__raise", sleep=slept.append)
    assert view.withdrawn == [variable_key("run-1")] and view.variables == {} and slept[0] >= 1.0


def test_a_raise_the_deciding_task_took_stays(spec) -> None:
    view = View(spec, deciding=["none", "running", "success"])

    def took_it(run_id: str) -> dict:  # what ask_about_cap pushes when it read the raise just written
        stored = parse(view.variables[variable_key("run-1")], "run-1")
        return {"decided": {"cap": stored.cap, "responded_at": stored.requested_at}}

    view.decided = took_it
    raised = _raise(view)
    assert view.withdrawn == [] and parse(view.variables[variable_key("run-1")], "run-1") == raised


def test_a_deciding_task_that_never_ends_is_an_error_to_retry_not_a_refusal(spec) -> None:
    view = View(spec, deciding=["none", "running"])
    with pytest.raises(RuntimeError, match="has been running for 0 s"):
        _raise(view, wait_s=0.0)


# ---- a raise while the question waits is the answer --------------------------------------------------


def test_a_raise_while_the_question_waits_answers_it_as_the_api_user(spec) -> None:
    answerer = Answerer()
    view = View(spec, deciding=["success"], review=["queued", "running", "awaiting_input"], answerer=answerer)
    view.decision = _asked()
    raised = _raise(view, 12_000)
    assert answerer.answers == [("tracegen_generate", TARGET, "review_cap", "Continue at the cap typed below",
                                 {CAP_FIELD: 12_000})]
    # Pushed before answering, and kept as the run's raise: what review_cap checks the answer against.
    assert view.announced == [raised.to_json()]
    assert parse(view.variables[variable_key("run-1")], "run-1") == raised and view.withdrawn == []


def test_a_raise_read_too_late_by_a_deciding_task_that_asked_answers_its_question(spec) -> None:
    answerer = Answerer()
    view = View(spec, deciding=["none", "running", "success"], review=["awaiting_input"], answerer=answerer)
    view.decision = _asked()
    raised = _raise(view, 9000)
    assert [a[3:] for a in answerer.answers] == [("Continue at the cap typed below", {CAP_FIELD: 9000})]
    assert parse(view.variables[variable_key("run-1")], "run-1") == raised


def test_without_the_api_connection_the_raise_is_refused_saying_how_to_answer(spec) -> None:
    view = View(spec, deciding=["success"], review=["awaiting_input"], answerer=None)
    view.decision = _asked()
    with pytest.raises(RaiseRefused, match=r"connection 'tracegen_api' \(TRACEGEN_API_CONN\), which is not "
                                           r"defined.*'Continue at the cap typed below' and 12000"):
        _raise(view, 12_000)
    assert view.variables == {} and view.announced == []


def test_a_malformed_api_connection_is_named(spec) -> None:
    view = View(spec, deciding=["success"], review=["awaiting_input"],
                answerer=ConnectionMisconfigured("Airflow connection 'tracegen_api': no login or no password"))
    view.decision = _asked()
    with pytest.raises(RaiseRefused, match="'tracegen_api': no login or no password"):
        _raise(view, 12_000)
    assert view.variables == {}


def test_a_reviewer_who_answered_first_wins_and_the_raise_is_withdrawn(spec) -> None:
    view = View(spec, deciding=["success"], review=["awaiting_input"],
                answerer=Answerer(AnswerFailed("HTTP 409 already updated", status=409)))
    view.decision = _asked()
    with pytest.raises(RaiseRefused, match="someone answered first"):
        _raise(view, 12_000)
    assert view.withdrawn == [variable_key("run-1")] and view.variables == {}


@pytest.mark.parametrize("review", ["success", "skipped"])
def test_a_question_already_answered_is_not_answered_again(spec, review) -> None:
    answerer = Answerer()
    view = View(spec, deciding=["success"], review=[review], answerer=answerer)
    view.decision = _asked()
    with pytest.raises(RaiseRefused, match=f"already decided its cap: its question \\(review_cap\\) is {review}"):
        _raise(view, 12_000)
    assert answerer.answers == [] and view.variables == {}


def test_a_run_that_asked_nothing_is_refused(spec) -> None:
    view = View(spec, deciding=["skipped"], answerer=Answerer())
    with pytest.raises(RaiseRefused, match="already decided its cap"):
        _raise(view, 12_000)
    assert view.variables == {}


def test_a_question_that_never_gets_asked_is_an_error_to_retry(spec) -> None:
    view = View(spec, deciding=["success"], review=["queued"], answerer=Answerer())
    view.decision = _asked()
    with pytest.raises(RuntimeError, match="review_cap of run .* has been queued for 0 s without asking"):
        _raise(view, 12_000, wait_s=0.0)


def _waiting(spec, answerer: Answerer, deciding: list[str] | None = None) -> View:
    view = View(spec, deciding=deciding or ["success"], review=["awaiting_input"], answerer=answerer)
    view.decision = _asked()
    return view


def test_a_raise_answers_the_question_only_for_an_assigned_user(spec, monkeypatch) -> None:
    """With assigned users, a raise by anyone else does not answer through the API user for them: refused,
    naming who triggered it and who may answer, and nothing answered, announced or kept."""
    monkeypatch.setenv(ASSIGNED_USERS_ENV, "alice,7:carol")
    answerer = Answerer()
    # bob may act on the DAG's runs (role user), yet is not assigned; vic is read-only.
    for who in ("bob", "vic", "mallory"):
        view = _waiting(spec, answerer, deciding=["none", "running", "success"])
        with pytest.raises(RaiseRefused, match=f"'{who}', who triggered this raise, is not one of the users who may "
                                               r"answer it \(alice, 7: TRACEGEN_QUESTION_ASSIGNED_USERS\)"):
            _raise(view, 12_000, by=who)
        assert answerer.answers == [] and view.announced == [] and view.variables == {}
    # An assigned user, by id or by the name the operator gave.
    for who in ("alice", "carol"):
        _raise(_waiting(spec, answerer), 12_000, by=who)
    assert len(answerer.answers) == 2


def test_without_assigned_users_a_raise_answers_for_whoever_airflow_lets_answer(spec, monkeypatch) -> None:
    answerer = Answerer()
    for who in ("vic", "mallory"):  # read-only, and unknown to the auth manager
        view = _waiting(spec, answerer)
        with pytest.raises(RaiseRefused, match=f"'{who}', who triggered this raise, may not answer tracegen_generate"):
            _raise(view, 12_000, by=who)
    assert answerer.answers == []
    _raise(_waiting(spec, answerer), 12_000, by="bob")
    assert len(answerer.answers) == 1


def test_a_raise_that_cannot_tell_who_may_answer_does_not_answer(spec, monkeypatch) -> None:
    answerer = Answerer()
    with pytest.raises(RaiseRefused, match="names no triggering user"):
        _raise(_waiting(spec, answerer), 12_000, by=None)
    # An auth manager whose users a worker cannot see: name them, or answer in Required Actions.
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                       "airflow.api_fastapi.auth.managers.base_auth_manager.BaseAuthManager")
    with pytest.raises(RaiseRefused, match="cannot be told from a worker.*TRACEGEN_QUESTION_ASSIGNED_USERS"):
        _raise(_waiting(spec, answerer), 12_000, by="bob")
    assert answerer.answers == []
