"""SGLang's launch flags as the pinned SGLang release parses them: one table for the fleet's validation and
the stand-in, so a fleet that validates launches real SGLang, and the stand-in refuses what SGLang refuses.

`sglang_launch_flags.json` beside this module is generated from SGLang's own parser
(`sglang.srt.server_args.ServerArgs.add_cli_args`) by tests/fixtures/sglang_reference.py, and the tests
check it against that parser: every flag with its spellings, action, value type, choices and default; the
speculative-decoding algorithm names SGLang's start-up resolves; the running-request cap that start-up sets
for each of them when --max-running-requests is not given; the keys --cuda-graph-config takes. Nothing here
imports SGLang. docs/simulator.md says how to re-check against a newer release.

The value types are SGLang's own argparse types, re-implemented under their SGLang names so argparse's
messages read the same ("invalid human_readable_int value: ...").
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Sequence
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

TABLE_FILE = Path(__file__).with_name("sglang_launch_flags.json")


@cache
def table() -> dict[str, Any]:
    """The flag table (see the module docstring)."""
    return json.loads(TABLE_FILE.read_text())


def sglang_version() -> str:
    """The SGLang release whose parser the table mirrors."""
    return table()["sglang"]


class LaunchArgvError(ValueError):
    """An argv SGLang would not start with; the message is the one SGLang gives."""


# ---- SGLang's argparse value types ---------------------------------------------------------------------

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def human_readable_int(value: str) -> int:
    """sglang.srt.utils.common.human_readable_int: 32768, 32k (SI, decimals allowed) or 32Ki (IEC)."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'. "
                    f"Use an integer IEC value such as '{int(Decimal(number))}{suffix}', "
                    f"or an SI value such as '{number}{suffix[0]}'."
                )
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. "
            "Use a plain integer, SI suffixes (1k, 1M), or IEC suffixes (1Ki, 1Mi). "
            "Suffixes are case-sensitive."
        ) from None


def loads(value: str) -> Any:
    """json.loads, SGLang's type for JSON-valued flags (argparse names it in its message)."""
    return json.loads(value)


def json_list_type(value: str) -> Any:
    """sglang.srt.utils.common.json_list_type."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON list: {value}. Please provide a valid JSON list."
        ) from None


def nullable_str(value: str) -> str | None:
    """sglang.srt.utils.common.nullable_str: "" and "None" mean no value."""
    if not value or value == "None":
        return None
    return value


def parse_cuda_graph_backend_arg(raw: str) -> str:
    """sglang.srt.model_executor.cuda_graph_config.parse_cuda_graph_backend_arg."""
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


def parse_cuda_graph_config_arg(raw: str) -> dict[str, dict[str, Any]]:
    """sglang.srt.model_executor.cuda_graph_config.parse_cuda_graph_config_arg: a JSON object of phase to
    settings, each phase's keys among the ones SGLang allows for it."""
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--cuda-graph-config must be JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"--cuda-graph-config must be a JSON object, got {type(parsed).__name__}"
        )
    allowed_keys = table()["cuda_graph_config_keys"]
    phases = tuple(allowed_keys)
    result: dict[str, dict[str, Any]] = {}
    for phase, settings in parsed.items():
        phase = str(phase)
        if phase not in allowed_keys:
            raise argparse.ArgumentTypeError(
                f"--cuda-graph-config: unknown phase '{phase}', expected one of {phases}"
            )
        if not isinstance(settings, dict):
            raise argparse.ArgumentTypeError(
                f"--cuda-graph-config['{phase}'] must be a JSON object, got {type(settings).__name__}"
            )
        if "backend" in settings:
            parse_cuda_graph_backend_arg(settings["backend"])
        allowed = tuple(allowed_keys[phase])
        for key in settings:
            if key not in allowed:
                raise argparse.ArgumentTypeError(
                    f"--cuda-graph-config['{phase}']: unknown key '{key}', expected one of {allowed}"
                )
        result[phase] = dict(settings)
    return result


VALUE_TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "json": loads,
    "human_readable_int": human_readable_int,
    "json_list": json_list_type,
    "nullable_str": nullable_str,
    "cuda_graph_backend": parse_cuda_graph_backend_arg,
    "cuda_graph_config": parse_cuda_graph_config_arg,
}


class _StoreChoiceAsValue(argparse.Action):
    """SGLang's DeprecatedStoreConstAction with a value: the retired valued flag's one accepted choice
    stores a fixed value on the flag that replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        setattr(namespace, self.dest, self.const)


class _LoraPaths(argparse.Action):
    """SGLang's LoRAPathAction: paths, or JSON objects naming `lora_name` and `lora_path`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        paths: list[Any] = []
        for path in values or []:
            path = path.strip()
            if path.startswith("{") and path.endswith("}"):
                try:
                    obj = json.loads(path)
                except json.JSONDecodeError as exc:
                    parser.error(f"{option_string}: {path!r} is not JSON: {exc}")
                if not isinstance(obj, dict) or "lora_path" not in obj or "lora_name" not in obj:
                    parser.error(
                        f"{path!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys."
                    )
                paths.append(obj)
            else:
                paths.append(path)
        setattr(namespace, self.dest, paths)


def add_sglang_flags(container: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add every SGLang launch flag of the table to a parser or argument group, in SGLang's order (the order
    decides which default a shared destination starts with, as in SGLang's parser)."""
    for entry in table()["flags"]:
        options, kind = entry["options"], entry["action"]
        common = {"dest": entry["dest"], "default": entry["default"]}
        if kind in ("store_true", "store_false"):
            container.add_argument(*options, action=kind, **common)
        elif kind == "boolean_optional":
            # argparse derives the --no- spelling from the positive one.
            positive = [o for o in options if not o.startswith("--no-")]
            container.add_argument(*positive, action=argparse.BooleanOptionalAction, **common)
        elif kind == "store_choice_as_value":
            container.add_argument(*options, action=_StoreChoiceAsValue, choices=entry["choices"],
                                   const=entry["const"], **common)  # fmt: skip
        elif kind == "lora_paths":
            container.add_argument(*options, action=_LoraPaths, nargs=entry["nargs"],
                                   type=VALUE_TYPES[entry["type"]], **common)  # fmt: skip
        elif kind == "store":
            extra = {"const": entry["const"]} if entry["nargs"] == "?" else {}
            container.add_argument(*options, nargs=entry["nargs"], type=VALUE_TYPES.get(entry["type"]),
                                   choices=entry["choices"], **common, **extra)  # fmt: skip
        else:
            raise ValueError(f"{TABLE_FILE.name}: {options}: unknown action {kind!r}")


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise LaunchArgvError(message)


@cache
def _parser() -> argparse.ArgumentParser:
    parser = _RaisingParser(prog="sglang serve")
    add_sglang_flags(parser)
    return parser


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """`argv` parsed as SGLang's parser parses it; LaunchArgvError with argparse's message if it refuses."""
    return vars(_parser().parse_args(list(argv)))


# ---- what SGLang's start-up refuses or decides after parsing -------------------------------------------


def log_levels() -> frozenset[str]:
    """--log-level values SGLang starts with: it looks the upper-cased value up as `logging.<LEVEL>`."""
    return frozenset(logging.getLevelNamesMapping())


def startup_refusal(args: dict[str, Any]) -> str | None:
    """Why SGLang, having parsed its flags into `args`, still would not start; None when it would.

    The checks SGLang makes right after parsing or while resolving its arguments: the log level, the
    speculative-decoding algorithm's name, and a served model name without ':'.
    """
    level = args.get("log_level")
    if isinstance(level, str) and level.upper() not in log_levels():
        return f"module 'logging' has no attribute '{level.upper()}'"
    algorithm = args.get("speculative_algorithm")
    if algorithm is not None and algorithm.upper() not in table()["speculative_algorithms"]:
        return f"Unknown speculative algorithm name: {algorithm}"
    served = args.get("served_model_name")
    if isinstance(served, str) and ":" in served:
        return "served_model_name cannot contain a colon (':') character."
    return None


def launch_refusal(argv: Sequence[str]) -> str | None:
    """Why SGLang would not start with `argv` (its parser, then its start-up checks); None when it would."""
    try:
        args = parse(argv)
    except LaunchArgvError as exc:
        return str(exc)
    return startup_refusal(args)


def speculative_running_cap(algorithm: str | None) -> int | None:
    """The running-request cap SGLang's start-up sets for `algorithm` without --max-running-requests."""
    if algorithm is None:
        return None
    return table()["speculative_max_running_requests"].get(str(algorithm).upper())


def resolved_max_running_requests(max_running_requests: int | None, algorithm: str | None) -> int | None:
    """--max-running-requests as SGLang resolves it at start-up: the flag's value; without it, the cap of
    a speculative-decoding algorithm (48 for EAGLE, EAGLE3, NEXTN, ... in 0.5.23); otherwise None, and the
    scheduler sizes the batch from KV-cache memory."""
    if max_running_requests is not None:
        return max_running_requests
    return speculative_running_cap(algorithm)
