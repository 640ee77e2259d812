"""The gate's question and the reviewer's answer (gate_mode=ask), without Airflow: when a run asks, what
the question shows, which answers are refused and why, and the run an answer leaves (its record, the
chunks left at the chosen cap, the final report, the scheduled rerun). Real ledger, real audit."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace

import numpy as np
import pytest
from engine_support.helpers import make_config, prepare, rerun_work, root_of, write_dataset

from tracegen.audit.cap_question import (
    CURRENT,
    DRIFT,
    OTHER,
    PILOT,
    RECOMMENDED,
    STOP,
    AnswerRefused,
    CapDecision,
    CapQuestion,
    decision_of_answer,
)
from tracegen.config import RunConfig
from tracegen.generate.gate_watch import continuous_sample
from tracegen.run import QUESTION_FILE, RUN_FILE
from tracegen.run.decision import GATE_REPORT, apply, ask, rows_held
from tracegen.run.plan import chunks_with_work, pilot_indices
from tracegen.run.run_record import read_run_record, stopped_at_gate
from tracegen.run.run_report import audit_and_report
from tracegen.run.run_spec import RunSpec
from tracegen.run.while_asking import WhileAsking, account_text, provisional, provisional_cap
from tracegen.store.records import FAILED, OK, GeneratedRow
from tracegen.store.storage import StorageKeyError

N_ROWS = 400
CONTEXT = 40_960
WHEN = dt.datetime(2026, 3, 1, 12, 30, tzinfo=dt.UTC)


def natural_length(i: int) -> int:
    """A heavy-tailed length per index, the same in every test: about 20% run past 4096."""
    rng = np.random.default_rng(i)
    return int(np.exp(rng.normal(7.4, 0.8)))


def rows(run_id: str, cap: int, indices, *, failed=()) -> list[GeneratedRow]:
    out = []
    for i in indices:
        i = int(i)
        if i in failed:
            out.append(GeneratedRow(index=i, status=FAILED, max_tokens=cap, run_id=run_id, chunk=1,
                                    error="HTTP 503 after 6 attempts"))
            continue
        n = natural_length(i)
        out.append(GeneratedRow(index=i, status=OK, max_tokens=cap, run_id=run_id, chunk=1,
                                finish_reason="length" if n > cap else "stop", completion_tokens=min(n, cap),
                                reasoning_tokens=min(n, cap) // 2, reasoning_content="thinking", content="done",
                                server="gpu0", latency_s=1.0))
    return out


def make_run(tmp_path, **params) -> RunSpec:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {"pilot_size": 300, "chunk_size": 100, "gate_mode": "ask"}
    config = make_config(write_dataset(tmp_path / "d.jsonl", N_ROWS), tmp_path / "out", **{**base, **params})
    return prepare(config, "run-1")


def pilot_stopped_run(tmp_path) -> RunSpec:
    """A run at 4096 whose pilot the gate stops: the pilot's rows committed and audited."""
    spec = make_run(tmp_path)
    pilot = pilot_indices(spec.config, N_ROWS)
    root_of(spec.config).commits.commit(rows("run-1", 4096, pilot), "run-1", 1, "pilot")
    audit_and_report(spec, name="pilot-report", indices=pilot, tokens_per_s_per_gpu=900.0, context_length=CONTEXT)
    return spec


def ask_pilot(spec: RunSpec) -> CapQuestion:
    question = ask(spec, drift_sample=continuous_sample(spec), context_length=CONTEXT,
                   tokens_per_s_per_gpu=900.0,
                   report_url=lambda name: f"http://airflow:8080/tracegen/roots/abc/runs/run-1/{name}")
    assert question is not None
    return question


def answer(question: CapQuestion, kind: str, cap=None, **kw) -> CapDecision:
    return decision_of_answer(question, [question.option_label(kind)], {"cap": cap}, responded_by=kw.pop("who", "reviewer"),
                  responded_at=WHEN, **kw)


def test_the_pilot_gate_asks_with_the_table_and_the_run_waits(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    root = root_of(spec.config)
    question = ask_pilot(spec)
    assert question.trigger == PILOT and question.current_cap == 4096
    assert question.recommended_cap is not None and 4096 < question.recommended_cap <= CONTEXT - 1
    assert question.max_cap == CONTEXT - 1
    # The recommended cap first and marked; stop last, the one an unanswered question takes.
    assert [o.kind for o in question.options] == [RECOMMENDED, OTHER, CURRENT, STOP]
    assert question.labels[0] == f"Continue at {question.recommended_cap:,} tokens (recommended)"
    body = question.body
    assert body.startswith("**Truncation is over the threshold in the pilot.** truncation ")
    assert "| max_tokens | predicted truncation | 95% interval | tokens/row | ETA | GPU time | basis |" in body
    assert "| 4,096 (current) |" in body and f"**{question.recommended_cap:,} (recommended)**" in body
    assert "observed" in body and "modelled" in body
    assert "the servers' context length is 40,960 tokens" in body and "from 4,097 to 40,959" in body
    assert "[Open the report](http://airflow:8080/tracegen/roots/abc/runs/run-1/pilot-report.html)" in body
    assert "24 hours" in body and "continued from their tokens to the new cap" in body
    assert question.report_uri.endswith("runs/run-1/pilot-report.html")
    # Stored beside the record: until it is answered, the scheduled rerun leaves the run alone.
    assert CapQuestion.from_json(json.loads(root.run_files.get("run-1", QUESTION_FILE))) == question
    assert stopped_at_gate(root, spec)
    assert rerun_work(spec.config.output_uri) == []


def test_continuing_at_the_recommended_cap_goes_on_in_place(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask_pilot(spec)
    decision = answer(question, RECOMMENDED, who="Ada Reviewer")
    cap = question.recommended_cap
    assert (decision.cap, decision.kind, decision.from_cap, decision.timed_out) == (cap, RECOMMENDED, 4096, False)
    assert decision.responded_by == "Ada Reviewer" and decision.responded_at == WHEN.isoformat()
    assert decision.cap_rows == question.cap_rows  # the table they saw

    decided, work = apply(spec, decision)
    # The same run: same id and layout, at the chosen cap; a drift past it fails the chunks (nobody is
    # asked twice) rather than leaving them for a question that will not come.
    assert (decided.run_id, decided.layout, decided.config.max_tokens) == ("run-1", spec.layout, cap)
    assert decided.config.gate_mode == "stop" and decided.decisions == (decision,)
    root = root_of(spec.config)
    stored = read_run_record(root, "run-1")
    assert stored.decisions == (decision,) and stored.config.max_tokens == cap
    assert json.loads(root.run_files.get("run-1", RUN_FILE))["decisions"][0]["responded_by"] == "Ada Reviewer"
    # The work left at the chosen cap: every row the pilot did not finish (those cut at 4096 below the
    # new cap among them) and every row never generated.
    frame = root.snapshots.frame()
    cut = set(frame.loc[frame["finish_reason"] == "length", "index"].tolist())
    assert cut and {w.chunk for w in work} == {i // 100 for i in set(range(N_ROWS)) - set(frame["index"])} | {
        i // 100 for i in cut}
    assert sum(w.remaining for w in work) == N_ROWS - (len(frame) - len(cut))
    assert not stopped_at_gate(root, decided)
    assert sum(w.work.remaining for w in rerun_work(spec.config.output_uri)) == sum(w.remaining for w in work)

    # The final report says who decided what, when, on which table.
    report = audit_and_report(read_run_record(root, "run-1"), name="report")
    doc = json.loads(root.run_files.get("run-1", "report.json"))
    assert doc["decisions"] == [decision.to_json()] and doc["audit"]["max_tokens"] == cap
    html = (tmp_path / "out" / "runs" / "run-1" / "report.html").read_text()
    assert "answered by <b>Ada Reviewer</b>" in html and f"max_tokens=<b>{cap:,}</b> (from 4,096)" in html
    assert report.json_uri.endswith("report.json")


def test_another_cap_the_current_cap_stop_and_a_timeout(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask_pilot(spec)
    other = answer(question, OTHER, 12000)
    assert (other.cap, other.kind) == (12000, OTHER)
    assert spec.decided(other).config.max_tokens == 12000
    current = answer(question, CURRENT)
    assert current.cap == 4096 and spec.decided(current).config.gate_mode == "warn"  # accepted: the gate only warns
    stop = answer(question, STOP)
    assert stop.cap is None and not stop.continues
    timed_out = decision_of_answer(question, [question.option_label(STOP)], {"cap": None}, responded_by=None,
                       responded_at=WHEN, timed_out=True)
    assert timed_out.timed_out and timed_out.responded_by is None and "nobody answered" in timed_out.summary()

    decided, work = apply(spec, timed_out)
    assert work == [] and decided.config == spec.config and decided.decisions == (timed_out,)
    root = root_of(spec.config)
    assert stopped_at_gate(root, read_run_record(root, "run-1"))  # the rerun never finishes it
    assert rerun_work(spec.config.output_uri) == []


@pytest.mark.parametrize(("kind", "params", "message"), [
    (OTHER, {"cap": None}, "'Continue at the cap typed below' needs a cap in the form's 'cap' field (4,097 to 40,959)"),
    (OTHER, {}, "needs a cap"),
    (OTHER, {"cap": CONTEXT}, "cap 40,960 is too large: the servers' context length is 40,960 tokens (prompt + "
                              "completion must fit); enter at most 40,959"),
    (OTHER, {"cap": 10**7}, "enter at most 40,959"),
    (OTHER, {"cap": 0}, "cap 0 is below 1 token"),
    (OTHER, {"cap": 8192.5}, "cap 8192.5 is not a whole number of tokens"),
    (OTHER, {"cap": "lots"}, "cap 'lots' is not a whole number of tokens"),
    (OTHER, {"cap": True}, "cap True is not a whole number of tokens"),
    (RECOMMENDED, {"cap": 9000}, "a cap (9,000) was typed but 'Continue at"),
    (STOP, {"cap": 9000}, "choose 'Continue at the cap typed below' to continue at it, or clear the field"),
])
def test_answers_the_run_cannot_act_on_are_refused_saying_why(tmp_path, kind, params, message) -> None:
    question = ask_pilot(pilot_stopped_run(tmp_path))
    with pytest.raises(AnswerRefused) as info:
        decision_of_answer(question, [question.option_label(kind)], params, responded_by="r", responded_at=WHEN)
    assert message in str(info.value)


def test_unknown_or_several_options_are_refused(tmp_path) -> None:
    question = ask_pilot(pilot_stopped_run(tmp_path))
    with pytest.raises(AnswerRefused, match="'Continue at 99 tokens' is not one of this question's options"):
        decision_of_answer(question, ["Continue at 99 tokens"], {}, responded_by="r", responded_at=WHEN)
    with pytest.raises(AnswerRefused, match="choose exactly one option"):
        decision_of_answer(question, question.labels[:2], {}, responded_by="r", responded_at=WHEN)
    # A typed cap within range is taken as an integer whatever JSON number type carried it.
    assert decision_of_answer(question, [question.option_label(OTHER)], {"cap": 9000.0}, responded_by="r",
                  responded_at=WHEN).cap == 9000


def test_no_recommended_option_when_the_servers_cannot_take_it(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask(spec, drift_sample=continuous_sample(spec), context_length=4500, report_url=None)
    assert question is not None and question.max_cap == 4499
    assert [o.kind for o in question.options] == [OTHER, CURRENT, STOP]
    assert "(over the context)" in question.body and "[Open the report]" not in question.body
    with pytest.raises(AnswerRefused, match="enter at most 4,499"):
        decision_of_answer(question, [question.option_label(OTHER)], {"cap": 8192}, responded_by="r", responded_at=WHEN)


def test_nothing_is_asked_when_no_gate_held_the_run(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    for mode in ("stop", "warn"):
        unasked = replace(spec, config=replace(spec.config, gate_mode=mode))
        assert ask(unasked, drift_sample=continuous_sample(spec), context_length=CONTEXT) is None
    # A pilot that passes and a fan-out that generated everything (failed rows are the rerun's): no question.
    passing = make_run(tmp_path / "b", max_tokens=16384)
    root = root_of(passing.config)
    root.commits.commit(rows("run-1", 16384, range(N_ROWS), failed={7, 8}), "run-1", 1, "all")
    audit_and_report(passing, name="pilot-report", indices=pilot_indices(passing.config, N_ROWS))
    assert rows_held(passing, root.snapshots.frame()) == 0
    assert ask(passing, drift_sample=continuous_sample(passing), context_length=CONTEXT) is None
    with pytest.raises(StorageKeyError):  # nothing asked: the rerun is free to retry the failed rows
        root.run_files.get("run-1", QUESTION_FILE)
    assert sum(w.work.remaining for w in rerun_work(passing.config.output_uri)) == 2


def test_the_continuous_gate_asks_about_the_rows_it_held_back(tmp_path) -> None:
    # No pilot: the continuous gate closed mid-run and the chunks after it did not start.
    spec = make_run(tmp_path, pilot_size=0)
    root = root_of(spec.config)
    root.commits.commit(rows("run-1", 4096, range(200)), "run-1", 1, "first-half")
    assert rows_held(spec, root.snapshots.frame()) == 200
    question = ask(spec, drift_sample=continuous_sample(spec), context_length=CONTEXT,
                   report_url=lambda name: f"/tracegen/x/{name}")
    assert question is not None and question.trigger == DRIFT
    assert question.verdict["verdict"] == "stop" and question.throughput is None
    assert question.body.startswith("**Truncation is over the threshold in the rows generated so far")
    assert "| ETA |" not in question.body  # no measured throughput without a pilot: no time columns
    assert f"[Open the report](/tracegen/x/{GATE_REPORT}.html)" in question.body
    assert json.loads(root.run_files.get("run-1", f"{GATE_REPORT}.json"))["verdict"]["verdict"] == "stop"
    decided, work = apply(spec, answer(question, OTHER, 16384))
    assert decided.decisions[0].trigger == DRIFT and decided.config.max_tokens == 16384
    assert sum(w.remaining for w in work) == N_ROWS - int((root.snapshots.frame()["finish_reason"] == "stop").sum())


def test_the_record_carries_the_decisions_and_older_records_still_read(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    decided = spec.decided(answer(ask_pilot(spec), OTHER, 10000))
    assert RunSpec.from_json(json.loads(json.dumps(decided.to_json()))) == decided
    older = spec.to_json()
    del older["decisions"]  # a record written before the gate could ask
    assert RunSpec.from_json(older) == spec
    bad = decided.to_json()
    bad["decisions"][0]["kind"] = "maybe"
    with pytest.raises(ValueError, match="decision: kind 'maybe'"):
        RunSpec.from_json(bad)


def test_ask_is_the_default_and_the_question_times_out_after_a_day() -> None:
    config = RunConfig(dataset_uri="/d.jsonl", output_uri="/out")
    assert config.gate_mode == "ask" and config.gate_question_timeout_minutes == 24 * 60


# ---- generating while the question waits (run.while_asking) -------------------------------------------


def asking_rows(cap: int, indices, **kw) -> list[GeneratedRow]:
    """Rows a while-asking chunk commits: generated at `cap`, marked so."""
    out = rows("run-1", cap, indices, **kw)
    for r in out:
        r.while_asking = True
    return out


def test_the_question_plans_work_at_the_recommended_cap_within_the_budget(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask_pilot(spec)
    plan = WhileAsking.from_json(question.while_asking)
    assert plan.mode == RECOMMENDED and plan.cap == question.recommended_cap
    # The budget is a share of the dataset's rows (25% of 400); the chunks are the first ones that fit in it.
    assert plan.budget_rows == 100 and 0 < plan.rows_planned <= 100
    assert plan.rows_planned == sum(c.remaining for c in plan.chunks) and plan.rows_left > plan.rows_planned
    frame = root_of(spec.config).snapshots.frame()
    left = chunks_with_work(frame, N_ROWS, spec.layout, provisional(spec, plan.cap).config)
    # Every chunk with work left that still fits, in dataset order.
    assert set(plan.chunks) <= set(left) and list(plan.chunks) == sorted(plan.chunks, key=lambda c: c.chunk)
    assert all(plan.rows_planned + c.remaining > plan.budget_rows for c in set(left) - set(plan.chunks))
    # The reviewer is told what runs meanwhile, and what it costs at the pilot's throughput.
    assert plan.gpu_hours is not None and plan.gpu_hours > 0
    assert (f"While you decide, the fleet goes on at max\\_tokens={plan.cap:,} (the recommended cap): "
            f"{plan.rows_planned} rows in {len(plan.chunks)} chunks, at most 100 rows") in question.body
    assert CapQuestion.from_json(question.to_json()) == question


@pytest.mark.parametrize(("params", "cap"), [({"while_asking": "current"}, 4096), ({"while_asking": "idle"}, None),
                                             ({"while_asking_budget_pct": 0.0}, None)])
def test_the_run_s_own_cap_or_no_work_while_asking(tmp_path, params, cap) -> None:
    spec = pilot_stopped_run(tmp_path)
    spec = replace(spec, config=replace(spec.config, **params))
    question = ask_pilot(spec)
    assert (question.while_asking or {}).get("cap") == cap
    assert ("While you decide" in question.body) == (cap is not None)


def test_without_a_recommended_cap_the_highest_cap_of_the_table_the_servers_take(tmp_path) -> None:
    question = ask_pilot(pilot_stopped_run(tmp_path))
    bare = replace(question, recommended_cap=None, options=())
    assert RECOMMENDED not in [o.kind for o in bare.options]
    fitting = [int(r["cap"]) for r in bare.cap_rows if int(r["cap"]) <= bare.max_cap]
    assert provisional_cap(bare, RECOMMENDED) == max(fitting) > 4096
    narrow = replace(bare, max_cap=max(fitting) - 1, options=())
    assert provisional_cap(narrow, RECOMMENDED) == max(c for c in fitting if c < max(fitting))
    assert provisional_cap(bare, "current") == 4096 and provisional_cap(bare, "idle") is None


def test_the_record_and_the_report_say_what_the_answer_made_of_the_work_done_while_asking(tmp_path) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask_pilot(spec)
    root = root_of(spec.config)
    at = question.while_asking["cap"]
    chunk = question.while_asking["chunks"][0]
    done = set(root.snapshots.frame()["index"].tolist())
    generated = [i for i in range(chunk["start"], chunk["stop"]) if i not in done]
    root.commits.commit(asking_rows(at, generated), "run-1", 1, "asking")
    finished = sum(natural_length(i) <= at for i in generated)
    cut = [i for i in generated if natural_length(i) > at]
    assert cut and finished  # the law truncates some rows even at the recommended cap

    higher = answer(question, OTHER, at * 2)
    decided, work = apply(spec, higher)
    account = decided.decisions[-1].while_asking
    assert account["rows"] == len(generated) and account["caps"] == [at]
    assert (account["finished"], account["truncated"], account["kept"]) == (finished, len(cut), finished)
    # Applied before the second fan-out: the cut rows are still to extend, and that fan-out has them.
    assert (account["extended"], account["to_extend"], account["truncated_at_answer"]) == (0, len(cut), 0)
    assert read_run_record(root, "run-1").decisions[-1].while_asking == account
    assert set(cut) <= {i for w in work for i in range(w.start, w.stop)}

    # Extended at the answer's cap: the final report counts them from the ledger.
    extended = rows("run-1", at * 2, cut)
    for r in extended:
        r.provenance = {"action": "extended", "tokens_before": at}
    root.commits.commit(extended, "run-1", 1, "decided")
    audit_and_report(read_run_record(root, "run-1"), name="report")
    doc = json.loads(root.run_files.get("run-1", "report.json"))["run"]["while_asking"]
    assert (doc["extended"], doc["to_extend"], doc["kept"]) == (len(cut), 0, finished)
    assert doc["text"].startswith(f"while the question waited, {len(generated)} rows (")
    assert f"{len(cut)} extended to {at * 2:,}" in doc["text"]
    assert doc["text"] in (tmp_path / "out" / "runs" / "run-1" / "report.html").read_text()


@pytest.mark.parametrize("kind", [CURRENT, STOP])
def test_a_lower_answer_counts_the_cut_rows_as_truncated_and_a_stop_leaves_them_committed(tmp_path, kind) -> None:
    spec = pilot_stopped_run(tmp_path)
    question = ask_pilot(spec)
    root = root_of(spec.config)
    at, chunk = question.while_asking["cap"], question.while_asking["chunks"][0]
    done = set(root.snapshots.frame()["index"].tolist())
    generated = [i for i in range(chunk["start"], chunk["stop"]) if i not in done]
    root.commits.commit(asking_rows(at, generated), "run-1", 1, "asking")
    cut = sum(natural_length(i) > at for i in generated)

    decided, work = apply(spec, answer(question, kind))
    account = decided.decisions[-1].while_asking
    if kind == STOP:
        assert work == [] and account["answer_cap"] is None and "kept" not in account
        assert "the run stopped, and every one of them stays committed" in account_text(account)
    else:
        # Truncated at the recommended cap, above the answer's 4,096: truncated at it, nothing to extend.
        assert (account["truncated_at_answer"], account["to_extend"], account["kept"]) == (cut, 0, len(generated) - cut)
        assert not {i for w in work for i in range(w.start, w.stop)} & set(generated)
    assert len(root.snapshots.frame().query("while_asking")) == len(generated)  # every row stays committed


# ---- the answer takes effect at once ---------------------------------------------------------------------


def test_the_answers_plan_leaves_the_chunks_still_to_start_to_themselves() -> None:
    from tracegen.run.while_asking import generating, left_to_start

    chunks = [{"chunk": c, "start": 100 * c, "stop": 100 * (c + 1), "remaining": 100} for c in (3, 4, 5, 6, 7, 8)]
    states = {0: "success", 1: "running", 2: "queued", 3: "up_for_retry", 4: "scheduled"}  # 5: not scheduled yet
    assert generating(states) == [1]
    # Finished ones are planned from the ledger (what they left at the provisional cap); the running one is
    # waited for; the rest, a retry among them, start after the answer and read it.
    assert left_to_start(states, chunks) == {5, 6, 7, 8}
    assert left_to_start({i: "success" for i in range(6)}, chunks) == set()
    assert left_to_start({0: "failed", 1: "skipped"}, chunks[:2]) == set()


class _AnsweredTI:
    """The task instance `apply_decision` sees: the question task's chunk list, and the states of the chunk
    tasks generated while asking, which move on each time they are read."""

    run_id = "manual__answered"

    def __init__(self, chunks, states_seen) -> None:
        self.chunks, self.states_seen, self.reads = chunks, list(states_seen), 0

    def xcom_pull(self, task_ids, **_):
        assert task_ids == "ask_about_cap"
        return self.chunks

    def get_task_states(self, dag_id, run_ids, task_ids):
        assert (dag_id, run_ids, task_ids) == ("tracegen_generate", [self.run_id], ["generate_while_asking"])
        states = self.states_seen[min(self.reads, len(self.states_seen) - 1)]
        self.reads += 1
        return {self.run_id: {f"generate_while_asking_{i}": f"TaskInstanceState.{s.upper()}"
                              for i, s in states.items()}}


def test_apply_decision_waits_for_the_chunks_generating_before_the_answer_and_leaves_out_the_rest() -> None:
    from tracegen.run.while_asking import settled_left_to_start
    from tracegen.tasks.api import TaskApi

    def left(ti) -> set[int]:
        return settled_left_to_start(TaskApi({"ti": ti, "run_id": ti.run_id}), poll_s=0)

    chunks = [{"chunk": c, "start": 100 * c, "stop": 100 * (c + 1), "remaining": 100} for c in range(4)]
    # When it first looks, chunks 0 and 1 generate (maybe at the provisional cap), 2 is queued, 3 not yet
    # scheduled; 2 and 3 start after the answer and read it, so they are neither waited for nor planned,
    # however long they run (with a budget of the whole dataset some chunk task is always running).
    ti = _AnsweredTI(chunks, [{0: "running", 1: "running", 2: "queued"},
                              {0: "success", 1: "running", 2: "running"},
                              {0: "success", 1: "up_for_retry", 2: "running", 3: "running"}])
    # Chunk 1 failed while waited for: its retry reads the answer, so the answer's plan leaves it out too.
    assert left(ti) == {1, 2, 3}
    assert ti.reads == 3
    ti = _AnsweredTI(chunks, [{0: "running", 1: "running"}, {0: "success", 1: "success", 2: "running"}])
    assert left(ti) == {2, 3}
    # No question, or nothing generated while asking (while_asking=idle): nothing to wait for.
    assert left(_AnsweredTI([], [{}])) == set()
