"""Telling the reviewer that the gate's question waits (gate_mode=ask): e-mail and webhook notifiers.

`review_cap` (`tracegen.review_gate.CapReviewOperator`) poses the question in Airflow's Required Actions;
Airflow's HITL operator calls each of its `notifiers` right after the question is written, and only then.
One `QuestionNotifier` per Airflow connection the operator names in TRACEGEN_QUESTION_NOTIFY (comma-
separated connection ids, read when the DAG is parsed). Each connection's conn_type picks the channel:

- `smtp` / `email`: an e-mail through that SMTP server (host, port, login, password; extra `from`, `to`,
  `starttls`, `ssl`, `allow_login_without_tls`). A login is refused without TLS (`starttls` or `ssl`), so a
  password never crosses the network in the clear, unless the connection's extra `allow_login_without_tls`
  is true (a relay on the same host, say);
- `http` / `https`: a JSON POST to a webhook (the URL in host, or host, port and extra `path`; extra
  `headers`). The body's `text` is what Slack's and Teams' incoming webhooks show; `tracegen` holds the
  same facts as fields, for anything else that reads it.

Connections only: nothing in an output root (which a run's conf can name) can send mail or reach a URL.

A notification is a courtesy, the question is the point: a connection that is missing, malformed or whose
server does not answer is logged as a warning naming what is wrong, and the question is asked anyway. Each
notification has a total deadline, TRACEGEN_QUESTION_NOTIFY_DEADLINE_S seconds (default 30) from connecting
to the server's last byte: a server that answers one byte at a time never trips a per-read timeout, and
would otherwise keep the question from being posed. The task log names a server by `shown_location` (no
login, password, path or token of a webhook URL).

Airflow's own notifiers (the SMTP provider's SmtpNotifier, the HTTP provider's HttpNotifier) send through
their hooks, which would change what is sent and kept: SmtpHook reads other connection extras (implicit TLS
unless `disable_ssl`, STARTTLS unless `disable_tls`), reconnects up to 5 times on a disconnect, bounds each
read but not the whole, and SmtpNotifier mails HTML; HttpHook sends the connection's extras as request
headers, follows redirects, and debug-logs the whole URL, a webhook's secret. So the sending here is
smtplib's and httpx's, bounded by the deadline.

TRACEGEN_QUESTION_ASSIGNED_USERS (comma-separated user ids, each optionally `id:display name`) limits who
may answer (HITL's `assigned_users`); unset, anyone who may act on the DAG's runs may answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import quote

from airflow.sdk.bases.notifier import BaseNotifier

from tracegen.audit.cap_question import CapQuestion
from tracegen.audit.figures import AT_CAP, figure
from tracegen.common.http_connection import (
    HTTP_TYPES,
    ConnectionMisconfigured,
    connection_extra,
    connection_flag,
    connection_port,
    http_url,
)
from tracegen.common.locations import shown_location
from tracegen.common.tls import client_tls
from tracegen.run.api_answer import ASSIGNED_USERS_ENV

NOTIFY_ENV = "TRACEGEN_QUESTION_NOTIFY"
DEADLINE_ENV = "TRACEGEN_QUESTION_NOTIFY_DEADLINE_S"
log = logging.getLogger(__name__)

EMAIL_TYPES = ("smtp", "email")
WEBHOOK_TYPES = HTTP_TYPES
# Long enough for a slow relay, short enough that a dead one does not keep the question waiting to be posed
# (the notifiers run before the task parks in AWAITING_INPUT): the bound on one connect or one read.
SEND_TIMEOUT_S = 15.0
# The bound on a whole notification, however its server paces its bytes.
DEFAULT_DEADLINE_S = 30.0
ALLOW_CLEARTEXT_LOGIN = "allow_login_without_tls"


# A notification connection that cannot be used (the name callers and tests know it by).
ChannelMisconfigured = ConnectionMisconfigured


class ChannelFailed(RuntimeError):
    """The channel's server was reached and refused the notification."""


class DeadlinePassed(TimeoutError):
    """The notification did not finish within its total deadline; it was given up."""


def notify_deadline_s() -> float:
    """TRACEGEN_QUESTION_NOTIFY_DEADLINE_S, or the default when unset; a value that is not a positive number
    is the default too (and said so), since a notification must never keep the question from being posed."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        log.warning("%s=%r is not a positive number of seconds; using %g", DEADLINE_ENV, raw, DEFAULT_DEADLINE_S)
        return DEFAULT_DEADLINE_S
    return value


def question_notifiers() -> list[QuestionNotifier]:
    """One notifier per connection id in TRACEGEN_QUESTION_NOTIFY; none when it is unset or empty. The
    connections themselves are read when the question is posed (a worker's view, current then)."""
    ids = [part.strip() for part in os.environ.get(NOTIFY_ENV, "").split(",")]
    return [QuestionNotifier(conn_id) for conn_id in dict.fromkeys(i for i in ids if i)]


def assigned_users() -> list[dict[str, str]] | None:
    """HITL's `assigned_users` from TRACEGEN_QUESTION_ASSIGNED_USERS: `alice,bob` or `7:Alice Smith`. The id
    is what Airflow checks (the auth manager's user id: the username for the simple auth manager, the
    numeric id for FAB); the name is what the UI shows. None (anyone may answer) when unset or empty."""
    users = []
    for entry in os.environ.get(ASSIGNED_USERS_ENV, "").split(","):
        user_id, _, name = (part.strip() for part in entry.partition(":"))
        if user_id:
            users.append({"id": user_id, "name": name or user_id})
    return users or None


# ---- the message --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuestionMessage:
    """What every channel says: the subject, the gate's verdict line, the recommended cap and the links."""

    subject: str
    run_id: str
    dag_id: str
    task_id: str
    verdict_line: str
    recommended_line: str
    recommended_cap: int | None
    current_cap: int
    question_url: str
    report_link: str
    timeout_minutes: float

    @property
    def text(self) -> str:
        return "\n".join([
            self.subject, "",
            self.verdict_line,
            self.recommended_line, "",
            f"Answer the question: {self.question_url}",
            f"Report: {self.report_link}", "",
            f"Unanswered within {_duration(self.timeout_minutes)}, the run stops.",
        ])

    def webhook_body(self) -> dict[str, Any]:
        # `text` at the top level is what Slack and Teams incoming webhooks display; ours go under one key
        # so they cannot collide with a receiver's own top-level fields (Slack's `channel`, `username`).
        return {"text": self.text, "tracegen": {"event": "question_waiting", **asdict(self)}}


def _duration(minutes: float) -> str:
    return f"{minutes:g} minutes" if minutes < 120 else f"{minutes / 60:g} hours"


def message_for(context: Any) -> QuestionMessage:
    """The message for the question `context["task"]` (a CapReviewOperator) has just posed."""
    task, ti = context["task"], context["ti"]
    question = CapQuestion.from_json(task.question)
    return QuestionMessage(
        subject=task.subject, run_id=ti.run_id, dag_id=ti.dag_id, task_id=ti.task_id,
        verdict_line=verdict_line(question.verdict), recommended_line=recommended_line(question),
        recommended_cap=question.recommended_cap, current_cap=question.current_cap,
        question_url=question_url(ti.dag_id, ti.run_id, ti.task_id, ti.map_index),
        # The review page when the deployment serves one; else where the report is stored, as text.
        report_link=shown_location(question.report_url or question.report_uri),
        timeout_minutes=question.timeout_minutes,
    )


def verdict_line(verdict: dict[str, Any]) -> str:
    """'truncated at the cap: 44 of 120 (36.7%). <the gate's reason>': the figure as every page names it."""
    parts = []
    if isinstance(verdict.get("truncated"), int) and isinstance(verdict.get("total"), int):
        parts.append(f"{AT_CAP}: {figure(verdict['truncated'], verdict['total'])}.")
    if verdict.get("reason"):
        parts.append(str(verdict["reason"]))
    return " ".join(parts) or f"The gate's verdict: {verdict.get('verdict') or 'unknown'}."


def recommended_line(question: CapQuestion) -> str:
    rec = question.recommended_cap
    if rec is None:
        return "Recommended cap: none (no cap in the table is predicted to meet the threshold; see the report)."
    if rec > question.max_cap:
        return (f"Recommended cap: max_tokens={rec:,}, beyond what the servers can serve (at most "
                f"{question.max_cap:,}), so it is not among the options.")
    return f"Recommended cap: max_tokens={rec:,} (from max_tokens={question.current_cap:,})."


def question_url(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The Airflow UI's Required Actions page of the task instance (the UI route
    `dags/:dagId/runs/:runId/tasks/:taskId[/mapped/:mapIndex]/required_actions`), absolute when
    `[api] base_url` is set. Unlike the HITL operator's own `generate_link_to_ui`, it keeps base_url's path,
    so a UI served under a prefix is linked right."""
    from airflow.providers.common.compat.sdk import conf

    base = (conf.get("api", "base_url", fallback=None) or "").rstrip("/")
    path = f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id, safe='')}"
    if map_index is not None and map_index >= 0:
        path += f"/mapped/{map_index}"
    return f"{base}{path}/required_actions"


# ---- the channels -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmailChannel:
    """An e-mail through an SMTP server: STARTTLS or implicit TLS when the connection asks for it, a login
    when it has one."""

    host: str
    port: int
    sender: str
    recipients: tuple[str, ...]
    login: str | None
    password: str | None = field(repr=False)
    starttls: bool
    ssl: bool

    @classmethod
    def from_connection(cls, conn: Any) -> EmailChannel:
        extra = connection_extra(conn)
        if not conn.host:
            raise ChannelMisconfigured("no host (the SMTP server's name or address)")
        sender = extra.get("from")
        if not isinstance(sender, str) or "@" not in sender:
            raise ChannelMisconfigured(f"extra 'from' must be the sender's address, got {sender!r}")
        to = extra.get("to")
        recipients = [a.strip() for a in to.split(",")] if isinstance(to, str) else to
        if (not isinstance(recipients, list) or not recipients
                or not all(isinstance(a, str) and "@" in a for a in recipients)):
            raise ChannelMisconfigured(f"extra 'to' must be a list of addresses, got {to!r}")
        starttls, ssl = connection_flag(extra, "starttls"), connection_flag(extra, "ssl")
        if starttls and ssl:
            raise ChannelMisconfigured("extra 'starttls' and 'ssl' are both true: choose one")
        if conn.login and not (starttls or ssl) and not connection_flag(extra, ALLOW_CLEARTEXT_LOGIN):
            raise ChannelMisconfigured(
                f"a login without TLS would send the password in the clear: set extra 'starttls' or 'ssl' to "
                f"true, or '{ALLOW_CLEARTEXT_LOGIN}' to true where the server is trusted (the same host)")
        return cls(host=conn.host, port=connection_port(conn, 465 if ssl else 587 if starttls else 25), sender=sender,
                   recipients=tuple(recipients), login=conn.login or None, password=conn.password or None,
                   starttls=starttls, ssl=ssl)

    @property
    def where(self) -> str:
        return f"SMTP {shown_location(self.host, with_path=False)}:{self.port}"

    def send(self, message: QuestionMessage, deadline_s: float) -> None:
        import smtplib
        from email.message import EmailMessage

        mail = EmailMessage()
        mail["Subject"] = f"tracegen question: {message.subject}"
        mail["From"] = self.sender
        mail["To"] = ", ".join(self.recipients)
        mail.set_content(message.text)
        smtp_class = smtplib.SMTP_SSL if self.ssl else smtplib.SMTP
        # The per-read timeout never races the deadline: below SEND_TIMEOUT_S the deadline alone gives up.
        smtp = smtp_class(timeout=SEND_TIMEOUT_S)  # not connected yet: the timer can reach it
        passed = threading.Event()

        def give_up() -> None:
            # smtplib has no total timeout; shutting the socket down wakes the read it is blocked in.
            passed.set()
            sock = getattr(smtp, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(deadline_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            smtp.connect(self.host, self.port)
            if self.starttls:
                smtp.starttls()
            if self.login:
                smtp.login(self.login, self.password or "")
            smtp.send_message(mail)
            smtp.quit()
        except (OSError, smtplib.SMTPException):
            if passed.is_set():
                raise DeadlinePassed(_deadline_text(deadline_s)) from None
            raise
        finally:
            timer.cancel()
            smtp.close()


@dataclass(frozen=True)
class WebhookChannel:
    """A JSON POST to an incoming webhook (Slack, Teams, or anything that reads JSON)."""

    url: str = field(repr=False)  # its path is the webhook's secret
    headers: dict[str, str] = field(repr=False)  # may carry a token

    @classmethod
    def from_connection(cls, conn: Any) -> WebhookChannel:
        extra = connection_extra(conn)
        url = http_url(conn)
        headers = extra.get("headers", {})
        if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in headers.items()):
            raise ChannelMisconfigured("extra 'headers' must be an object of header names to string values")
        return cls(url=url, headers=headers)

    @property
    def where(self) -> str:
        # Never the whole URL: an incoming webhook's path is its secret (Slack's, Teams').
        return f"webhook {shown_location(self.url, with_path=False)}"

    def send(self, message: QuestionMessage, deadline_s: float) -> None:
        # httpx's timeouts bound each read, not the request: cancelling the request at the deadline does.
        response = _run(self._post(message, deadline_s))
        if response.status_code >= 300:
            raise ChannelFailed(f"answered HTTP {response.status_code}: {response.text[:200]!r}")

    async def _post(self, message: QuestionMessage, deadline_s: float) -> Any:
        import httpx

        async with httpx.AsyncClient(timeout=SEND_TIMEOUT_S, follow_redirects=False, verify=client_tls()) as client:
            try:
                return await asyncio.wait_for(
                    client.post(self.url, content=json.dumps(message.webhook_body()),
                                headers={"Content-Type": "application/json", **self.headers}), deadline_s)
            except TimeoutError:
                raise DeadlinePassed(_deadline_text(deadline_s)) from None


def _deadline_text(deadline_s: float) -> str:
    return f"not done within the notification's deadline of {deadline_s:g} s ({DEADLINE_ENV}); given up"


def _run(coroutine: Any) -> Any:
    """`coroutine`'s result, from synchronous code whether or not this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def channel_for(conn: Any) -> EmailChannel | WebhookChannel:
    kind = (conn.conn_type or "").strip().lower()
    if kind in EMAIL_TYPES:
        return EmailChannel.from_connection(conn)
    if kind in WEBHOOK_TYPES:
        return WebhookChannel.from_connection(conn)
    raise ChannelMisconfigured(f"conn_type {kind or 'none'!r} is not a notification channel: "
                               f"{' or '.join(EMAIL_TYPES)} for e-mail, {' or '.join(WEBHOOK_TYPES)} for a webhook")


# ---- the notifier -------------------------------------------------------------------------------------


class QuestionNotifier(BaseNotifier):
    """Tells the channel of one Airflow connection that the question waits. Never raises: whatever goes
    wrong is a warning in the task log, and the question is asked."""

    def __init__(self, conn_id: str) -> None:
        super().__init__()
        self.conn_id = conn_id

    def notify(self, context: Any) -> None:
        label = f"question notification via connection {self.conn_id!r}"
        try:
            message = message_for(context)
        except Exception as exc:  # noqa: BLE001 - a notification must never fail the review task
            log.warning("%s not sent: the question could not be read (%s: %s)", label,
                             type(exc).__name__, exc)
            return
        try:
            conn = _connection(self.conn_id)
        except Exception as exc:  # noqa: BLE001 - the SDK raises its own not-found types
            log.warning("%s not sent: the connection could not be read (%s: %s); define it as "
                             "AIRFLOW_CONN_%s or under Admin → Connections", label, type(exc).__name__, exc,
                             self.conn_id.upper())
            return
        try:
            channel = channel_for(conn)
        except ChannelMisconfigured as exc:
            log.warning("%s not sent: the connection is malformed: %s", label, exc)
            return
        try:
            channel.send(message, notify_deadline_s())
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, timed out: the question still waits
            log.warning("%s not sent: %s failed (%s: %s)", label, channel.where, type(exc).__name__,
                        _without_secrets(str(exc), channel))
            return
        log.info("%s sent through %s", label, channel.where)


def _without_secrets(text: str, channel: EmailChannel | WebhookChannel) -> str:
    """An error's text as the log may show it: an error that quotes the channel's URL (httpx's do) shows
    it as `where` does, and its password or header values not at all."""
    if isinstance(channel, WebhookChannel):
        text = text.replace(channel.url, shown_location(channel.url, with_path=False))
        secrets = list(channel.headers.values())
    else:
        text = text.replace(channel.host, shown_location(channel.host, with_path=False))
        secrets = [channel.password or ""]
    for secret in secrets:
        if len(secret) >= 4:  # a shorter one would blank ordinary words
            text = text.replace(secret, "***")
    return text


def _connection(conn_id: str) -> Any:
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)
