"""The typed, validated configuration of one generation run, built from the DAG's params.

Every field carries its own rule (`Int`, `Float`, `Choice`, `Uri`): the rule validates the value here
and also describes the trigger form's field (`tracegen.params` builds the Airflow `Param`s from it), so
the form and the validation cannot drift. Errors name the param and the accepted range.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tracegen.common import locations
from tracegen.common.cap_rule import HIGHEST, LOWEST, CapRefused, check_cap
from tracegen.common.locations import state_dir  # noqa: F401  (its home is `locations`; callers import it from here)

TRUNCATED_POLICIES = ("extend", "regenerate", "keep")
GATE_MODES = ("ask", "stop", "warn")
INVALID_ROW_POLICIES = ("record", "fail")
MEASURE_MODES = ("auto", "always", "never")
RUNAWAY_POLICIES = ("drop", "resample", "keep")
WHILE_ASKING_MODES = ("recommended", "current", "idle")
# How a dataset's rows are read (`tracegen.dataset.reading`): the input form, told per row under `auto`; which
# assistant turns are generated; the fields a dataset's own names may be mapped onto.
DATASET_FORMATS = ("auto", "messages", "sharegpt", "prompt")
TURN_MODES = ("last", "first", "each", "chain")
MAPPABLE_FIELDS = ("messages", "conversations", "prompt", "system", "id", "tools", "category")

# Airflow run ids contain ':' and '+'; storage keys and spool dirs want a tamer alphabet. A safe run id
# matches RUN_ID_PATTERN; the review pages accept nothing else.
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,119}")
RUN_ID_MAX = 120
# What `safe_run_id` appends to an id it had to change: "--" and 16 hex digits of the exact id's SHA-256.
_HASH_SUFFIX = re.compile(r"--[0-9a-f]{16}\Z")
_HASH_HEX = 16
PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parents[1]
SAMPLE_DATASET = PACKAGE_DIR / "sample_data" / "agentic_coding_prompts.jsonl.gz"
LOCAL_SIM = "local-sim"  # the fleet source naming the bundled simulated fleet (tracegen.fleet.sources)


class ConfigError(ValueError):
    """A param is missing, has the wrong type or is out of range; the message names it."""


def safe_run_id(run_id: str) -> str:
    """The id a run's files are stored under (`runs/<id>/`, ledger rows, spool dirs, its raise Variable): it
    matches RUN_ID_PATTERN, stays recognisable, and two different run ids never share it.

    An id that already matches the pattern is kept as it is, unless it ends the way a changed id does.
    Any other id keeps its readable part (unsafe characters replaced, cut to length) and gets "--" and a
    hash of the exact id: Airflow accepts both `manual__...T12:00:56+00:00` and `manual__...T12_00_56_00_00`,
    which read alike once cleaned, and the hash keeps them apart. A kept id never ends like a changed one,
    so no id can choose to be stored where another run is."""
    if not isinstance(run_id, str):
        raise ConfigError(f"run id must be a string, got {type(run_id).__name__}")
    if RUN_ID_PATTERN.fullmatch(run_id) and not _HASH_SUFFIX.search(run_id):
        return run_id
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id).strip("._-")
    if not re.search(r"[A-Za-z0-9]", cleaned):
        raise ConfigError(f"run id {run_id!r} has no usable characters")
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
    readable = cleaned[: RUN_ID_MAX - len(digest) - 2].rstrip("._-")
    return f"{readable}--{digest}"


def legacy_run_id(run_id: str) -> str | None:
    """The id a run was stored under before stored ids carried a hash (the cleaned id alone), or None when
    it is the same as `safe_run_id`'s. Two Airflow runs could share that form, so it finds a run's files only
    when their record names that exact Airflow run (`stored_as`)."""
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id).strip("._")[:RUN_ID_MAX]
    if not cleaned or not RUN_ID_PATTERN.fullmatch(cleaned) or cleaned == safe_run_id(run_id):
        return None
    return cleaned


def stored_as(stored: str, airflow_run_id: str, recorded: str | None) -> bool:
    """Whether `runs/<stored>/`, whose record names the Airflow run `recorded` (None: no record, or one
    naming none), holds the Airflow run `airflow_run_id`'s files: the one rule every reader that maps an
    Airflow run to its files applies. Never when the record names another Airflow run."""
    if recorded not in (None, airflow_run_id):
        return False
    try:
        if stored == safe_run_id(airflow_run_id):
            return True
    except ConfigError:
        return False
    return recorded == airflow_run_id and stored == legacy_run_id(airflow_run_id)


def check_conf_keys(conf: Any, declared: Any, *, dag_id: str) -> None:
    """`ConfigError` naming every key of a DagRun's conf that is not one of its DAG's params, each with the
    closest param. Airflow merges a conf key it does not know into the params as it is, and nothing reads
    it: `max_token` would run at the default cap without a word."""
    if not conf:
        return
    if not isinstance(conf, dict):
        raise ConfigError(f"the conf of a {dag_id} run must be a JSON object, got {type(conf).__name__}")
    known = sorted(str(k) for k in declared)
    unknown = sorted(str(k) for k in conf if k not in declared)
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ConfigError(f"unknown conf key{'s' if len(unknown) > 1 else ''} {', '.join(named)}: {dag_id} takes "
                      f"{', '.join(known) or 'no conf'}; correct the conf and trigger again")


# ---- rules: one definition per param, for validation and for the trigger form ---------------------


def bounded(kind: str, bounds: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A number field's JSON schema with its bounds inside `allOf`. Airflow checks them when a run is
    triggered: a value outside is refused, naming the bound, and no run is created. The trigger form's number
    input reads only a top-level minimum and maximum, and clamps what was typed to them when it loses focus
    (0 became 1, 10,000,000 the maximum, and the run started at that); it sees none here, so it sends what the
    person typed, and the refusal is Airflow's, shown in the dialog."""
    return {"type": kind, "allOf": [bounds], **more}


@dataclass(frozen=True, kw_only=True)
class Rule:
    """How a field is checked and, when it has a `title`, shown on the trigger form."""

    title: str | None = None  # None: not a trigger-form param
    description: str = ""

    def check(self, name: str, value: Any) -> None:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """JSON-schema keywords for an Airflow `Param` (type, range, enum)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Rule):
    low: int = 0
    high: int = 0
    zero_ok: bool = False  # 0 is also accepted (a "choose it for me" value below `low`)

    def check(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
        if self.zero_ok and value == 0:
            return
        if not self.low <= value <= self.high:
            zero = "0 or " if self.zero_ok else ""
            raise ConfigError(f"{name}: {value} is outside {zero}[{self.low}, {self.high}]")

    def schema(self) -> dict[str, Any]:
        if self.zero_ok:
            return bounded("integer", {"minimum": 0, "maximum": self.high},
                           anyOf=[{"enum": [0]}, {"minimum": self.low}])
        return bounded("integer", {"minimum": self.low, "maximum": self.high})


@dataclass(frozen=True)
class Cap(Rule):
    """A completion cap: `tracegen.common.cap_rule`'s one check (an integer within [LOWEST, HIGHEST]), its bounds
    the form's."""

    def check(self, name: str, value: Any) -> None:
        try:
            check_cap(value, name=name)
        except CapRefused as exc:
            raise ConfigError(str(exc)) from None

    def schema(self) -> dict[str, Any]:
        return bounded("integer", {"minimum": LOWEST, "maximum": HIGHEST})


@dataclass(frozen=True)
class Float(Rule):
    low: float = 0.0
    high: float = 0.0
    low_open: bool = False

    def check(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
        low_ok = self.low < value if self.low_open else self.low <= value
        if value != value or not low_ok or value > self.high:
            bound = f"({self.low}, {self.high}]" if self.low_open else f"[{self.low}, {self.high}]"
            raise ConfigError(f"{name}: {value} is outside {bound}")

    def schema(self) -> dict[str, Any]:
        low = {"exclusiveMinimum": self.low} if self.low_open else {"minimum": self.low}
        return bounded("number", {**low, "maximum": self.high})


@dataclass(frozen=True)
class Choice(Rule):
    choices: tuple[str, ...] = ()

    def check(self, name: str, value: Any) -> None:
        if value not in self.choices:
            raise ConfigError(f"{name}: {value!r} is not one of {list(self.choices)}")

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.choices)}


@dataclass(frozen=True)
class Flag(Rule):
    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True)
class Uri(Rule):
    """An absolute local path, file:///abs/path or s3://bucket/key (s3://bucket[/prefix] when `bucket_ok`);
    `what` says what it must point at, `access` whether a run reads or writes there (`locations`: the
    operator's prefixes, checked by `RunConfig.check_locations` before a run writes anything)."""

    what: str = ""
    bucket_ok: bool = False  # an output root may be a whole bucket; a dataset is one object
    access: str = locations.READ

    @property
    def pattern(self) -> str:
        s3 = r"s3://[^/]+(/.*)?" if self.bucket_ok else r"s3://[^/]+/.*[^/].*"
        return rf"^(/.*|file://(localhost)?/.*|{s3})$"

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name}: required ({self.what})")
        if not re.fullmatch(self.pattern, value, re.DOTALL):
            key = "prefix" if self.bucket_ok else "key"
            raise ConfigError(f"{name}: {value!r} is not an absolute local path, file:///... or "
                              f"s3://bucket/{key} ({self.what})")

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "minLength": 1, "pattern": self.pattern}


_JSON_WS = "[ \\t\\n\\r]*"
# One "field": "name" pair: a field tracegen knows, and a dataset field name as a JSON string without escapes.
_FIELD_PAIR = (f'{_JSON_WS}"(?:{"|".join(MAPPABLE_FIELDS)})"{_JSON_WS}:{_JSON_WS}'
               f'"[^"\\\\\\x00-\\x1f]+"{_JSON_WS}')
# The whole field mapping, as the form's schema and the config's check both apply it: empty, or a JSON object
# of such pairs. What it matches json.loads reads as a dict of those fields to non-empty names.
FIELD_MAP_PATTERN = f"^{_JSON_WS}(\\{{(?:{_FIELD_PAIR}(?:,{_FIELD_PAIR})*|{_JSON_WS})\\}})?{_JSON_WS}$"


def parse_field_map(text: Any, name: str = "dataset_fields") -> dict[str, str]:
    """A field mapping as the trigger form gives it: "" or null for none (Airflow's form sends an emptied field
    as null), or a JSON object from tracegen's field names (`MAPPABLE_FIELDS`) to the dataset's own, e.g.
    {"prompt": "question", "id": "uid"}."""
    if text is None:
        return {}
    if not isinstance(text, str):
        raise ConfigError(f"{name}: expected a JSON object as text, got {type(text).__name__}")
    if not re.search(FIELD_MAP_PATTERN, text):
        raise ConfigError(f"{name}: {text!r} is not a JSON object mapping any of {list(MAPPABLE_FIELDS)} to the "
                          'dataset\'s own field names, e.g. {"prompt": "question", "id": "uid"}')
    return json.loads(text) if text.strip() else {}


def check_field_map(mapping: Any, name: str = "dataset_fields") -> dict[str, str]:
    """A field mapping already parsed (a stored reading's): the same rule as `parse_field_map`."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"{name}: expected an object, got {type(mapping).__name__}")
    return parse_field_map(json.dumps(mapping, ensure_ascii=False), name)


@dataclass(frozen=True)
class FieldMap(Rule):
    """A JSON object, as text, from tracegen's field names to a dataset's own (`parse_field_map`)."""

    def check(self, name: str, value: Any) -> None:
        parse_field_map(value, name)

    def schema(self) -> dict[str, Any]:
        # null: Airflow's trigger form sends an empty field as null, which must not make the whole form invalid.
        return {"type": ["string", "null"], "pattern": FIELD_MAP_PATTERN}


# The longest chat_template_kwargs accepted: every request of the run carries them.
TEMPLATE_KWARGS_MAX_CHARS = 4096
_JSON_SCALAR = ('(?:true|false|null|"[^"\\\\\\x00-\\x1f]*"'
                '|-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)')
# One "name": value pair of the template's arguments: enable_thinking true or false, any other name a scalar.
_TEMPLATE_PAIR = (f'{_JSON_WS}(?:"enable_thinking"{_JSON_WS}:{_JSON_WS}(?:true|false)'
                  f'|"(?!enable_thinking")[^"\\\\\\x00-\\x1f]+"{_JSON_WS}:{_JSON_WS}{_JSON_SCALAR}){_JSON_WS}')
# The chat template's arguments as the form's schema and the config's check both apply them: empty, or a flat
# JSON object of such pairs (what chat templates take: enable_thinking, reasoning_effort, a thinking budget).
TEMPLATE_KWARGS_PATTERN = f"^{_JSON_WS}(\\{{(?:{_TEMPLATE_PAIR}(?:,{_TEMPLATE_PAIR})*|{_JSON_WS})\\}})?{_JSON_WS}$"


@dataclass(frozen=True)
class TemplateKwargs(Rule):
    """A JSON object, as text, passed to the model's chat template with every request (`parse_template_kwargs`)."""

    def check(self, name: str, value: Any) -> None:
        parse_template_kwargs(value, name)

    def schema(self) -> dict[str, Any]:
        # null: Airflow's trigger form sends an empty field as null.
        return {"type": ["string", "null"], "maxLength": TEMPLATE_KWARGS_MAX_CHARS,
                "pattern": TEMPLATE_KWARGS_PATTERN}


def parse_template_kwargs(text: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """The chat template's arguments as the trigger form gives them: "" or null for none (Airflow's form sends an
    emptied field as null), or a flat JSON object such as {"enable_thinking": false} (SGLang hands it to the
    template as it is): names to true, false, null, numbers or strings, enable_thinking true or false."""
    if text is None:
        return {}
    if not isinstance(text, str):
        raise ConfigError(f"{name}: expected a JSON object as text, got {type(text).__name__}")
    if len(text) > TEMPLATE_KWARGS_MAX_CHARS:
        raise ConfigError(f"{name}: {len(text):,} characters, more than {TEMPLATE_KWARGS_MAX_CHARS:,}")
    if not re.search(TEMPLATE_KWARGS_PATTERN, text):
        raise ConfigError(f"{name}: {text[:80]!r} is not a flat JSON object of names to true, false, null, numbers "
                          'or strings (enable_thinking true or false), e.g. {"enable_thinking": false}')
    return json.loads(text) if text.strip() else {}


def _rule(rule: Rule, default: Any) -> Any:
    return field(default=default, metadata={"rule": rule})


def rule_of(name: str) -> Rule:
    """The rule of RunConfig's field `name`."""
    for f in fields(RunConfig):
        if f.name == name:
            return f.metadata["rule"]
    raise KeyError(name)


# The RunConfig fields a request samples by (`tracegen.sglang.settings.Sampling` carries them to the wire).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class RunConfig:
    """What one run generates, under which cap, into which output root, and how it gates itself.

    The fields with a rule `title` are the trigger form's params, in form order (max_tokens first)."""

    max_tokens: int = _rule(Cap(
        title="Max tokens (completion cap)",
        description="Cap on completion tokens (thinking + answer). Rows that hit it finish with 'length' and "
        "are truncated; the pilot gate stops the run when too many do. A whole number from 1 to 1,048,576, "
        "below the model's context length (the run's first task checks it against the servers' before any "
        "starts)."), 4096)
    dataset_uri: str = _rule(Uri(
        title="Dataset", what="a JSONL, JSONL.gz or Parquet file, or a folder of Parquet shards or a Hugging "
        "Face dataset saved to disk, local or s3://",
        description="Prompts or conversations: a JSONL, JSONL.gz or Parquet file, a folder of Parquet shards, or "
        "a Hugging Face dataset saved with save_to_disk, in any form 'Input form' names; an absolute local "
        "path, file:///... or s3://bucket/key, under a prefix the operator allows for reading "
        "(TRACEGEN_READ_PREFIXES or TRACEGEN_WRITE_PREFIXES; the bundled sample data by default). Anywhere "
        "else the run is refused before anything is written."), "")
    dataset_format: str = _rule(Choice(
        DATASET_FORMATS, title="Input form",
        description="How a row holds its conversation: 'messages' (OpenAI chat messages), 'sharegpt' "
        "('conversations' of from/value: human, gpt, system, function_call, observation; or of role/content), "
        "'prompt' (one prompt string, with an optional 'system' string); 'auto' tells each row's form by the "
        "field it holds."), "auto")
    dataset_fields: str = _rule(FieldMap(
        title="Field names",
        description="For a dataset whose fields have other names: a JSON object from tracegen's names "
        f"({', '.join(MAPPABLE_FIELDS)}) to the dataset's, e.g. {{\"prompt\": \"question\", \"id\": \"uid\"}}. "
        "Empty: the names above."), "")
    turns: str = _rule(Choice(
        TURN_MODES, title="Turns generated",
        description="Which assistant turns of a conversation are generated. 'last': a conversation ending "
        "with an assistant turn is the prompt up to it, and that turn is generated again (a row ending with a "
        "user or tool message is generated as it is); 'first': the conversation up to its first user message; "
        "'each': one row per assistant turn, its real history as the prompt (row ids name the conversation "
        "and the turn: <id>#turn-<n>); 'chain': the rows 'each' gives, each turn generated after the model's "
        "own earlier answers, which replace the dataset's in its history (a conversation with tool calls or "
        "results cannot be chained and is invalid). No prompt ever ends with an assistant message."), "last")
    max_invalid_pct: float = _rule(Float(
        0.0, 100.0, title="Most unusable rows (%)",
        description="The run's first task reads a sample of the dataset's rows and stops the run, before any "
        "GPU time, when more than this share of them cannot be used (a wrong form or field names, say), "
        "naming the reasons with their counts and example rows. 100: go on whatever the share."), 50.0)
    output_uri: str = _rule(Uri(
        title="Output root", what="a local directory, file:// or s3://bucket/prefix", bucket_ok=True,
        access=locations.WRITE,
        description="Where committed parts, the ledger, run records and reports live: an absolute local "
        "directory, file:///... or s3://bucket/prefix (through the Airflow connection aws_default), under a "
        "prefix the operator allows for writing (TRACEGEN_WRITE_PREFIXES; the state directory by default). "
        "Anywhere else the run is refused before anything is written."), "")
    temperature: float = _rule(Float(0.0, 2.0, title="Temperature",
                                     description="Sampling temperature sent with every request."), 0.6)
    top_p: float = _rule(Float(0.0, 1.0, low_open=True, title="Top-p",
                               description="Nucleus sampling probability mass."), 0.95)
    # Every sampling param SGLang's chat route would otherwise take from the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty) is sent with every request, on both routes:
    # its /generate route fills a missing one from its own defaults (top_k off), so a value left to the
    # server would sample a continuation, or a streamed first generation, differently.
    top_k: int = _rule(Int(1, 1_000_000, zero_ok=True, title="Top-k",
                           description="Tokens sampled from at each step; 0: every token (no top-k). The "
                           "default is Qwen3's recommendation for thinking."), 20)
    min_p: float = _rule(Float(0.0, 1.0, title="Min-p",
                               description="Least probability of a sampled token, relative to the most likely."),
                         0.0)
    repetition_penalty: float = _rule(Float(0.0, 2.0, low_open=True, title="Repetition penalty",
                                            description="Above 1 discourages tokens already in the prompt or "
                                            "the output; 1: none."), 1.0)
    chat_template_kwargs: str = _rule(TemplateKwargs(
        title="Chat template arguments",
        description="A JSON object the model's chat template is rendered with, for every row, e.g. "
        "{\"enable_thinking\": false} for a Qwen3 model answering without thinking. Kept in each row's "
        "provenance and in the export's manifest. Empty: the template's defaults."), "")
    thinking_off_pct: float = _rule(Float(
        0.0, 100.0, title="Rows without thinking (%)",
        description="For a drafter that serves both modes: this share of the rows, chosen by their ids (the "
        "same rows in every run), is generated with thinking off (enable_thinking false in the chat template "
        "arguments), the rest as the arguments above say. 0: none."), 0.0)
    stop_loops: bool = _rule(Flag(
        title="Stop looping rows",
        description="Where the servers stream incrementally, stream every generation and stop it once it "
        "loops (committed as a runaway, never continued); off: every row is asked of the chat route whole "
        "and runs to its end or the cap."), True)
    chunk_size: int = _rule(Int(
        10, 1_000_000, zero_ok=True, title="Chunk size",
        description="Rows per mapped generation task (at least 10); 0 chooses it: four batches of the whole "
        "fleet (--max-running-requests x GPUs) and at least 500, grown so the number of mapped tasks stays "
        "well under Airflow's max_map_length (1024), with the first chunks twice the pilot. The chunks that "
        "start together when the gate passes are 1/N, 2/N ... N/N of the size (N chunk tasks at once, "
        "TRACEGEN_CHUNK_CONCURRENCY), so they end apart."), 0)
    pilot_size: int = _rule(Int(
        0, 1_000_000, title="Pilot size",
        description="Random rows generated and audited before the fan-out; 0 skips the pilot (the "
        "continuous gate still watches the running truncation rate)."), 1500)
    pilot_seed: int = _rule(Int(0, 2**32 - 1), 0)
    truncation_threshold: float = _rule(Float(
        0.0, 1.0, title="Truncation threshold",
        description="Largest acceptable share of rows finishing with 'length' (0.05 = 5%)."), 0.05)
    gate_mode: str = _rule(Choice(
        GATE_MODES, title="Gate mode",
        description="When truncation is over the threshold (at the pilot, or drifting there mid-run): 'ask' "
        "pauses the run at a question in Required Actions (continue at the recommended cap, at another cap, "
        "at this cap accepting the truncation, or stop) and the same run goes on as answered; 'stop' stops "
        "the run there (it ends 'stopped by the gate', every committed row kept, no task failed); 'warn' logs "
        "and goes on. 'stop' and 'warn' are for runs nobody watches."),
        "ask")
    gate_question_timeout_minutes: float = _rule(Float(
        0.1, 30 * 24 * 60.0, title="Gate question timeout (minutes)",
        description="With gate_mode=ask: how long the question waits for an answer. Unanswered, the run "
        "stops, as if 'stop' had been chosen (the servers stay up while it waits)."), 24 * 60.0)
    while_asking: str = _rule(Choice(
        WHILE_ASKING_MODES, title="While the question waits",
        description="With gate_mode=ask: what the fleet does while the gate's question waits for an answer. "
        "'recommended': it goes on generating at the cap the question recommends (the likeliest answer; with "
        "none, the highest cap of the table the servers can take), within the budget below; 'current': the "
        "same at the run's own cap; 'idle': nothing runs until the answer. Nothing generated while asking is "
        "lost: a higher answer extends what was cut, a lower one keeps what finished, and a 'stop' leaves "
        "every committed row in the output root for the next run."), "recommended")
    while_asking_budget_pct: float = _rule(Float(
        0.0, 100.0, title="Work while asking (% of the dataset's rows)",
        description="The most rows generated while the question waits, as a share of the dataset's rows "
        "(25 = a quarter): what an unanswered question can cost. The question states it in rows and, from "
        "the pilot's throughput, in GPU-hours. 0 is the same as while_asking=idle."), 25.0)
    truncated_policy: str = _rule(Choice(
        TRUNCATED_POLICIES, title="Rows truncated under a lower cap",
        description="'extend': rows that hit a lower cap in an earlier run are continued from their exact "
        "tokens up to this cap, with the same sampling params: only the new tokens are paid for, and the "
        "lengths are those of one uninterrupted run at this cap (a row stored without token ids is "
        "generated again instead). 'regenerate': they are generated again from scratch under this cap, "
        "which pays their tokens twice and under-represents long completions. 'keep': they count as done. "
        "The new row supersedes the old one at export."), "extend")
    measure_tail: str = _rule(Choice(
        MEASURE_MODES, title="Measure the tail",
        description="Continue the pilot's truncated rows from their exact tokens up to the largest candidate "
        "cap (4x max_tokens: 16384 at 4096, or what the servers' context allows) before the gate reports, "
        "so the cap table up to that cap is measured, not extrapolated. 'auto': when the pilot's truncation "
        "is over the threshold (the gate stops or asks); 'always'; 'never'. The continued rows are real rows "
        "of the dataset: none is generated again at the cap finally chosen."), "auto")
    measure_budget_tokens: int = _rule(Int(
        1_000, 100_000_000_000, zero_ok=True, title="Tail measurement budget (tokens)",
        description="Most new tokens measuring the tail may generate, counted for the worst case (every "
        "truncated pilot row running to the cap). When it cannot take every row to the top cap, every row "
        "goes to a lower cap instead of some rows to the top (a subset chosen by cost would bias the "
        "measurement). 0: as many tokens as the pilot itself generated."), 0)
    runaway_policy: str = _rule(Choice(
        RUNAWAY_POLICIES, title="Runaway rows",
        description="Truncated rows whose tail loops (no cap would finish them): 'drop' leaves them out of "
        "the export and lists them in the report; 'keep' exports them with the truncated rows when those are "
        "exported; 'resample' generates each once more from scratch, the fresh sample replacing it."),
        "drop")
    invalid_rows: str = _rule(Choice(
        INVALID_ROW_POLICIES, title="Malformed dataset rows",
        description="'record' marks them invalid in the ledger and goes on; 'fail' stops the chunk naming "
        "the row."), "record")
    part_rows: int = _rule(Int(1, 100_000), 500)
    part_seconds: float = _rule(Float(0.1, 3600.0), 60.0)
    max_in_flight_per_server: int = _rule(Int(1, 4096), 128)
    # True: each server's in-flight limit starts at autotune_start_in_flight and follows what the server
    # reports (tracegen.sglang.autotune); False: max_in_flight_per_server is a fixed limit.
    autotune_in_flight: bool = _rule(Flag(), True)
    # A trickle, not a batch: a chunk task that starts while others keep the servers full then takes over
    # as they drain instead of taking an equal share at once (tasks with equal shares end together, and
    # the fleet drains through all their tails at once); on servers with room it grows within a poll.
    autotune_start_in_flight: int = _rule(Int(1, 4096), 8)
    request_deadline_s: float = _rule(Float(1.0, 24 * 3600.0), 1800.0)
    max_attempts: int = _rule(Int(1, 100), 6)
    # 0: unknown until the fleet reports it; checked again after provisioning
    context_length: int = _rule(Int(0, 10_000_000), 0)
    aws_conn_id: str = "aws_default"

    def __post_init__(self) -> None:
        for f in fields(self):
            if (rule := f.metadata.get("rule")) is not None:
                rule.check(f.name, getattr(self, f.name))
        self.check_context_length(self.context_length)

    def check_locations(self) -> None:
        """Every URI field lies under the prefixes the operator allows for what the run does there
        (`locations`): a run refused here has written nothing. Not part of decoding (`__post_init__`): a
        record read back describes where a run was, and the prefixes may have changed since."""
        for f in fields(self):
            rule = f.metadata.get("rule")
            if isinstance(rule, Uri):
                try:
                    locations.check(getattr(self, f.name), access=rule.access, name=f.name)
                except locations.LocationRefused as exc:
                    raise ConfigError(str(exc)) from None

    def check_context_length(self, context_length: int) -> None:
        """max_tokens must leave room for a prompt inside the model's context window (`cap_rule`)."""
        try:
            check_cap(self.max_tokens, name="max_tokens", context_length=context_length or None)
        except CapRefused as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RunConfig:
        """Build from DAG params (or a JSON dict); unknown keys are an error, not silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"unknown param(s) {unknown}; known: {sorted(known)}")
        return cls(**params)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=2, sort_keys=True).encode()
