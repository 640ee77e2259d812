"""Launch argv and host scripts, run for real by a local `sh`: exact argv, quoting, pid files, stop."""

import json
import subprocess

import pytest
from fixtures.procs import is_alive
from fleet_helpers import live_group_members, probe_spec, wait_for

from tracegen.fleet import (
    FleetConnection,
    FleetError,
    FleetSpec,
    FleetSpecError,
    config_hash,
    launch_argv,
    server_env,
)
from tracegen.fleet import server as fleet_server


def test_launch_argv_is_exact():
    spec = FleetSpec.from_dict(
        {
            "hosts": [{"conn_id": "gpu_a", "gpus": [0, 3], "base_port": 30000}],
            "model_path": "Qwen/Qwen3-30B-A3B",
            "served_model_name": "qwen3",
            "python": "/opt/sglang/bin/python",
            "sglang_flags": {
                "--speculative-algorithm": "EAGLE3",
                "--speculative-draft-model-path": "/models/drafter-v1",
                "--speculative-num-steps": 3,
                "--mem-fraction-static": 0.85,
                "--enable-metrics": True,
                "--disable-radix-cache": False,
                # SGLang 0.5.23 has no --cuda-graph-bs (it is ambiguous there): batch sizes are per phase.
                "--cuda-graph-bs-decode": [1, 2, 4],
                "--reasoning-parser": "qwen3",
            },
        }
    )
    host = spec.hosts[0]
    assert launch_argv(spec, host, 3) == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-30B-A3B",
        "--served-model-name", "qwen3",
        "--host", "127.0.0.1", "--port", "30003",
        "--cuda-graph-bs-decode", "1", "2", "4",
        "--enable-metrics",
        "--mem-fraction-static", "0.85",
        "--reasoning-parser", "qwen3",
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/models/drafter-v1",
        "--speculative-num-steps", "3",
    ]  # fmt: skip
    # The key itself stays out of the argv: SGLang reads it from the --config file the launch script writes.
    with_key = launch_argv(spec, host, 0, api_key="s3cret")
    assert with_key[9:13] == ["--port", "30000", "--config", "sglang-gpu0-port30000.config.yaml"]
    assert "s3cret" not in " ".join(with_key)
    assert server_env(spec, 3) == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match="not one of host gpu_a"):
        launch_argv(spec, host, 1)


def test_config_hash_tracks_flags_and_hides_the_key():
    spec = FleetSpec.from_dict({"hosts": [{"conn_id": "a", "gpus": [0]}], "model_path": "m"})
    other = FleetSpec.from_dict({**spec.to_dict(), "sglang_flags": {"--max-running-requests": 64}})
    h = spec.hosts[0]
    env = server_env(spec, 0)
    same = config_hash(launch_argv(spec, h, 0), env)
    assert same == config_hash(launch_argv(spec, h, 0), env)
    assert same != config_hash(launch_argv(other, h, 0), env)
    assert same != config_hash(launch_argv(spec, h, 0), {"CUDA_VISIBLE_DEVICES": "1"})
    keyed = launch_argv(spec, h, 0, "k1")
    assert config_hash(keyed, env, "k1") != config_hash(keyed, env, "k2")  # a rotated key restarts


def test_flag_order_in_the_description_does_not_change_argv_or_hash():
    # A fleet description that went through an XCom on PostgreSQL (JSONB) comes back with its flags in
    # another order; it must still match the servers it launched, or they would be restarted.
    flags = {"--reasoning-parser": "qwen3", "--max-running-requests": 64, "--enable-metrics": True}
    a = FleetSpec.from_dict({"hosts": [{"conn_id": "a", "gpus": [0]}], "model_path": "m", "sglang_flags": flags})
    b = FleetSpec.from_dict({**a.to_dict(), "sglang_flags": dict(reversed(list(flags.items())))})
    h, env = a.hosts[0], server_env(a, 0)
    assert launch_argv(a, h, 0) == launch_argv(b, h, 0)
    assert config_hash(launch_argv(a, h, 0), env) == config_hash(launch_argv(b, h, 0), env)


# Free-text flags of SGLang (a flag with choices would not validate with such a value).
INJECTIONS = {
    "--speculative-draft-model-path": "EAGLE3; touch {canary}",
    "--tokenizer-path": "$(touch {canary})",
    "--completion-template": "`touch {canary}`",
    "--chat-template": "x' ; touch {canary} ; echo '",
    "--download-dir": "a b && touch {canary} | cat > {canary} &",
}


def test_injection_values_reach_the_server_verbatim_and_run_nothing(tmp_path, stray_groups):
    canary = tmp_path / "CANARY"
    flags = {flag: value.format(canary=canary) for flag, value in INJECTIONS.items()}
    spec = probe_spec(tmp_path, sglang_flags=flags)
    host = spec.hosts[0]
    with FleetConnection(spec) as fleet:
        state = fleet_server.launch(fleet, host, 2)
        stray_groups.append(state.pgid)
        record_path = tmp_path / "probe.json"
        assert wait_for(record_path.exists), "probe server never started"
        record = json.loads(record_path.read_text())
        # The server got exactly the argv the pure builder produced: quoting lost nothing and added nothing.
        assert record["argv"] == launch_argv(spec, host, 2)[3:]
        assert record["cuda"] == "2"
        assert record["pid"] == record["pgid"] == record["sid"] == state.pid  # own session, own group
        fleet_server.stop(fleet, host, 2)
    assert not canary.exists()


def test_launch_argv_refuses_values_that_would_parse_as_flags():
    spec = FleetSpec.from_dict(
        {
            "hosts": [{"conn_id": "a", "gpus": [0]}],
            "model_path": "m",
            "sglang_flags": {
                "--cuda-graph-bs-decode": [8, 16],
                "--random-seed": "-1",
                "--bucket-e2e-request-latency": [-2, "-0.5"],
            },
        }
    )
    host = spec.hosts[0]
    argv = launch_argv(spec, host, 0, api_key="k")
    # Negative numbers are values to argparse; every flag the fleet manages appears once.
    assert argv[-8:] == [
        "--bucket-e2e-request-latency", "-2", "-0.5", "--cuda-graph-bs-decode", "8", "16", "--random-seed", "-1"
    ]  # fmt: skip
    assert [argv.count(flag) for flag in ("--model-path", "--host", "--port", "--config")] == [1, 1, 1, 1]
    # The flags mapping is a plain dict: a change after validation must still not reach a host.
    spec.sglang_flags["--cuda-graph-bs-decode"] = [8, "--host=0.0.0.0", "--model-path=attacker/model"]
    with pytest.raises(
        FleetSpecError, match=r"sglang_flags\[--cuda-graph-bs-decode\]: '--host=0.0.0.0' looks like a flag"
    ):
        launch_argv(spec, host, 0)
    spec.sglang_flags.clear()
    spec.sglang_flags["--hos"] = "0.0.0.0"
    with pytest.raises(FleetSpecError, match="--hos abbreviates --host"):
        launch_argv(spec, host, 0)


def test_control_characters_in_values_are_rejected(tmp_path):
    for value in ("a\nb", "a\x00b", "a\rtouch x"):
        with pytest.raises(ValueError, match="control character"):
            probe_spec(tmp_path, sglang_flags={"--x": value})
    with pytest.raises(ValueError, match="model_path"):
        probe_spec(tmp_path, model_path="m\n$(touch /tmp/x)")


def test_stop_kills_the_whole_group_and_escalates_to_sigkill(tmp_path, stray_groups):
    spec = probe_spec(
        tmp_path, stop_timeout_s=0.5, env={**probe_spec(tmp_path).env, "PROBE_IGNORE_TERM": "1"}
    )
    host = spec.hosts[0]
    with FleetConnection(spec) as fleet:
        state = fleet_server.launch(fleet, host, 2)
        stray_groups.append(state.pgid)
        # The probe spawns a child in its group: the group has two live members.
        assert wait_for(lambda: len(live_group_members(state.pgid)) == 2)
        members = live_group_members(state.pgid)
        result = fleet_server.stop(fleet, host, 2)
        assert result.result == "killed"  # SIGTERM was ignored; SIGKILL finished it
        assert live_group_members(state.pgid) == []
        assert not any(is_alive(pid) for pid in members)
        assert fleet_server.inspect(fleet, host, 2).state == "absent"
        assert fleet_server.stop(fleet, host, 2).result == "absent"


def test_stale_pid_file_of_a_recycled_pid_is_never_signalled(tmp_path, stray_groups):
    """A pid file whose pid now belongs to another process (different start time) is left alone."""
    spec = probe_spec(tmp_path)
    host = spec.hosts[0]
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stray_groups.append(bystander.pid)
    try:
        work = tmp_path / "work"
        work.mkdir()
        (work / "sglang-gpu2-port31002.pid").write_text(
            f"pid={bystander.pid}\npgid={bystander.pid}\nstart=1\nconfig=abc\n"
        )
        with FleetConnection(spec) as fleet:
            assert fleet_server.inspect(fleet, host, 2).state == "stale"
            assert fleet_server.stop(fleet, host, 2).result == "stale"
        assert bystander.poll() is None  # still running: never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_launch_on_a_live_slot_joins_the_same_config_and_refuses_another(tmp_path, stray_groups):
    spec = probe_spec(tmp_path)
    host = spec.hosts[0]
    other = probe_spec(tmp_path, sglang_flags={"--max-running-requests": 8})
    with FleetConnection(spec) as fleet, FleetConnection(other) as fleet2:
        state = fleet_server.launch(fleet, host, 2)
        stray_groups.append(state.pgid)
        joined = fleet_server.launch(fleet, host, 2)  # e.g. a concurrent provisioner: same server
        assert (joined.state, joined.pid) == ("running", state.pid)
        with pytest.raises(FleetError, match="already running"):
            fleet_server.launch(fleet2, host, 2)
        # A stop that asks to keep the current config leaves it alone; a plain stop does not.
        assert fleet_server.stop(fleet, host, 2, keep_config=state.config).result == "kept"
        assert live_group_members(state.pgid)
        assert fleet_server.stop(fleet, host, 2).result == "stopped"
