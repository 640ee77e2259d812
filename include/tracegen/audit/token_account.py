"""Where the fleet's tokens went: every token the servers generated for an output root, from the ledger alone.

Each ledger row records what it cost: its new tokens (`completion_tokens - prefix_tokens`; an extended row
reuses its source's tokens as its prefix and pays only past them). Each index's current row
(`store.current`) holds its whole chain: the row itself and, through its prefix, the rows it extends. So the
tokens generated split without overlap into:

- **kept**: current rows that finished (stop, tool calls): what the export writes by default;
- **truncated, left out**: current rows cut at their cap and not looping;
- **runaways**: current rows that loop, cut at the cap or stopped while they looped (finish `loop`), as
  generated until then;
- **superseded**: rows no current row extends, replaced by a row generated again (truncated_policy=regenerate,
  or a row without token ids), by a fresh sample (runaway_policy=resample), or by the answer to the gate's
  question (generated while it waited, at a cap the answer did not keep);

and the tokens of **failed attempts**, which no ledger row holds: a failed request returns no usage, so they
are not counted, and the table says so.

What prefill cost (`prefill`), over every ok row, each for its own requests as the generated tokens are: the
prompt tokens sent to the servers (`records.prompt_sent`: an extended row's continuation sends the prompt and
the kept ids), those the servers found in their prefix cache (`cached_tokens`), and the rest, computed. A
server that does not report its cache (the chat route without --enable-cache-report, an older SGLang) leaves a
row's cached count unknown: the cached share is taken over the rows where it is known, and the rows where it
is not are counted apart, never as 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.runaway import scored_runaway
from tracegen.store.current import current_mask
from tracegen.store.records import COMPLETE, EXTENDED, LOOP, OK, RESAMPLED, prompt_sent

KEPT, TRUNCATED, RUNAWAY, SUPERSEDED = "kept", "truncated_left_out", "runaway", "superseded"
SUPERSEDED_BY = ("generated_again", "resampled", "while_asking", "other")


def token_account(frame: pd.DataFrame) -> dict[str, Any]:
    """The account of a ledger frame (every row, every column `store.records.LEDGER_COLUMNS` names)."""
    empty = {"generated": 0, KEPT: 0, TRUNCATED: 0, RUNAWAY: 0, SUPERSEDED: 0,
             "superseded_by": dict.fromkeys(SUPERSEDED_BY, 0), "stopped_rows": 0, "stopped_tokens": 0,
             "stopped_saved": 0,
             "failed_attempts": None, "prefill": prefill_account(frame)}
    if len(frame) == 0:
        return empty
    ok = (frame["status"] == OK).to_numpy(bool)
    tokens = frame["completion_tokens"].fillna(0).to_numpy(np.int64) * ok
    prefix = frame["prefix_tokens"].fillna(0).to_numpy(np.int64) * ok
    new = np.maximum(tokens - prefix, 0)
    cur = current_mask(frame) & ok
    finish = frame["finish_reason"].astype(object).to_numpy()
    looped = np.isin(finish, (LOOP,)) | (np.isin(finish, ("length",)) & scored_runaway(frame))
    complete = np.isin(finish, COMPLETE)
    in_chain = _in_current_chain(frame, cur, tokens, prefix)
    lost = ok & ~cur & ~in_chain
    doc = {
        "generated": int(new.sum()),
        KEPT: int(tokens[cur & complete].sum()),
        TRUNCATED: int(tokens[cur & ~complete & ~looped].sum()),
        RUNAWAY: int(tokens[cur & looped].sum()),
        SUPERSEDED: int(new[lost].sum()),
        "superseded_by": _superseded_by(frame, lost, new, cur),
        "stopped_rows": int((cur & np.isin(finish, (LOOP,))).sum()),
        "stopped_tokens": int(tokens[cur & np.isin(finish, (LOOP,))].sum()),
        # What stopping them spared at least: each stopped row would have run on to its cap (and been
        # continued past it, before runaways were done at every cap).
        "stopped_saved": int(np.maximum(frame["max_tokens"].to_numpy(np.int64) - tokens, 0)[
            cur & np.isin(finish, (LOOP,))].sum()),
        "failed_attempts": None,  # a failed request returns no usage: not in the ledger
        "prefill": prefill_account(frame),
    }
    kept = doc[KEPT]
    doc["generated_per_kept"] = round(doc["generated"] / kept, 4) if kept else None
    return doc


def prefill_account(frame: pd.DataFrame) -> dict[str, Any]:
    """The prompt tokens the ok rows sent, found cached and computed (see the module docstring): `sent` over
    all `rows`; `cached`, `computed` (sent - cached) and `cached_share` over the `known_rows` whose server
    reported its cache (`known_sent` of the tokens sent); `unknown_rows` did not say. A frame without the
    column (rows committed before it) knows none."""
    if len(frame) == 0:
        return {"rows": 0, "sent": 0, "known_rows": 0, "known_sent": 0, "cached": 0, "computed": 0,
                "cached_share": None, "unknown_rows": 0}
    ok = (frame["status"] == OK).to_numpy(bool)
    sent = prompt_sent(frame["prompt_tokens"].fillna(0).to_numpy(np.int64),
                       frame["prefix_tokens"].fillna(0).to_numpy(np.int64))
    cached = (frame["cached_tokens"].to_numpy(np.float64) if "cached_tokens" in frame.columns
              else np.full(len(frame), np.nan))
    known = ok & ~np.isnan(cached)
    known_sent, found = int(sent[known].sum()), int(cached[known].sum())
    return {"rows": int(ok.sum()), "sent": int(sent[ok].sum()), "known_rows": int(known.sum()),
            "known_sent": known_sent, "cached": found, "computed": known_sent - found,
            "cached_share": round(found / known_sent, 4) if known_sent else None,
            "unknown_rows": int((ok & ~known).sum())}


def prefill_line(doc: dict[str, Any]) -> str | None:
    """What prefill cost, in words, for the report, `status` and the review pages (None: no ok row, or an
    account from before it was kept)."""
    p = doc.get("prefill")
    if not p or not p["rows"]:
        return None

    def rows(n: int) -> str:
        return f"{n:,} row" + ("" if n == 1 else "s")

    sent = f"{p['sent']:,} prompt tokens sent over {rows(p['rows'])}"
    unknown = f"cache not reported for {rows(p['unknown_rows'])}"
    if not p["known_rows"]:
        return f"{sent}; {unknown}"
    share = f"{p['cached_share']:.1%}" if p["cached_share"] is not None else "-"
    figures = f"{p['cached']:,} found cached ({share}), {p['computed']:,} computed"
    if not p["unknown_rows"]:
        return f"{sent}: {figures}"
    return (f"{sent}; of the {p['known_sent']:,} sent by the {rows(p['known_rows'])} whose server reported its "
            f"cache, {figures}; {unknown}")


def _in_current_chain(frame: pd.DataFrame, cur: np.ndarray, tokens: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """Per row: a row some current row extends, directly or through rows it extends (its tokens are inside
    that current row's). An extended row's prefix is its source's whole completion, at a lower cap."""
    pivot = frame["pivot"].astype(object).to_numpy()
    idx = frame["index"].to_numpy(np.int64)
    cap = frame["max_tokens"].to_numpy(np.int64)
    inside = np.zeros(len(frame), dtype=bool)
    # Walk each chain down from its current row: few indices have more than two links.
    heads = np.flatnonzero(cur & (pivot == EXTENDED))
    if heads.size == 0:
        return inside
    by_index: dict[int, list[int]] = {}
    for pos in np.flatnonzero(np.isin(idx, idx[heads])):
        by_index.setdefault(int(idx[pos]), []).append(int(pos))
    for head in heads:
        at = int(head)
        while pivot[at] == EXTENDED and prefix[at] > 0:
            source = [p for p in by_index[int(idx[at])]
                      if p != at and not inside[p] and cap[p] < cap[at] and tokens[p] == prefix[at]]
            if not source:
                break
            at = max(source, key=lambda p: cap[p])
            inside[at] = True
    return inside


def _superseded_by(frame: pd.DataFrame, lost: np.ndarray, new: np.ndarray, cur: np.ndarray) -> dict[str, int]:
    """The superseded tokens by what replaced them: the current row of their index says."""
    out = dict.fromkeys(SUPERSEDED_BY, 0)
    if not lost.any():
        return out
    idx = frame["index"].to_numpy(np.int64)
    pivot = pd.Series(frame["pivot"].astype(object).to_numpy()[cur], index=idx[cur])
    asking = frame["while_asking"].fillna(False).to_numpy(bool) if "while_asking" in frame.columns else \
        np.zeros(len(frame), dtype=bool)
    for pos in np.flatnonzero(lost):
        by = pivot.get(int(idx[pos]))
        kind = ("while_asking" if asking[pos] else "resampled" if by == RESAMPLED
                else "generated_again" if by is not None and by != EXTENDED else "other")
        out[kind] += int(new[pos])
    return out


def stopped_line(doc: dict[str, Any]) -> str | None:
    """What stopping loops while they looped did, in words (None: none was stopped)."""
    rows = doc.get("stopped_rows") or 0
    if not rows:
        return None
    return (f"{rows:,} rows were stopped while they looped, after {doc['stopped_tokens']:,} tokens in all; "
            f"running on to their caps they would have cost at least {doc.get('stopped_saved') or 0:,} more")


def account_lines(doc: dict[str, Any]) -> list[tuple[str, int, str]]:
    """The account as (what, tokens, share of generated) rows, for the report's table and `status`."""
    total = doc["generated"] or 0

    def share(n: int) -> str:
        return f"{n / total:.1%}" if total else "-"

    rows = [("generated by the fleet", total, share(total)), ("in the rows kept", doc[KEPT], share(doc[KEPT])),
            ("truncated rows left out", doc[TRUNCATED], share(doc[TRUNCATED])),
            ("runaways, as generated until cut or stopped", doc[RUNAWAY], share(doc[RUNAWAY]))]
    for kind in SUPERSEDED_BY:
        n = doc["superseded_by"][kind]
        if n:
            label = {"generated_again": "superseded: generated again", "resampled": "superseded: runaways resampled",
                     "while_asking": "superseded: generated while asking, discarded by the answer",
                     "other": "superseded: other"}[kind]
            rows.append((label, n, share(n)))
    return rows
