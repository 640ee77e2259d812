"""A run whose every configured location holds credentials shows none of them: the webhook URL and the API
server's URL carry `user:password@` and a token, the SMTP connection a login and password, and the
dataset a presigned-style query. What the run writes for people to read (the task log, dataset.json, the
report's JSON and HTML, the question's notifications, a raise's error, the export's manifest) is grepped
for every one of them. Real components throughout: moto's S3, an SMTP server and HTTP receivers on
loopback, the run's own prepare, audit and export."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from engine_support.helpers import make_config, prepare, write_dataset
from fixtures.notify_receivers import LOGIN, PASSWORD, WebhookReceiver, notification_receivers

import tracegen.run.run_report as report_module
from tracegen.audit.cap_question import question_from_report
from tracegen.export import export_dataset
from tracegen.run.api_answer import AnswerFailed, configured_answerer
from tracegen.store.storage import open_storage

SECRETS = ("hookuser", "hookpass", "hook-qs-token", "apiuser", "apipass", "api-qs-token", "raise-password",
           PASSWORD, "X-Amz-Signature", "s1gnature")


def test_no_credential_reaches_a_log_a_report_a_manifest_or_a_message(s3, s3_uri, tmp_path, monkeypatch, caplog):
    from tracegen.review_gate import CapReviewOperator

    bucket = f"s3://{s3.bucket}"
    monkeypatch.setenv("TRACEGEN_WRITE_PREFIXES", f"{bucket},{tmp_path}")
    monkeypatch.setenv("TRACEGEN_READ_PREFIXES", bucket)
    local = write_dataset(tmp_path / "prompts.jsonl", 12)
    open_storage(s3_uri).put("data/prompts.jsonl", local.read_bytes())
    dataset_uri = f"{s3_uri}data/prompts.jsonl?X-Amz-Signature=s1gnature"
    output_uri = f"{s3_uri}out"
    caplog.set_level(logging.DEBUG)

    with notification_receivers() as (mail, hook):
        api = WebhookReceiver().start()
        api.status = 401
        try:
            monkeypatch.setenv("AIRFLOW_CONN_Q_HOOK", json.dumps({"conn_type": "http", "host": hook.url().replace(
                "http://", "http://hookuser:hookpass@") + "?token=hook-qs-token"}))
            monkeypatch.setenv("AIRFLOW_CONN_Q_MAIL", json.dumps(
                {"conn_type": "smtp", "host": "127.0.0.1", "port": mail.port, "login": LOGIN,
                 "password": PASSWORD, "extra": {"from": "t@example.test", "to": ["r@example.test"],
                                                        "allow_login_without_tls": True}}))
            monkeypatch.setenv("AIRFLOW_CONN_TRACEGEN_API", json.dumps(
                {"conn_type": "http", "host": f"http://apiuser:apipass@127.0.0.1:{api.port}/?t=api-qs-token",
                 "login": "raiser", "password": "raise-password"}))
            monkeypatch.setenv("TRACEGEN_QUESTION_NOTIFY", "q_hook,q_mail")

            config = make_config(dataset_uri, output_uri)
            spec = prepare(config, "run-1")
            outcome = report_module.audit_and_report(spec, name="pilot-report")
            report = json.loads(open_storage(output_uri).get(f"runs/{spec.run_id}/pilot-report.json"))
            question = question_from_report(
                report, run_id=spec.run_id, trigger="pilot", max_cap=40_959, context_length=40_960,
                truncated_policy="extend", report_uri=outcome.html_uri, report_url=None, timeout_minutes=60)
            task = CapReviewOperator(task_id="review_cap", question=question.to_json())
            task._pose()
            ti = SimpleNamespace(dag_id="tracegen_generate", run_id="manual__1", task_id="review_cap", map_index=-1)
            for notifier in task.notifiers:
                notifier({"task": task, "ti": ti, "task_instance": ti})
            post = hook.wait_for(lambda body: True)
            message, _, login = mail.wait_for(lambda m: True)
            with pytest.raises(AnswerFailed) as refused:
                configured_answerer().answer("tracegen_generate", "manual__1", "review_cap", "Stop the run", {})
            assert len(api.posts) == 1 and login == LOGIN  # both servers were really reached
        finally:
            api.stop()

    export = export_dataset(output_uri, str(tmp_path / "export"), check_prefixes=False)
    shown = {
        "task log": caplog.text,
        "dataset.json": open_storage(output_uri).get("dataset.json").decode(),
        "report.json": json.dumps(report),
        "report.html": open_storage(output_uri).get(f"runs/{spec.run_id}/pilot-report.html").decode(),
        "question": task.body,
        "webhook": json.dumps(post["body"]),
        "mail": message.get_content(),
        "raise error": str(refused.value),
        "manifest": (tmp_path / "export" / "manifest.json").read_text(),
    }
    assert export.rows == 0 and "s3://" in shown["manifest"]
    assert report["run"]["config"]["dataset_uri"] == f"{s3_uri}data/prompts.jsonl"
    leaked = {where: [s for s in SECRETS if s in text] for where, text in shown.items()}
    assert leaked == {where: [] for where in shown}, leaked
