"""FleetSpec: built from dicts/JSON, and every bad field rejected with a message naming it."""

import json

import pytest

from tracegen.fleet import FleetSpec, FleetSpecError, HostSpec


def base(**over):
    data = {
        "hosts": [{"conn_id": "gpu_a", "gpus": [0, 1], "base_port": 30000}],
        "model_path": "Qwen/Qwen3-8B",
    }
    data.update(over)
    return data


def test_from_json_roundtrip():
    spec = FleetSpec.from_json(
        json.dumps(
            base(
                served_model_name="qwen3",
                sglang_flags={
                    "--speculative-algorithm": "EAGLE3",
                    "--speculative-num-steps": 3,
                    "--enable-metrics": True,
                },
            )
        )
    )
    assert spec.hosts == (HostSpec("gpu_a", (0, 1), 30000),)
    assert spec.model_name == "qwen3"
    assert spec.servers() == [(spec.hosts[0], 0), (spec.hosts[0], 1)]
    assert FleetSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"model_path": "Qwen/x; rm -rf /"}, "model_path"),
        ({"model_path": "$(touch /tmp/x)"}, "model_path"),
        ({"model_path": "a/`id`"}, "model_path"),
        ({"model_path": "models/../../etc"}, "'..'"),
        ({"model_path": "a\nb"}, "model_path"),
        ({"served_model_name": "qwen:3"}, "served_model_name"),
        ({"python": "python3 -c evil"}, "python"),
        ({"launch_module": "sglang.launch_server;id"}, "launch_module"),
        ({"sglang_flags": {"--Bad_Flag": 1}}, "--[a-z0-9-]+"),
        ({"sglang_flags": {"-x": 1}}, "--[a-z0-9-]+"),
        ({"sglang_flags": {"--x; id": 1}}, "--[a-z0-9-]+"),
        ({"sglang_flags": {"--port": 1}}, "set by the fleet"),
        ({"sglang_flags": {"--api-key": "k"}}, "set by the fleet"),
        ({"sglang_flags": {"--config": "/tmp/flags.yaml"}}, "--config is set by the fleet"),
        # argparse reads a unique prefix as the whole option: these are --host and --api-key again.
        ({"sglang_flags": {"--hos": "0.0.0.0"}}, "--hos abbreviates --host"),
        ({"sglang_flags": {"--api": "k"}}, "--api abbreviates --api-key"),
        # Values that argparse would read as flags of their own.
        (
            {"sglang_flags": {"--cuda-graph-bs-decode": [8, "--host=0.0.0.0", "--model-path=attacker/model"]}},
            "sglang_flags[--cuda-graph-bs-decode]: '--host=0.0.0.0' looks like a flag",
        ),
        ({"sglang_flags": {"--reasoning-parser": "--port"}}, "sglang_flags[--reasoning-parser]: '--port'"),
        ({"sglang_flags": {"--chat-template": "-x"}}, "looks like a flag"),
        ({"sglang_flags": {"--x": "a\nb"}}, "control character"),
        ({"sglang_flags": {"--x": {"a": 1}}}, "string or a number"),
        ({"sglang_flags": {"--x": []}}, "empty list"),
        ({"sglang_flags": {"--max-running-requests": "lots"}}, "must be a positive integer"),
        ({"sglang_flags": {"--max-running-requests": 0}}, "must be a positive integer"),
        ({"sglang_flags": {"--max-running-requests": 2.5}}, "must be a positive integer"),
        ({"sglang_flags": {"--max-running-requests": True}}, "must be a positive integer"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "CUDA_VISIBLE_DEVICES"),
        ({"env": {"A B": "x"}}, "environment variable"),
        ({"bind_host": "0.0.0.0"}, "api_key_conn_id"),
        ({"bind_host": "10.0.0.5"}, "api_key_conn_id"),
        ({"bind_host": "bad host;id", "api_key_conn_id": "k"}, "bind_host"),
        ({"health_timeout_s": 0}, "health_timeout_s"),
        ({"work_dir": "a b"}, "work_dir"),
        ({"unknown_field": 1}, "unknown field"),
        ({"hosts": []}, "hosts"),
        ({"hosts": [{"conn_id": "a", "gpus": []}]}, "gpus"),
        ({"hosts": [{"conn_id": "a", "gpus": [0, 0]}]}, "twice"),
        ({"hosts": [{"conn_id": "a", "gpus": [0]}, {"conn_id": "a", "gpus": [1]}]}, "host twice"),
        ({"hosts": [{"conn_id": "a", "gpus": [1], "base_port": 65535}]}, "base_port"),
        ({"hosts": [{"conn_id": "a;id", "gpus": [1]}]}, "conn_id"),
    ],
)
def test_bad_fields_are_rejected_naming_the_field(over, needle):
    with pytest.raises(FleetSpecError, match=None) as info:
        FleetSpec.from_dict(base(**over))
    assert needle in str(info.value)


def test_network_bind_with_api_key_is_allowed():
    spec = FleetSpec.from_dict(base(bind_host="0.0.0.0", api_key_conn_id="sglang_key"))
    assert spec.bind_host == "0.0.0.0"


def test_invalid_json_is_a_clear_error():
    with pytest.raises(FleetSpecError, match="not valid JSON"):
        FleetSpec.from_json("{hosts: ")


@pytest.mark.parametrize(("value", "batch"), [(64, 64), ("64", 64), (None, None), (False, None)])
def test_the_batch_per_server_is_read_from_the_flags(value, batch):
    flags = {} if value is None else {"--max-running-requests": value}
    assert FleetSpec.from_dict(base(sglang_flags=flags)).max_running_requests == batch
