"""Making a raise (`run.raise_request.request_raise`) over a view of Airflow's metadata: when it is refused,
and how it settles the race with the run's deciding task, which reads a raise once, when it starts."""

from __future__ import annotations

from typing import Any

import pytest
from engine_support.helpers import make_config, prepare, write_dataset

from tracegen.run.cap_raise import CapRaise, RaiseFacts, parse, variable_key
from tracegen.run.raise_request import RaiseRefused, request_raise

TARGET = "manual__2026-12-01T09:00:00+00:00"


class View:
    """Airflow as the raise task sees it: the target run's state, XComs, deciding task, and the Variables."""

    def __init__(self, spec, *, state: str | None = "running", deciding: list[str] | None = None) -> None:
        self.spec, self.state = spec, state
        self.deciding = deciding or ["none"]  # successive answers; the last one repeats
        self.variables: dict[str, str] = {}
        self.decision: dict[str, Any] | None = None  # what ask_about_cap pushed as its question once finished
        self.withdrawn: list[str] = []

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


@pytest.fixture
def spec(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 20)
    return prepare(make_config(dataset, tmp_path / "out", max_tokens=4096, gate_mode="warn"), "run-1")


def _raise(view: View, cap: Any = 8192, **kwargs: Any) -> CapRaise:
    return request_raise(view, TARGET, cap, requested_by="alice", raised_in="manual__raise", sleep=lambda s: None,
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


def test_a_run_whose_deciding_task_started_is_refused_and_nothing_written(spec) -> None:
    view = View(spec, deciding=["running"])
    with pytest.raises(RaiseRefused, match="already decided its cap"):
        _raise(view)
    assert view.variables == {}


def test_a_raise_read_too_late_is_withdrawn_and_refused(spec) -> None:
    # Not started when checked, then running (it read the Variables before the write), then done with
    # another decision: the raise must not stay behind as if taken.
    view = View(spec, deciding=["none", "running", "running", "success"])
    view.decision = {"decided": {"cap": 4096, "responded_at": "2026-12-01T09:00:00+00:00"}}
    with pytest.raises(RaiseRefused, match="decided its cap while this raise was written"):
        _raise(view)
    assert view.withdrawn == [variable_key("run-1")] and view.variables == {}


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
