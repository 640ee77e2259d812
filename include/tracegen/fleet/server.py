"""The life of one SGLang server per GPU: find it, reuse or (re)launch it, wait for health, stop it.

`FleetConnection` holds one transport per host (and the SSH tunnels to loopback-bound servers)
for the life of a task, and answers which URLs the HTTP client should use. The functions in
`tracegen.fleet` (`provision`, `status`, `teardown`) are built on the per-server steps here.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from tracegen.common.tls import tls_for
from tracegen.fleet import command
from tracegen.fleet.spec import SECRET_CONNECTION_TYPES, FleetSpec, HostSpec, SecretRef
from tracegen.fleet.transport import FleetError, Transport, open_transport

T = TypeVar("T")
R = TypeVar("R")

LOG_TAIL_LINES = 40
PROBE_TIMEOUT_S = 10.0  # /health runs a 1-token generation; a busy server answers slowly
POLL_INTERVAL_S = 0.5


def resolve_secret(name: str, ref: SecretRef) -> str:
    """The value of one env secret reference, read from Airflow on this worker (never logged: the value is
    registered with Airflow's log masker so a stray log line shows *** instead)."""
    from airflow.sdk import BaseHook, Variable

    where = f"fleet env[{name}]: {ref.describe()}"
    try:
        if ref.variable is not None:
            value = Variable.get(ref.variable)
        else:
            conn = BaseHook.get_connection(ref.connection)
            # Only a connection meant to hold a bare credential (spec.SECRET_CONNECTION_TYPES says why).
            kind = (conn.conn_type or "").strip().lower()
            if kind not in SECRET_CONNECTION_TYPES:
                raise _Refused(
                    f"{where} is of type {kind or 'none'!r}: a secret for the servers is read only from a "
                    f"connection of type {' or '.join(sorted(SECRET_CONNECTION_TYPES))} (Generic), never from one "
                    "a hook of this deployment uses; store the secret in a Generic connection or a Variable"
                )
            if ref.field.startswith("extra."):
                value = (conn.extra_dejson or {}).get(ref.field[len("extra."):])
            else:
                value = getattr(conn, ref.field)
    except _Refused as exc:
        raise FleetError(str(exc)) from None
    except Exception as exc:  # the SDK raises its own not-found types; say which reference failed
        raise FleetError(f"{where} could not be read ({type(exc).__name__}: {exc})") from None
    if value is None or value == "":
        raise FleetError(f"{where} is empty or not set")
    value = str(value)
    for form in secret_forms(value):
        _mask(form, name)
    return value


class _Refused(Exception):
    """A reference resolved to something the fleet must not send (its message says what)."""


def _mask(value: str, name: str) -> None:
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # outside an Airflow task environment there is no masker to tell
        return
    try:
        mask_secret(value, name)
    except Exception:  # masking is a safety net; a masker not set up must not stop the launch
        pass


def secret_forms(value: str) -> list[str]:
    """The spellings of `value` a log can hold, longest first: as it is; inside a Python repr (SGLang logs
    `server_args=ServerArgs(..., api_key='...')`, so `a\\b` appears as `a\\\\b`), with either quote and as
    ascii() writes it; inside a JSON string (ensure_ascii on and off); and shell-quoted (shlex.quote, as a
    command line echoed by a launcher shows it). Each form is what appears between the delimiters, so a
    form also matches inside a larger repr or JSON document."""
    forms = {value}
    for text in (repr(value), ascii(value), json.dumps(value), json.dumps(value, ensure_ascii=False)):
        forms.add(text[1:-1])  # the quotes are the surrounding document's, not the secret's
    forms.add(value.replace("\\", "\\\\").replace("'", "\\'"))  # repr's escaping under the other quote
    forms.add(value.replace("\\", "\\\\").replace('"', '\\"'))
    quoted = shlex.quote(value)
    forms.add(quoted)
    forms.add(quoted.replace("'\"'\"'", "'\\''"))  # the other common spelling of a quote in single quotes
    return sorted((f for f in forms if f), key=len, reverse=True)


def redact(text: str, secrets: dict[str, str]) -> str:
    """`text` with every form of every secret value (`secret_forms`) replaced by `<label>`, in one pass that
    tries the longest form first: no form is left half-replaced by a shorter one, and no label is taken for a
    secret and replaced again."""
    labels: dict[str, str] = {}
    for label, value in secrets.items():
        for form in secret_forms(value) if value else ():
            labels.setdefault(form, label)
    if not labels:
        return text
    pattern = re.compile("|".join(re.escape(form) for form in sorted(labels, key=len, reverse=True)))
    return pattern.sub(lambda m: f"<{labels[m.group()]}>", text)


def resolve_api_key(conn_id: str) -> str:
    """The API key stored as the password of an Airflow connection."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # the SDK raises its own not-found type; the message is what matters
        raise FleetError(f"api key connection {conn_id!r} not found: {exc}") from None
    if not conn.password:
        raise FleetError(f"api key connection {conn_id!r} has no password (the API key goes there)")
    for form in secret_forms(conn.password):  # SGLang logs it in its server args, as a repr
        _mask(form, "api_key")
    return conn.password


@dataclass(frozen=True)
class PidState:
    """What a host's pid file says about one server slot."""

    state: str  # absent | corrupt | stale | running | orphaned | launched
    pid: int | None
    pgid: int | None
    config: str
    age_s: int | None  # seconds since launch, by the host's clock
    listening: str = "none"  # who listens on the port: own (our group) | other | none (inspect only)

    @classmethod
    def parse(cls, values: dict[str, str]) -> PidState:
        def num(key: str) -> int | None:
            raw = values.get(key, "")
            return int(raw) if raw.lstrip("-").isdigit() else None

        return cls(
            values.get("state", "unknown"),
            num("pid"),
            num("pgid"),
            values.get("config", ""),
            num("age"),
            values.get("listening", "none"),
        )

    @property
    def alive(self) -> bool:
        return self.state in ("running", "orphaned", "launched")


@dataclass(frozen=True)
class ServerHandle:
    """A healthy server of the fleet. `url` is valid while the FleetConnection that made it is open."""

    host: str
    gpu: int
    port: int
    url: str
    pid: int
    pgid: int
    config: str
    reused: bool
    model: str

    @property
    def label(self) -> str:
        return f"{self.host}:gpu{self.gpu}"


@dataclass(frozen=True)
class ServerStatus:
    """One GPU slot as `status()` sees it."""

    host: str
    gpu: int
    port: int
    state: str  # pid-file state: absent | stale | corrupt | running | orphaned
    pid: int | None
    config_matches: bool  # launched with the flags the spec asks for now
    healthy: bool  # /health 200 and /model_info names the spec's model
    detail: str
    url: str | None


@dataclass(frozen=True)
class StopResult:
    host: str
    gpu: int
    result: str  # absent | stale | stopped | killed
    pid: int | None


@dataclass(frozen=True)
class Probe:
    healthy: bool
    model_ok: bool | None  # None when /model_info was not reached
    detail: str


class FleetConnection:
    """Open transports (and tunnels) to every host of a fleet; close it to drop them.

    Use as a context manager for the life of a task::

        with FleetConnection(spec) as fleet:
            urls = fleet.urls()          # what the HTTP client should call
            headers = fleet.headers()    # Authorization when the fleet uses an API key
    """

    def __init__(self, spec: FleetSpec, api_key: str | None = None,
                 secrets: dict[str, str] | None = None) -> None:
        self.spec = spec
        self._api_key = api_key
        self._secrets = secrets
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> FleetConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def api_key(self) -> str | None:
        if self._api_key is None and self.spec.api_key_conn_id:
            self._api_key = resolve_api_key(self.spec.api_key_conn_id)
        return self._api_key

    @property
    def secrets(self) -> dict[str, str]:
        """The values of the env secrets the spec references, resolved once per connection, on this worker."""
        if self._secrets is None:
            self._secrets = {name: resolve_secret(name, ref) for name, ref in self.spec.secret_refs().items()}
        return self._secrets

    def redact(self, text: str) -> str:
        """`text` with the API key and the env secrets already resolved masked in every form a log writes them
        (`redact`). SGLang logs its resolved server args (api_key included) at start as a repr, and log tails
        end up in task logs. Only values already resolved: resolving here could fail and hide the real error."""
        secrets = {"api key": self._api_key} if self._api_key else {}
        secrets.update(self._secrets or {})
        return redact(text, secrets) if secrets else text

    def headers(self) -> dict[str, str]:
        key = self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def transport(self, host: HostSpec) -> Transport:
        # One lock: the first SSH connect and each tunnel must not race between worker threads.
        with self._lock:
            if host.conn_id not in self._transports:
                self._transports[host.conn_id] = open_transport(host.conn_id, self.spec.ssh_cmd_timeout_s)
            return self._transports[host.conn_id]

    def url(self, host: HostSpec, gpu: int) -> str:
        transport = self.transport(host)
        with self._lock:
            return transport.url(self.spec.bind_host, host.port(gpu))

    def urls(self) -> list[str]:
        """Client URLs of every server in the spec, in `spec.servers()` order."""
        return [self.url(host, gpu) for host, gpu in self.spec.servers()]

    def run(
        self, host: HostSpec, gpu: int, script: str, what: str, timeout: float | None = None
    ) -> dict[str, str]:
        result = self.transport(host).run(script, timeout or self.spec.ssh_cmd_timeout_s)
        values = command.parse_kv(result.stdout)
        if result.exit_status != 0:
            reason = self.redact(
                values.get("error") or result.stderr.strip()[-500:] or f"exit status {result.exit_status}"
            )
            raise FleetError(f"{host.conn_id}:gpu{gpu}: {what} failed: {reason}")
        return values

    def close(self) -> None:
        with self._lock:
            for transport in self._transports.values():
                transport.close()
            self._transports.clear()


# --- per-server steps ---------------------------------------------------------------------------


def expected_config(fleet: FleetConnection, host: HostSpec, gpu: int) -> str:
    key = fleet.api_key
    argv = command.launch_argv(fleet.spec, host, gpu, key)
    return command.config_hash(argv, command.hashed_env(fleet.spec, gpu, fleet.secrets), key)


def inspect(fleet: FleetConnection, host: HostSpec, gpu: int) -> PidState:
    return PidState.parse(fleet.run(host, gpu, command.inspect_script(fleet.spec, host, gpu), "inspect"))


def launch(fleet: FleetConnection, host: HostSpec, gpu: int) -> PidState:
    script = command.launch_script(fleet.spec, host, gpu, fleet.api_key, fleet.secrets)
    try:
        return PidState.parse(fleet.run(host, gpu, script, "launch"))
    except FleetError as exc:
        raise FleetError(f"{exc}\n--- log tail ---\n{log_tail(fleet, host, gpu)}") from None


def stop(fleet: FleetConnection, host: HostSpec, gpu: int, keep_config: str | None = None) -> StopResult:
    script = command.stop_script(fleet.spec, host, gpu, keep_config)
    # The remote side waits out the grace period and the SIGKILL check itself.
    values = fleet.run(
        host, gpu, script, "stop", timeout=fleet.spec.stop_timeout_s + fleet.spec.ssh_cmd_timeout_s
    )
    return StopResult(host.conn_id, gpu, values.get("result", "unknown"), PidState.parse(values).pid)


def log_tail(fleet: FleetConnection, host: HostSpec, gpu: int, lines: int = LOG_TAIL_LINES) -> str:
    try:
        result = fleet.transport(host).run(
            command.log_tail_script(fleet.spec, host, gpu, lines), fleet.spec.ssh_cmd_timeout_s
        )
    except FleetError as exc:
        return f"(log unavailable: {exc})"
    text = result.stdout.rstrip() or "(log is empty)"
    return fleet.redact(text)


def model_matches(spec: FleetSpec, info: dict[str, Any]) -> bool:
    """`/model_info` names the configured model (path and, when reported, the served name)."""
    path, served = info.get("model_path"), info.get("served_model_name")
    if path is None and served is None:
        return False
    return (path is None or path == spec.model_path) and (served is None or served == spec.model_name)


def probe(url: str, spec: FleetSpec, headers: dict[str, str], timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """Healthy = `/health` answers 200 and `/model_info` names the configured model."""
    try:
        with httpx.Client(base_url=url, timeout=timeout, headers=headers, trust_env=False,
                          verify=tls_for(url)) as client:
            health = client.get("/health")
            if health.status_code != 200:
                return Probe(False, None, f"/health answered {health.status_code}")
            info = client.get("/model_info")
            if info.status_code != 200:
                return Probe(False, None, f"/model_info answered {info.status_code}")
            body = info.json()
    except (httpx.HTTPError, ValueError) as exc:
        return Probe(False, None, f"{type(exc).__name__}: {exc}")
    if not isinstance(body, dict) or not model_matches(spec, body):
        shown = (
            {k: body.get(k) for k in ("model_path", "served_model_name")} if isinstance(body, dict) else body
        )
        return Probe(False, False, f"/model_info names {shown}, expected {spec.model_name!r}")
    return Probe(True, True, "healthy")


def served_context_length(url: str, headers: dict[str, str], model: str, timeout: float = 30.0) -> int:
    """The context length a healthy server enforces (prompt + completion), as SGLang reports it.

    `/server_info` says `context_length` only when --context-length was passed (SGLang reports the flag,
    null without it); the limit the server resolved from the model's config is `max_model_len` of the
    model's entry in `/v1/models`.
    """
    where = f"{url}: context length"
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout, trust_env=False,
                          verify=tls_for(url)) as client:
            info = client.get("/server_info")
            info.raise_for_status()
            value = info.json().get("context_length")
            if value is None:
                listing = client.get("/v1/models")
                listing.raise_for_status()
                cards = [c for c in listing.json().get("data") or [] if isinstance(c, dict)]
                # The served model first; adapters listed beside it report no limit of their own.
                cards.sort(key=lambda card: card.get("id") != model)
                value = next((c["max_model_len"] for c in cards if c.get("max_model_len") is not None), None)
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise FleetError(f"{where}: {type(exc).__name__}: {exc}") from None
    if type(value) is not int or value < 1:
        raise FleetError(
            f"{where}: neither /server_info context_length nor /v1/models max_model_len gives it (got {value!r})"
        )
    return value


def served_context_lengths(handles: Iterable[ServerHandle], headers: dict[str, str]) -> dict[str, int]:
    """Each server's context length (`served_context_length`), asked of all servers at once."""
    handles = list(handles)
    lengths = parallel(lambda h: served_context_length(h.url, headers, h.model), handles)
    return {h.label: n for h, n in zip(handles, lengths, strict=True)}


def parallel(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """fn over items concurrently (one thread per server; remote steps mostly wait), in order."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(fn, items))


@dataclass
class _Pending:
    host: HostSpec
    gpu: int
    url: str
    state: PidState
    reused: bool
    deadline: float
    last: str = "not probed yet"


def wait_healthy(fleet: FleetConnection, pending: list[_Pending]) -> list[ServerHandle]:
    """Poll every pending server until healthy; fail fast when a server dies or serves another model."""
    done: dict[int, ServerHandle] = {}
    headers = fleet.headers()
    while len(done) < len(pending):
        for i, item in enumerate(pending):
            if i in done:
                continue
            # A round trip to the host first: it tells "still loading" from "died", and probing
            # a port nobody listens on through an SSH tunnel only produces tracebacks.
            now = inspect(fleet, item.host, item.gpu)
            if not now.alive or now.pid != item.state.pid:
                raise FleetError(
                    f"{item.host.conn_id}:gpu{item.gpu}: server process {item.state.pid} exited before "
                    f"becoming healthy ({now.state}); last probe: {item.last}\n--- log tail ---\n"
                    f"{log_tail(fleet, item.host, item.gpu)}"
                )
            if now.listening == "other":
                raise FleetError(
                    f"{item.host.conn_id}:gpu{item.gpu}: port {item.host.port(item.gpu)} is held by a process "
                    f"outside server {item.state.pid}'s group (a server launched by hand?); stop it or "
                    f"change base_port\n--- log tail ---\n{log_tail(fleet, item.host, item.gpu)}"
                )
            if now.listening == "own":
                result = probe(item.url, fleet.spec, headers, timeout=5.0)
                item.last = result.detail
                if result.model_ok is False:
                    raise FleetError(f"{item.host.conn_id}:gpu{item.gpu} at {item.url}: {result.detail}")
                if result.healthy:
                    done[i] = ServerHandle(
                        host=item.host.conn_id,
                        gpu=item.gpu,
                        port=item.host.port(item.gpu),
                        url=item.url,
                        pid=item.state.pid or 0,
                        pgid=item.state.pgid or 0,
                        config=item.state.config,
                        reused=item.reused,
                        model=fleet.spec.model_name,
                    )
                    continue
            else:
                item.last = f"nothing listens on port {item.host.port(item.gpu)} yet"
            if time.monotonic() > item.deadline:
                raise FleetError(
                    f"{item.host.conn_id}:gpu{item.gpu}: not healthy after {fleet.spec.health_timeout_s:.0f} s "
                    f"(last probe of {item.url}: {item.last})\n--- log tail ---\n"
                    f"{log_tail(fleet, item.host, item.gpu)}"
                )
        if len(done) < len(pending):
            time.sleep(POLL_INTERVAL_S)
    return [done[i] for i in range(len(pending))]


def prepare(fleet: FleetConnection, host: HostSpec, gpu: int) -> _Pending:
    """Decide reuse / wait / restart / launch for one slot, and act on it (no health wait)."""
    spec = fleet.spec
    wanted = expected_config(fleet, host, gpu)
    state = inspect(fleet, host, gpu)
    now = time.monotonic()
    if state.state == "running" and state.config == wanted:
        age = state.age_s if state.age_s is not None else 0
        remaining = spec.health_timeout_s - age
        if remaining > 0:
            # Same model and flags: reuse it. If it is still warming up, wait out what is left of
            # its own health timeout rather than throwing away minutes of weight loading.
            return _Pending(host, gpu, fleet.url(host, gpu), state, True, now + remaining)
        if probe(fleet.url(host, gpu), spec, fleet.headers()).healthy:
            return _Pending(host, gpu, fleet.url(host, gpu), state, True, now)
        # Older than its health timeout and still not healthy: wedged. Restart it below.
    if state.alive:
        stop(fleet, host, gpu, keep_config=wanted)
    launched = launch(fleet, host, gpu)
    return _Pending(host, gpu, fleet.url(host, gpu), launched, False, now + spec.health_timeout_s)
