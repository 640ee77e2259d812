import json

import pytest

from tracegen.config import RUN_ID_PATTERN, ConfigError, RunConfig, safe_run_id

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
        ("max_tokens", 0, "max_tokens 0 is below 1 token"),
        ("max_tokens", "8192", "max_tokens '8192' is not a whole number of tokens"),
        ("max_tokens", True, "max_tokens True is not a whole number of tokens"),
        ("max_tokens", 1_048_577, "max_tokens 1,048,577 is too large: 1,048,576 is the largest max_tokens a run "
                                  "accepts; enter at most 1,048,576"),
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
    with pytest.raises(ConfigError, match=r"max_tokens 8,192 is too large: the servers' context length is 8,192 "
                                          r"tokens \(prompt \+ completion must fit\); enter at most 8,191"):
        RunConfig(**BASE, max_tokens=8192, context_length=8192)
    config = RunConfig(**BASE, max_tokens=8192)
    with pytest.raises(ConfigError, match="enter at most 4,095"):
        config.check_context_length(4096)
    config.check_context_length(8193)  # one token left for the prompt
    config.check_context_length(0)  # unknown: nothing to check against


def test_config_round_trips_through_json():
    config = RunConfig(**BASE, max_tokens=8192)
    assert RunConfig.from_params(json.loads(config.dumps())) == config


def test_safe_run_id():
    stored = safe_run_id("manual__2026-11-29T19:16:49.123+00:00")
    assert stored.startswith("manual__2026-11-29T19_16_49.123_00_00--") and RUN_ID_PATTERN.fullmatch(stored)
    assert safe_run_id("run-1") == "run-1"
    with pytest.raises(ConfigError):
        safe_run_id("::")


def test_the_trigger_forms_cap_fields_are_the_one_cap_rules():
    """The run's form and the raise's form take their max_tokens bounds from `tracegen.common.cap_rule`, which
    RunConfig checks a value by (one rule for every cap)."""
    from tracegen.common.cap_rule import HIGHEST, LOWEST
    from tracegen.config import rule_of
    from tracegen.params import raise_cap_params, trigger_params

    schema = {"type": "integer", "allOf": [{"minimum": LOWEST, "maximum": HIGHEST}]}
    assert rule_of("max_tokens").schema() == schema
    for form in (trigger_params(), raise_cap_params()):
        assert {k: form["max_tokens"].schema[k] for k in schema} == schema
    assert RunConfig(**BASE, max_tokens=HIGHEST).max_tokens == HIGHEST
    with pytest.raises(ConfigError, match="max_tokens 10,000,000,000 is too large"):
        RunConfig(**BASE, max_tokens=10**10)
    with pytest.raises(ConfigError, match="max_tokens of about 401 digits is too large"):
        RunConfig(**BASE, max_tokens=10**400)


def test_every_form_field_names_draft_07_and_uses_only_its_keywords():
    """The forms' fields name JSON Schema draft-07 (`params.SCHEMA_DRAFT`: cheaper for Airflow to check at each
    serialization). A validator ignores keywords its draft does not know, so a field using a later draft's
    keyword (`prefixItems`, `dependentRequired`, ...) would silently stop being checked: each field must be a
    valid draft-07 schema whose keywords draft-07 defines, and must still refuse a value out of its range."""
    from airflow.sdk.exceptions import ParamValidationError
    from jsonschema.validators import Draft7Validator

    from tracegen.params import SCHEMA_DRAFT, raise_cap_params, trigger_params

    known = set(Draft7Validator.META_SCHEMA["properties"]) | {"$schema"}
    for form in (trigger_params(), raise_cap_params()):
        for name, param in form.items():
            assert {k: param.schema[k] for k in SCHEMA_DRAFT} == SCHEMA_DRAFT, name
            Draft7Validator.check_schema(param.schema)
            assert set(param.schema) <= known, (name, set(param.schema) - known)
            for sub in param.schema.get("allOf", []):
                assert set(sub) <= known, (name, set(sub) - known)
    with pytest.raises(ParamValidationError, match="less than the minimum of 1"):
        trigger_params()["max_tokens"].resolve(0)
