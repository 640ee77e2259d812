"""The gate's question tells the reviewer it waits: the notifiers `review_cap` is built with, sending to a
real SMTP server and a real HTTP receiver on loopback (tests/fixtures/notify_receivers.py), configured
through Airflow connections as an operator would (`AIRFLOW_CONN_<ID>`, TRACEGEN_QUESTION_NOTIFY). A
connection that is missing, malformed or unreachable is a warning, never a failed review task."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from fixtures.notify_receivers import LOGIN, mail_connection, notification_receivers, webhook_connection
from fixtures.ports import free_port

from tracegen.audit.cap_question import PILOT, CapDecision, CapQuestion
from tracegen.review.notify import ASSIGNED_USERS_ENV, NOTIFY_ENV, QuestionNotifier

BASE_URL = "http://airflow.example.test:8080"
RUN_ID = "manual__2026-03-01T12:30:00+00:00"
REPORT_URL = f"{BASE_URL}/tracegen/roots/r0/runs/{RUN_ID}/pilot-report.html"
QUESTION_URL = (f"{BASE_URL}/dags/tracegen_generate/runs/manual__2026-03-01T12%3A30%3A00%2B00%3A00/tasks/"
                "review_cap/required_actions")
VERDICT = {"verdict": "stop", "reason": "truncation 36.7% is over the threshold 5.0%", "truncated": 44,
           "total": 120}


def question(**overrides: Any) -> CapQuestion:
    fields: dict[str, Any] = dict(
        run_id=RUN_ID, trigger=PILOT, current_cap=4096, recommended_cap=9216, max_cap=40_959,
        context_length=40_960, truncated_policy="extend", verdict=VERDICT, cap_rows=[], confidence=0.95,
        throughput=None, report_uri="file:///out/runs/run-1/pilot-report.html", report_url=REPORT_URL,
        timeout_minutes=60.0,
    )
    return CapQuestion(**{**fields, **overrides})


@pytest.fixture
def receivers(monkeypatch: pytest.MonkeyPatch):
    """Both receivers running, and the operator's settings pointing at them."""
    with notification_receivers() as (mail, hook):
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", mail_connection(mail))
        monkeypatch.setenv("AIRFLOW_CONN_Q_HOOK", webhook_connection(hook))
        monkeypatch.setenv(NOTIFY_ENV, "q_mail, q_hook")
        monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE_URL + "/")
        yield mail, hook


def review_task(q: CapQuestion | None = None):
    return review_task_for((q or question()).to_json())


def review_task_for(question_json: Any):
    from tracegen.review_gate import CapReviewOperator

    return CapReviewOperator(task_id="review_cap", question=question_json)


def pose(task) -> dict[str, Any]:
    """Pose the question as `execute` does, then call the notifiers as the HITL operator does right after
    writing it; the context is what the task runner hands them (the task, and the task instance's ids)."""
    task._pose()
    ti = SimpleNamespace(dag_id="tracegen_generate", run_id=RUN_ID, task_id=task.task_id, map_index=-1)
    context = {"task": task, "ti": ti, "task_instance": ti}
    for notifier in task.notifiers:
        notifier(context)
    return context


def test_the_mail_and_the_webhook_carry_the_verdict_the_recommended_cap_and_both_links(receivers) -> None:
    mail, hook = receivers
    task = review_task()
    assert [n.conn_id for n in task.notifiers] == ["q_mail", "q_hook"]
    assert all(isinstance(n, QuestionNotifier) for n in task.notifiers)
    pose(task)

    subject = (f"Run {RUN_ID}: The pilot is over the truncation threshold at max_tokens=4,096: continue at "
               "which cap?")
    message, rcpt, login = mail.wait_for(lambda m: True)
    assert message["Subject"] == f"tracegen question: {subject}"
    assert (message["From"], rcpt, login) == ("tracegen@example.test", ["reviewer@example.test"], LOGIN)
    text = message.get_content().replace("\r\n", "\n")  # SMTP's line ends
    lines = text.splitlines()
    assert ("truncated at the cap: 44 of 120 (36.7%). truncation 36.7% is over the threshold 5.0%") in lines
    assert "Recommended cap: max_tokens=9,216 (from max_tokens=4,096)." in lines
    assert f"Answer the question: {QUESTION_URL}" in lines and f"Report: {REPORT_URL}" in lines
    assert "Unanswered within 60 minutes, the run stops." in lines

    post = hook.wait_for(lambda body: True)
    assert post["path"] == "/hooks/question" and post["headers"]["X-Tracegen-Token"] == "hook-test-token"
    body = post["body"]
    assert body["text"] == text.rstrip("\n")  # the text Slack and Teams show is the e-mail's
    fields = body["tracegen"]
    assert fields["event"] == "question_waiting" and fields["subject"] == subject
    assert (fields["recommended_cap"], fields["current_cap"], fields["run_id"]) == (9216, 4096, RUN_ID)
    assert (fields["question_url"], fields["report_link"]) == (QUESTION_URL, REPORT_URL)
    assert fields["verdict_line"].startswith("truncated at the cap: 44 of 120 (36.7%).")


def test_without_a_review_page_the_report_link_is_where_the_report_is_stored(receivers) -> None:
    _, hook = receivers
    pose(review_task(question(report_url=None, recommended_cap=None)))
    fields = hook.wait_for(lambda body: True)["body"]["tracegen"]
    assert fields["report_link"] == "file:///out/runs/run-1/pilot-report.html"
    assert fields["recommended_line"].startswith("Recommended cap: none")


def test_a_recommended_cap_beyond_the_servers_is_named_as_not_offered(receivers) -> None:
    _, hook = receivers
    pose(review_task(question(recommended_cap=65_536)))
    line = hook.wait_for(lambda body: True)["body"]["tracegen"]["recommended_line"]
    assert line == ("Recommended cap: max_tokens=65,536, beyond what the servers can serve (at most 40,959), so "
                    "it is not among the options.")


def test_nothing_to_ask_and_a_raise_passed_through_tell_nobody(receivers) -> None:
    from airflow.sdk.exceptions import AirflowSkipException

    mail, hook = receivers
    with pytest.raises(AirflowSkipException):
        review_task_for({}).execute({})
    decided = CapDecision(trigger="raise", option="raise", kind="other", from_cap=4096, cap=8192,
                          responded_by="ops", responded_at="2026-03-01T12:30:00+00:00", timed_out=False,
                          verdict={}, cap_rows=[], report_uri="file:///r")
    assert review_task_for({"decided": decided.to_json()}).execute({})["cap"] == 8192
    # Posing one question afterwards is seen, so "nothing arrived" above is not a receiver that is down.
    pose(review_task())
    hook.wait_for(lambda body: True)
    mail.wait_for(lambda m: True)
    assert len(hook.posts) == 1 and len(mail.messages) == 1


def test_a_refused_answer_asks_again_without_telling_everyone_again(receivers) -> None:
    import datetime as dt

    from tracegen.audit.cap_question import OTHER

    task = review_task()
    asked_again: list[Any] = []
    object.__setattr__(task, "execute", lambda context: asked_again.append(list(task.notifiers)))
    ti = SimpleNamespace(xcom_push=lambda key, value: None)
    q = question()
    task.execute_complete({"ti": ti}, {"chosen_options": [q.option_label(OTHER)], "params_input": {"cap": None},
                                       "responded_at": dt.datetime(2026, 3, 1, tzinfo=dt.UTC),
                                       "responded_by_user": {"id": "ada", "name": "Ada"}, "timedout": False})
    assert asked_again == [[]]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "tracegen.review.notify"]


@pytest.mark.parametrize(("conn", "says"), [
    (None, "question notification via connection 'q_broken' not sent: the connection could not be read"),
    ({"conn_type": "ssh", "host": "h"},
     "the connection is malformed: conn_type 'ssh' is not a notification channel: smtp or email for e-mail, "
     "http or https for a webhook"),
    ({"conn_type": "smtp", "port": 25, "extra": {"from": "a@b.test", "to": ["c@d.test"]}},
     "the connection is malformed: no host"),
    ({"conn_type": "smtp", "host": "127.0.0.1", "extra": {"from": "a@b.test"}},
     "the connection is malformed: extra 'to' must be a list of addresses, got None"),
    ({"conn_type": "email", "host": "127.0.0.1", "extra": {"to": ["c@d.test"]}},
     "the connection is malformed: extra 'from' must be the sender's address, got None"),
    ({"conn_type": "smtp", "host": "127.0.0.1", "extra": {"from": "a@b.test", "to": ["c@d.test"],
                                                          "starttls": "yes"}},
     "the connection is malformed: extra 'starttls' must be true or false, got 'yes'"),
    ({"conn_type": "http", "extra": {}}, "the connection is malformed: no host"),
    ({"conn_type": "http", "host": "hooks.example.test", "schema": "services/T0/B0/x"},
     "the connection is malformed: schema 'services' is not http or https"),
    ({"conn_type": "https", "host": "https://hooks.example.test/x", "extra": {"headers": ["Bearer x"]}},
     "the connection is malformed: extra 'headers' must be an object of header names to string values"),
], ids=["missing", "not-a-channel", "smtp-no-host", "smtp-no-to", "email-no-from", "smtp-starttls-not-bool",
        "http-no-host", "http-uri-path-in-schema", "https-headers-not-object"])
def test_a_missing_or_malformed_connection_is_a_warning_naming_what_is_wrong(
    conn: dict | None, says: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_Q_BROKEN", raising=False)
    if conn is not None:
        monkeypatch.setenv("AIRFLOW_CONN_Q_BROKEN", json.dumps(conn))
    monkeypatch.setenv(NOTIFY_ENV, "q_broken")
    with caplog.at_level(logging.WARNING):
        pose(review_task())  # does not raise
    [warning] = _warnings(caplog)
    assert says in warning, warning


def test_unreachable_or_refusing_servers_are_warnings_and_the_question_is_still_asked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    closed = free_port()  # nothing listens there
    monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps({"conn_type": "smtp", "host": "127.0.0.1", "port": closed,
                                                          "extra": {"from": "a@b.test", "to": ["c@d.test"]}}))
    monkeypatch.setenv("AIRFLOW_CONN_Q_HOOK", json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": closed,
                                                          "schema": "http", "extra": {"path": "/secret/path"}}))
    with notification_receivers() as (_, refusing):
        refusing.status = 500
        monkeypatch.setenv("AIRFLOW_CONN_Q_REFUSING", webhook_connection(refusing))
        monkeypatch.setenv(NOTIFY_ENV, "q_mail,q_hook,q_refusing")
        with caplog.at_level(logging.WARNING):
            task = review_task()
            pose(task)
        assert len(refusing.posts) == 1
    mail_warning, hook_warning, refused_warning = _warnings(caplog)
    assert f"'q_mail' not sent: SMTP 127.0.0.1:{closed} failed (ConnectionRefusedError" in mail_warning
    assert f"'q_hook' not sent: webhook http://127.0.0.1:{closed} failed (ConnectError" in hook_warning
    assert "secret" not in hook_warning  # a webhook's path is its secret: never in a log
    assert f"'q_refusing' not sent: webhook http://127.0.0.1:{refusing.port} failed (ChannelFailed: answered HTTP 500" in refused_warning


def test_who_may_answer_is_the_operators_setting_and_anyone_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NOTIFY_ENV, raising=False)
    monkeypatch.delenv(ASSIGNED_USERS_ENV, raising=False)
    unset = review_task()
    assert unset.assigned_users is None and unset.notifiers == []
    monkeypatch.setenv(ASSIGNED_USERS_ENV, "alice, 7:Bob Smith,,")
    assert review_task().assigned_users == [{"id": "alice", "name": "alice"}, {"id": "7", "name": "Bob Smith"}]


def _pose_within(task, seconds: float) -> float:
    """Pose the question in a thread; how long it took, failing when it is still blocked after `seconds`."""
    import threading
    import time

    started = time.monotonic()
    thread = threading.Thread(target=pose, args=(task,), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"posing the question is still blocked after {seconds:g} s"
    return time.monotonic() - started


def test_a_server_trickling_one_byte_every_5_s_is_given_up_at_the_deadline_and_the_question_is_posed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    from fixtures.notify_receivers import trickling_server

    monkeypatch.setenv("TRACEGEN_QUESTION_NOTIFY_DEADLINE_S", "2")
    with trickling_server("http") as slow_hook, trickling_server("smtp") as slow_mail:
        monkeypatch.setenv("AIRFLOW_CONN_Q_HOOK", json.dumps(
            {"conn_type": "http", "host": f"http://127.0.0.1:{slow_hook.port}/hooks/secret-path"}))
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps(
            {"conn_type": "smtp", "host": "127.0.0.1", "port": slow_mail.port,
             "extra": {"from": "a@b.test", "to": ["c@d.test"]}}))
        monkeypatch.setenv(NOTIFY_ENV, "q_hook,q_mail")
        task = review_task()
        with caplog.at_level(logging.WARNING):
            took = _pose_within(task, 30)
        # Two notifications, one after the other, each given up at its 2 s deadline.
        assert took < 2 * 2 + 3, took
        assert task.body and task.options  # the question is posed
        hook_warning, mail_warning = _warnings(caplog)
        for warning, where in ((hook_warning, f"webhook http://127.0.0.1:{slow_hook.port}"),
                               (mail_warning, f"SMTP 127.0.0.1:{slow_mail.port}")):
            assert f"{where} failed (DeadlinePassed: not done within the notification's deadline of 2 s" in warning
        # Given up means hung up, not left reading in the background.
        deadline = time.monotonic() + 12
        while (slow_hook.closed_by_client, slow_mail.closed_by_client) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (slow_hook.connections, slow_mail.connections) == (1, 1)
        assert (slow_hook.closed_by_client, slow_mail.closed_by_client) == (1, 1)


def test_a_login_without_tls_is_refused_unless_the_connection_allows_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with notification_receivers() as (mail, _):
        cleartext = json.loads(mail_connection(mail))
        del cleartext["extra"]["allow_login_without_tls"]
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps(cleartext))
        monkeypatch.setenv(NOTIFY_ENV, "q_mail")
        with caplog.at_level(logging.WARNING):
            pose(review_task())
        [warning] = _warnings(caplog)
        assert ("the connection is malformed: a login without TLS would send the password in the clear: set extra "
                "'starttls' or 'ssl' to true, or 'allow_login_without_tls' to true") in warning
        assert mail.messages == []
        # Without a login there is no password to protect; with the setting, the operator took the risk.
        del cleartext["login"], cleartext["password"]
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps(cleartext))
        pose(review_task())
        assert mail.wait_for(lambda m: True)[2] is None
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", mail_connection(mail))
        pose(review_task())
        mail.wait_for(lambda m: len(mail.messages) == 2)
        assert mail.messages[1][2] == LOGIN


def test_credentials_in_a_webhook_url_or_an_smtp_host_never_reach_the_task_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    closed = free_port()
    secrets = ("hookuser", "hookpass", "tok3n-in-query", "frag-secret", "secret-path", "smtpuser", "smtppass")
    with notification_receivers() as (mail, hook):
        monkeypatch.setenv("AIRFLOW_CONN_Q_HOOK", json.dumps(
            {"conn_type": "http",
             "host": f"http://hookuser:hookpass@127.0.0.1:{hook.port}/secret-path?token=tok3n-in-query#frag-secret"}))
        monkeypatch.setenv("AIRFLOW_CONN_Q_DEAD", json.dumps(
            {"conn_type": "http", "host": f"http://hookuser:hookpass@127.0.0.1:{closed}/secret-path?t=tok3n-in-query"}))
        monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps(
            {"conn_type": "smtp", "host": "smtpuser:smtppass@127.0.0.1", "port": closed, "login": "smtpuser",
             "password": "smtppass", "extra": {"from": "a@b.test", "to": ["c@d.test"], "starttls": True}}))
        monkeypatch.setenv(NOTIFY_ENV, "q_hook,q_dead,q_mail")
        with caplog.at_level(logging.DEBUG):
            pose(review_task())
            hook.wait_for(lambda body: True)
            hook.status = 500
            pose(review_task())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"sent through webhook http://127.0.0.1:{hook.port}" in logged
    assert f"webhook http://127.0.0.1:{hook.port} failed (ChannelFailed" in logged
    assert f"webhook http://127.0.0.1:{closed} failed (ConnectError" in logged
    assert f"SMTP 127.0.0.1:{closed} failed" in logged
    assert [s for s in secrets if s in logged] == []
