"""Generating while the gate's question waits (gate_mode=ask, `while_asking` not 'idle').

A question can wait hours for its answer, and the fleet must not wait with it. Since rows truncated under
a lower cap are extended from their tokens, work done before the answer is not thrown away:
- a row that finishes under any cap is complete for every answer (kept);
- a row truncated below the chosen cap is extended after the answer, paying only its new tokens;
- a row truncated at or above the chosen cap counts as truncated at it.
Only a 'stop' makes that work moot, and even then its rows stay committed for the next run.

So while the question waits, the chunks with work left run at a provisional cap: the one the question
recommends (`recommended`: the likeliest answer, and the cheapest mistake either way), or the run's own
(`current`). A budget, a share of the dataset's rows, bounds what an unanswered question can cost: the
chunks generated while asking are those whose rows fit in it, in dataset order. Their rows are marked in the ledger
(`while_asking`), and `account` says from the ledger what the answer made of them.

Which cap a task generates at is decided from Airflow's metadata (the question task's XComs, the answer),
never from what the output root says.

The answer takes effect at once: the chunks generated while asking that have not started by then start at
the answered cap, and the answer's own fan-out (the chunks past the budget, the rows truncated under the
provisional cap) is planned as soon as the chunks already generating have committed, without waiting for
the rest of the fan-out (`left_to_start`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.cap_question import RECOMMENDED, CapQuestion
from tracegen.audit.formats import gpu_hours, num
from tracegen.common import dag_ids
from tracegen.run import plan
from tracegen.run.run_spec import RunSpec
from tracegen.store.records import COMPLETE, EXTENDED, FAILED, OK

log = logging.getLogger(__name__)

IDLE = "idle"


@dataclass(frozen=True)
class WhileAsking:
    """What the fleet generates while a question waits: at which cap, within which budget, which chunks."""

    mode: str  # RunConfig.while_asking: 'recommended' or 'current'
    cap: int
    budget_rows: int
    chunks: tuple[plan.ChunkWork, ...]
    rows_planned: int
    rows_left: int  # rows with work left at `cap` in the whole dataset, budget or not
    gpu_hours: float | None  # the planned rows' cost at the pilot's throughput, when it was measured

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["chunks"] = [c.to_json() for c in self.chunks]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WhileAsking:
        return cls(mode=str(doc["mode"]), cap=int(doc["cap"]), budget_rows=int(doc["budget_rows"]),
                   chunks=tuple(plan.ChunkWork.from_json(c) for c in doc["chunks"]),
                   rows_planned=int(doc["rows_planned"]), rows_left=int(doc["rows_left"]),
                   gpu_hours=None if doc.get("gpu_hours") is None else float(doc["gpu_hours"]))

    def statement(self) -> str:
        """What the reviewer is told (Markdown): what runs while they decide, and what it costs if nobody does."""
        which = "the recommended cap" if self.mode == RECOMMENDED else "the run's own cap"
        if not self.chunks:
            return (f"While you decide, nothing is generated: the budget ({num(self.budget_rows)} rows) is smaller "
                    f"than any chunk with work left at max_tokens={self.cap:,}.")
        cost = f", about {gpu_hours(self.gpu_hours)} of GPU time at the pilot's throughput" if self.gpu_hours else ""
        return (f"While you decide, the fleet goes on at max_tokens={self.cap:,} ({which}): {num(self.rows_planned)} "
                f"rows in {len(self.chunks)} chunk{'' if len(self.chunks) == 1 else 's'}, at most {num(self.budget_rows)} rows (the run's "
                f"while_asking_budget_pct){cost}. Nothing of it is lost: a higher answer extends what it cut, a "
                "lower one keeps what finished, and 'stop' leaves its rows committed for the next run.")


def provisional_cap(question: CapQuestion, mode: str) -> int | None:
    """The cap to generate at while `question` waits; None under 'idle'. 'recommended' without a
    recommended cap the servers can take: the highest cap of the question's table they can."""
    if mode == IDLE:
        return None
    if mode != RECOMMENDED:
        return question.current_cap
    recommended = next((o.cap for o in question.options if o.kind == RECOMMENDED), None)
    if recommended is not None:
        return recommended
    fitting = [int(r["cap"]) for r in question.cap_rows if question.current_cap <= int(r["cap"]) <= question.max_cap]
    return max(fitting, default=question.current_cap)


def provisional(spec: RunSpec, cap: int) -> RunSpec:
    """The run as it generates while its question waits: at `cap`, its gate only warning (the question is
    already asked: nothing is held back for a second one)."""
    return replace(spec, config=replace(spec.config, max_tokens=cap, gate_mode="warn"))


def plan_work(spec: RunSpec, question: CapQuestion, frame: pd.DataFrame,
              turn_starts: np.ndarray | None = None) -> WhileAsking | None:
    """The work done while `question` waits, or None when the run idles (while_asking=idle, or no budget).
    `turn_starts`: under turns=chain, each conversation's first prompt row (`plan.chunks_with_work`)."""
    config = spec.config
    cap = provisional_cap(question, config.while_asking)
    if cap is None or config.while_asking_budget_pct <= 0:
        return None
    at = provisional(spec, cap)
    work = plan.chunks_with_work(frame, spec.dataset.n_rows, spec.layout, at.config, turn_starts)
    budget = math.floor(spec.dataset.n_rows * config.while_asking_budget_pct / 100.0)
    chosen, planned = [], 0
    for w in work:  # in dataset order, every chunk that still fits: a large first chunk does not use it all up
        if planned + w.remaining <= budget:
            chosen.append(w)
            planned += w.remaining
    return WhileAsking(mode=config.while_asking, cap=cap, budget_rows=budget, chunks=tuple(chosen),
                       rows_planned=planned, rows_left=sum(w.remaining for w in work),
                       gpu_hours=_gpu_hours(question, cap, planned))


def _gpu_hours(question: CapQuestion, cap: int, rows: int) -> float | None:
    """GPU time of `rows` rows at `cap`, from the question's table (its GPU time is for the rows left)."""
    left = (question.throughput or {}).get("rows_remaining")
    row = next((r for r in question.cap_rows if int(r["cap"]) == cap), None)
    if not left or row is None or row.get("gpu_hours") is None:
        return None
    return float(row["gpu_hours"]) * rows / float(left)


def account(frame: pd.DataFrame, run_id: str, answer_cap: int | None, *, answered: bool = True) -> dict[str, Any] | None:
    """What was generated while the question waited, from the ledger, and what the answer made of it; None
    when nothing was.

    `answer_cap`: the cap the run continued at (None: it stopped). Rows truncated below it count as
    `extended` once their extension is committed (before that, `to_extend`); rows truncated at or above it
    count as truncated at it; finished rows are kept. `answered=False`: the question still waits."""
    if not len(frame) or "while_asking" not in frame.columns:
        return None
    mask = (frame["run_id"] == run_id).to_numpy(bool) & frame["while_asking"].fillna(False).to_numpy(bool)
    rows = frame[mask]
    if not len(rows):
        return None
    ok = rows[rows["status"] == OK]
    finished = ok["finish_reason"].isin(COMPLETE).to_numpy(bool)
    cut = ok[~finished]
    caps = sorted(int(c) for c in rows["max_tokens"].unique())
    doc: dict[str, Any] = {
        "caps": caps, "rows": int(len(rows)), "failed": int((rows["status"] == FAILED).sum()),
        "new_tokens": int((ok["completion_tokens"] - ok["prefix_tokens"]).sum()),
        "finished": int(finished.sum()), "truncated": int(len(cut)), "answered": answered,
        "answer_cap": answer_cap,
    }
    if not answered or answer_cap is None:
        return doc
    below = cut["max_tokens"].to_numpy(np.int64) < answer_cap
    later = frame[(frame["pivot"] == EXTENDED).to_numpy(bool) & (frame["max_tokens"] == answer_cap).to_numpy(bool)]
    extended = np.isin(cut["index"].to_numpy(np.int64), later["index"].to_numpy(np.int64)) & below
    doc.update(kept=doc["finished"], extended=int(extended.sum()), to_extend=int((below & ~extended).sum()),
               truncated_at_answer=int((~below).sum()))
    return doc


def account_text(doc: dict[str, Any] | None) -> str:
    """The account in one sentence, for logs and the report."""
    if not doc:
        return "nothing was generated while the question waited"
    caps = ", ".join(f"{c:,}" for c in doc["caps"])
    head = (f"while the question waited, {num(doc['rows'])} rows ({num(doc['new_tokens'])} new tokens) were "
            f"generated at max_tokens={caps}: {num(doc['finished'])} finished, {num(doc['truncated'])} truncated"
            + (f", {num(doc['failed'])} failed" if doc["failed"] else ""))
    if not doc["answered"]:
        return head + "; the question still waits"
    if doc["answer_cap"] is None:
        return head + "; the run stopped, and every one of them stays committed for the next run"
    fate = [f"{num(doc['kept'])} kept"]
    if doc["extended"] or doc["to_extend"]:
        fate.append(f"{num(doc['extended'])} extended to {doc['answer_cap']:,}"
                    + (f" ({num(doc['to_extend'])} still to extend)" if doc["to_extend"] else ""))
    if doc["truncated_at_answer"]:
        fate.append(f"{num(doc['truncated_at_answer'])} counted as truncated at {doc['answer_cap']:,}")
    return head + f"; the answer ({doc['answer_cap']:,}): " + ", ".join(fate)


STARTED = ("running", "success", "skipped", "failed", "upstream_failed", "removed")


def generating(states: dict[int, str]) -> list[int]:
    """The map indexes of the while-asking chunk tasks generating now: each may have started before the
    answer, at the provisional cap, so the answer's plan waits until they have committed."""
    return sorted(i for i, state in states.items() if state == "running")


def left_to_start(states: dict[int, str], chunks: list[dict[str, Any]], among: set[int] | None = None) -> set[int]:
    """The chunk numbers of the while-asking chunk tasks (of the map indexes `among`, else all) that have not
    started (their map index's state, a lower-case TaskInstanceState, or "none"): they start after the
    answer, at its cap, so the answer's fan-out leaves them out. A chunk task waiting for a retry counts
    too: its next try reads the answer."""
    return {plan.ChunkWork.from_json(chunk).chunk for i, chunk in enumerate(chunks)
            if (among is None or i in among) and states.get(i, "none") not in STARTED}


def settled_left_to_start(api: Any, poll_s: float = 2.0) -> set[int]:
    """The chunk numbers of the chunk tasks generated while asking that had not started when the answer's task
    (`apply_decision`, through `api`, a `tasks.api.TaskApi`) first looked: they read the answer when they
    start and take its cap themselves (`left_to_start`). Returned once those that were generating then have
    ended: they may run at the provisional cap, and their rows must be committed before the answer's plan
    reads the ledger. Chunk tasks that start meanwhile are not waited for. Each ends within a chunk's time,
    and sooner on a stop, which it polls for."""
    chunks = api.xcom_pull(dag_ids.DECIDING_TASK) or []
    if not chunks:
        return set()
    prefix = f"{dag_ids.WHILE_ASKING}_"

    def states() -> dict[int, str]:
        found = api.task_states([dag_ids.WHILE_ASKING])
        return {int(k.removeprefix(prefix)): v for k, v in found.items()
                if k.startswith(prefix) and k.removeprefix(prefix).isdigit()}

    first = states()
    waited = set(generating(first))
    now, waiting = first, set(waited)
    while waiting:
        log.info("waiting for %d chunk tasks generating since before the answer to commit: %s", len(waiting),
                 sorted(waiting))
        time.sleep(poll_s)
        now = states()
        waiting &= set(generating(now))
    # One of them that failed and waits for its retry reads the answer too when it starts again.
    return left_to_start(first, chunks) | left_to_start(now, chunks, among=waited)
