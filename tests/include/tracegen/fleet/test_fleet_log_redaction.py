"""Log redaction of the fleet's secrets.

SGLang logs `server_args` as a repr, so an API key `a\\b` appears in its log as `a\\\\b`; the log tail the fleet
puts into a start-up failure (and so into task logs) replaced only the raw value, and a secret with a backslash
(or a quote, or a non-ASCII character) survived. Now every spelling a log can hold is masked: the raw value,
its repr (either quote, and ascii()), its JSON string (ASCII and not) and its shell-quoted form. Checked on the
redaction function and through the log path: a program launched like SGLang that logs its secrets those ways.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from fixtures.ports import free_port
from fleet_helpers import HERE

from tracegen.fleet import FleetConnection, FleetError, FleetSpec, provision
from tracegen.fleet.server import redact, secret_forms

API_KEY = "key\\with\\backslashes'and\"quotes"
HF_TOKEN = "hf\\tok'en\"caf\u00e9\\n"
SECRETS = [API_KEY, HF_TOKEN, "plain-secret-value", "a\\b", "it's", "tab\there"]


def spellings(value: str) -> list[str]:
    """How a log can write `value` (what must never survive redaction)."""
    return [value, repr(value)[1:-1], ascii(value)[1:-1], json.dumps(value)[1:-1],
            json.dumps(value, ensure_ascii=False)[1:-1], shlex.quote(value)]


@pytest.mark.parametrize("value", SECRETS)
def test_every_spelling_of_a_secret_is_redacted(value):
    lines = [f"server_args=ServerArgs(api_key={value!r}, port=1)", f"{ {'k': value} !r}",
             json.dumps({"k": value}), json.dumps({"k": value}, ensure_ascii=False), f"export K={shlex.quote(value)}",
             f"ascii={ascii(value)}", f"raw={value}"]
    text = "\n".join(lines)
    out = redact(text, {"HF_TOKEN": value})
    for spelling in spellings(value):
        assert spelling not in out, (spelling, out)
    assert out.count("<HF_TOKEN>") == len(lines), out


def test_redaction_leaves_other_text_alone_and_labels_are_not_redacted_again():
    text = "loading weights; api key"
    assert redact(text, {"api key": "zzz"}) == text
    assert redact("token=api", {"api key": "api"}) == "token=<api key>"
    assert secret_forms("abc") == ["abc"]


def test_a_start_up_failure_log_tail_shows_no_spelling_of_any_secret(tmp_path):
    port = free_port()
    spec = FleetSpec.from_dict({
        "hosts": [{"conn_id": "local", "gpus": [0], "base_port": port}],
        "model_path": "Qwen/Qwen3-8B",
        "python": sys.executable,
        "launch_module": "fleet_log_probe",
        "work_dir": str(tmp_path / "work"),
        "api_key_conn_id": "sglang_api_key",
        "env": {"PYTHONPATH": str(HERE), "PROBE_LOG_NAMES": "HF_TOKEN",
                "HF_TOKEN": {"from_variable": "hf_token"}},
        "health_timeout_s": 30,
        "stop_timeout_s": 2,
    })
    with FleetConnection(spec, api_key=API_KEY, secrets={"HF_TOKEN": HF_TOKEN}) as fleet:
        with pytest.raises(FleetError) as info:
            provision(spec, fleet)
    message = str(info.value)
    assert "PROBE-FAILED-TO-START" in message and "server_args=ServerArgs(" in message, message
    assert "<api key>" in message and "<HF_TOKEN>" in message
    for value in (API_KEY, HF_TOKEN):
        for spelling in spellings(value):
            assert spelling not in message, (spelling, message)


def test_a_knob_the_stand_in_refuses_fails_its_launch_with_its_own_words(tmp_path):
    # Validation judges the stand-in's flags with SGLang's checks and leaves --sim-* knobs to the stand-in:
    # the fleet file validates, and the launch fails with the stand-in's message in the log's tail.
    spec = FleetSpec.from_dict({
        "hosts": [{"conn_id": "local", "gpus": [0], "base_port": free_port()}],
        "model_path": "Qwen/Qwen3-8B",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "work_dir": str(tmp_path / "work"),
        "sglang_flags": {"--sim-loop-shape": "spiral"},
        "health_timeout_s": 30,
        "stop_timeout_s": 2,
    })
    with FleetConnection(spec) as fleet:
        with pytest.raises(FleetError) as info:
            provision(spec, fleet)
    message = str(info.value)
    assert "exited before becoming healthy" in message, message
    assert "--sim-loop-shape: invalid choice: 'spiral'" in message, message
