"""Command-line flags of the stand-in: `sglang.launch_server`'s flags plus `--sim-*` knobs.

Provisioning launches the stand-in with exactly the argv it would give SGLang, so the stand-in's parser is
SGLang's: every flag of the pinned SGLang release, with its spellings, value types and choices, comes from
the table in `tracegen.sglang.launch_flags` (checked against SGLang's own parser by the tests), and SGLang's
start-up checks after parsing are the same function. A flag SGLang refuses (unknown, ambiguous, a value
outside its choices) exits with code 2 and argparse's message, as SGLang does; a flag SGLang accepts is
accepted even when the stand-in has no use for it (GPU-only ones are recorded in /server_info and
otherwise ignored). The flags the stand-in models are listed in docs/simulator.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from tracegen.sglang.launch_flags import add_sglang_flags, resolved_max_running_requests, startup_refusal
from tracegen.simulator.faults import FaultConfig
from tracegen.simulator.lengths import LAWS, LengthModel, build_model

DEFAULT_MAX_MODEL_LEN = 40960  # Qwen3's config.json value
# The batch the stand-in decodes when SGLang would size it from KV-cache memory (no flag, no speculative cap).
DEFAULT_MAX_RUNNING = 256
DEFAULT_SPEC_ACCEPT_LENGTH = 3.0  # typical EAGLE/MTP accept length on chat traffic


class LaunchRefused(Exception):
    """The argv the stand-in would not start with; the message is the one it prints."""


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so fleet validation can ask the same parser; `parse_args` exits."""

    def error(self, message: str) -> NoReturn:
        raise LaunchRefused(message)


# The stand-in's own flags, in --help's order: (flag, add_argument's keyword arguments).
_SIM_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--sim-time-scale", {
        "type": float, "default": 1.0,
        "help": "simulated seconds per wall second (1000: a simulated hour in 3.6 s)",
    }),
    ("--sim-seed", {"type": int, "default": 0, "help": "seed of the per-prompt difficulty"}),
    ("--sim-max-model-len", {
        "type": int, "default": DEFAULT_MAX_MODEL_LEN,
        "help": "the model's own context length (its config.json), used and reported as max_model_len "
        "when --context-length is not given",
    }),
    # The length law.
    ("--sim-length-model", {
        "default": "reference",
        "help": "'reference' (default: the reference job's law, 18%% truncated at 4096), 'short', 'long', 'lognormal:MEDIAN:SIGMA', 'fixed:N'",
    }),
    ("--sim-length-law", {
        "default": None, "choices": [law for law in LAWS if law != "fixed"],
        "help": "shape of the natural lengths (default lognormal); the median moves to keep the truncated share",
    }),
    ("--sim-tail-dof", {"type": float, "default": None, "help": "logt: degrees of freedom (default 3)"}),
    ("--sim-long-mode-share", {
        "type": float, "default": None, "help": "bimodal: share of long samples (default 0.3)",
    }),
    ("--sim-long-mode-ratio", {
        "type": float, "default": None, "help": "bimodal: long/short median ratio (default 8)",
    }),
    ("--sim-runaway-rate", {
        "type": float, "default": None,
        "help": "share of samples that never stop and loop until the cap (default 0)",
    }),
    ("--sim-loop-shape", {
        "default": None, "choices": ["phrase", "varied"],
        "help": "how runaways loop: 'phrase' (default: an exact phrase of 8-63 tokens) or 'varied' (periods "
        "of 1 to 1,000 tokens, onset early and late, half of them near-exact)",
    }),
    ("--sim-prompt-variance-share", {
        "type": float, "default": None,
        "help": "share of the log-length variance fixed by the prompt; the rest is per sample (default 0.5)",
    }),
    ("--sim-truncated-share", {
        "type": float, "default": None,
        "help": "calibrate: share of samples longer than --sim-truncated-at (default: the model's own, 0.18 for seed)",
    }),
    ("--sim-truncated-at", {
        "type": int, "default": None,
        "help": "the cap --sim-truncated-share refers to (default 4096; 100 for 'short')",
    }),
    # Speed, tool calls and serving.
    ("--sim-step-base-ms", {
        "type": float, "default": 15.0, "help": "decode step time at batch 0 (simulated ms)",
    }),
    ("--sim-step-per-req-ms", {
        "type": float, "default": 0.15, "help": "extra step time per running request",
    }),
    # A prompt's prefill on one GPU. The default is a ~27B dense model in BF16 on one H100 SXM: a token of
    # prefill costs 2 x 27e9 FLOPs, and NVIDIA's H100 SXM datasheet gives 989 dense BF16 TFLOPS; at the ~40%
    # model FLOPs utilisation prefill reaches at 8k-token chunks, 989e12 x 0.4 / 54e9 = 7,300 tokens a second.
    ("--sim-prefill-tokens-per-s", {
        "type": float, "default": 7300.0,
        "help": "prompt tokens a GPU prefills a simulated second (default: a ~27B model on one H100)",
    }),
    ("--sim-accept-length", {
        "type": float, "default": None,
        "help": f"tokens per step with --speculative-algorithm (default {DEFAULT_SPEC_ACCEPT_LENGTH})",
    }),
    ("--sim-warmup-s", {
        "type": float, "default": 0.2, "help": "wall seconds of warm-up before /health is 200",
    }),
    ("--sim-tool-call-rate", {
        "type": float, "default": 0.25, "help": "share of prompts with `tools` that finish with a tool call",
    }),
    ("--sim-stream-interval-ms", {
        "type": float, "default": 50.0,
        "help": "most wall ms between two looks at a stream (sooner when its next event is due); events due "
        "meanwhile are written together, each its own (their count is --stream-interval's)",
    }),
    ("--sim-drain-timeout-s", {
        "type": float, "default": 600.0, "help": "SIGTERM: max wall seconds to drain",
    }),
    # Faults.
    ("--sim-error-rate", {"type": float, "default": 0.0}),
    ("--sim-error-status", {"type": int, "default": 500}),
    ("--sim-drop-rate", {"type": float, "default": 0.0}),
    ("--sim-hang-rate", {"type": float, "default": 0.0}),
    ("--sim-abort-rate", {"type": float, "default": 0.0}),
    ("--sim-crash-after", {"type": int, "default": None, "help": "exit after this many generation requests"}),
    ("--sim-wedge-after", {"type": int, "default": None, "help": "stop producing tokens after N requests"}),
    ("--sim-wedged", {"action": "store_true", "help": "start wedged: /health 200, no tokens"}),
    ("--sim-slow-start-s", {"type": float, "default": 0.0, "help": "extra wall seconds of /health 503"}),
    ("--sim-fault-seed", {"type": int, "default": None, "help": "fault RNG seed (default: --sim-seed)"}),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tracegen.simulator",
        description="SGLang stand-in: speaks sglang.launch_server's HTTP protocol without a GPU.",
    )
    add_sglang_flags(p.add_argument_group("SGLang's launch flags (sglang.srt.server_args)"))
    s = p.add_argument_group("stand-in only (--sim-*)")
    for flag, kwargs in _SIM_FLAGS:
        s.add_argument(flag, **kwargs)
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
        """The context the server enforces: --context-length, else the model's own (--sim-max-model-len)."""
        given = self.args["context_length"]
        return given if given is not None else self.args["sim_max_model_len"]

    @property
    def max_running(self) -> int:
        """The batch the engine decodes: --max-running-requests as SGLang resolves it, else what KV-cache
        memory would allow (the stand-in's DEFAULT_MAX_RUNNING)."""
        resolved = self.args["max_running_requests"]
        return resolved if resolved is not None else DEFAULT_MAX_RUNNING

    @property
    def served_model_name(self) -> str:
        return self.args["served_model_name"]


def _check(parser: argparse.ArgumentParser, ok: bool, message: str) -> None:
    if not ok:
        parser.error(message)


def _config_keys(action: argparse.Action) -> set[str]:
    return {action.dest} | {o[2:].replace("-", "_") for o in action.option_strings if o.startswith("--")}


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """SGLang's `--config FILE.yaml` (ConfigArgumentMerger): each key becomes `--key value`, placed before
    the command line's own flags (which win). The fleet hands the API key over this way, out of the
    world-readable argv."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    _check(parser, argv.count("--config") == 1, "Multiple config files specified! Only one allowed.")
    _check(parser, at + 1 < len(argv), "No config file specified after --config flag!")
    path = argv[at + 1]
    _check(parser, path.lower().endswith((".yaml", ".yml")), f"Config file must be YAML format, got: {path}")
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    data = {} if data is None else data
    _check(parser, isinstance(data, dict), "Config file must contain a dictionary at root level")
    switches = {
        k for a in parser._actions if isinstance(a, argparse._StoreTrueAction) for k in _config_keys(a)
    }
    one_value = [
        a
        for a in parser._actions
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreAction) or a.nargs is None
    ]
    unsupported = {
        k
        for a in parser._actions
        if a.option_strings and a not in one_value and "--config" not in a.option_strings
        for k in _config_keys(a)
    }
    unsupported -= {k for a in one_value for k in _config_keys(a)}
    from_file: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        _check(parser, str(key).replace("-", "_") not in unsupported, f"Unsupported config option '{key}'")
        if isinstance(value, bool):
            if str(key).replace("-", "_") in switches:
                from_file += [flag] if value else []
            else:
                from_file += [flag, str(value).lower()]
        elif isinstance(value, list):
            from_file += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            import json

            from_file += [flag, json.dumps(value)]
        else:
            from_file += [flag, str(value)]
    return from_file + argv[:at] + argv[at + 2 :]


def parse_args(argv: Sequence[str]) -> SimSettings:
    """Parse and validate argv; on any error prints argparse's message and exits with code 2, as SGLang's
    parser does."""
    parser = build_parser()
    try:
        return _settings(parser, argv)
    except LaunchRefused as exc:
        argparse.ArgumentParser.error(parser, str(exc))


def launch_refusal(argv: Sequence[str]) -> str | None:
    """Why the stand-in would not start with `argv`, or None: what fleet validation asks before launching."""
    try:
        _settings(build_parser(), argv)
    except LaunchRefused as exc:
        return str(exc)
    return None


def _settings(parser: argparse.ArgumentParser, argv: Sequence[str]) -> SimSettings:
    a = vars(parser.parse_args(_with_config_file(parser, list(argv))))
    _resolve_sglang_args(parser, a)
    _check_sim_args(parser, a)
    accept = _accept_length(parser, a)
    return SimSettings(
        args=a, argv=tuple(argv), length_model=_length_model(parser, a), faults=_faults(parser, a),
        accept_length=accept,
    )


DEPRECATED_TOOL_CALL_PARSERS = {"qwen25": "qwen", "glm45": "glm"}


def _resolve_sglang_args(parser: argparse.ArgumentParser, a: dict[str, Any]) -> None:
    """SGLang's flags as its start-up checks and resolves them: its refusals, and the defaults it fills in."""
    # Not required by SGLang's parser, but its start-up fails without a model to load.
    _check(parser, a["model_path"] is not None, "the following arguments are required: --model-path")
    refusal = startup_refusal(a)
    _check(parser, refusal is None, str(refusal))
    if a["served_model_name"] is None:
        a["served_model_name"] = a["model_path"]
    _check(
        parser,
        ":" not in a["served_model_name"],
        f"--served-model-name must not contain ':': {a['served_model_name']!r}",
    )
    if a["tokenizer_path"] is None:
        a["tokenizer_path"] = a["model_path"]
    # SGLang's start-up renames its deprecated parser names (serving_hook._handle_deprecated_args), and
    # /server_info reports the new one: launched with qwen25, a server says qwen.
    a["tool_call_parser"] = DEPRECATED_TOOL_CALL_PARSERS.get(a["tool_call_parser"], a["tool_call_parser"])
    _check(parser, 0 <= a["port"] <= 65535, f"--port must be in 0..65535, got {a['port']}")
    _check(
        parser,
        a["context_length"] is None or a["context_length"] >= 2,
        f"--context-length must be >= 2, got {a['context_length']}",
    )
    _check(
        parser, a["sim_max_model_len"] >= 2, f"--sim-max-model-len must be >= 2, got {a['sim_max_model_len']}"
    )
    _check(
        parser,
        a["max_running_requests"] is None or a["max_running_requests"] >= 1,
        f"--max-running-requests must be >= 1, got {a['max_running_requests']}",
    )
    # As /server_info reports it: the flag, or the cap SGLang's start-up sets for speculative decoding.
    a["max_running_requests"] = resolved_max_running_requests(
        a["max_running_requests"], a["speculative_algorithm"]
    )
    _check(
        parser,
        a["max_queued_requests"] is None or a["max_queued_requests"] >= 0,
        f"--max-queued-requests must be >= 0, got {a['max_queued_requests']}",
    )


def _check_sim_args(parser: argparse.ArgumentParser, a: dict[str, Any]) -> None:
    _check(parser, a["sim_time_scale"] > 0, f"--sim-time-scale must be > 0, got {a['sim_time_scale']}")
    _check(
        parser,
        a["sim_prefill_tokens_per_s"] > 0,
        f"--sim-prefill-tokens-per-s must be > 0, got {a['sim_prefill_tokens_per_s']}",
    )
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


def _accept_length(parser: argparse.ArgumentParser, a: dict[str, Any]) -> float:
    """Tokens per decode step: 1 without speculative decoding; recorded in `a` as /server_info reports it."""
    accept = 1.0
    if a["speculative_algorithm"] is not None:
        accept = a["sim_accept_length"] if a["sim_accept_length"] is not None else DEFAULT_SPEC_ACCEPT_LENGTH
    _check(parser, accept >= 1, f"--sim-accept-length must be >= 1, got {accept}")
    a["sim_accept_length"] = accept
    return accept


def _length_model(parser: argparse.ArgumentParser, a: dict[str, Any]) -> LengthModel:
    shape = {
        field: a[flag]
        for field, flag in (
            ("tail_dof", "sim_tail_dof"), ("long_share", "sim_long_mode_share"),
            ("long_ratio", "sim_long_mode_ratio"), ("runaway_rate", "sim_runaway_rate"), ("loop_shape", "sim_loop_shape"),
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
        return build_model(
            a["sim_length_model"],
            a["sim_length_law"],
            a["sim_truncated_share"],
            a["sim_truncated_at"],
            **shape,
        )
    except ValueError as exc:
        parser.error(f"--sim-length-model: {exc}")


def _faults(parser: argparse.ArgumentParser, a: dict[str, Any]) -> FaultConfig:
    fault_seed = a["sim_fault_seed"] if a["sim_fault_seed"] is not None else a["sim_seed"]
    try:
        return FaultConfig(
            error_rate=a["sim_error_rate"], error_status=a["sim_error_status"], drop_rate=a["sim_drop_rate"],
            hang_rate=a["sim_hang_rate"], abort_rate=a["sim_abort_rate"], crash_after=a["sim_crash_after"],
            wedge_after=a["sim_wedge_after"], wedged=a["sim_wedged"], slow_start_s=a["sim_slow_start_s"],
            seed=fault_seed,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(f"fault flags: {exc}")
