"""The operator's API connection a raise answers the question through (`tracegen.run.api_answer`): read
from an Airflow connection as the operator defines it, refused naming what is missing, and an api-server that
cannot be reached reported, not waited on. Answering a real api-server is tests/e2e/test_cap_review.py's."""

from __future__ import annotations

import json
import socket

import pytest

from tracegen.common.http_connection import ConnectionMisconfigured
from tracegen.run.api_answer import (
    API_CONN_ENV,
    AnswerFailed,
    ApiAnswerer,
    answering_login,
    configured_answerer,
)


def _define(monkeypatch: pytest.MonkeyPatch, conn_id: str = "tracegen_api", **fields) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "http", **fields}))


@pytest.mark.parametrize("fields, url", [
    ({"host": "http://airflow-apiserver:8080/"}, "http://airflow-apiserver:8080"),
    ({"host": "airflow.example.test", "schema": "https", "port": 8443, "extra": {"path": "/airflow"}},
     "https://airflow.example.test:8443/airflow"),
    ({"host": "127.0.0.1", "port": 8080}, "http://127.0.0.1:8080"),
])
def test_the_connection_names_the_api_server_and_the_user(monkeypatch, fields, url) -> None:
    _define(monkeypatch, **fields, login="tracegen-raise", password="a-long-password")
    answerer = configured_answerer()
    assert (answerer.base_url, answerer.login, answerer.conn_id) == (url, "tracegen-raise", "tracegen_api")
    assert "a-long-password" not in repr(answerer)
    assert answering_login() == "tracegen-raise"


def test_another_connection_id_is_named_by_the_environment(monkeypatch) -> None:
    _define(monkeypatch, "ops_api", host="http://api:8080", login="ops", password="a-long-password")
    monkeypatch.setenv(API_CONN_ENV, "ops_api")
    assert configured_answerer().conn_id == "ops_api"


def test_no_connection_is_none(monkeypatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_TRACEGEN_API", raising=False)
    assert configured_answerer() is None and answering_login() is None


@pytest.mark.parametrize("fields, why", [
    ({"host": "http://api:8080", "login": "tracegen-raise"}, "no login or no password"),
    ({"host": "http://api:8080", "password": "a-long-password"}, "no login or no password"),
    ({"login": "u", "password": "a-long-password"}, "no host"),
    ({"host": "api", "schema": "ftp", "login": "u", "password": "a-long-password"}, "schema 'ftp' is not http"),
])
def test_a_malformed_connection_is_refused_naming_it_and_what_is_wrong(monkeypatch, fields, why) -> None:
    _define(monkeypatch, **fields)
    with pytest.raises(ConnectionMisconfigured, match=f"Airflow connection 'tracegen_api': {why}"):
        configured_answerer()
    assert answering_login() is None  # nobody's answer is taken for a raise


def test_an_api_server_not_reached_is_an_answer_failed_without_a_status() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the answer: nothing listens
    answerer = ApiAnswerer(base_url=f"http://127.0.0.1:{port}", login="u", password="a-long-password")
    with pytest.raises(AnswerFailed, match=f"the api-server at http://127.0.0.1:{port} .* not reached") as caught:
        answerer.answer("tracegen_generate", "manual__1", "review_cap", "Continue at the cap typed below", {"cap": 9000})
    assert caught.value.status is None


def test_an_api_server_url_with_credentials_is_named_without_them() -> None:
    from fixtures.notify_receivers import WebhookReceiver

    refusing = WebhookReceiver().start()
    refusing.status = 401
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    try:
        messages = []
        for port in (refusing.port, closed):
            answerer = ApiAnswerer(base_url=f"http://urluser:urlpass@127.0.0.1:{port}/?tok=qs-secret",
                                   login="raiser", password="the-api-password")
            with pytest.raises(AnswerFailed) as caught:
                answerer.answer("tracegen_generate", "manual__1", "review_cap", "Stop the run", {})
            messages.append(str(caught.value))
    finally:
        refusing.stop()
    assert len(refusing.posts) == 1  # the refusal came from the server, not from a URL that could not be used
    assert messages[0].startswith(f"the api-server at http://127.0.0.1:{refusing.port}/ (connection "
                                  "'tracegen_api'): /auth/token refused user 'raiser': HTTP 401"), messages[0]
    assert messages[1].startswith(f"the api-server at http://127.0.0.1:{closed}/ (connection 'tracegen_api'): "
                                  "not reached"), messages[1]
    assert not [s for s in ("urluser", "urlpass", "qs-secret", "the-api-password") if s in "\n".join(messages)]
