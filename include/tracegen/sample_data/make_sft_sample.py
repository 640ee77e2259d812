"""Generate the bundled SFT-style sample: multi-turn agentic conversations in ShareGPT form, with tool calls
and their results, each ending with the assistant's own answer (what a fine-tuning set holds).

It is what a new user is likely to bring: run with `turns=last` the final answers are generated again, with
`turns=each` every assistant turn is, after its real history. Every conversation was written for tracegen
from the templates below, drawn by one `random.Random(seed)` and written as plain JSONL, so the file is
byte-for-byte reproducible.

    python -m tracegen.sample_data.make_sft_sample [--rows 40] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from tracegen.sample_data import SFT_SAMPLE_DATASET, SFT_SAMPLE_ROWS

SEED = 20260101
TOOLS = [
    {"name": "run_shell", "description": "Run a shell command in the repository and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
]
SYSTEM = ("You are an autonomous software agent working in the user's repository. Inspect before you edit, "
          "and say what you changed.")
PROJECTS = ["billing-service", "ingest-worker", "ledgerd", "authgate", "notifier", "search-indexer"]
MODULES = ["parser", "retry", "cache", "config", "scheduler", "exporter"]
BUGS = [
    ("an off-by-one error in the pagination loop", "the loop stops one page early"),
    ("a race between two writers of the same file", "the second rename can overwrite the first"),
    ("a timeout that is read in milliseconds but given in seconds", "requests time out after 30 ms"),
    ("a missing None check on the optional header", "a request without the header raises KeyError"),
]
FOLLOW_UPS = [
    "Can you add a regression test for that?",
    "Does the same problem exist anywhere else in the package?",
    "Please also update the changelog entry.",
]


def conversation(rng: random.Random, i: int) -> dict[str, Any]:
    project, module = rng.choice(PROJECTS), rng.choice(MODULES)
    bug, symptom = rng.choice(BUGS)
    path = f"src/{project.replace('-', '_')}/{module}.py"
    turns: list[dict[str, str]] = [
        {"from": "human", "value": f"In {project}, {symptom}. I think it is {bug} in {module}. Can you find it?"},
        {"from": "function_call", "value": json.dumps({"name": "run_shell",
                                                       "arguments": {"command": f"grep -n 'def ' {path}"}})},
        {"from": "observation", "value": "12:def load(self):\n40:def step(self, page):\n77:def close(self):"},
        {"from": "function_call", "value": json.dumps({"name": "read_file", "arguments": {"path": path}})},
        {"from": "observation", "value": f"# {path}\n" + "\n".join(f"line {k}: ..." for k in range(rng.randint(3, 8)))},
        {"from": "gpt", "value": f"Found it: {bug} in `{module}.step`, which is why {symptom}. The fix is to "
                                 "change the bound and keep the rest of the loop as it is."},
    ]
    for follow in rng.sample(FOLLOW_UPS, rng.randint(0, 2)):
        turns.append({"from": "human", "value": follow})
        turns.append({"from": "gpt", "value": f"Done: {follow.lower().rstrip('?.')} for `{module}` in {project}."})
    return {"id": f"sft-{i:04d}", "system": SYSTEM, "tools": json.dumps(TOOLS), "conversations": turns,
            "category": "agentic-sft"}


def rows(n: int = SFT_SAMPLE_ROWS, seed: int = SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [conversation(rng, i) for i in range(n)]


def write(out: Path = SFT_SAMPLE_DATASET, n: int = SFT_SAMPLE_ROWS) -> Path:
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows(n)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=SFT_SAMPLE_ROWS)
    parser.add_argument("--out", type=Path, default=SFT_SAMPLE_DATASET)
    args = parser.parse_args()
    print(write(args.out, args.rows))


if __name__ == "__main__":
    main()
