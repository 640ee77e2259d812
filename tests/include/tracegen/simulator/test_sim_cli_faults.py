"""Launch flags (SGLang's plus --sim-*) and the fault settings' validation and reproducibility."""

import subprocess
import sys

import pytest

from tracegen.simulator.faults import ABORT, CRASH, DROP, ERROR, HANG, PASS, FaultConfig, FaultInjector
from tracegen.simulator.launch_args import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_RUNNING, parse_args


def test_defaults_resolve_like_sglang():
    s = parse_args(["--model-path", "Qwen/Qwen3-8B"])
    a = s.args
    assert a["host"] == "127.0.0.1" and a["port"] == 30000
    assert a["served_model_name"] == "Qwen/Qwen3-8B" and a["tokenizer_path"] == "Qwen/Qwen3-8B"
    # As SGLang's /server_info: the flags as given (null context length, no running-request cap) while the
    # server runs with the model's own context and a batch sized from "memory".
    assert a["context_length"] is None and a["max_running_requests"] is None
    assert s.context_length == DEFAULT_MAX_MODEL_LEN and s.max_running == DEFAULT_MAX_RUNNING
    assert a["log_level"] == "info" and a["weight_version"] == "default" and a["load_format"] == "auto"
    assert s.accept_length == 1.0


def test_gpu_only_flags_are_accepted_and_recorded():
    argv = [
        "--model",
        "m",
        "--tp-size",
        "2",
        "--dp-size",
        "1",
        "--mem-fraction-static",
        "0.85",
        "--chunked-prefill-size",
        "8192",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--attention-backend",
        "fa3",
        "--cuda-graph-max-bs-decode",
        "256",
        "--disable-cuda-graph",
        "--base-gpu-id",
        "3",
        "--trust-remote-code",
        "--watchdog-timeout",
        "600",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--enable-metrics",
        "--log-level",
        "warning",
        "--max-queued-requests",
        "10",
        "--max-running-requests",
        "64",
    ]
    s = parse_args(argv)
    assert s.args["tp_size"] == 2 and s.args["base_gpu_id"] == 3 and s.args["mem_fraction_static"] == 0.85
    assert s.args["disable_cuda_graph"] is True and s.args["speculative_num_steps"] == 3
    assert s.accept_length == 3.0  # speculative default
    assert parse_args([*argv, "--sim-accept-length", "2.5"]).accept_length == 2.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-path", "m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ([], "the following arguments are required: --model-path"),
        (["--model-path", "m", "--served-model-name", "a:b"], "cannot contain a colon"),
        (["--model-path", "m", "--sim-length-model", "weird"], "unknown length model"),
        (["--model-path", "m", "--sim-error-rate", "2"], "error_rate must be a number in [0, 1]"),
        (["--model-path", "m", "--speculative-algorithm", "MAGIC"], "Unknown speculative algorithm name: MAGIC"),
        (["--model-path", "m", "--sim-length-law", "cauchy"], "invalid choice: 'cauchy'"),
        (["--model-path", "m", "--sim-runaway-rate", "0.3"], "runaways alone pass any cap"),
        (["--model-path", "m", "--sim-length-model", "fixed:9", "--sim-length-law", "logt"], "no median"),
        (["--model-path", "m", "--sim-truncated-at", "0"], "--sim-truncated-at must be >= 1"),
        (["--model-path", "m", "--sim-length-law", "logt", "--sim-tail-dof", "0"], "tail_dof must be > 0"),
    ],
)
def test_bad_flags_exit_2_with_argparse_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_length_law_flags_keep_the_truncated_share():
    s = parse_args(["--model-path", "m", "--sim-length-law", "logt", "--sim-runaway-rate", "0.02"])
    assert s.length_model.kind == "logt" and s.length_model.runaway_rate == 0.02
    assert s.length_model.survival(4096) == pytest.approx(0.18, abs=0.001)
    short = parse_args(["--model-path", "m", "--sim-length-model", "short", "--sim-length-law", "bimodal"])
    assert short.length_model.survival(100) == pytest.approx(0.18, abs=0.002)
    chosen = parse_args(["--model-path", "m", "--sim-truncated-share", "0.3", "--sim-truncated-at", "8192"])
    assert chosen.length_model.survival(8192) == pytest.approx(0.3)
    assert parse_args(["--model-path", "m"]).args["enable_deterministic_inference"] is False
    assert parse_args(["--model-path", "m", "--enable-deterministic-inference"]).args[
        "enable_deterministic_inference"
    ]


def test_unknown_flag_exits_2_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "tracegen.simulator", "--model-path", "m", "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unrecognized arguments: --bogus" in proc.stderr


def test_fault_config_validation():
    for bad in (
        {"error_rate": -0.1},
        {"error_status": 404},
        {"error_status": True},
        {"drop_rate": "x"},
        {"crash_after": -1},
        {"wedged": "yes"},
        {"slow_start_s": -1},
        {"error_rate": 0.6, "hang_rate": 0.6},
    ):
        with pytest.raises(ValueError):
            FaultConfig().updated(bad)
    with pytest.raises(ValueError, match=r"unknown fault setting\(s\) \['nope'\]"):
        FaultConfig().updated({"nope": 1})


def test_fault_decisions_are_reproducible_and_match_rates():
    cfg = FaultConfig(error_rate=0.1, drop_rate=0.1, hang_rate=0.1, abort_rate=0.1, seed=5)
    a = [FaultInjector(cfg).decide() for _ in range(1)]
    inj1, inj2 = FaultInjector(cfg), FaultInjector(cfg)
    seq1 = [inj1.decide() for _ in range(4000)]
    seq2 = [inj2.decide() for _ in range(4000)]
    assert seq1 == seq2 and a[0] == seq1[0]
    for kind in (ERROR, DROP, HANG, ABORT):
        assert 0.08 < seq1.count(kind) / 4000 < 0.12, kind
    assert 0.55 < seq1.count(PASS) / 4000 < 0.65


def test_crash_and_wedge_counters_count_from_when_set():
    inj = FaultInjector(FaultConfig(crash_after=2))
    assert [inj.decide() for _ in range(3)] == [PASS, PASS, CRASH]
    inj = FaultInjector(FaultConfig())
    inj.decide()
    inj.update({"wedge_after": 1})
    inj.decide()
    assert not inj.config.wedged
    inj.decide()
    assert inj.config.wedged
