"""A seeded test set for the online loop stop (`tracegen.audit.loop_stop`): legitimate repetition that must
survive, and loops that must be stopped.

Every case is a response's token ids in the SGLang stand-in's tokenizer (`tracegen.simulator.tokens`, a real
byte-level BPE): prose and code between the structures are windows of the stand-in's token streams (the
tokenization of its agentic-coding text), and the structures are text written here and tokenized.

- **Legit** (`legit_cases`): what agentic coding output repeats on purpose. A file written out again with
  one line changed, a snippet given in three variants, a test run twice with the same output (a long one back to
  back too), a traceback quoted three times, a markdown table of near-identical rows, a list of similar tool
  calls, log lines, JSON records alike but for their id, and plain long rows. Each sits early in its
  response (short tail) or late (full window), some at its very start.
- **Loops** (`loop_cases`): a phrase or block repeated until the response ends, exact or near-exact (a word
  of the loop swapped for one of a few near-variants in some repetitions, which may change the period by a
  token or two), with periods from 1 to 1,000 tokens, onsets early and late, loops right after legitimate
  repetition, and continuations whose loop began in the earlier output (`prefix`).

All of it is a pure function of the seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from tracegen.simulator import corpus, tokens

LOOP_PERIODS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 800, 1000)
# Near-variants need a word to vary; the longest near loop stays within the window's reach with its variants
# (a period of about 1,000 exactly fills half the window, and each variant costs n-grams).
NEAR_PERIODS = tuple(p for p in LOOP_PERIODS if 8 <= p <= 900)
START = (0, 40)  # tokens of ordinary text before a structure that opens its response
EARLY_ONSET = (0, 400)  # before an early loop or structure: the tail is shorter than a window
LATE_ONSET = (3_000, 10_000)  # before a late one: the window is full
# Words a looping model swaps in and out of its phrase ("Wait," / "But wait," / "Hmm,").
VARIANTS = (" Wait", " wait", " But wait", " Hmm", " Actually", " So", " Let me", " OK")
VARIANT_RATE = 0.3  # share of repetitions in which the word is swapped


@dataclass(frozen=True, slots=True)
class LoopCase:
    name: str
    ids: tuple[int, ...]  # the earlier output (prefix) then the response
    prefix: int = 0  # ids[:prefix] were generated before this request
    onset: int | None = None  # loops: index in ids where the loop begins
    period: int | None = None  # loops: tokens per repetition (the unvaried one)
    near: bool = False  # loops: near-variants inside the loop

    @property
    def is_loop(self) -> bool:
        return self.onset is not None

    @property
    def response(self) -> tuple[int, ...]:
        return self.ids[self.prefix :]


# -- pieces -------------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _text(text: str) -> tuple[int, ...]:
    return tuple(tokens.text_ids(text))


def prose(rng: random.Random, n: int) -> list[int]:
    """n ids of the stand-in's ordinary text (a window of one of its token streams)."""
    if n <= 0:
        return []
    stream = tokens.stream(rng.choice(("en", "en", "intl")))
    return stream.window(rng.randrange(stream.size), n).tolist()


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(corpus.IDENT_PARTS, rng.randint(2, 3)))


def _path(rng: random.Random) -> str:
    return f"{rng.choice(corpus.DIRS)}/{_ident(rng)}/{_ident(rng)}.{rng.choice(corpus.EXTS)}"


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(corpus.EN_WORDS) for _ in range(rng.randint(lo, hi)))


def code_file(rng: random.Random, lines: int) -> list[str]:
    """Lines of a Python file: functions, assignments, calls, comments."""
    out = [f"import {_ident(rng)}", ""]
    while len(out) < lines:
        out.append(f"def {_ident(rng)}({_ident(rng)}, {_ident(rng)}=None):")
        out.append(f'    """{_words(rng, 4, 10).capitalize()}."""')
        for _ in range(rng.randint(2, 7)):
            x = rng.random()
            if x < 0.3:
                out.append(f"    {_ident(rng)} = {_ident(rng)}({_ident(rng)}, {rng.randint(0, 999)})")
            elif x < 0.5:
                out.append(f"    if {_ident(rng)} is None or len({_ident(rng)}) > {rng.randint(1, 512)}:")
                out.append(f"        raise ValueError(\"{_words(rng, 2, 6)}\")")
            elif x < 0.7:
                out.append(f"    # {_words(rng, 3, 9)}")
            else:
                out.append(f"    for {_ident(rng)} in {_ident(rng)}.{_ident(rng)}():")
                out.append(f"        {_ident(rng)}.append({_ident(rng)})")
        out.append(f"    return {_ident(rng)}")
        out.append("")
    return out[:lines]


def _changed(rng: random.Random, lines: list[str]) -> list[str]:
    """The same lines with one of them changed, as an edit does."""
    out = list(lines)
    k = rng.randrange(len(out))
    out[k] = f"    {_ident(rng)} = {_ident(rng)}({rng.randint(0, 99)})  # {_words(rng, 2, 5)}"
    return out


def _fenced(lines: list[str], lang: str = "python") -> str:
    return f"\n```{lang}\n" + "\n".join(lines) + "\n```\n"


def _file_tokens(lines: list[str]) -> int:
    return len(_text(_fenced(lines)))


def file_of(rng: random.Random, target_tokens: int) -> list[str]:
    """A code file of about `target_tokens` ids."""
    lines = code_file(rng, 4)
    while _file_tokens(lines) < target_tokens:
        lines = code_file(random.Random(rng.random()), len(lines) + max(2, len(lines) // 3))
    return lines


# -- legit repetition ---------------------------------------------------------------------------------
PLACES = {"start": START, "early": EARLY_ONSET, "late": LATE_ONSET}


def _placed(rng: random.Random, where: str, body: list[int]) -> list[int]:
    return prose(rng, rng.randint(*PLACES[where])) + body + prose(rng, rng.randint(100, 800))


def file_rewritten(rng: random.Random, size: int) -> list[int]:
    """A file written out, a sentence, the same file again with one line changed."""
    lines = file_of(rng, size)
    note = _text(f"\nNow the same file with the fix applied to `{_ident(rng)}`:\n")
    return list(_text(_fenced(lines))) + list(note) + list(_text(_fenced(_changed(rng, lines))))


def three_variants(rng: random.Random, size: int) -> list[int]:
    """A snippet given three times, each with another line changed ("option A / B / C")."""
    lines = file_of(rng, size)
    out: list[int] = []
    for label in "ABC":
        out += _text(f"\nOption {label}, which changes one line:\n") + _text(_fenced(_changed(rng, lines)))
    return out


def _one_run(rng: random.Random, tests: int) -> list[int]:
    """A verbose pytest run of `tests` passing tests."""
    names = [f"tests/test_{_ident(rng)}.py::test_{_ident(rng)}" for _ in range(tests)]
    lines = ["$ pytest -v", "============ test session starts ============"]
    lines += [f"{n} PASSED [{100 * (i + 1) // tests:3d}%]" for i, n in enumerate(names)]
    lines.append(f"============ {tests} passed in {rng.random() * 9:.2f}s ============")
    return list(_text(_fenced(lines, "")))


def same_run_twice(rng: random.Random, tests: int) -> list[int]:
    """A test run's output, a sentence, the identical output of the run again."""
    run = _one_run(rng, tests)
    return run + list(_text("\nRunning it again to rule out a flaky order dependence:\n")) + run


def long_block_twice(rng: random.Random, kind: str) -> list[int]:
    """A block of just over 1,024 tokens written out twice, identical and back to back: a test run's output
    (whose lines share n-grams of their own) or a file. Its copies fill a window, as a loop's would."""
    sub = rng.random()
    if kind == "run":
        n, block = 30, []
        while len(block) < 1_024:
            n += 1
            block = _one_run(random.Random(sub), n)
    else:
        lines = file_of(random.Random(sub), 1_400)
        while _file_tokens(lines[:-1]) >= 1_024:
            lines = lines[:-1]
        block = list(_text(_fenced(lines)))
    return block + block


def same_failure_thrice(rng: random.Random, frames: int) -> list[int]:
    """A failing test's traceback quoted three times, identical, between attempts at a fix that did not take."""
    lines = ["$ pytest -x tests/test_" + _ident(rng) + ".py", "F", "=================== FAILURES ==================="]
    for _ in range(frames):
        lines += [f'  File "{_path(rng)}", line {rng.randint(1, 900)}, in {_ident(rng)}',
                  f"    {_ident(rng)} = {_ident(rng)}({_ident(rng)})"]
    lines += [f"E   KeyError: '{_ident(rng)}'", "1 failed in 0.42s"]
    run = list(_text(_fenced(lines, "")))
    out = run
    for _ in range(2):
        out = out + list(_text(f"\nI changed `{_ident(rng)}` and ran it again; still the same failure:\n")) + run
    return out


def table(rng: random.Random, rows: int, wide: bool) -> list[int]:
    """A markdown table of near-identical rows: every row its own name and figures, shared columns else."""
    head = "| module | status | tests | time | lint | types | docs |" if wide else "| file | change | lines |"
    out = [head, "|---|---|---|---|---|---|---|" if wide else "|---|---|---|"]
    for _ in range(rows):
        if wide:
            status = rng.choice(("✅ pass", "✅ pass", "✅ pass", "❌ fail"))
            out.append(f"| `{_ident(rng)}` | {status} | {rng.randint(1, 80)} | {rng.random() * 3:.2f}s | ✓ | ✓ | ✓ |")
        else:
            out.append(f"| `{_path(rng)}` | {rng.choice(('renamed', 'updated', 'added'))} import | "
                       f"+{rng.randint(1, 40)} −{rng.randint(0, 20)} |")
    return list(_text("\n" + "\n".join(out) + "\n"))


def similar_calls(rng: random.Random, calls: int) -> list[int]:
    """Tool calls of one tool, each on another path or pattern."""
    out: list[int] = []
    tool = rng.choice(("read_file", "grep", "run_tests"))
    for _ in range(calls):
        arg = (f'"pattern": "{_ident(rng)}", "path": "{rng.choice(corpus.DIRS)}/"' if tool == "grep"
               else f'"path": "{_path(rng)}"')
        out += _text(f'<tool_call>\n{{"name": "{tool}", "arguments": {{{arg}}}}}\n</tool_call>\n')
    return out


def records(rng: random.Random, count: int, fields: int) -> list[int]:
    """A JSON fixture of records alike but for their id and name: `fields` settings shared by all of them."""
    shared = ", ".join(f'"{_ident(rng)}": {rng.choice(("true", "null", "0", chr(34) + _ident(rng) + chr(34)))}'
                       for _ in range(fields))
    rows = [f'{{"id": {rng.randint(1, 99_999)}, "name": "{_ident(rng)}", {shared}}}' for _ in range(count)]
    return list(_text("\n```json\n[\n  " + ",\n  ".join(rows) + "\n]\n```\n"))


def log_lines(rng: random.Random, lines: int) -> list[int]:
    """Log lines of one worker: the same message with its own timestamp, batch and timing each time."""
    t = rng.randint(0, 80_000)
    out = []
    for _ in range(lines):
        t += rng.randint(1, 900)
        out.append(f"2026-12-03 {t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}.{rng.randint(0, 999):03d} "
                   f"INFO worker-{rng.randint(0, 7)} processed batch {rng.randint(1000, 99999)} "
                   f"in {rng.random() * 2:.3f}s")
    return list(_text("\n```\n" + "\n".join(out) + "\n```\n"))


def legit_cases(seed: int = 0) -> Iterator[LoopCase]:
    """Responses that repeat on purpose: none of them may be stopped."""
    rng = random.Random(seed)
    for frames in (3, 8):
        for where in PLACES:
            yield LoopCase(f"same failure thrice {frames} {where}",
                           tuple(_placed(rng, where, same_failure_thrice(rng, frames))))
    for where in ("early", "late"):
        for size in (40, 150, 400, 700, 1000):
            yield LoopCase(f"file rewritten {size} {where}", tuple(_placed(rng, where, file_rewritten(rng, size))))
        for size in (60, 150, 300):
            yield LoopCase(f"three variants {size} {where}", tuple(_placed(rng, where, three_variants(rng, size))))
        for n in (8, 40):
            yield LoopCase(f"test run twice {n} {where}", tuple(_placed(rng, where, same_run_twice(rng, n))))
        for kind in ("run", "file"):
            yield LoopCase(f"long {kind} twice back to back {where}",
                           tuple(_placed(rng, where, long_block_twice(rng, kind))))
        for rows in (30, 120):
            for wide in (False, True):
                yield LoopCase(f"table {rows} rows{' wide' if wide else ''} {where}",
                               tuple(_placed(rng, where, table(rng, rows, wide))))
        for calls in (10, 60):
            yield LoopCase(f"similar calls {calls} {where}", tuple(_placed(rng, where, similar_calls(rng, calls))))
        yield LoopCase(f"log lines 150 {where}", tuple(_placed(rng, where, log_lines(rng, 150))))
        for fields in (5, 20, 40):
            yield LoopCase(f"records 60 of {fields} fields {where}",
                           tuple(_placed(rng, where, records(rng, 60, fields))))
    for i in range(8):
        yield LoopCase(f"plain long row {i}", tuple(prose(rng, 16_384)))


# -- loops --------------------------------------------------------------------------------------------
def looping(rng: random.Random, onset: int, period: int, near: bool, length: int) -> list[int]:
    """`onset` ids of ordinary text, then a phrase of `period` ids repeated until `length` ids: with `near`,
    one of its words is swapped for a near-variant in `VARIANT_RATE` of the repetitions."""
    unit = prose(rng, period)
    variants = [list(_text(v)) for v in rng.sample(VARIANTS, 3)]
    slot = rng.randrange(max(1, period - 3))
    out = prose(rng, onset)
    while len(out) < length:
        if near and rng.random() < VARIANT_RATE:
            word = rng.choice(variants)
            out += unit[:slot] + word + unit[slot + min(len(word), period - slot):]
        else:
            out += unit
    return out[:length]


def _loop_length(onset: int, period: int) -> int:
    # Long enough that any stop within the bound the tests assert (2 periods + the window) happens inside it.
    return onset + 2 * period + 2 * 2048 + 1024


def loop_cases(seed: int = 0) -> Iterator[LoopCase]:
    """Responses that fall into a loop: all of them must be stopped."""
    rng = random.Random(seed + 1_000_003)
    for near, periods in ((False, LOOP_PERIODS), (True, NEAR_PERIODS)):
        kind = "near" if near else "exact"
        for period in periods:
            for where, bounds in (("early", EARLY_ONSET), ("late", LATE_ONSET)):
                onset = rng.randint(*bounds)
                ids = looping(rng, onset, period, near, _loop_length(onset, period))
                yield LoopCase(f"{kind} loop {period} {where}", tuple(ids), onset=onset, period=period, near=near)
    # A loop right after legitimate repetition, which had the tail judged (and spared) until then.
    for period in (5, 55, 377):
        for kind, make in (("similar calls", lambda: similar_calls(rng, 60)),
                           ("records", lambda: records(rng, 40, 20)), ("table", lambda: table(rng, 120, True))):
            before = prose(rng, rng.randint(*LATE_ONSET)) + make()
            ids = before + looping(rng, 0, period, False, _loop_length(0, period))
            yield LoopCase(f"loop {period} after {kind}", tuple(ids), onset=len(before), period=period)
    # Continuations: the loop began in the earlier output, before the request.
    for period in (3, 55, 377, 800):
        onset = rng.randint(*LATE_ONSET)
        ids = looping(rng, onset, period, False, _loop_length(onset, period))
        split = onset + rng.randint(period, 2 * period + 600)
        yield LoopCase(f"continued loop {period}", tuple(ids), prefix=split, onset=onset, period=period)


def all_cases(seed: int = 0) -> list[LoopCase]:
    return [*legit_cases(seed), *loop_cases(seed)]
