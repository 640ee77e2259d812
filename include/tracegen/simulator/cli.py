"""Command-line flags of the stand-in: `sglang.launch_server`'s flags plus `--sim-*` knobs.

Provisioning launches the stand-in with exactly the argv it would give SGLang, so every SGLang flag
the pipeline may pass is accepted (GPU-only ones are recorded in /server_info and otherwise
ignored), and an unknown flag exits with code 2 and argparse's message, as SGLang does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracegen.simulator.faults import FaultConfig
from tracegen.simulator.lengths import LAWS, LengthModel, build_model

DEFAULT_CONTEXT_LENGTH = 40960  # Qwen3's config.json value
DEFAULT_MAX_RUNNING = 256
DEFAULT_SPEC_ACCEPT_LENGTH = 3.0  # typical EAGLE/MTP accept length on chat traffic
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "LOOKAHEAD")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# SGLang flags that only matter on a GPU: (flag, type or "bool"). Accepted, stored, ignored.
_IGNORED_VALUE_FLAGS: tuple[tuple[str, Any], ...] = (
    ("--tokenizer-path", str), ("--tokenizer-mode", str), ("--load-format", str), ("--revision", str),
    ("--dtype", str), ("--kv-cache-dtype", str), ("--quantization", str), ("--attention-backend", str),
    ("--prefill-attention-backend", str), ("--decode-attention-backend", str), ("--sampling-backend", str),
    ("--grammar-backend", str), ("--mm-attention-backend", str), ("--moe-runner-backend", str),
    ("--mem-fraction-static", float), ("--chunked-prefill-size", int), ("--max-prefill-tokens", int),
    ("--max-total-tokens", int), ("--schedule-policy", str), ("--schedule-conservativeness", float),
    ("--cuda-graph-max-bs", int), ("--torch-compile-max-bs", int), ("--base-gpu-id", int),
    ("--gpu-id-step", int), ("--pp-size", int), ("--ep-size", int), ("--nnodes", int), ("--node-rank", int),
    ("--dist-init-addr", str), ("--random-seed", int), ("--watchdog-timeout", float), ("--log-level-http", str),
    ("--tool-call-parser", str), ("--chat-template", str), ("--stream-interval", int), ("--device", str),
    ("--download-dir", str), ("--weight-version", str), ("--speculative-draft-model-path", str),
    ("--speculative-draft-model-revision", str), ("--speculative-num-steps", int),
    ("--speculative-eagle-topk", int), ("--speculative-num-draft-tokens", int),
    ("--speculative-accept-threshold-single", float), ("--speculative-accept-threshold-acc", float),
    ("--speculative-token-map", str), ("--speculative-draft-load-format", str),
    ("--speculative-attention-mode", str), ("--file-storage-path", str), ("--json-model-override-args", str),
    ("--preferred-sampling-params", str), ("--tokenizer-worker-num", int), ("--decode-log-interval", int),
)  # fmt: skip
_IGNORED_BOOL_FLAGS = (
    "--trust-remote-code", "--disable-cuda-graph", "--disable-radix-cache", "--enable-torch-compile",
    "--enable-mixed-chunk", "--enable-dp-attention", "--disable-overlap-schedule", "--show-time-cost",
    "--enable-cache-report", "--allow-auto-truncate", "--enable-dp-lm-head", "--skip-tokenizer-init",
    "--disable-cuda-graph-padding", "--enable-nan-detection", "--enable-p2p-check", "--log-requests",
    "--enable-memory-saver", "--disable-custom-all-reduce", "--disable-shared-experts-fusion",
    "--enable-two-batch-overlap", "--enable-request-time-stats-logging",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tracegen.simulator",
        description="SGLang stand-in: speaks sglang.launch_server's HTTP protocol without a GPU.",
    )
    g = p.add_argument_group("SGLang flags the stand-in honours")
    g.add_argument("--model-path", "--model", dest="model_path", required=True)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--reasoning-parser", default=None)
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    g.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    g.add_argument("--max-running-requests", type=int, default=None)
    g.add_argument("--max-queued-requests", type=int, default=None)
    g.add_argument("--speculative-algorithm", default=None)
    g.add_argument("--enable-metrics", action="store_true")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    g.add_argument("--skip-server-warmup", action="store_true")
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    # With it a request's seed (default 42) fixes its sample; without it every request samples afresh.
    g.add_argument("--enable-deterministic-inference", action="store_true")

    ig = p.add_argument_group("SGLang flags accepted and ignored (GPU-only)")
    for flag, kind in _IGNORED_VALUE_FLAGS:
        ig.add_argument(flag, type=kind, default=None)
    for flag in _IGNORED_BOOL_FLAGS:
        ig.add_argument(flag, action="store_true")

    s = p.add_argument_group("stand-in only (--sim-*)")
    s.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="simulated seconds per wall second (1000: a simulated hour in 3.6 s)",
    )
    s.add_argument("--sim-seed", type=int, default=0, help="seed of the per-prompt difficulty")
    s.add_argument(
        "--sim-length-model",
        default="seed",
        help="'seed' (default: 18%% truncated at 4096), 'short', 'long', 'lognormal:MEDIAN:SIGMA', 'fixed:N'",
    )
    s.add_argument(
        "--sim-length-law",
        default=None,
        choices=[law for law in LAWS if law != "fixed"],
        help="shape of the natural lengths (default lognormal); the median moves to keep the truncated share",
    )
    s.add_argument("--sim-tail-dof", type=float, default=None, help="logt: degrees of freedom (default 3)")
    s.add_argument(
        "--sim-long-mode-share",
        type=float,
        default=None,
        help="bimodal: share of long samples (default 0.3)",
    )
    s.add_argument(
        "--sim-long-mode-ratio", type=float, default=None, help="bimodal: long/short median ratio (default 8)"
    )
    s.add_argument(
        "--sim-runaway-rate",
        type=float,
        default=None,
        help="share of samples that never stop and loop until the cap (default 0)",
    )
    s.add_argument(
        "--sim-prompt-variance-share",
        type=float,
        default=None,
        help="share of the log-length variance fixed by the prompt; the rest is per sample (default 0.5)",
    )
    s.add_argument(
        "--sim-truncated-share",
        type=float,
        default=None,
        help="calibrate: share of samples longer than --sim-truncated-at (default: the model's own, 0.18 for seed)",
    )
    s.add_argument(
        "--sim-truncated-at",
        type=int,
        default=None,
        help="the cap --sim-truncated-share refers to (default 4096; 100 for 'short')",
    )
    s.add_argument(
        "--sim-step-base-ms", type=float, default=15.0, help="decode step time at batch 0 (simulated ms)"
    )
    s.add_argument(
        "--sim-step-per-req-ms", type=float, default=0.15, help="extra step time per running request"
    )
    s.add_argument(
        "--sim-accept-length",
        type=float,
        default=None,
        help=f"tokens per step with --speculative-algorithm (default {DEFAULT_SPEC_ACCEPT_LENGTH})",
    )
    s.add_argument(
        "--sim-warmup-s", type=float, default=0.2, help="wall seconds of warm-up before /health is 200"
    )
    s.add_argument(
        "--sim-tool-call-rate",
        type=float,
        default=0.25,
        help="share of prompts with `tools` that finish with a tool call",
    )
    s.add_argument(
        "--sim-stream-interval-ms", type=float, default=50.0, help="wall ms between streamed chunks"
    )
    s.add_argument(
        "--sim-drain-timeout-s", type=float, default=600.0, help="SIGTERM: max wall seconds to drain"
    )
    s.add_argument("--sim-error-rate", type=float, default=0.0)
    s.add_argument("--sim-error-status", type=int, default=500)
    s.add_argument("--sim-drop-rate", type=float, default=0.0)
    s.add_argument("--sim-hang-rate", type=float, default=0.0)
    s.add_argument("--sim-abort-rate", type=float, default=0.0)
    s.add_argument(
        "--sim-crash-after", type=int, default=None, help="exit after this many generation requests"
    )
    s.add_argument("--sim-wedge-after", type=int, default=None, help="stop producing tokens after N requests")
    s.add_argument("--sim-wedged", action="store_true", help="start wedged: /health 200, no tokens")
    s.add_argument("--sim-slow-start-s", type=float, default=0.0, help="extra wall seconds of /health 503")
    s.add_argument("--sim-fault-seed", type=int, default=None, help="fault RNG seed (default: --sim-seed)")
    return p


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The resolved launch configuration the server runs with."""

    args: dict[str, Any]  # every flag, resolved, as /server_info reports it
    argv: tuple[str, ...]
    length_model: LengthModel
    faults: FaultConfig
    accept_length: float

    @property
    def context_length(self) -> int:
        return self.args["context_length"]

    @property
    def served_model_name(self) -> str:
        return self.args["served_model_name"]


def _check(parser: argparse.ArgumentParser, ok: bool, message: str) -> None:
    if not ok:
        parser.error(message)  # exits 2 with usage, like argparse's own errors


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """SGLang's `--config FILE.yaml`: each key becomes `--key value`, placed before the command line's
    own flags (which win). The fleet hands the API key over this way, out of the world-readable argv."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    _check(parser, argv.count("--config") == 1 and at + 1 < len(argv), "--config takes exactly one file")
    path = argv[at + 1]
    _check(parser, path.endswith((".yaml", ".yml")), f"--config {path}: must be a .yaml or .yml file")
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    _check(parser, isinstance(data, dict), f"--config {path}: must hold a mapping at its root")
    switches = {s for a in parser._actions if a.nargs == 0 and a.const is True for s in a.option_strings}
    from_file: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if isinstance(value, bool) and flag in switches:
            from_file += [flag] if value else []
        elif isinstance(value, list):
            from_file += [flag, *(str(v) for v in value)] if value else []
        else:
            from_file += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return from_file + argv[:at] + argv[at + 2 :]


def parse_args(argv: Sequence[str]) -> SimSettings:
    """Parse and validate argv; on any error prints argparse's message and exits with code 2."""
    parser = build_parser()
    ns = parser.parse_args(_with_config_file(parser, list(argv)))
    a = vars(ns)
    if a["served_model_name"] is None:
        a["served_model_name"] = a["model_path"]
    _check(
        parser,
        ":" not in a["served_model_name"],
        f"--served-model-name must not contain ':': {a['served_model_name']!r}",
    )
    if a["tokenizer_path"] is None:
        a["tokenizer_path"] = a["model_path"]
    if a["context_length"] is None:
        a["context_length"] = DEFAULT_CONTEXT_LENGTH
    if a["max_running_requests"] is None:
        a["max_running_requests"] = DEFAULT_MAX_RUNNING
    _check(parser, 0 <= a["port"] <= 65535, f"--port must be in 0..65535, got {a['port']}")
    _check(parser, a["context_length"] >= 2, f"--context-length must be >= 2, got {a['context_length']}")
    _check(
        parser,
        a["max_running_requests"] >= 1,
        f"--max-running-requests must be >= 1, got {a['max_running_requests']}",
    )
    _check(
        parser,
        a["max_queued_requests"] is None or a["max_queued_requests"] >= 0,
        f"--max-queued-requests must be >= 0, got {a['max_queued_requests']}",
    )
    _check(parser, a["sim_time_scale"] > 0, f"--sim-time-scale must be > 0, got {a['sim_time_scale']}")
    _check(parser, a["sim_warmup_s"] >= 0, f"--sim-warmup-s must be >= 0, got {a['sim_warmup_s']}")
    _check(
        parser,
        0 <= a["sim_tool_call_rate"] <= 1,
        f"--sim-tool-call-rate must be in [0, 1], got {a['sim_tool_call_rate']}",
    )
    _check(
        parser,
        a["sim_stream_interval_ms"] > 0,
        f"--sim-stream-interval-ms must be > 0, got {a['sim_stream_interval_ms']}",
    )
    algo = a["speculative_algorithm"]
    _check(
        parser,
        algo is None or algo.upper() in SPECULATIVE_ALGORITHMS,
        f"--speculative-algorithm {algo!r} is not one of {', '.join(SPECULATIVE_ALGORITHMS)}",
    )
    accept = 1.0
    if algo is not None:
        accept = a["sim_accept_length"] if a["sim_accept_length"] is not None else DEFAULT_SPEC_ACCEPT_LENGTH
    _check(parser, accept >= 1, f"--sim-accept-length must be >= 1, got {accept}")
    a["sim_accept_length"] = accept
    shape = {
        field: a[flag]
        for field, flag in (
            ("tail_dof", "sim_tail_dof"), ("long_share", "sim_long_mode_share"),
            ("long_ratio", "sim_long_mode_ratio"), ("runaway_rate", "sim_runaway_rate"),
            ("prompt_share", "sim_prompt_variance_share"),
        )
        if a[flag] is not None
    }  # fmt: skip
    _check(
        parser,
        a["sim_truncated_at"] is None or a["sim_truncated_at"] >= 1,
        f"--sim-truncated-at must be >= 1, got {a['sim_truncated_at']}",
    )
    try:
        length_model = build_model(
            a["sim_length_model"],
            a["sim_length_law"],
            a["sim_truncated_share"],
            a["sim_truncated_at"],
            **shape,
        )
    except ValueError as exc:
        parser.error(f"--sim-length-model: {exc}")
    fault_seed = a["sim_fault_seed"] if a["sim_fault_seed"] is not None else a["sim_seed"]
    try:
        faults = FaultConfig(
            error_rate=a["sim_error_rate"], error_status=a["sim_error_status"], drop_rate=a["sim_drop_rate"],
            hang_rate=a["sim_hang_rate"], abort_rate=a["sim_abort_rate"], crash_after=a["sim_crash_after"],
            wedge_after=a["sim_wedge_after"], wedged=a["sim_wedged"], slow_start_s=a["sim_slow_start_s"],
            seed=fault_seed,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(f"fault flags: {exc}")
    # SGLang reports the input limit as context minus one generated token.
    a["max_req_input_len"] = a["context_length"] - 1
    return SimSettings(
        args=a, argv=tuple(argv), length_model=length_model, faults=faults, accept_length=accept
    )
