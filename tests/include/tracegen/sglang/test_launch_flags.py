"""SGLang's launch flags, judged by SGLang's own parser: the table tracegen ships is the pinned release's, the
parser built from it acts like SGLang's, and SGLang, the fleet's validation and the stand-in start (or refuse
to start) with the same argv."""

from __future__ import annotations

import argparse

import pytest
from fixtures import sglang_reference as sglang_ref

from tracegen.fleet import FleetSpec, FleetSpecError
from tracegen.run.run_spec import FleetRef
from tracegen.sglang import launch_flags
from tracegen.simulator.launch_args import launch_refusal as stand_in_refusal


def test_the_pinned_sglang_is_installed_and_the_table_is_its_own():
    assert sglang_ref.sglang().version == sglang_ref.pinned_version() == launch_flags.sglang_version()
    derived = sglang_ref.flag_table()
    assert derived == launch_flags.table(), "regenerate: python tests/fixtures/sglang_reference.py"
    assert sglang_ref.render_table(derived) == launch_flags.TABLE_FILE.read_text()


def _described(action: argparse.Action) -> dict:
    kind = action.type
    return {
        "options": action.option_strings, "dest": action.dest, "nargs": action.nargs,
        "choices": sglang_ref._choices(action), "default": action.default,
        "const": action.const if action.nargs == "?" else None,
        "type": getattr(kind, "__name__", kind), "takes_value": action.nargs != 0,
    }  # fmt: skip


def test_the_parser_built_from_the_table_has_sglangs_actions():
    theirs = [_described(a) for a in sglang_ref.parser()._actions]
    ours_parser = argparse.ArgumentParser(prog="sglang serve")
    launch_flags.add_sglang_flags(ours_parser)
    ours = [_described(a) for a in ours_parser._actions]
    assert [a["options"] for a in ours] == [a["options"] for a in theirs]
    for mine, real in zip(ours, theirs, strict=True):
        # Value types are SGLang's functions re-implemented under the same names (argparse quotes them).
        real["type"] = {"<lambda>": mine["type"]}.get(real["type"], real["type"])
        assert mine == real, real["options"]


# (argv after --model-path, does SGLang 0.5.23 start with it). The first rows are the easy ones to get wrong
# by hand: flags that look valid but SGLang refuses, and flags SGLang takes that look unlikely.
VERDICTS = [
    ("--cuda-graph-bs 8 16", False),  # ambiguous: --cuda-graph-bs-decode / --cuda-graph-bs-prefill
    ("--cuda-graph-max-bs 256", False),
    ("--enable-nan-detection", False),
    ("--reasoning-parser qwen-3", False),
    ("--tool-call-parser qwen3", False),
    ("--kv-cache-dtype fp8", False),
    ("--speculative-algorithm LOOKAHEAD", False),
    ("--cuda-graph-bs-decode 1 2 4 8", True),
    ("--page-size 16", True),
    ("--enable-hierarchical-cache", True),
    ("--hicache-ratio 2", True),
    ("--admin-api-key admin-secret", True),
    ("--enable-priority-scheduling", True),
    ("--model-loader-extra-config {}", True),
    ("--context-length 32k", True),
    ("--log-level WARNING", True),
    ("--speculative-algorithm FROZEN_KV_MTP", True),
    # And around them.
    ("--speculative-algorithm eagle3", True),
    ("--speculative-algorithm NEXTN --speculative-num-steps 3", True),
    ("--log-level chatty", False),
    ("--context-length 1.5Ki", False),
    ("--context-length 40960", True),
    ("--cuda-graph-config {\"decode\":{\"bs\":[1,2]}}", True),
    ("--cuda-graph-config {\"decode\":{\"size\":1}}", False),
    ("--tool-call-parser qwen25 --reasoning-parser qwen3", True),
    ("--no-enable-tf32-matmul", True),
    ("--monokernel-backend amd", True),
    ("--monokernel-backend nvidia", False),
    ("--mem-fraction-static lots", False),
    ("--enable-metrics --max-running-requests 64 --max-queued-requests 128", True),
]


def _as_fleet_flags(words: list[str]) -> dict:
    """Command-line words as a fleet file's sglang_flags: a bare flag is true, several values a list."""
    flags: dict = {}
    for word in words:
        if word.startswith("--"):
            flag, flags[word] = word, []
        else:
            flags[flag].append(word)
    return {f: True if not v else v[0] if len(v) == 1 else v for f, v in flags.items()}


@pytest.mark.parametrize(("flags", "starts"), VERDICTS, ids=[f for f, _ in VERDICTS])
def test_sglang_the_table_the_stand_in_and_fleet_validation_agree(flags, starts):
    argv = ["--model-path", "Qwen/Qwen3-8B", *flags.split()]
    sglang_says = sglang_ref.launch_refusal(argv)
    assert (sglang_says is None) == starts, sglang_says
    assert (launch_flags.launch_refusal(argv) is None) == starts
    assert (stand_in_refusal(argv) is None) == starts
    spec = {"hosts": [{"conn_id": "gpu_a", "gpus": [0]}], "model_path": "Qwen/Qwen3-8B",
            "sglang_flags": _as_fleet_flags(flags.split())}  # fmt: skip
    for module in ("sglang.launch_server", "tracegen.simulator"):
        if starts:
            FleetSpec.from_dict({**spec, "launch_module": module})
        else:
            with pytest.raises(FleetSpecError, match="would not start"):
                FleetSpec.from_dict({**spec, "launch_module": module})


def test_refusals_name_sglangs_reason():
    argv = ["--model-path", "m", "--cuda-graph-bs", "8"]
    assert launch_flags.launch_refusal(argv) == (
        "ambiguous option: --cuda-graph-bs could match --cuda-graph-bs-decode, --cuda-graph-bs-prefill"
    )
    assert sglang_ref.launch_refusal(argv).endswith(launch_flags.launch_refusal(argv))
    with pytest.raises(FleetSpecError, match=r"SGLang 0\.5\.23 would not start: argument --kv-cache-dtype: invalid"):
        FleetSpec.from_dict({"hosts": [{"conn_id": "a", "gpus": [0]}], "model_path": "m",
                             "sglang_flags": {"--kv-cache-dtype": "fp8"}})  # fmt: skip


def test_the_running_request_cap_per_speculative_algorithm_is_sglangs():
    algorithms = launch_flags.table()["speculative_algorithms"]
    assert set(algorithms) >= {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH"}
    assert sglang_ref.speculative_running_caps(algorithms) == launch_flags.table()["speculative_max_running_requests"]
    for algorithm in ("EAGLE", "EAGLE3", "NEXTN", "eagle3"):
        assert launch_flags.speculative_running_cap(algorithm) == 48
    assert launch_flags.speculative_running_cap("UNO") is None
    assert launch_flags.resolved_max_running_requests(None, None) is None
    assert launch_flags.resolved_max_running_requests(128, "EAGLE3") == 128


def _fleet(**flags) -> FleetSpec:
    return FleetSpec.from_dict({"hosts": [{"conn_id": "gpu_a", "gpus": [0, 1, 2, 3]}], "model_path": "m",
                                "sglang_flags": flags})  # fmt: skip


def test_the_plan_sizes_a_speculative_fleet_by_sglangs_cap_of_48():
    # SGLang caps running requests at 48 with EAGLE/EAGLE3/NEXTN when the flag is not given: the plan's
    # slots are 48 per server, not "unknown" (nor the 256 the stand-in decodes when no cap applies).
    fleet = _fleet(**{"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": "d"})
    assert fleet.max_running_requests == 48
    assert FleetRef.of(fleet, "fleet.json").slots == 48 * 4
    assert _fleet(**{"--speculative-algorithm": "NEXTN", "--max-running-requests": 96}).max_running_requests == 96
    assert _fleet(**{"--speculative-algo": "EAGLE"}).max_running_requests == 48  # argparse's abbreviation
    assert _fleet().max_running_requests is None
    assert FleetRef.of(_fleet(), "fleet.json").slots is None


def test_sglangs_value_types():
    hri = launch_flags.human_readable_int
    assert [hri("32768"), hri("32k"), hri("25.6k"), hri("32Ki"), hri("1M")] == [32768, 32000, 25600, 32768, 10**6]
    for bad in ("32K", "1.5Ki", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            hri(bad)
    assert launch_flags.nullable_str("None") is None and launch_flags.nullable_str("x") == "x"
