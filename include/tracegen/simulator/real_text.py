"""Real text no one on the team wrote, for judging the loop judge (`tracegen.audit.loop_stop`): what an agent
writes or quotes that repeats on purpose, and loops built from it.

**Documents** (`documents`) are read from what every tracegen install has: the Python standard library, the
packages `make venv` pins (their data files, schemas, lock-like RECORD files, metadata, generated tables, test
data), and the output of commands any Linux machine runs (directory and `find` listings, a process listing,
an import-time log, the repository's own `git log --stat`). Each is named by its source; its text is cut at
`max_tokens` of the stand-in's tokenizer (a byte-level BPE, `tracegen.simulator.tokens`). Nothing here was
written to pass or fail a rule.

**Loops** (`loops`) are blocks of those documents repeated until the response ends: exact, or near-exact (a
word of the block swapped for one of three near-variants in 30% of the repetitions, as `loop_cases` does), with
periods from 1 to 8,192 tokens, starting early or late in the document's own text.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tracegen.simulator import tokens
from tracegen.simulator.loop_cases import VARIANT_RATE, VARIANTS, LoopCase

MAX_TOKENS = 32_768  # the longest cap a document is judged at
MIN_TOKENS = 512  # a shorter source says little: left out
_CHARS_PER_TOKEN = 8  # generous: the text read for `max_tokens` tokens
LONG_PERIODS = (1, 2, 3, 5, 8, 13, 34, 89, 233, 610, 1_000, 1_500, 3_000, 6_000, 8_192)
NEAR_LONG_PERIODS = tuple(p for p in LONG_PERIODS if p >= 8)


@dataclass(frozen=True, slots=True)
class Document:
    source: str  # where it came from: a path under a named root, or a command
    kind: str  # data, schema, config, lock, metadata, table, code, listing, log, csv
    text: str

    def ids(self, max_tokens: int = MAX_TOKENS) -> list[int]:
        return _ids(self.text, max_tokens)


@lru_cache(maxsize=512)
def _ids(text: str, max_tokens: int) -> list[int]:
    return list(tokens.text_ids(text[: max_tokens * _CHARS_PER_TOKEN])[:max_tokens])


def _read(path: Path, max_tokens: int) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read(max_tokens * _CHARS_PER_TOKEN)


def _run(argv: list[str], cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=60,
                             env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def _every(paths: list[Path], n: int) -> list[Path]:
    """`n` of `paths` spread evenly over their sorted order (deterministic, not the first few alone)."""
    paths = sorted(paths)
    if len(paths) <= n:
        return paths
    return [paths[i * len(paths) // n] for i in range(n)]


def _sources() -> Iterator[tuple[str, str, Path | list[str], Path | None]]:
    """(kind, source name, path or argv, cwd) of every document, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    enc = stdlib / "encodings"
    for p in _every([*enc.glob("cp*.py"), *enc.glob("mac_*.py"), *enc.glob("iso8859_*.py")], 40):
        yield "table", f"stdlib:{p.relative_to(stdlib)}", p, None
    for rel in ("html/entities.py", "locale.py", "mimetypes.py", "pydoc_data/topics.py", "token.py",
                "_pydecimal.py", "unicodedata.py", "sre_constants.py", "opcode.py", "keyword.py"):
        if (stdlib / rel).is_file():
            yield "code", f"stdlib:{rel}", stdlib / rel, None
    data = site / "botocore" / "data"
    for name in ("endpoints.json", "partitions.json", "sdk-default-configuration.json"):
        yield "data", f"botocore:data/{name}", data / name, None
    for service in _every([d for d in data.iterdir() if d.is_dir()], 40):
        for model in sorted(service.glob("*/service-2.json*"))[-1:]:
            yield "schema", f"botocore:{model.relative_to(data.parent)}", model, None
    for schema in _every(list((site / "jsonschema_specifications" / "schemas").rglob("*")), 30):
        if schema.is_file():
            yield "schema", f"jsonschema_specifications:{schema.relative_to(site)}", schema, None
    for rel in ("airflow/config_templates/config.yml", "airflow/api_fastapi/core_api/openapi/v2-rest-api-generated.yaml",
                "airflow/api_fastapi/core_api/openapi/_private_ui.yaml",
                "airflow/_shared/observability/metrics/metrics_template.yaml",
                "torchgen/packaged/ATen/native/native_functions.yaml", "torchgen/packaged/autograd/derivatives.yaml",
                "torch/_export/serde/schema.yaml"):
        if (site / rel).is_file():
            yield "config", f"site-packages:{rel}", site / rel, None
    dist = sorted(site.glob("*.dist-info"))
    for record in _every([d / "RECORD" for d in dist if (d / "RECORD").is_file()], 60):
        yield "lock", f"site-packages:{record.relative_to(site)}", record, None
    for meta in _every([d / "METADATA" for d in dist if (d / "METADATA").is_file()], 30):
        yield "metadata", f"site-packages:{meta.relative_to(site)}", meta, None
    for tab in sorted((site / "tzdata" / "zoneinfo").glob("*.tab")):
        yield "table", f"site-packages:{tab.relative_to(site)}", tab, None
    for csv in _every(list((site / "numpy" / "random" / "tests" / "data").glob("*.csv")), 8):
        yield "csv", f"site-packages:{csv.relative_to(site)}", csv, None
    for txt in _every(list((site / "scipy" / "spatial" / "tests" / "data").glob("*.txt")), 8):
        yield "csv", f"site-packages:{txt.relative_to(site)}", txt, None
    for stub in ("numpy/__init__.pyi", "torch/_C/_VariableFunctions.pyi", "pandas/core/frame.py",
                 "sqlalchemy/sql/functions.py", "botocore/exceptions.py"):
        if (site / stub).is_file():
            yield "code", f"site-packages:{stub}", site / stub, None
    for pkg in ("botocore/data/ec2", "numpy", "pandas/core", "airflow/providers/amazon/aws/hooks", "pyarrow"):
        if (site / pkg).is_dir():
            yield "listing", f"ls -l site-packages/{pkg}", ["ls", "-l", "--time-style=long-iso", str(site / pkg)], None
    for pkg in ("botocore/data/s3", "jsonschema_specifications", "airflow/api_fastapi", "pytz", "moto/s3"):
        if (site / pkg).is_dir():
            yield "listing", f"find site-packages/{pkg}", ["find", pkg, "-type", "f", "-not", "-name", "*.pyc"], site
    yield "listing", "ps -eo pid,ppid,user,stat,rss,comm", ["ps", "-eo", "pid,ppid,user,stat,rss,comm"], None
    yield "log", f"{Path(sys.executable).name} -X importtime -c 'import pandas'", \
        [sys.executable, "-X", "importtime", "-c", "import pandas"], None
    repo = Path(__file__).resolve().parents[3]
    if (repo / ".git").exists():
        yield "log", "git log --stat -n 150", ["git", "log", "--stat", "-n", "150", "--no-color"], repo


@lru_cache(maxsize=4)
def documents(max_tokens: int = MAX_TOKENS) -> tuple[Document, ...]:
    """Every document of at least `MIN_TOKENS` tokens, cut at `max_tokens`."""
    out = []
    for kind, source, where, cwd in _sources():
        if isinstance(where, Path):
            if not where.is_file():
                continue
            text = _read(where, max_tokens)
        else:
            text = _run(where, cwd)[: max_tokens * _CHARS_PER_TOKEN]
        doc = Document(source, kind, text)
        if len(doc.ids(max_tokens)) >= MIN_TOKENS:
            out.append(doc)
    return tuple(out)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def _near_word(rng: random.Random) -> list[list[int]]:
    return [list(tokens.text_ids(v)) for v in rng.sample(VARIANTS, 3)]


def looping_block(ids: list[int], onset: int, period: int, near: bool, length: int, rng: random.Random) -> list[int]:
    """The document's own first `onset` ids, then a block of `period` of its ids (taken after the onset)
    repeated until `length` ids; with `near`, a word at one place of the block is swapped for one of three
    near-variants in `VARIANT_RATE` of the repetitions."""
    start = onset + rng.randrange(max(1, len(ids) - onset - period))
    block = ids[start : start + period]
    if len(block) < period:
        block = (block * (period // max(1, len(block)) + 1))[:period]
    variants = _near_word(rng)
    slot = rng.randrange(max(1, period - 3))
    out = list(ids[:onset])
    while len(out) < length:
        if near and rng.random() < VARIANT_RATE:
            word = rng.choice(variants)
            out += block[:slot] + word + block[slot + min(len(word), period - slot):]
        else:
            out += block
    return out[:length]


def loops(docs: tuple[Document, ...] | None = None, *, per_period: int = 2) -> Iterator[LoopCase]:
    """Loops built from the documents: for each period (exact, and near-exact from 8 tokens up) and each
    onset (early: within the first 400 ids; late: 3,000-10,000), `per_period` documents' blocks repeated."""
    docs = documents() if docs is None else docs
    pool = [d for d in docs if len(d.ids()) >= 12_000]
    for near, periods in ((False, LONG_PERIODS), (True, NEAR_LONG_PERIODS)):
        for period in periods:
            for where, bounds in (("early", (0, 400)), ("late", (3_000, 10_000))):
                for k in range(per_period):
                    rng = random.Random(_seed(near, period, where, k))
                    doc = pool[rng.randrange(len(pool))]
                    onset = rng.randint(*bounds)
                    # Room past the bound for an exact loop; a near loop's variants may be new for a few periods more.
                    length = onset + 2 * period + 512 + 2_048 + (4 * period if near else 0)
                    ids = looping_block(doc.ids(), onset, period, near, length, rng)
                    yield LoopCase(f"{'near' if near else 'exact'} loop {period} {where} of {doc.source}",
                                   tuple(ids), onset=onset, period=period, near=near)
