"""The fleet description: which hosts, which GPUs, which model, which SGLang flags.

`FleetSpec` is validated on construction so that every value that later reaches a remote
shell has already passed a strict pattern (names, paths) or is a plain value that the
command builder quotes. Build it from a dict or JSON with `FleetSpec.from_dict` /
`FleetSpec.from_json`; errors name the offending field, and quote the value (escaped, bounded: `shown`)
only where it cannot be a credential: an env value, a secret reference's name, field or keys are never
quoted, since a secret pasted in the wrong place would otherwise be printed by `fleet validate`.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from typing import Any

LOCAL = "local"  # host id meaning "this machine, no SSH"

# Flags the fleet sets itself from dedicated fields; accepting them in `sglang_flags` too would
# make two sources of truth for the port, the bind address or the model. `--config` is how the fleet
# hands over the API key, and a config file of the operator's choosing could set any of the others.
MANAGED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--base-gpu-id",
        "--config",
    }
)

# The one SGLang flag tracegen reads as well as passes on: the batch per server sizes the chunks.
BATCH_FLAG = "--max-running-requests"
# The stand-in's module: it takes SGLang's flags plus its own --sim-* knobs.
SIMULATOR_MODULE = "tracegen.simulator"
STAND_IN_KNOB = "--sim-"

_FLAG_NAME = re.compile(r"--[a-z0-9][a-z0-9-]*")
# Paths and Hugging Face repo ids: no spaces, no shell metacharacters, no `..` components.
_PATH_SEGMENT = r"[A-Za-z0-9_.+=@-]+"
_MODEL_PATH = re.compile(rf"/?{_PATH_SEGMENT}(/{_PATH_SEGMENT})*/?")
_SERVED_NAME = re.compile(r"[A-Za-z0-9_.+=@/-]+")  # SGLang forbids ':' in served model names
_EXECUTABLE = re.compile(rf"/?{_PATH_SEGMENT}(/{_PATH_SEGMENT})*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_CONN_ID = re.compile(r"[A-Za-z0-9_.-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")
# C0, DEL and C1 controls (U+0080..U+009F: a terminal reads U+009B as CSI, like ESC [), and the Unicode line and
# paragraph separators: never legitimate in a name, a flag or an env value.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What argparse (SGLang's parser) reads as a negative number rather than as an option.
_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")

FlagValue = str | int | float | bool | None | list[str | int | float]

# An `env` value held in Airflow instead of the fleet file, resolved on the worker when a server is launched:
#   {"from_variable": "hf_token"}                         the Variable's value
#   {"from_connection": "hf", "field": "password"}        a field of a connection (password by default;
#                                                          login, host, schema, or extra.<key>)
# The fleet file (and so its digest, the run records and XCom) holds the reference only.
FROM_VARIABLE = "from_variable"
FROM_CONNECTION = "from_connection"
CONNECTION_FIELDS = ("password", "login", "host", "schema")
SECRET_REFERENCE_HELP = (
    '{"from_variable": "<Airflow Variable key>"} or {"from_connection": "<Airflow connection id>", '
    '"field": "password"}'
)
# Names whose value is a credential: a whole `_`-separated word of the name (HF_TOKEN, OPENAI_API_KEY,
# AWS_SECRET_ACCESS_KEY), so TOKENIZERS_PARALLELISM or KEY_CACHE_DTYPE-like words inside others do not count.
_SECRET_WORDS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS",
                           "APIKEY", "PAT", "AUTH"})
# Values that are credentials whatever their name: Hugging Face, OpenAI-style and AWS access key ids.
_SECRET_VALUE = re.compile(r"hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|(AKIA|ASIA)[0-9A-Z]{16}|ghp_[A-Za-z0-9]{20,}")
# The name of an Airflow Variable or connection a secret is read from. Airflow itself takes up to 250 of
# [A-Za-z0-9_.-]; a reference is stricter: a letter first and at most REF_NAME_MAX characters (the ids operators
# type: `hf_token`, `wandb-prod`), so a credential pasted where its name goes is refused, not printed back.
REF_NAME_MAX = 64
_REF_NAME = re.compile(rf"[A-Za-z][A-Za-z0-9_.-]{{0,{REF_NAME_MAX - 1}}}")
# A run of 20+ letters and digits with no separator that mixes both: how generated tokens look, not names.
_TOKEN_RUN = re.compile(r"[A-Za-z0-9]{20,}")
_EXTRA_FIELD = re.compile(r"extra\.[A-Za-z][A-Za-z0-9_.-]{0,63}")

# Which connections a secret may be read from. A `from_connection` reference copies a field of the connection
# into the environment of a process on a GPU host: whoever runs code there (the model's own code, with
# trust_remote_code; a log line; a debugger) holds it. So:
# - Airflow's own connections are refused by name when the fleet is validated: `airflow*` (airflow_db is the
#   metadata database: every connection and Variable, in clear once the Fernet key leaks too) and `*_default`
#   (the ids Airflow creates and its hooks fall back on: aws_default, google_cloud_default, ssh_default, ...,
#   credentials the deployment uses for itself).
# - The fleet's own connections are refused too: a host's SSH connection (its key logs into every GPU host) and
#   the API key's connection (the fleet hands the key to SGLang through --config, readable by the server only).
# - On the worker, the connection read must be of a type in SECRET_CONNECTION_TYPES: Generic, Airflow's type
#   for "a bare credential". Any other type is a connection to some service (postgres, aws, ssh, http, ...) that
#   a hook of the deployment uses, and its fields are that service's credentials. The type is known only where
#   Airflow's connections are (the worker), so this half is checked when the secret is resolved; an operator
#   who stores a token for the servers creates a Generic connection for it (or uses a Variable).
SECRET_CONNECTION_TYPES = frozenset({"generic"})
_AIRFLOW_OWN_CONNECTION = re.compile(r"airflow.*|.*_default", re.IGNORECASE)

# How much of a refused value an error may quote (non-secret fields only; escaped, see `shown`).
_SHOWN_MAX = 120


# Switch values no credential takes: HF_HUB_DISABLE_IMPLICIT_TOKEN=1 names a token but holds none.
_SWITCH_VALUES = frozenset({"0", "1", "true", "false", "yes", "no", "on", "off"})


def looks_secret(name: str, value: str | None = None) -> bool:
    """An env entry whose name or value says it is a credential (and so must not be written inline)."""
    if value is not None and _SECRET_VALUE.search(value):
        return True
    if value is not None and value.strip().lower() in _SWITCH_VALUES:
        return False
    words = {w for w in name.upper().split("_") if w}
    return bool(words & _SECRET_WORDS) or any(w.endswith(("TOKEN", "PASSWORD", "SECRET", "APIKEY")) for w in words)


def shown(value: Any) -> str:
    """A value as an error may quote it: its repr (control and other non-printable characters escaped, so
    nothing reaches a terminal raw) cut to a bounded length."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", repr(value))  # a repr of our own types too
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


def _control_refusal(value: str) -> str:
    """Which control character `value` holds and where, without the value."""
    found = _CONTROL.search(value)
    where = f" (U+{ord(found.group()):04X} at position {found.start()})" if found else ""
    return f"contains a control character{where}"


def looks_like_token(text: str) -> bool:
    """Whether `text`, given as a name, looks like a credential instead: a known token shape (hf_, sk-, AKIA,
    ghp_) or a long run of mixed letters and digits."""
    if _SECRET_VALUE.search(text):
        return True
    return any(any(c.isdigit() for c in run) and any(c.isalpha() for c in run) for run in _TOKEN_RUN.findall(text))


def _check_ref_name(where: str, value: Any, what: str) -> None:
    """A reference name: an id, never echoed when refused (it may be the secret pasted in its place)."""
    if not isinstance(value, str):
        raise FleetSpecError(f"{where}: must be a string, {what}")
    if looks_like_token(value):
        raise FleetSpecError(
            f"{where}: looks like a credential, not the name of one (the value, {len(value)} characters, is not "
            f"shown). Keep the secret in Airflow and give {what} here"
        )
    if not _REF_NAME.fullmatch(value):
        raise FleetSpecError(
            f"{where}: is not {what}: a letter, then letters, digits, '_', '.' or '-', at most {REF_NAME_MAX} "
            f"characters (the value, {len(value)} characters, is not shown)"
        )


@dataclass(frozen=True)
class SecretRef:
    """Where an env value is held in Airflow: a Variable, or a field of a connection."""

    variable: str | None = None
    connection: str | None = None
    field: str = "password"

    def describe(self) -> str:
        if self.variable is not None:
            return f"Airflow Variable {self.variable!r}"
        return f"field {self.field!r} of Airflow connection {self.connection!r}"


def parse_secret_ref(name: str, value: Any) -> SecretRef:
    """The reference an `env` object names; errors say which entry and what is wrong, and never quote a name,
    a field or a key given in it (any of them may be a credential pasted in the wrong place)."""
    where = f"env[{name}]"
    keys = set(value)
    if keys == {FROM_VARIABLE}:
        key = value[FROM_VARIABLE]
        _check_ref_name(f"{where}.{FROM_VARIABLE}", key, "an Airflow Variable key")
        return SecretRef(variable=key)
    if FROM_CONNECTION in keys and keys <= {FROM_CONNECTION, "field"}:
        conn_id = value[FROM_CONNECTION]
        _check_ref_name(f"{where}.{FROM_CONNECTION}", conn_id, "an Airflow connection id")
        if _AIRFLOW_OWN_CONNECTION.fullmatch(conn_id):
            raise FleetSpecError(
                f"{where}.{FROM_CONNECTION}: {conn_id!r} is one of Airflow's own connections (airflow*, *_default), "
                "never sent to a GPU host; create a Generic connection holding only this secret, or use "
                f'{{"{FROM_VARIABLE}": ...}}'
            )
        field_name = value.get("field", "password")
        if field_name not in CONNECTION_FIELDS and not (
            isinstance(field_name, str) and _EXTRA_FIELD.fullmatch(field_name) and not looks_like_token(field_name)
        ):
            raise FleetSpecError(
                f"{where}.field: is not one of {list(CONNECTION_FIELDS)} or extra.<key> (the value is not shown)"
            )
        return SecretRef(connection=conn_id, field=field_name)
    known = sorted(keys & {FROM_VARIABLE, FROM_CONNECTION, "field"})
    others = len(keys) - len(known)
    given = f"keys {known}" + (f" and {others} other key(s), not shown" if others else "")
    raise FleetSpecError(f"{where}: not a secret reference ({given}); use {SECRET_REFERENCE_HELP}")


class FleetSpecError(ValueError):
    """A fleet description field is missing or invalid; the message names the field and value."""


def _check_pattern(name: str, value: Any, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise FleetSpecError(f"{name}: {shown(value)} is not {what}")
    if ".." in value.split("/"):
        raise FleetSpecError(f"{name}: {shown(value)} must not contain '..' path components")


def _check_plain_value(name: str, value: Any, *, secret: bool = False) -> None:
    # Quoting makes any printable value safe for the shell; control characters (newline, NUL, ESC, CSI)
    # are never legitimate in a flag or env value and would corrupt the pid/log protocol. An env value may be
    # a credential that does not look like one (`secret`): its refusals never quote it.
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        what = f"a {type(value).__name__}" if secret else shown(value)
        raise FleetSpecError(f"{name}: {what} must be a string or a number")
    if isinstance(value, str) and _CONTROL.search(value):
        quoted = "the value is not shown" if secret else f"value {shown(value)}"
        raise FleetSpecError(f"{name}: {_control_refusal(value)} ({quoted})")


def _check_flag_value(name: str, value: Any) -> None:
    _check_plain_value(name, value)
    # Each value is its own argv element, but argparse still reads one that starts with '-' as an
    # option: `[8, "--host=0.0.0.0"]` would rebind the server after the fleet's own --host.
    if isinstance(value, str) and value.startswith("-") and not _NEGATIVE_NUMBER.fullmatch(value):
        raise FleetSpecError(
            f"{name}: {shown(value)} looks like a flag; a value starting with '-' would reach SGLang as an "
            "option of its own (give every flag its own key in sglang_flags)"
        )


def check_sglang_flags(flags: Any) -> None:
    """Refuse flags that could override what the fleet manages, and values that would parse as flags.

    Run on construction and again by the launch argv builder, so a flags mapping changed after
    validation still cannot reach a server.
    """
    if not isinstance(flags, dict):
        raise FleetSpecError(f"sglang_flags: {shown(flags)} must be a mapping of flag to value")
    for flag, value in flags.items():
        if not isinstance(flag, str) or not _FLAG_NAME.fullmatch(flag):
            raise FleetSpecError(f"sglang_flags: flag name {shown(flag)} must look like --[a-z0-9-]+")
        if flag in MANAGED_FLAGS:
            raise FleetSpecError(
                f"sglang_flags: {flag} is set by the fleet itself (model_path, served_model_name, "
                "bind_host, base_port, api_key_conn_id); remove it from sglang_flags"
            )
        # argparse accepts any unique prefix of an option: `--hos 0.0.0.0` is `--host 0.0.0.0`.
        abbreviated = sorted(m for m in MANAGED_FLAGS if m.startswith(flag))
        if abbreviated:
            raise FleetSpecError(
                f"sglang_flags: {flag} abbreviates {abbreviated[0]}, which the fleet sets itself; "
                "remove it from sglang_flags"
            )
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, list | tuple):
            if not value:
                raise FleetSpecError(f"sglang_flags[{flag}]: empty list; use false/null to omit a flag")
            for item in value:
                _check_flag_value(f"sglang_flags[{flag}]", item)
        else:
            _check_flag_value(f"sglang_flags[{flag}]", value)


def flag_args(flags: dict[str, FlagValue]) -> list[str]:
    """The flags as argv, in name order: one fleet description gives one argv (and config hash) however it
    was stored; an XCom on PostgreSQL (JSONB) hands the flags back in another order than the fleet file's,
    and a changed hash would restart healthy servers (a model reload on a GPU)."""
    argv: list[str] = []
    for flag, value in sorted(flags.items()):
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def _positive_int(value: Any) -> int | None:
    """`value` as a count: an int, or its digits as a string (a command line's form), else None."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is int and value >= 1:
        return value
    return None


def is_loopback(bind_host: str) -> bool:
    """True when `bind_host` only accepts connections from the host itself."""
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostSpec:
    """One GPU host: how to reach it, which GPUs to use, and the port of GPU 0."""

    conn_id: str  # an Airflow SSH connection id, or "local" for this machine
    gpus: tuple[int, ...]
    base_port: int = 30000  # the server on GPU g listens on base_port + g

    def __post_init__(self) -> None:
        _check_pattern("hosts[].conn_id", self.conn_id, _CONN_ID, "an Airflow connection id or 'local'")
        if isinstance(self.gpus, list):
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if not isinstance(self.gpus, tuple) or not self.gpus:
            raise FleetSpecError(f"hosts[{self.conn_id}].gpus: {shown(self.gpus)} must be a non-empty list of ids")
        for gpu in self.gpus:
            if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < 1024:
                raise FleetSpecError(f"hosts[{self.conn_id}].gpus: {shown(gpu)} is not a GPU id (0..1023)")
        if len(set(self.gpus)) != len(self.gpus):
            raise FleetSpecError(f"hosts[{self.conn_id}].gpus: {list(self.gpus)} lists a GPU twice")
        if not isinstance(self.base_port, int) or isinstance(self.base_port, bool):
            raise FleetSpecError(f"hosts[{self.conn_id}].base_port: {shown(self.base_port)} must be an integer")
        if self.base_port < 1024 or self.base_port + max(self.gpus) > 65535:
            raise FleetSpecError(
                f"hosts[{self.conn_id}].base_port: {self.base_port} + GPU id must stay within 1024..65535"
            )

    @property
    def is_local(self) -> bool:
        return self.conn_id == LOCAL

    def port(self, gpu: int) -> int:
        return self.base_port + gpu


@dataclass(frozen=True)
class FleetSpec:
    """Everything needed to launch, find, check and stop one SGLang server per GPU."""

    hosts: tuple[HostSpec, ...]
    model_path: str
    served_model_name: str | None = None  # None: SGLang serves the model under its path
    python: str = "python3"  # the interpreter on the GPU host (a venv's python, usually)
    launch_module: str = "sglang.launch_server"  # `tracegen.simulator` in tests and the demo
    sglang_flags: dict[str, FlagValue] = field(default_factory=dict)
    bind_host: str = "127.0.0.1"
    api_key_conn_id: str | None = None  # Airflow connection whose password is the API key
    work_dir: str = ".tracegen/fleet"  # on each host; relative paths are under the login's $HOME
    # Extra environment for the server process: a plain string, or a reference to a secret held in Airflow
    # (SecretRef: resolved on the worker at launch, never written into the fleet file or anything derived).
    env: dict[str, str | dict[str, str]] = field(default_factory=dict)
    health_timeout_s: float = 900.0  # large models take minutes to load
    stop_timeout_s: float = 120.0  # SIGTERM drains in-flight requests before SIGKILL
    ssh_cmd_timeout_s: float = 120.0  # one remote command (launch, status, log tail)

    def __post_init__(self) -> None:
        hosts = self.hosts
        if isinstance(hosts, list):
            hosts = tuple(HostSpec(**h) if isinstance(h, dict) else h for h in hosts)
            object.__setattr__(self, "hosts", hosts)
        if not isinstance(hosts, tuple) or not hosts or not all(isinstance(h, HostSpec) for h in hosts):
            raise FleetSpecError(f"hosts: {shown(self.hosts)} must be a non-empty list of hosts")
        seen = [h.conn_id for h in hosts]
        if len(set(seen)) != len(seen):
            raise FleetSpecError(f"hosts: {seen} lists a host twice; put all its GPUs in one entry")

        _check_pattern("model_path", self.model_path, _MODEL_PATH, "a model path or Hugging Face repo id")
        if self.served_model_name is not None:
            _check_pattern(
                "served_model_name", self.served_model_name, _SERVED_NAME, "a served model name (no ':')"
            )
        _check_pattern("python", self.python, _EXECUTABLE, "an executable name or path")
        _check_pattern("launch_module", self.launch_module, _MODULE, "a dotted Python module name")
        _check_pattern("work_dir", self.work_dir, _EXECUTABLE, "a directory path")
        if not is_loopback(self.bind_host):
            try:
                ipaddress.ip_address(self.bind_host)
            except ValueError:
                _check_pattern("bind_host", self.bind_host, _HOSTNAME, "an IP address or host name")
            if not self.api_key_conn_id:
                raise FleetSpecError(
                    f"bind_host: {self.bind_host!r} is a network address; set api_key_conn_id so the "
                    "servers require an API key (or bind 127.0.0.1 and reach them through SSH tunnels)"
                )
        if self.api_key_conn_id is not None:
            _check_pattern("api_key_conn_id", self.api_key_conn_id, _CONN_ID, "an Airflow connection id")

        check_sglang_flags(self.sglang_flags)
        batch = self.sglang_flags.get(BATCH_FLAG)
        if batch is not None and batch is not False and _positive_int(batch) is None:
            raise FleetSpecError(
                f"sglang_flags[{BATCH_FLAG}]: {shown(batch)} must be a positive integer, the requests each server "
                "decodes at once (tracegen sizes chunks from it)"
            )
        refusal = self._launch_refusal()
        if refusal is not None:
            raise FleetSpecError(f"sglang_flags: {refusal}")

        if not isinstance(self.env, dict):
            raise FleetSpecError(f"env: a {type(self.env).__name__} (not shown) must be a mapping of name to value")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise FleetSpecError(f"env: {shown(name)} is not an environment variable name")
            if name == "CUDA_VISIBLE_DEVICES":
                raise FleetSpecError("env: CUDA_VISIBLE_DEVICES is set per server from hosts[].gpus")
            if isinstance(value, dict):
                ref = parse_secret_ref(name, value)
                own = self._own_connection(ref.connection)
                if own is not None:
                    raise FleetSpecError(
                        f"env[{name}].{FROM_CONNECTION}: {ref.connection!r} is {own}; the fleet never sends it to "
                        "a server's environment (create a Generic connection holding only this secret)"
                    )
                continue
            if not isinstance(value, str):
                raise FleetSpecError(f"env[{name}]: must be a string or a secret reference ({SECRET_REFERENCE_HELP})")
            # Checked before any message quotes the value: a refused credential must not reach a log.
            if value and looks_secret(name, value):
                raise FleetSpecError(
                    f"env[{name}]: looks like a credential written inline (the value is not shown). The fleet "
                    "file is copied to every worker and read by anyone who can read it; keep the secret in "
                    f"Airflow and reference it instead: {SECRET_REFERENCE_HELP}. It is resolved on the worker "
                    "when the server is launched and reaches only the server's environment"
                )
            _check_plain_value(f"env[{name}]", value, secret=True)

        for name, low in (("health_timeout_s", 1.0), ("stop_timeout_s", 0.5), ("ssh_cmd_timeout_s", 5.0)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= 86400:
                raise FleetSpecError(f"{name}: {shown(value)} must be a number of seconds in {low}..86400")

    def _own_connection(self, conn_id: str | None) -> str | None:
        """What `conn_id` is to this fleet when it is one of its own connections (see SECRET_CONNECTION_TYPES)."""
        if conn_id is None:
            return None
        if any(conn_id == host.conn_id for host in self.hosts):
            return "a host's SSH connection"
        if conn_id == self.api_key_conn_id:
            return "the connection of the servers' API key"
        return None

    def _server_argv(self, flags: dict[str, Any]) -> list[str]:
        """The launch argv after `-m MODULE` of the first server with `flags`, less the API key's --config
        (what the launched program's parser reads; command.launch_argv builds the real one for every server)."""
        host = self.hosts[0]
        served = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return ["--model-path", self.model_path, *served, "--host", self.bind_host,
                "--port", str(host.port(host.gpus[0])), *flag_args(flags)]  # fmt: skip

    def _sglang_flags(self) -> dict[str, Any]:
        """The flags SGLang's parser reads: the stand-in's own knobs (STAND_IN_KNOB) left aside."""
        return {f: v for f, v in self.sglang_flags.items() if not f.startswith(STAND_IN_KNOB)}

    def _launch_refusal(self) -> str | None:
        """Why the launched program would not start with these flags, in SGLang's own words, or None.

        Every launch module is judged by the pinned SGLang release's parser and start-up checks
        (tracegen.sglang.launch_flags), so a fleet file that validates here launches real SGLang. The
        stand-in's parser is SGLang's plus its --sim-* knobs; those are left to the stand-in's own start-up,
        whose refusal fails the launch with its log (production code imports nothing of the stand-in)."""
        from tracegen.sglang.launch_flags import launch_refusal, sglang_version

        refusal = launch_refusal(self._server_argv(self._sglang_flags()))
        if refusal is None:
            return None
        if self.launch_module == SIMULATOR_MODULE:
            return f"the stand-in ({SIMULATOR_MODULE}) would not start: {refusal}"
        return f"SGLang {sglang_version()} would not start: {refusal}"

    @property
    def max_running_requests(self) -> int | None:
        """Requests each server decodes at once, as SGLang resolves it at start-up: --max-running-requests
        when set; without it, the cap SGLang puts on speculative decoding (48 with EAGLE, EAGLE3, NEXTN, ...);
        otherwise None, and SGLang sizes the batch from KV-cache memory once the model is loaded."""
        from tracegen.sglang.launch_flags import parse, resolved_max_running_requests

        # SGLang's parser reads the flags (spellings, abbreviations, the stand-in's knobs left aside).
        argv = flag_args(self._sglang_flags())
        args = parse(["--model-path", self.model_path, *argv])
        return resolved_max_running_requests(args["max_running_requests"], args["speculative_algorithm"])

    def plain_env(self) -> dict[str, str]:
        """The env entries written in the fleet file itself."""
        return {name: value for name, value in self.env.items() if isinstance(value, str)}

    def secret_refs(self) -> dict[str, SecretRef]:
        """The env entries held in Airflow, by variable name."""
        return {name: parse_secret_ref(name, value) for name, value in self.env.items() if isinstance(value, dict)}

    @property
    def model_name(self) -> str:
        """The name the servers answer to (`/model_info` served_model_name)."""
        return self.served_model_name or self.model_path

    def servers(self) -> list[tuple[HostSpec, int]]:
        """Every (host, gpu) pair, in a stable order."""
        return [(host, gpu) for host in self.hosts for gpu in host.gpus]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetSpec:
        if not isinstance(data, dict):
            raise FleetSpecError(f"fleet description must be a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise FleetSpecError(f"unknown field(s) {unknown}; known fields are {sorted(known)}")
        hosts = data.get("hosts")
        if not isinstance(hosts, list):
            raise FleetSpecError(f"hosts: {shown(hosts)} must be a list of host objects")
        parsed = []
        for i, host in enumerate(hosts):
            if not isinstance(host, dict):
                raise FleetSpecError(f"hosts[{i}]: {shown(host)} must be an object with conn_id and gpus")
            extra = sorted(set(host) - set(HostSpec.__dataclass_fields__))
            if extra:
                raise FleetSpecError(f"hosts[{i}]: unknown field(s) {extra}")
            if "conn_id" not in host or "gpus" not in host:
                raise FleetSpecError(f"hosts[{i}]: conn_id and gpus are required")
            parsed.append(HostSpec(**host))
        if "model_path" not in data:
            raise FleetSpecError("model_path: required")
        return cls(**{**data, "hosts": tuple(parsed)})

    @classmethod
    def from_json(cls, text: str) -> FleetSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FleetSpecError(f"fleet description is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hosts": [
                {"conn_id": h.conn_id, "gpus": list(h.gpus), "base_port": h.base_port} for h in self.hosts
            ],
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "python": self.python,
            "launch_module": self.launch_module,
            "sglang_flags": dict(self.sglang_flags),
            "bind_host": self.bind_host,
            "api_key_conn_id": self.api_key_conn_id,
            "work_dir": self.work_dir,
            "env": {name: dict(value) if isinstance(value, dict) else value for name, value in self.env.items()},
            "health_timeout_s": self.health_timeout_s,
            "stop_timeout_s": self.stop_timeout_s,
            "ssh_cmd_timeout_s": self.ssh_cmd_timeout_s,
        }
