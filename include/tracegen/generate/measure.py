"""Measure the tail: continue the pilot's truncated rows to a higher cap, so the cap table is observed
where it matters instead of extrapolated from a log-normal fitted below the cap.

After the pilot, when its truncation is over the threshold (`measure_tail=auto`) or always when asked,
the pilot's truncated rows are continued from their exact token prefixes (`generate.extend`, the same
machinery as `truncated_policy=extend`) to one *measure cap*: the largest of `capfit.candidate_caps` (4x the run's cap)
that the servers' context allows for every one of those rows' prompts and that the token budget covers
in the worst case (every row running to the cap). The pilot audit that follows then holds, for every
pilot row, either its natural length or "longer than the measure cap", and the Kaplan-Meier part of the
cap fit reaches up to that cap.

Why every truncated row goes to the same cap. Kaplan-Meier is unbiased only when whether a row is
censored, and where, does not depend on its length. Extending rows until a budget runs out would stop
exactly the long ones mid-way (or, choosing rows by cost, leave the long ones out): the survivors past
the cap would be under-counted and the recommended cap too low. So the cap is chosen up front from the
worst case, and when the budget cannot take every row to the top cap, every row goes to a lower one.
The worst case bounds what is spent, so nothing has to be cut off while running (tokens of requests
that fail and are retried are not counted: the ledger never sees them).

The measured rows are ordinary rows of the run (their own chunk number, `MEASURE_CHUNK`, cap the measure
cap, `pivot` extended): a row that finished is complete at any cap, one still cut at the measure cap is
truncated at any cap up to it (`plan.done_rows`), and one the run's final cap exceeds is extended again
by the second fan-out. None is generated twice. What was decided and what it cost is stored as
`runs/<run_id>/measure.json` (`MEASURE_FILE`) for the reports, before the first token is spent, so a
retried task measures to the same cap.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit import gate
from tracegen.audit.capfit import candidate_caps
from tracegen.audit.stats import gate_counts
from tracegen.dataset.stored import load_index
from tracegen.fleet import FleetSpec
from tracegen.generate.chunk import fleet_endpoints
from tracegen.generate.engine import DEFAULT_OPTIONS, ChunkEngine, ChunkJob, ChunkOptions
from tracegen.generate.extend import not_extendable
from tracegen.run import MEASURE_CHUNK, MEASURE_FILE, plan
from tracegen.run.run_spec import RunSpec
from tracegen.sglang.routing import ServerEndpoint
from tracegen.store.current import current_mask
from tracegen.store.records import COMPLETE, FAILED, OK
from tracegen.store.root import OutputRoot, open_root
from tracegen.store.snapshots import COMPACT_OVER
from tracegen.store.storage import StorageKeyError

log = logging.getLogger(__name__)



@dataclass
class TailMeasurement:
    """What measuring the tail decided (before any token is spent) and, once done, what it cost."""

    mode: str  # the run's measure_tail
    trigger: str | None  # why it measures; None when it does not
    run_cap: int
    cap: int | None  # the measure cap; None: nothing measured (`reason` says why)
    reason: str
    indices: list[int] = field(default_factory=list)  # the pilot's truncated rows, continued to `cap`
    budget_tokens: int = 0
    budget_source: str = ""
    worst_case_tokens: int = 0  # every row of `indices` running to `cap`
    context_limit: int | None = None  # the highest cap the servers' context leaves for every such prompt
    candidates: list[int] = field(default_factory=list)
    pilot_rows: int = 0
    pilot_tokens: int = 0  # completion tokens of the pilot's rows before measuring
    not_extendable: int = 0  # rows without token ids: generated again from scratch (counted whole)
    outcome: dict[str, Any] | None = None  # `outcome()` once measured

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TailMeasurement:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


def read_measurement(root: OutputRoot, run_id: str) -> TailMeasurement | None:
    try:
        return TailMeasurement.from_json(json.loads(root.run_files.get(run_id, MEASURE_FILE)))
    except StorageKeyError:
        return None


def write_measurement(root: OutputRoot, run_id: str, m: TailMeasurement) -> str:
    return root.run_files.put(run_id, MEASURE_FILE, json.dumps(m.to_json(), indent=2).encode())


def pilot_frame(root: OutputRoot, spec: RunSpec) -> tuple[np.ndarray, pd.DataFrame]:
    """The pilot's indices and every ledger row at them."""
    indices = plan.pilot_indices(spec.config, spec.dataset.n_rows, spec.layout)
    full = root.snapshots.frame(compact_over=COMPACT_OVER)
    frame = full[np.isin(full["index"].to_numpy(np.int64), indices)].reset_index(drop=True)
    return indices, frame


def trigger(spec: RunSpec, frame: pd.DataFrame) -> str | None:
    """Why this run measures its tail now (None: it does not), from the pilot's rows."""
    config = spec.config
    if config.measure_tail == "never":
        return None
    if config.measure_tail == "always":
        return "measure_tail=always"
    truncated, judged = gate_counts(frame, config.max_tokens)
    decision = gate.decide(gate.GateInputs(truncated, judged, gate.GateRule(config.truncation_threshold),
                                           max_tokens=config.max_tokens))
    if decision.verdict != gate.STOP:
        return None
    return (f"the pilot's truncation at max_tokens={config.max_tokens:,} is over the {config.truncation_threshold:.1%} "
            f"threshold: {truncated:,} of {judged:,} rows ({decision.rate:.1%}; {decision.confidence:.0%} interval "
            f"{decision.ci_low:.1%}–{decision.ci_high:.1%})")


def truncated_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The current rows of `frame` that are truncated (ok, finish `length`) and not runaways (their loop would
    run to any cap: measuring it measures nothing and costs the most): index, completion_tokens,
    prompt_tokens, max_tokens, part."""
    if frame.empty:
        return frame.iloc[0:0][["index", "completion_tokens", "prompt_tokens", "max_tokens", "part"]]
    cur = current_mask(frame) & (frame["status"] == OK).to_numpy(bool) & \
        (frame["finish_reason"] == "length").to_numpy(bool) & ~plan.scored_runaways(frame)
    rows = frame.loc[cur, ["index", "completion_tokens", "prompt_tokens", "max_tokens", "part"]]
    return rows.sort_values("index").reset_index(drop=True)


def context_limit(prompt_tokens: Sequence[int] | np.ndarray, context_length: int | None) -> int | None:
    """The highest cap every one of these prompts fits under: SGLang refuses prompt + cap > context."""
    if not context_length:
        return None
    longest = int(np.max(prompt_tokens)) if len(prompt_tokens) else 0
    return max(0, int(context_length) - longest)


def worst_case_tokens(cap: int, prefixes: np.ndarray, bare: np.ndarray) -> int:
    """New tokens if every row ran to `cap`: the tokens past its prefix, or all of them for a row without
    token ids (generated again from scratch). Rows already at or past `cap` are not sent."""
    prefixes = np.asarray(prefixes, dtype=np.int64)
    bare = np.asarray(bare, dtype=bool)
    sent = prefixes < cap
    return int(np.where(bare, cap, cap - prefixes)[sent].sum())


def choose_cap(
    prefixes: np.ndarray,
    bare: np.ndarray,
    *,
    run_cap: int,
    budget: int,
    limit: int | None,
    candidates: Sequence[int] | None = None,
) -> tuple[int | None, int, list[int], str]:
    """(measure cap or None, its worst-case tokens, the caps considered, why): the largest candidate above
    the run's cap, clipped to `limit`, whose worst case the budget covers, the same for every row."""
    if candidates is None:
        candidates = candidate_caps(run_cap)
    caps = sorted({min(int(c), limit) if limit is not None else int(c) for c in candidates})
    caps = [c for c in caps if c > run_cap]
    if not caps:
        where = f"the context leaves at most {limit:,} tokens for these prompts" if limit is not None else \
            f"no candidate cap is above {run_cap:,}"
        return None, 0, caps, f"nothing to measure above max_tokens={run_cap:,}: {where}"
    cost = {c: worst_case_tokens(c, prefixes, bare) for c in caps}
    affordable = [c for c in caps if cost[c] <= budget]
    if not affordable:
        return None, 0, caps, (f"the budget of {budget:,} tokens cannot take the {len(prefixes):,} truncated rows "
                               f"even to {caps[0]:,} (worst case {cost[caps[0]]:,} tokens)")
    cap = affordable[-1]
    if cap == caps[-1]:
        why = "the context's limit for these prompts" if limit is not None and cap == limit else \
            "the highest cap considered"
    else:
        why = (f"{cap:,}, not {caps[-1]:,}: taking every row to {caps[-1]:,} could cost {cost[caps[-1]]:,} tokens, "
               f"over the budget of {budget:,}; every row goes to the same lower cap rather than some rows to "
               "the top (a subset chosen by cost would bias the measurement)")
    return cap, cost[cap], caps, why


def _not_extendable(root: OutputRoot, rows: pd.DataFrame) -> np.ndarray:
    """Per row of `rows`: stored without the token ids a continuation needs (read from their parts)."""
    bare = np.zeros(len(rows), dtype=bool)
    where = {(p, int(i)): k for k, (p, i) in enumerate(zip(rows["part"], rows["index"], strict=True))}
    for part in sorted(set(rows["part"])):
        for row in root.commits.read_part(str(part)):
            k = where.get((part, row.index))
            if k is not None and row.status == OK and row.finish_reason == "length" \
                    and int(rows["max_tokens"].iat[k]) == row.max_tokens:
                bare[k] = not_extendable(row) is not None
    return bare


def tail_measurement_of(spec: RunSpec, root: OutputRoot, *, context_length: int | None) -> TailMeasurement:
    """Whether and to which cap this run measures its tail, from the pilot's committed rows."""
    config = spec.config
    _, frame = pilot_frame(root, spec)
    cur_ok = current_mask(frame) & (frame["status"] == OK).to_numpy(bool) if len(frame) else np.zeros(0, bool)
    pilot_tokens = int(frame["completion_tokens"].to_numpy(np.int64)[cur_ok].sum()) if len(frame) else 0
    base = dict(mode=config.measure_tail, run_cap=config.max_tokens, pilot_rows=int(cur_ok.sum()),
                pilot_tokens=pilot_tokens)
    why = trigger(spec, frame) if config.pilot_size else None
    if why is None:
        reason = ("measure_tail=never" if config.measure_tail == "never" else
                  "no pilot" if not config.pilot_size else "the pilot's truncation is within the threshold")
        return TailMeasurement(trigger=None, cap=None, reason=reason, **base)
    rows = truncated_rows(frame)
    if rows.empty:
        return TailMeasurement(trigger=why, cap=None, reason="no pilot row is truncated", **base)
    budget, source = config.measure_budget_tokens, f"measure_budget_tokens={config.measure_budget_tokens:,}"
    if not budget:
        # The pilot's own cost is what the operator already chose to spend deciding the cap: measuring may
        # at most double it. In the worst case only; most truncated rows finish soon after the cap.
        budget, source = max(pilot_tokens, 1), "the pilot's own completion tokens (measure_budget_tokens=0)"
    bare = _not_extendable(root, rows)
    limit = context_limit(rows["prompt_tokens"].to_numpy(np.int64), context_length or config.context_length)
    prefixes = rows["completion_tokens"].to_numpy(np.int64)
    cap, worst, caps, reason = choose_cap(prefixes, bare, run_cap=config.max_tokens, budget=budget, limit=limit)
    sent = rows["index"].to_numpy(np.int64)[prefixes < cap] if cap else np.empty(0, np.int64)
    return TailMeasurement(
        trigger=why, cap=cap, reason=reason, indices=[int(i) for i in sent], budget_tokens=int(budget),
        budget_source=source, worst_case_tokens=worst, context_limit=limit, candidates=caps,
        not_extendable=int(bare.sum()), **base,
    )


def outcome(root: OutputRoot, spec: RunSpec, m: TailMeasurement) -> dict[str, Any]:
    """What the measurement did, from the ledger: rows continued, finished, still cut, tokens spent."""
    frame = root.snapshots.frame(compact_over=COMPACT_OVER)
    mine = frame[(frame["run_id"] == spec.run_id) & (frame["chunk"] == MEASURE_CHUNK)]
    ok = mine[mine["status"] == OK]
    new = (ok["completion_tokens"] - ok["prefix_tokens"]).to_numpy(np.int64)
    finished = ok["finish_reason"].isin(COMPLETE).to_numpy(bool)
    lengths = ok["completion_tokens"].to_numpy(np.int64)
    return {
        "rows": len(m.indices),
        "measured": int(len(ok)),
        "finished": int(finished.sum()),
        "still_truncated": int((~finished).sum()),
        "failed_or_rejected": int(len(set(m.indices) - set(ok["index"].tolist()))),
        "new_tokens": int(new.sum()),
        "prefix_tokens_reused": int(ok["prefix_tokens"].sum()),
        "regenerated": int((ok["pivot"] != "extended").sum()),
        "budget_share": float(new.sum()) / m.budget_tokens if m.budget_tokens else None,
        "pilot_share": float(new.sum()) / m.pilot_tokens if m.pilot_tokens else None,
        # How many measured rows would each candidate cap still cut (natural length past it).
        "past_cap": {str(c): int((lengths > c).sum()) for c in m.candidates if c <= (m.cap or 0)},
        "failed_rows": int((mine["status"] == FAILED).sum()),
    }


def measure_tail(
    spec: RunSpec,
    *,
    context_length: int | None,
    fleet: FleetSpec | None = None,
    endpoints: Sequence[ServerEndpoint] | None = None,
    before_measuring: Callable[[], Any] | None = None,
    root: OutputRoot | None = None,
    options: ChunkOptions = DEFAULT_OPTIONS,
) -> TailMeasurement:
    """Decide (or take up the decision of an earlier attempt), then continue the pilot's truncated rows to
    the measure cap on `endpoints` or the servers of `fleet`, and store what it cost.

    `before_measuring` runs once it is known that rows will be sent (the pilot report then: the chunks
    beside the pilot read its verdict and stop, leaving the fleet to the measurement). `root`: the run's
    output root, when the task has opened it already."""
    config = spec.config
    root = open_root(config.output_uri, config.aws_conn_id) if root is None else root
    m = read_measurement(root, spec.run_id)
    if m is None:
        m = tail_measurement_of(spec, root, context_length=context_length)
        write_measurement(root, spec.run_id, m)
    else:
        log.info("taking up the tail measurement an earlier attempt decided: cap %s", m.cap)
    if m.cap is None or not m.indices:
        log.info("no tail measurement: %s", m.reason)
        return m
    log.info("measuring the tail (%s): %d truncated pilot rows continued to %d, %s; worst case %s tokens of a "
             "budget of %s (%s)", m.trigger, len(m.indices), m.cap, m.reason, f"{m.worst_case_tokens:,}",
             f"{m.budget_tokens:,}", m.budget_source)
    if before_measuring is not None:
        before_measuring()
    # The run's settings at the measure cap; extend, whatever the run's policy: a measurement regenerating
    # rows would pay their prefixes again and measure other samples than the pilot's.
    measured = replace(config, max_tokens=m.cap, truncated_policy="extend")

    def run(servers: Sequence[ServerEndpoint]) -> None:
        job = ChunkJob(config=measured, run_id=spec.run_id, model=spec.fleet.model, chunk=MEASURE_CHUNK,
                       label=f"tail measurement ({len(m.indices):,} rows to {m.cap:,})")
        engine = ChunkEngine(job, root=root, dataset=load_index(root, config.aws_conn_id), servers=servers,
                             options=options)
        engine.run(np.asarray(m.indices, dtype=np.int64))

    if endpoints is not None:
        run(endpoints)
    elif fleet is not None:
        with fleet_endpoints(fleet, measured) as servers:
            run(servers)
    else:
        raise ValueError("measure_tail needs the fleet or the endpoints to send requests to")
    m.outcome = outcome(root, spec, m)
    write_measurement(root, spec.run_id, m)
    o = m.outcome
    log.info("tail measured to %d: %d of %d rows finished, %d still truncated; %s new tokens (%s of the budget)",
             m.cap, o["finished"], o["rows"], o["still_truncated"], f"{o['new_tokens']:,}",
             f"{100 * (o['budget_share'] or 0):.0f}%")
    return m
