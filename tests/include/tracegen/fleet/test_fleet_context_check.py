"""The pilot and the chunks beside it start with provision_fleet, not after it, so each generation task checks
the run's cap against the context its servers report before its first request: a cap over it fails the task,
naming the server and the bound, with nothing sent and nothing committed (a refused request would otherwise
be recorded as a rejected row)."""

from __future__ import annotations

import sys

import pytest
from engine_support.helpers import committed_indices, make_config, metric, prepare, root_of, write_dataset
from fixtures.ports import free_port

from tracegen.config import ConfigError
from tracegen.fleet import FleetConnection, FleetSpec, provision, teardown
from tracegen.generate.chunk import check_served_context, run_pilot
from tracegen.run.run_spec import FleetRef


def _fleet(tmp_path, context_length: int) -> FleetSpec:
    return FleetSpec.from_dict({
        "hosts": [{"conn_id": "local", "gpus": [0], "base_port": free_port()}],
        "model_path": "Qwen/Qwen3-8B",
        "python": sys.executable,
        "launch_module": "tracegen.simulator",
        "sglang_flags": {"--context-length": context_length, "--sim-time-scale": 1000,
                         "--enable-metrics": True},
        "work_dir": str(tmp_path / "fleet"),
        "health_timeout_s": 60,
        "stop_timeout_s": 5,
    })


def test_a_pilot_whose_cap_is_over_the_served_context_sends_nothing_and_commits_nothing(tmp_path, stray_groups):
    fleet = _fleet(tmp_path, 2048)
    config = make_config(write_dataset(tmp_path / "prompts.jsonl", 40), tmp_path / "out", max_tokens=4096,
                         pilot_size=20)
    spec = prepare(config, "manual__context")
    spec = type(spec)(**{**spec.__dict__, "fleet": FleetRef.of(fleet, "test-fleet")})
    try:
        with pytest.raises(ConfigError, match=r"local:gpu0: max_tokens 4,096 is too large: .* 2,048 tokens"):
            run_pilot(spec, fleet=fleet)
        with FleetConnection(fleet) as connection:
            handles = provision(fleet, connection)  # the server the pilot launched, reused
            stray_groups.extend(h.pgid for h in handles)
            assert [h.reused for h in handles] == [True]
            assert metric(handles[0].url, "sglang:num_requests_total") == 0, "a request reached the server"
            # The same check passes a cap that fits, and reports each server's context.
            fits = make_config(tmp_path / "prompts.jsonl", tmp_path / "out", max_tokens=1024)
            assert check_served_context(fits, handles, connection.headers()) == {"local:gpu0": 2048}
        assert committed_indices(root_of(config)) == []
    finally:
        teardown(fleet)
