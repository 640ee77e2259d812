"""`turns=chain` in a chunk: a conversation's turns in order, each after the model's own earlier answers.

Turn k of a conversation is sent once turns 1..k-1 are committed complete (`ok`, finish `stop`; a runaway
never finishes so), and its prompt is its dataset prompt with every earlier assistant turn replaced by the
committed answer to it (`dataset.turns.chained_messages`). Turns of different conversations run side by
side, so the fleet stays busy while a conversation waits for its previous turn's commit.

- **Committed, not only finished.** A turn's successor waits until the part holding it is committed (the
  engine commits as soon as a successor waits: `awaiting_commit`). The answer a successor is built on is
  then the ledger's, whatever happens to the task after: a retry reads the same answer from the part.
- **Held, not invalid.** A turn that ends any other way (truncated at the cap, a runaway, a tool call,
  failed, rejected, invalid) holds every later turn of its conversation: they are not sent in this pass and
  get no ledger row, so they stay pending. A raised cap that completes the turn (continued from its tokens,
  `generate.extend`, its prompt being the chained one the ledger's ids were rendered from) or a scheduled
  rerun goes on from there.
- **Resume.** What is committed is never sent again (the engine's `remaining`); a turn whose earlier turns
  were committed by an earlier attempt or run is built from their parts, read here.

The chunk's plan keeps a conversation in one chunk (`run.plan.whole_conversations`); a scope that holds a
turn but not its predecessors (the resample of a runaway turn, the tail measurement of pilot turns) builds it
from the committed predecessors all the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from tracegen.dataset.reader import DatasetIndex, InvalidRow, PromptRow, read_indices
from tracegen.dataset.turns import chained_messages
from tracegen.generate.extend import Extension, Superseded, extension_jobs
from tracegen.run import plan
from tracegen.sglang.client import Sampling
from tracegen.store.entries import LedgerError
from tracegen.store.records import GeneratedRow, completes_chain_turn
from tracegen.store.root import OutputRoot

log = logging.getLogger(__name__)


def is_complete(row: GeneratedRow) -> bool:
    """Whether a later turn can follow this turn's row, just generated (`plan.chain_complete` of a committed
    one: a row that stopped on its own is no runaway)."""
    return completes_chain_turn(row.status, row.finish_reason)


class ChainSchedule:
    """Which turns of a chunk's scope go when, and the chained prompt each goes with.

    `items()` hands out the turns ready to send, then waits for more: a turn becomes ready once its previous
    turn is finished complete (`finished`) and committed (`committed`). It ends when no sent turn can make
    another ready."""

    def __init__(self, *, root: OutputRoot, dataset: DatasetIndex, todo: np.ndarray, aws_conn_id: str,
                 sampling: Sampling, superseded: dict[int, Superseded] | None = None,
                 known_long: np.ndarray | None = None) -> None:
        self.root, self.dataset, self.aws_conn_id = root, dataset, aws_conn_id
        todo = np.asarray(todo, dtype=np.int64)
        self.todo = set(todo.tolist())
        self._ready: deque[PromptRow | InvalidRow | Extension] = deque()
        self._waiting: dict[int, int] = {}  # a turn sent or waiting -> its next turn, waiting on it
        self._prompts: dict[int, PromptRow | InvalidRow] = {}  # the dataset prompt of each waiting turn
        self._answers: dict[int, str | None] = {}  # committed answers of the scope's conversations
        self._awaiting: dict[int, GeneratedRow] = {}  # finished complete, waiting for their commit
        self._extensions: dict[int, Extension] = {}
        self._held: set[int] = set()
        self._outstanding = 0  # turns sent whose next turn waits on them
        self._stopped = False
        self._wake = asyncio.Event()
        self._plan(todo, superseded or {}, known_long, sampling)

    # ---- the plan at the chunk's start ---------------------------------------------------------------

    def _plan(self, todo: np.ndarray, superseded: dict[int, Superseded], known_long: np.ndarray | None,
              sampling: Sampling) -> None:
        if not todo.size:
            return
        dataset = self.dataset
        convs = np.unique(dataset.conversations(todo))
        rows = np.concatenate([np.arange(dataset.first_prompt_row(int(c)),
                                         dataset.first_prompt_row(int(c)) + dataset.prompt_rows_of(int(c)))
                               for c in convs])
        frame = self.root.snapshots.plan_frame(rows)
        complete = frame.loc[plan.chain_complete(frame), ["index", "part"]]
        complete_idx = set(complete["index"].to_numpy(np.int64).tolist())
        ready: list[int] = []
        needed: set[int] = set()  # committed answers the ready turns are built on
        for c in convs.tolist():
            first = dataset.first_prompt_row(c)
            blocked = False
            for i in range(first, first + dataset.prompt_rows_of(c)):
                if i not in self.todo:
                    if i not in complete_idx:
                        blocked = True  # truncated and kept, a runaway, invalid: what follows waits for a rerun
                    continue
                if blocked:
                    self._held.add(i)
                elif i - 1 >= first and i - 1 not in complete_idx:
                    self._waiting[i - 1] = i  # the turn before is in scope: it goes first
                else:
                    ready.append(i)
                    needed.update(range(first, i))
        self._answers = self._committed_answers(complete, needed)
        # Waiting turns' dataset prompts are read now, in one pass over the chunk's blocks.
        want = sorted(set(ready) | set(self._waiting.values()))
        sent_later = set(self._waiting.values())
        long = set(() if known_long is None else np.asarray(known_long).tolist())
        extend = {i: superseded[i] for i in want if i in superseded}
        if extend:
            for job in extension_jobs(self.root, dataset, extend, sampling=sampling, need_prompts=False,
                                      aws_conn_id=self.aws_conn_id):
                if isinstance(job, Extension):
                    self._extensions[job.source.index] = job
        first_ready: list[PromptRow | InvalidRow | Extension] = []
        for row in read_indices(dataset, want, aws_conn_id=self.aws_conn_id):
            if row.index in sent_later:
                self._prompts[row.index] = row  # an invalid one is recorded so when its turn comes
            else:
                first_ready.append(self._item(row))
        # Rows known to be long first: the chunk's stragglers start early.
        first_ready.sort(key=lambda item: _index(item) not in long)
        self._ready.extend(first_ready)
        self._outstanding = sum(1 for item in first_ready if _index(item) in self._waiting)
        if self._held:
            log.info("turns=chain: %d turns wait for an earlier turn of their conversation that is not complete "
                     "(truncated and kept, a runaway, invalid or failed); they stay pending", len(self._held))

    def _committed_answers(self, complete: Any, needed: set[int]) -> dict[int, str | None]:
        """The committed complete rows' answers of `needed` turns, read from their parts (one read a part)."""
        wanted = complete[complete["index"].isin(sorted(needed))]
        out: dict[int, str | None] = {}
        for part, group in wanted.groupby("part"):
            indices = set(group["index"].to_numpy(np.int64).tolist())
            for row in self.root.commits.read_part(str(part)):
                if row.index in indices and is_complete(row):
                    out[row.index] = row.content
        missing = needed - set(out)
        if missing:
            raise LedgerError(f"turns=chain: the ledger lists complete rows for turns {sorted(missing)[:5]} but "
                              "their parts do not hold them")
        return out

    def _item(self, row: PromptRow | InvalidRow) -> PromptRow | InvalidRow | Extension:
        """The row to send for a ready turn: its chained prompt (continued from its tokens when it is a
        truncated row to extend, its prompt the chained one)."""
        if isinstance(row, InvalidRow):
            return row
        first = self.dataset.first_prompt_row(int(self.dataset.conversations(np.asarray([row.index]))[0]))
        answers = [self._answers[j] for j in range(first, row.index)]
        chained = replace(row, messages=chained_messages(row.messages, answers))
        job = self._extensions.pop(row.index, None)
        if job is not None:
            job.prompt = chained
            return job
        return chained

    # ---- while the chunk runs ------------------------------------------------------------------------

    def finished(self, row: GeneratedRow) -> None:
        """A turn's row reached the spool: a complete one waits for its commit, any other holds what follows."""
        if row.index not in self._waiting:
            return
        if is_complete(row):
            self._awaiting[row.index] = row
            return
        self._outstanding -= 1
        nxt = self._waiting.pop(row.index)
        while True:  # every later turn of the conversation stays pending
            self._held.add(nxt)
            self._prompts.pop(nxt, None)
            if nxt not in self._waiting:
                break
            nxt = self._waiting.pop(nxt)
        self._wake.set()

    @property
    def awaiting_commit(self) -> bool:
        """Whether a finished turn's successor waits for the part holding it to be committed."""
        return bool(self._awaiting)

    def committed(self, indices: Iterable[int]) -> None:
        """The rows of `indices` are committed: the turns waiting on those that finished complete are ready."""
        for index in indices:
            row = self._awaiting.pop(index, None)
            if row is None:
                continue
            self._answers[index] = row.content
            self._outstanding -= 1
            nxt = self._waiting.pop(index)
            self._ready.append(self._item(self._prompts.pop(nxt)))
            if nxt in self._waiting:
                self._outstanding += 1
        self._wake.set()

    def held(self) -> set[int]:
        """The scope's turns not sent in this pass: an earlier turn of theirs is not complete."""
        return set(self._held)

    def stop(self) -> None:
        """The chunk stops sending: `items` ends instead of waiting for a turn that may never come."""
        self._stopped = True
        self._wake.set()

    async def items(self) -> AsyncIterator[PromptRow | InvalidRow | Extension]:
        while not self._stopped:
            while self._ready and not self._stopped:
                yield self._ready.popleft()
            if self._outstanding <= 0 or self._stopped:
                return
            self._wake.clear()
            await self._wake.wait()


def _index(item: PromptRow | InvalidRow | Extension) -> int:
    return item.source.index if isinstance(item, Extension) else item.index
