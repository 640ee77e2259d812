"""Where a run stands at its gate: the one rule every reader applies (the review pages, `status`, the
scheduled rerun, the question chain). Pure and import-light, so the review pages can use it from raw JSON."""

from __future__ import annotations

# A run's stage at its gate, as every reader names it (the review pages, `status`, the rerun, the question
# chain). GOING: no gate holds it (running or finished: Airflow's state says which).
GOING = "going"
ASKING = "waiting for the reviewer's answer"
STOPPED = "stopped by the gate"


def run_stage(*, gate_mode: str | None, pilot_verdict: str | None, question_asked: bool,
              last_decision_continues: bool | None) -> str:
    """The one rule for where a run stands at its gate, from what its records say:

    - its last decision (the reviewer's answer, a raise, or an unanswered question's timeout) rules:
      STOPPED when it stops the run, GOING when it continues it;
    - else a question asked and not answered yet: ASKING;
    - else the pilot's verdict is stop: STOPPED under gate_mode=stop, ASKING under gate_mode=ask (the
      question is being prepared: the run waits for a reviewer all the same, and no one else may finish it);
    - else GOING.
    """
    if last_decision_continues is not None:
        return GOING if last_decision_continues else STOPPED
    if question_asked:
        return ASKING
    if pilot_verdict == "stop" and gate_mode in ("stop", "ask"):
        return STOPPED if gate_mode == "stop" else ASKING
    return GOING
