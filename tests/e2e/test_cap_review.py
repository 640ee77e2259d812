"""The gate asks (gate_mode=ask) on a real Airflow: the question in Required Actions, answered through the
REST API and by a click in headless Chromium, refused when the run cannot act on it, and left unanswered.

Every Airflow component runs as a real process (tests/e2e/airflow_cluster.py: PostgreSQL, Celery on
Redis, api-server, scheduler), with the bundled simulated fleet (SGLang stand-ins) and the bundled
prompts, whose length law truncates about 18% of rows at the reference job's 4096. Each test triggers its own
run into its own output root, named in `tracegen_output_roots` so the review pages serve its reports.
The cluster is configured as an operator would to be told of questions (tracegen.review.notify): an e-mail
connection and a webhook connection, pointing at an SMTP server and an HTTP receiver this module runs on
loopback, and `admin` and `tracegen-raise` as the users who may answer. `tracegen-raise` is the user of the
API connection a raise made while the question waits answers as (tracegen.run.api_answer).
"""

from __future__ import annotations

import html
import json
import re
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
from e2e.airflow_cluster import AirflowApi, AirflowCluster, running_cluster, sample_prompts
from fixtures.notify_receivers import (
    MailReceiver,
    WebhookReceiver,
    mail_connection,
    notification_receivers,
    webhook_connection,
)
from plugins.cdp_browser import Browser, journey_shot

from tracegen.config import safe_run_id
from tracegen.run import MEASURE_CHUNK
from tracegen.status import dataset_status
from tracegen.store.root import OutputRoot
from tracegen.store.storage import open_storage

GENERATE, RAISE = "tracegen_generate", "tracegen_raise_cap"
RAISE_USER = "tracegen-raise"
N_ROWS = 240
CONF = {"max_tokens": 4096, "pilot_size": 120, "chunk_size": 50}
ROOTS = ("out-rest", "out-ui", "out-timeout", "out-drift", "out-pass", "out-raise")
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / ".state" / "test-screenshots"
OTHER = "Continue at the cap typed below"
STOP = "Stop the run"


@pytest.fixture(scope="module")
def receivers():
    with notification_receivers() as both:
        yield both


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, receivers: tuple[MailReceiver, WebhookReceiver]):
    root = tmp_path_factory.mktemp("review-cluster")
    mail, hook = receivers
    env = {
        # A faster stand-in clock: the runs are about the question, not about generation speed.
        "TRACEGEN_SIM_TIME_SCALE": "200",
        # Every component gets these, the Celery worker that runs review_cap among them.
        "AIRFLOW_CONN_TRACEGEN_QUESTION_MAIL": mail_connection(mail),
        "AIRFLOW_CONN_TRACEGEN_QUESTION_HOOK": webhook_connection(hook),
        "TRACEGEN_QUESTION_NOTIFY": "tracegen_question_mail,tracegen_question_hook",
        "TRACEGEN_QUESTION_ASSIGNED_USERS": f"admin,{RAISE_USER}",
    }
    with running_cluster(root, workers=1, worker_concurrency=4, extra_env=env, users={RAISE_USER: "user"},
                         api_conn_user=RAISE_USER) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def api(cluster: AirflowCluster) -> AirflowApi:
    api = cluster.api()
    api.set_variable("tracegen_output_roots", json.dumps([str(cluster.root / r) for r in ROOTS]))
    for dag_id in (GENERATE, RAISE):
        api.wait_for_dag(dag_id)
        api.unpause(dag_id)
    return api


@pytest.fixture(scope="module")
def dataset(cluster: AirflowCluster) -> Path:
    return sample_prompts(cluster.root / "prompts.jsonl", N_ROWS)


def _trigger(cluster: AirflowCluster, api: AirflowApi, dataset: Path, root: str, **conf) -> tuple[str, Path]:
    output = cluster.root / root
    run_id = api.trigger(GENERATE, {**CONF, "dataset_uri": str(dataset), "output_uri": str(output), **conf})
    return run_id, output


def _hitl_path(run_id: str) -> str:
    return f"/dags/{GENERATE}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/review_cap/-1/hitlDetails"


def _question(cluster: AirflowCluster, api: AirflowApi, run_id: str, timeout: float = 240) -> dict:
    """The run's open question, once its task waits for an answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {t["task_id"]: t["state"] for t in api.task_instances(GENERATE, run_id) if t["map_index"] == -1}
        if states.get("review_cap") == "awaiting_input":
            detail = api._call("GET", _hitl_path(run_id))
            if not detail["response_received"]:
                return detail
        assert api.run(GENERATE, run_id)["state"] in ("queued", "running"), (
            f"the run ended without asking: {api.describe(GENERATE, run_id)}\n{cluster.logs_summary()}")
        time.sleep(1)
    raise AssertionError(f"no question within {timeout:.0f} s: {api.describe(GENERATE, run_id)}")


def _question_link(cluster: AirflowCluster, run_id: str) -> str:
    """The Required Actions page of the run's review_cap in the Airflow UI."""
    return (f"{cluster.api_url}/dags/{GENERATE}/runs/{urllib.parse.quote(run_id, safe='')}/tasks/review_cap/"
            "required_actions")


def _notified(cluster: AirflowCluster, receivers: tuple[MailReceiver, WebhookReceiver], run_id: str,
              output: Path, detail: dict) -> tuple[str, str]:
    """The e-mail and the webhook POST about the run's question, each with the question's verdict figure and
    reason, its recommended cap and the two links; returns (question link, report link) as they carry them."""
    mail, hook = receivers
    question_link = _question_link(cluster, run_id)
    message, rcpt, _ = mail.wait_for(lambda m: question_link in m.get_content())
    post = hook.wait_for(lambda body: body["tracegen"]["run_id"] == run_id)
    assert message["Subject"] == f"tracegen question: {detail['subject']}" and rcpt == ["reviewer@example.test"]
    assert post["headers"]["X-Tracegen-Token"] == "hook-test-token"
    # The figure the question's body shows in bold, and the reason the pilot's gate gave.
    shown = re.search(r"truncated at the cap: \*\*(.+?)\*\*", detail["body"]).group(1)
    reason = json.loads((output / "runs" / safe_run_id(run_id) / "pilot-report.json").read_text())["verdict"]["reason"]
    recommended = detail["options"][0].split()[2]  # "Continue at 9,216 tokens (recommended)"
    report_link = detail["body"].split("[Open the report](", 1)[1].split(")", 1)[0]
    for text in (message.get_content().replace("\r\n", "\n"), post["body"]["text"]):
        lines = text.splitlines()
        assert f"truncated at the cap: {shown}. {reason}" in lines, text
        assert f"Recommended cap: max_tokens={recommended} (from max_tokens=4,096)." in lines, text
        assert f"Answer the question: {question_link}" in lines and f"Report: {report_link}" in lines, text
    fields = post["body"]["tracegen"]
    assert (fields["question_url"], fields["report_link"]) == (question_link, report_link)
    assert fields["recommended_cap"] == int(recommended.replace(",", ""))
    return question_link, report_link


def _answer(api: AirflowApi, run_id: str, option: str, cap=None) -> dict:
    return api._call("PATCH", _hitl_path(run_id), json={"chosen_options": [option], "params_input": {"cap": cap}})


def _refusal(api: AirflowApi, run_id: str, timeout: float = 60) -> str:
    """The reason the run gave for refusing the last answer, once the question is open again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        detail = api._call("GET", _hitl_path(run_id))
        if not detail["response_received"] and detail["task_instance"]["state"] == "awaiting_input":
            response = api.client.get(f"/dags/{GENERATE}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
                                      "/taskInstances/review_cap/xcomEntries/refused_answer",
                                      params={"deserialize": True})
            if response.status_code == 200:
                return response.json()["value"]["refused"]
        time.sleep(1)
    raise AssertionError(f"the question did not open again: {api._call('GET', _hitl_path(run_id))}")


def _states(api: AirflowApi, run_id: str) -> dict[str, set[str]]:
    states: dict[str, set[str]] = {}
    for t in api.task_instances(GENERATE, run_id):
        states.setdefault(t["task_id"], set()).add(t["state"])
    return states


def _record(output: Path, run_id: str) -> tuple[dict, dict]:
    run_dir = output / "runs" / safe_run_id(run_id)
    return json.loads((run_dir / "run.json").read_text()), json.loads((run_dir / "report.json").read_text())


def _check_completed_at(output: Path, run_id: str, cap: int) -> dict:
    """Every row done at the chosen cap in this one run, the decision in the record and the report, and
    every row the pilot saw cut at 4096 continued from its tokens, not generated again."""
    record, report = _record(output, run_id)
    assert record["config"]["max_tokens"] == cap and record["config"]["gate_mode"] == "stop"
    status = dataset_status(str(output))
    assert (status["total"], status["done"], status["left"], status["max_tokens"]) == (N_ROWS, N_ROWS, 0, cap), status
    output_root = OutputRoot(open_storage(str(output)))
    assert output_root.repair.check_invariants() == []
    frame = output_root.snapshots.frame()
    assert set(frame["run_id"]) == {safe_run_id(run_id)}  # one run, no second trigger
    cut = frame[(frame["max_tokens"] == 4096) & (frame["finish_reason"] == "length")]["index"]
    assert len(cut) > 0
    # Continued from their tokens: to the chosen cap, or earlier, by the tail measurement to its own cap or
    # while the question waited to the recommended cap (then only those left cut below the chosen cap are
    # continued again).
    measured = frame[(frame["chunk"] == MEASURE_CHUNK) & frame["index"].isin(cut)]
    redone = frame[frame["index"].isin(cut) & ((frame["max_tokens"] == cap) | (frame["chunk"] == MEASURE_CHUNK)
                                               | frame["while_asking"])]
    assert set(redone["index"]) == set(cut) and set(redone["pivot"]) == {"extended"}, redone["pivot"].tolist()
    done_by_measuring = measured[(measured["finish_reason"] != "length") | (measured["max_tokens"] >= cap)]["index"]
    # None redone at the chosen cap (the measured row itself is at it when the measurement's cap was chosen).
    assert not frame[frame["index"].isin(done_by_measuring) & (frame["max_tokens"] == cap)
                     & (frame["chunk"] != MEASURE_CHUNK)].size
    assert report["audit"]["max_tokens"] == cap and report["decisions"] == record["decisions"]
    return record["decisions"][-1]


@pytest.mark.timeout(600)
def test_the_question_is_answered_through_the_rest_api_and_the_run_completes_at_the_new_cap(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path, receivers: tuple[MailReceiver, WebhookReceiver]
) -> None:
    run_id, output = _trigger(cluster, api, dataset, "out-rest")
    detail = _question(cluster, api, run_id)
    # The reviewer was told, by e-mail and by webhook, and only the operator's assigned user may answer.
    _notified(cluster, receivers, run_id, output, detail)
    assert detail["assigned_users"] == [{"id": "admin", "name": "admin"}, {"id": RAISE_USER, "name": RAISE_USER}]
    assert "question notification via connection 'tracegen_question_mail' sent through SMTP 127.0.0.1:" in (
        _task_log(api, run_id, "review_cap"))
    options = detail["options"]
    assert options[0].endswith("(recommended)") and options[1:] == [
        OTHER, "Continue at 4,096 tokens, accepting the truncation", STOP]
    assert detail["defaults"] == [STOP] and detail["multiple"] is False
    assert detail["subject"] == (f"Run {safe_run_id(run_id)}: The pilot is over the truncation threshold at "
                                 "max_tokens=4,096: continue at which cap?")
    body = detail["body"]
    assert "| max_tokens | predicted truncation | 95% interval | tokens/row | ETA | GPU time | basis |" in body
    assert "| 4,096 (current) |" in body and "(recommended)** |" in body
    assert "the servers' context length is 40,960 tokens" in body  # read by provision_fleet from the servers
    # The link opens the pilot report on the review pages of this api-server.
    link = body.split("[Open the report](", 1)[1].split(")", 1)[0]
    assert link.startswith(f"{cluster.api_url}/tracegen/roots/") and link.endswith("/pilot-report.html")
    page = httpx.get(link, headers=api.client.headers, timeout=30)
    assert page.status_code == 200 and "<iframe" in page.text, page.text[:300]
    framed = page.text.split('<iframe sandbox="" title="', 1)[1].split('src="', 1)[1].split('"', 1)[0]
    report = httpx.get(cluster.api_url + framed, headers=api.client.headers, timeout=30)
    assert report.status_code == 200 and "Cap table" in report.text, report.text[:300]
    # The other cap field, and stop as what an unanswered question takes.
    assert detail["params"]["cap"]["schema"]["title"] == "Another cap (max_tokens)"

    # A cap the servers cannot serve is refused with the reason, and the same question opens again.
    _answer(api, run_id, OTHER, 50_000)
    refused = _refusal(api, run_id)
    assert refused == ("cap 50,000 is too large: the servers' context length is 40,960 tokens (prompt + "
                       "completion must fit); enter at most 40,959"), refused
    # The question says where a refusal's reason shows (Airflow keeps a question's text as first posed).
    # The run's tab is meant to show it too (review/next_step.py, from review_cap's XCom), but on the real
    # scheduler its page comes back without it, so only the XCom's reason above is checked.
    assert "An answer refused here says why in this run's **tracegen report** tab" in detail["body"]
    assert api.run(GENERATE, run_id)["state"] == "running"

    response = _answer(api, run_id, OTHER, 9000)
    assert response["responded_by"]["name"] == "admin"
    assert api.wait_run(GENERATE, run_id, 300) == "success", f"{api.describe(GENERATE, run_id)}\n{cluster.logs_summary()}"
    decision = _check_completed_at(output, run_id, 9000)
    assert (decision["option"], decision["kind"], decision["cap"], decision["from_cap"]) == (OTHER, "other", 9000, 4096)
    assert decision["responded_by"] == "admin" and not decision["timed_out"]
    assert [r["cap"] for r in decision["cap_rows"]][:1] == [4096]  # the table they saw
    states = _states(api, run_id)
    # The answer's own fan-out runs when it has work: none when the rows generated while asking (at the
    # recommended cap) finished or were cut at or above 9000, and the chunks that had not started then
    # took 9000 themselves. A fan-out over nothing is skipped by Airflow.
    planned = api.xcom(GENERATE, run_id, "apply_decision")
    assert states["generate_at_decided_cap"] == ({"success"} if planned else {"skipped"}), (planned, states)
    assert states["watcher"] == {"skipped"}, states
    assert states["generate_chunk"] == {"skipped"}  # nothing started past the gate before the answer


def _raise(api: AirflowApi, run_id: str, cap: int) -> tuple[str, str, str]:
    """Trigger tracegen_raise_cap on the run: its Airflow run id, final state and task log."""
    raise_run = api.trigger(RAISE, {"run_id": run_id, "max_tokens": cap})
    state = api.wait_run(RAISE, raise_run, 180)
    log = api.client.get(f"/dags/{RAISE}/dagRuns/{urllib.parse.quote(raise_run, safe='')}/taskInstances/raise_cap/"
                         "logs/1", headers={"Accept": "application/json"}).text
    return raise_run, state, log


@pytest.mark.timeout(600)
def test_a_raise_while_the_question_waits_is_the_answer(cluster: AirflowCluster, api: AirflowApi,
                                                         dataset: Path) -> None:
    run_id, output = _trigger(cluster, api, dataset, "out-raise")
    _question(cluster, api, run_id)
    raise_run, state, log = _raise(api, run_id, 12_000)
    assert state == "success", log[-3000:]
    # Airflow records the API connection's user as who answered, with the typed cap ...
    detail = api._call("GET", _hitl_path(run_id))
    assert detail["response_received"] and detail["responded_by_user"]["name"] == RAISE_USER, detail
    assert (detail["chosen_options"], detail["params_input"]) == ([OTHER], {"cap": 12_000}), detail
    # ... and a second raise finds the question answered: refused, changing nothing.
    _, second, second_log = _raise(api, run_id, 16_384)
    assert second == "failed" and ("already decided its cap" in second_log or "someone answered first" in second_log), (
        second_log[-3000:])

    assert api.wait_run(GENERATE, run_id, 300) == "success", f"{api.describe(GENERATE, run_id)}\n{cluster.logs_summary()}"
    # The run records the person who triggered the raise, and the raise it was.
    decision = _check_completed_at(output, run_id, 12_000)
    assert (decision["responded_by"], decision["kind"], decision["trigger"], decision["from_cap"]) == (
        "admin", "other", "pilot", 4096), decision
    assert decision["option"] == f"Raised to 12,000 with {RAISE} (run {raise_run}), answered as {RAISE_USER}"
    assert _states(api, run_id)["watcher"] == {"skipped"}


@pytest.mark.timeout(600)
def test_chromium_shows_the_required_action_with_the_cap_table_and_a_click_resumes_the_run(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path, receivers: tuple[MailReceiver, WebhookReceiver]
) -> None:
    run_id, output = _trigger(cluster, api, dataset, "out-ui")
    detail = _question(cluster, api, run_id)
    # The reviewer follows the links the notification brought: the report, then the question.
    page, report_link = _notified(cluster, receivers, run_id, output, detail)
    recommended = detail["options"][0]
    cap = int(recommended.split()[2].replace(",", ""))
    token = httpx.post(f"{cluster.api_url}/auth/token", json={"username": "admin", "password": cluster.password},
                       timeout=30).json()["access_token"]
    browser = Browser()
    try:
        browser.set_cookie(cluster.api_url + "/", "_token", token)
        browser.goto(report_link)
        browser.wait_for("!!document.querySelector('iframe[sandbox]')", 30)
        assert browser.eval("document.querySelector('iframe[sandbox]').title").startswith("pilot-report.html of run")
        # The stored report the page frames, opened at its own URL (the frame's origin is opaque).
        browser.goto(cluster.api_url + browser.eval("document.querySelector('iframe[sandbox]').getAttribute('src')"))
        browser.wait_for("document.body.innerText.includes('Cap table')", 30)
        browser.goto(page)
        button = f'[data-testid="hitl-option-{recommended}"]'
        browser.wait_for(f"!!document.querySelector({json.dumps(button)})", 60)
        text = browser.text()
        assert "Truncation is over the threshold in the pilot." in text
        # The cap table, rendered as a table, with the recommended row marked.
        rows = browser.eval("[...document.querySelectorAll('main table tr, table tr')].map(r => r.innerText)")
        assert any(r.startswith("max_tokens") for r in rows), rows
        assert any(r.startswith(f"{cap:,} (recommended)") for r in rows), rows
        assert any(r.startswith("4,096 (current)") for r in rows), rows
        assert "Another cap (max_tokens)" in text and "Open the report" in text
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        journey_shot(browser, "2-required-action")

        # "Another cap" with nothing typed: refused, and the question opens again.
        browser.click(f'[data-testid="hitl-option-{OTHER}"]')
        refused = _refusal(api, run_id)
        assert refused.startswith(f"'{OTHER}' needs a cap in the form's 'cap' field")
        browser.goto(page)
        browser.wait_for(f"(b => b && !b.disabled)(document.querySelector({json.dumps(button)}))", 60)
        assert "An answer refused here says why in this run's tracegen report tab" in browser.text()
        # The reason is in the run's tab, above the report the question was built from.
        browser.goto(f"{cluster.api_url}/tracegen/runs/{urllib.parse.quote(run_id, safe='')}")
        text = browser.text()
        assert "The last answer was refused, so the question is asked again:" in text and refused in text, text[:800]
        journey_shot(browser, "3-refused-answer-in-the-tab")
        browser.goto(page)
        browser.wait_for(f"(b => b && !b.disabled)(document.querySelector({json.dumps(button)}))", 60)

        browser.click(button)
        assert api.wait_run(GENERATE, run_id, 300) == "success", api.describe(GENERATE, run_id)
        browser.goto(f"{cluster.api_url}/tracegen/runs/{urllib.parse.quote(run_id, safe='')}")
        browser.wait_for("!!document.querySelector('iframe[sandbox]')", 30)
        journey_shot(browser, "4-report-with-decision")
        # The stored report the tab frames, opened at its own URL (the frame's origin is opaque).
        browser.goto(cluster.api_url + browser.eval("document.querySelector('iframe[sandbox]').getAttribute('src')"))
        browser.wait_for("document.body.innerText.includes('DECISION')", 30)
        assert "answered by admin" in browser.text()
        journey_shot(browser, "5-final-report")
    finally:
        browser.close()
    decision = _check_completed_at(output, run_id, cap)
    assert (decision["option"], decision["kind"], decision["responded_by"]) == (recommended, "recommended", "admin")


def _no_failed_task(states: dict[str, set[str]]) -> None:
    failed = {t: st for t, st in states.items() if st & {"failed", "upstream_failed"}}
    assert not failed, f"a gate stop is not a crash: {failed}"


def _tab_says_stopped(cluster: AirflowCluster, api: AirflowApi, run_id: str, deciding: str) -> str:
    """The run's "tracegen report" tab: stopped by the gate, showing the report that decided."""
    page = httpx.get(f"{cluster.api_url}/tracegen/runs/{urllib.parse.quote(run_id, safe='')}",
                     headers=api.client.headers, params={"dag_id": GENERATE}, timeout=30)
    assert page.status_code == 200, page.text[:300]
    text = html.unescape(page.text)  # the page escapes quotes; which entity it picks is not the point
    assert "Stopped by the gate." in text and f"This is the report that decided ({deciding})" in text
    return text


@pytest.mark.timeout(400)
def test_an_unanswered_question_stops_the_run(cluster: AirflowCluster, api: AirflowApi, dataset: Path) -> None:
    run_id, output = _trigger(cluster, api, dataset, "out-timeout", gate_question_timeout_minutes=0.25)
    _question(cluster, api, run_id)
    # Stopped by the gate, not failed: the decision task is skipped saying so, and what follows it too.
    assert api.wait_run(GENERATE, run_id, 180) == "success"
    states = _states(api, run_id)
    assert states["review_cap"] == {"success"} and states["apply_decision"] == {"skipped"}, states
    assert states["generate_at_decided_cap"] == {"skipped"} and states["watcher"] == {"skipped"}, states
    assert states["final_report"] == {"success"}
    _no_failed_task(states)
    # Who stopped it and when: nobody, by the question's timeout (a stop by timeout names no reviewer).
    assert "(stopped: nobody answered the gate's question by " in _tab_says_stopped(
        cluster, api, run_id, "pilot-report.html")
    record, report = _record(output, run_id)
    decision = record["decisions"][-1]
    assert (decision["option"], decision["cap"], decision["timed_out"], decision["responded_by"]) == (
        STOP, None, True, None)
    assert record["config"]["max_tokens"] == 4096 and report["decisions"] == record["decisions"]
    frame = OutputRoot(open_storage(str(output))).snapshots.frame()
    # While the question waited the fleet went on at the recommended cap, within the budget (25% of the rows);
    # the timeout's stop kept every row it committed, and nothing else ran after the question: the other rows
    # above 4096 are the pilot's truncated rows, continued to measure the tail before the gate's audit.
    asked = frame[frame["while_asking"]]
    assert 0 < len(asked) <= N_ROWS // 4 and decision["while_asking"]["rows"] == len(asked)
    assert decision["while_asking"]["answer_cap"] is None
    assert set(frame.loc[(frame["max_tokens"] > 4096) & ~frame["while_asking"], "pivot"]) <= {"extended"}


@pytest.mark.timeout(400)
def test_a_gate_stop_ends_the_run_stopped_by_the_gate_not_failed(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path
) -> None:
    # gate_mode=stop, into a root only the run's conf names (not in tracegen_output_roots): the review
    # pages find it from the run itself.
    run_id, output = _trigger(cluster, api, dataset, "out-stop", gate_mode="stop")
    assert api.wait_run(GENERATE, run_id, 300) == "success", f"{api.describe(GENERATE, run_id)}\n{cluster.logs_summary()}"
    states = _states(api, run_id)
    assert states["audit_and_gate"] == {"skipped"} and states["generate_chunk"] == {"skipped"}, states
    assert states["generate_alongside_pilot"] <= {"success", "skipped"} and states["watcher"] == {"skipped"}, states
    assert states["final_report"] == {"success"} and states["teardown_fleet"] == {"success"}, states
    _no_failed_task(states)
    text = _tab_says_stopped(cluster, api, run_id, "pilot-report.html")
    pilot = json.loads((output / "runs" / safe_run_id(run_id) / "pilot-report.json").read_text())
    assert pilot["verdict"]["verdict"] == "stop" and f"max_tokens={pilot['cap_table']['recommended_cap']:,}" in text
    frame = OutputRoot(open_storage(str(output))).snapshots.frame()
    assert frame["index"].nunique() < N_ROWS  # nothing past the gate


@pytest.mark.timeout(400)
def test_the_continuous_gate_asks_instead_of_failing_chunks(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path
) -> None:
    # No pilot: the continuous gate closes once the first chunks' rows show the truncation; the chunks
    # after it are held (skipped, not failed), and the run asks about the rows they left.
    run_id, output = _trigger(cluster, api, dataset, "out-drift", pilot_size=0)
    detail = _question(cluster, api, run_id)
    assert detail["subject"] == (f"Run {safe_run_id(run_id)}: The running truncation rate held chunks back at "
                                 "max_tokens=4,096: continue at which cap?")
    assert "in the rows generated so far (the continuous gate's sample)" in detail["body"]
    assert "/gate-report.html)" in detail["body"]
    states = _states(api, run_id)
    assert "skipped" in states["generate_chunk"] and "failed" not in states["generate_chunk"], states
    _answer(api, run_id, "Continue at 4,096 tokens, accepting the truncation")
    assert api.wait_run(GENERATE, run_id, 300) == "success", api.describe(GENERATE, run_id)
    record, report = _record(output, run_id)
    assert record["decisions"][-1]["trigger"] == "drift" and record["config"]["gate_mode"] == "warn"
    assert dataset_status(str(output))["left"] == 0 and report["decisions"] == record["decisions"]


def _watch_while_running(cluster: AirflowCluster, api: AirflowApi, run_id: str, timeout: float) -> dict:
    """Poll the run until it ends: the labels the grid shows for chunk tasks while they run, and the run's
    progress as its review page serves it (progress.json) while it is not over."""
    seen: dict = {"labels": {}, "progress": []}
    quoted = urllib.parse.quote(run_id, safe="")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in api.task_instances(GENERATE, run_id):
            if t["map_index"] >= 0 and t["state"] == "running":
                seen["labels"][(t["task_id"], t["map_index"])] = t.get("rendered_map_index")
        tab = api.client.get(f"{cluster.api_url}/tracegen/runs/{quoted}", follow_redirects=False)
        if tab.status_code == 303 and tab.headers["location"].endswith("/progress"):
            doc = api.client.get(cluster.api_url + tab.headers["location"] + ".json").json()
            seen["progress"].append(doc)
        if api.run(GENERATE, run_id)["state"] in ("success", "failed"):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"the run did not end in {timeout:.0f} s: {api.describe(GENERATE, run_id)}")


@pytest.mark.timeout(300)
def test_a_run_the_gate_passes_asks_nothing(cluster: AirflowCluster, api: AirflowApi, dataset: Path) -> None:
    run_id, output = _trigger(cluster, api, dataset, "out-pass", max_tokens=16384)
    seen = _watch_while_running(cluster, api, run_id, 240)
    assert api.run(GENERATE, run_id)["state"] == "success", api.describe(GENERATE, run_id)
    # A running chunk task is named by its chunk in the grid, not by its map index.
    assert seen["labels"], "no chunk task was seen running"
    assert all(label and label.startswith("chunk ") for label in seen["labels"].values()), seen["labels"]
    # The run's tab showed its live progress from the ledger while it ran.
    assert seen["progress"], "the run's tab never showed its progress"
    assert all(p["total"] == N_ROWS and 0 <= p["done"] <= N_ROWS for p in seen["progress"]), seen["progress"]
    # Live (refreshing) while rows were left; done counts only grow.
    assert any(p["live"] and p["done"] > 0 and p["rows_per_s"] and p["tokens_per_s"] and p["eta_s"]
               for p in seen["progress"]), seen["progress"]
    assert [p["done"] for p in seen["progress"]] == sorted(p["done"] for p in seen["progress"])
    # A chunk's log leads with its progress lines; the autotuner's per-change lines are at debug level.
    chunk = next(t for t in api.task_instances(GENERATE, run_id)
                 if t["task_id"] in ("generate_alongside_pilot", "generate_chunk") and t["state"] == "success")
    log = api.client.get(f"/dags/{GENERATE}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/"
                         f"{chunk['task_id']}/logs/{chunk['try_number']}", params={"map_index": chunk["map_index"]},
                         headers={"Accept": "application/json"}).text
    assert "rows/s" in log and re.search(r"in-flight limit \d+ -> \d+", log) is None, log[-2000:]
    states = _states(api, run_id)
    assert states["ask_about_cap"] == {"skipped"} and states["generate_chunk"] == {"success"}, states
    for task_id in ("review_cap", "apply_decision", "generate_at_decided_cap", "watcher"):
        assert states[task_id] == {"skipped"}, (task_id, states)
    record, report = _record(output, run_id)
    assert record["decisions"] == [] and report["decisions"] == []
    assert not (output / "runs" / safe_run_id(run_id) / "question.json").exists()
    assert dataset_status(str(output))["left"] == 0


def _task_log(api: AirflowApi, run_id: str, task_id: str) -> str:
    ti = next(t for t in api.task_instances(GENERATE, run_id) if t["task_id"] == task_id and t["map_index"] == -1)
    response = api.client.get(f"/dags/{GENERATE}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/"
                              f"{task_id}/logs/{max(ti['try_number'], 1)}", headers={"Accept": "application/json"})
    return response.text


@pytest.mark.timeout(300)
def test_a_failed_first_task_is_the_one_failure_and_the_final_tasks_skip_saying_why(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path
) -> None:
    """A failed first task fails one task: prepare_run fails on a missing dataset; final_report and teardown_fleet are
    skipped, each saying why, instead of failing on the run prepare_run never handed over."""
    run_id, _ = _trigger(cluster, api, dataset, "out-missing", dataset_uri=str(cluster.root / "no-such.jsonl"))
    assert api.wait_run(GENERATE, run_id, 240) == "failed", api.describe(GENERATE, run_id)
    states = _states(api, run_id)
    assert states["prepare_run"] == {"failed"}, states
    assert states["final_report"] == {"skipped"} and states["teardown_fleet"] == {"skipped"}, states
    failed = {t for t, st in states.items() if "failed" in st}
    assert failed <= {"prepare_run", "watcher"}, states  # the watcher is what marks the run failed
    assert "prepare_run did not describe the run" in _task_log(api, run_id, "final_report")
    assert "no server was launched for it" in _task_log(api, run_id, "teardown_fleet")


@pytest.mark.timeout(300)
def test_a_cap_the_fleet_cannot_hold_fails_the_first_task_before_any_server_starts(
    cluster: AirflowCluster, api: AirflowApi, dataset: Path
) -> None:
    """1,048,576, the largest cap the form takes, is more than the fleet's servers can hold: the run's first
    task refuses it against the fleet's declared context length, naming the bound, and no server is launched
    for it. (Beyond 1,048,576 the form itself refuses: tests/plugins/test_review_page.py.)"""
    run_id, output = _trigger(cluster, api, dataset, "out-clamped", max_tokens=1_048_576)
    assert api.wait_run(GENERATE, run_id, 240) == "failed", api.describe(GENERATE, run_id)
    states = _states(api, run_id)
    assert states["prepare_run"] == {"failed"} and states["provision_fleet"] == {"upstream_failed"}, states
    assert states["final_report"] == {"skipped"} and states["teardown_fleet"] == {"skipped"}, states
    log = _task_log(api, run_id, "prepare_run")
    assert "max_tokens 1,048,576 is too large: the servers' context length is 40,960 tokens" in log, log[-2000:]
    assert not (output / "runs").exists()  # nothing written, nothing generated
