"""A mid-run raise of the cap, without Airflow: which raises are taken, how a stored raise is read back,
the run a chunk generates for, and the decision the run records (tracegen.run.cap_raise). The whole
path through a real Airflow is tests/e2e/test_raise_cap.py."""

from __future__ import annotations

import json

import pytest
from engine_support.helpers import make_config, prepare, root_of, write_dataset

from tracegen.audit.cap_question import RAISE, CapDecision
from tracegen.run.cap_raise import (
    CapRaise,
    RaiseFacts,
    RaiseRefused,
    as_decision,
    at_raised_cap,
    check_raise,
    decode,
    encode,
    parse,
    variable_key,
)
from tracegen.run.decision import apply
from tracegen.run.run_record import read_run_record

CONTEXT = 40_960


@pytest.fixture
def spec(tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", 60)
    return prepare(make_config(dataset, tmp_path / "out", max_tokens=4096, gate_mode="warn"), "run-1")


def _raise(cap: int, *, from_cap: int = 4096, run_id: str = "run-1") -> CapRaise:
    return CapRaise(run_id=run_id, cap=cap, from_cap=from_cap, requested_by="alice",
                    requested_at="2026-11-30T10:00:00+00:00", raised_in="manual__raise")


def test_a_raise_goes_above_the_current_cap_and_within_the_context(spec) -> None:
    assert check_raise(spec, 8192, context_length=CONTEXT, earlier=None) == (4096, 8192)
    with pytest.raises(RaiseRefused, match="already 4,096; a new cap must go above it"):
        check_raise(spec, 4096, context_length=CONTEXT, earlier=None)
    with pytest.raises(RaiseRefused, match="already 4,096"):
        check_raise(spec, 2048, context_length=CONTEXT, earlier=None)
    with pytest.raises(RaiseRefused, match=r"context length is 40,960 tokens .*enter at most 40,959"):
        check_raise(spec, 40_960, context_length=CONTEXT, earlier=None)
    with pytest.raises(RaiseRefused, match="not a whole number"):
        check_raise(spec, "8192", context_length=CONTEXT, earlier=None)
    with pytest.raises(RaiseRefused, match="not a whole number"):
        check_raise(spec, True, context_length=CONTEXT, earlier=None)


def test_a_second_raise_goes_up_from_the_first(spec) -> None:
    first = _raise(8192)
    assert check_raise(spec, 12288, context_length=CONTEXT, earlier=first) == (8192, 12288)
    with pytest.raises(RaiseRefused, match="already raised to 8,192 by alice"):
        check_raise(spec, 6144, context_length=CONTEXT, earlier=first)


def test_a_stored_raise_is_read_back_strictly(spec) -> None:
    raised = _raise(8192)
    assert parse(encode(raised), "run-1") == raised
    # Taken when the raise task it names returned exactly it (the trust rule: test_cap_raise_trust.py).
    facts = RaiseFacts(run_cap=4096, context_length=CONTEXT, raise_state="success", record=raised.to_json())
    assert decode(encode(raised), "run-1", lambda r: facts) == raised
    assert parse(None, "run-1") is None and parse("", "run-1") is None
    assert decode(None, "run-1") is None and decode("", "run-1") is None
    key = variable_key("run-1")
    with pytest.raises(RaiseRefused, match=f"Airflow Variable {key}: not JSON"):
        parse("{8192", "run-1")
    with pytest.raises(RaiseRefused, match="names run 'run-2', not 'run-1'"):
        parse(encode(_raise(8192, run_id="run-2")), "run-1")
    with pytest.raises(RaiseRefused, match="cap"):
        parse(json.dumps({**raised.to_json(), "cap": 10**9}), "run-1")
    with pytest.raises(RaiseRefused, match="unexpected keyword"):
        parse(json.dumps({**raised.to_json(), "fleet": "/bin/sh"}), "run-1")


def test_chunks_generate_at_the_raised_cap_without_recording_it(spec) -> None:
    assert at_raised_cap(spec, None) is spec
    assert at_raised_cap(spec, _raise(4096)) is spec  # not above: nothing to do
    raised = at_raised_cap(spec, _raise(8192))
    assert raised.config.max_tokens == 8192 and raised.decisions == ()
    assert raised.config.gate_mode == "warn"


def test_the_raise_becomes_the_runs_decision_and_the_record_keeps_it(spec) -> None:
    decision = as_decision(spec, _raise(8192))
    assert decision.trigger == RAISE and CapDecision.from_json(decision.to_json()) == decision
    assert decision.summary() == ("alice raised the cap of the running run at 2026-11-30T10:00:00+00:00: "
                                  "continue at max_tokens=8,192 (from max_tokens=4,096)")
    decided, work = apply(spec, decision)
    # The operator's gate mode stays: a raise is not an answer to a question.
    assert decided.config.max_tokens == 8192 and decided.config.gate_mode == "warn"
    assert work  # nothing was generated yet: every chunk is left at the new cap
    recorded = read_run_record(root_of(spec.config), "run-1")
    assert recorded.decisions == (decision,) and recorded.config.max_tokens == 8192


def test_under_gate_mode_ask_a_raise_settles_the_gate_like_an_answer(tmp_path) -> None:
    dataset = write_dataset(tmp_path / "prompts.jsonl", 60)
    spec = prepare(make_config(dataset, tmp_path / "out", max_tokens=4096, gate_mode="ask"), "run-1")
    decided = spec.decided(as_decision(spec, _raise(8192)))
    assert decided.config.gate_mode == "stop"  # nobody is asked twice in one run
