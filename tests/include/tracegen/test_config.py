import json

import pytest

from tracegen.config import ConfigError, RunConfig, safe_run_id

BASE = {"dataset_uri": "/data/prompts.jsonl", "output_uri": "/out"}


def test_defaults_match_the_seed_story():
    config = RunConfig(**BASE)
    assert config.max_tokens == 4096
    assert config.pilot_size == 1500
    # The pivot continues rows truncated under a lower cap from their tokens unless told otherwise.
    assert config.truncated_policy == "extend"


def test_truncated_policies_are_one_rule_shared_by_the_form():
    from tracegen.config import TRUNCATED_POLICIES, rule_of

    rule = rule_of("truncated_policy")
    assert TRUNCATED_POLICIES == ("extend", "regenerate", "keep") and rule.schema()["enum"] == list(TRUNCATED_POLICIES)
    assert "'extend'" in rule.description and "'regenerate'" in rule.description and "'keep'" in rule.description
    for policy in TRUNCATED_POLICIES:
        assert RunConfig(**BASE, truncated_policy=policy).truncated_policy == policy


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens: 0 is outside"),
        ("max_tokens", "8192", "max_tokens: expected an integer"),
        ("max_tokens", True, "max_tokens: expected an integer"),
        ("truncation_threshold", 1.5, "truncation_threshold: 1.5 is outside [0.0, 1.0]"),
        ("truncation_threshold", float("nan"), "truncation_threshold: nan is outside"),
        ("top_p", 0.0, "top_p: 0.0 is outside (0.0, 1.0]"),
        ("chunk_size", 3, "chunk_size: 3 is outside"),
        ("gate_mode", "maybe", "gate_mode: 'maybe' is not one of"),
        ("truncated_policy", "drop", "truncated_policy: 'drop' is not one of"),
        ("dataset_uri", "", "dataset_uri: required"),
        # Storage locations: absolute local paths, file:// and s3://bucket/... only.
        ("output_uri", "relative/dir", "output_uri: 'relative/dir' is not an absolute local path"),
        ("output_uri", "s3://", "output_uri: 's3://' is not"),
        ("dataset_uri", "http://example.com/prompts.jsonl", "dataset_uri: 'http://example.com/prompts.jsonl' is not"),
        ("dataset_uri", "s3://bucket", "dataset_uri: 's3://bucket' is not"),
    ],
)
def test_bad_params_name_the_param(param, value, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_params({**BASE, param: value})
    assert message in str(err.value)


def test_unknown_param_is_refused():
    with pytest.raises(ConfigError, match=r"unknown param\(s\) \['max_token'\]"):
        RunConfig.from_params({**BASE, "max_token": 8192})


def test_max_tokens_must_fit_the_context():
    with pytest.raises(ConfigError, match="does not fit the model's context length of 8192"):
        RunConfig(**BASE, max_tokens=8192, context_length=8192)
    config = RunConfig(**BASE, max_tokens=8192)
    with pytest.raises(ConfigError, match="use at most 4095"):
        config.check_context_length(4096)


def test_config_round_trips_through_json():
    config = RunConfig(**BASE, max_tokens=8192)
    assert RunConfig.from_params(json.loads(config.dumps())) == config


def test_safe_run_id():
    assert safe_run_id("manual__2026-11-29T19:16:49.123+00:00") == "manual__2026-11-29T19_16_49.123_00_00"
    with pytest.raises(ConfigError):
        safe_run_id("::")
