"""What the pivot did: rows truncated under a lower cap that a run replaced, extended from their tokens or
generated again, and what that cost and saved. Counts ok rows, restricted to ``run_id`` when one is given."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.columns import Coded
from tracegen.store.layout import MEASURE_CHUNK
from tracegen.store.records import EXTENDED, FALLBACK_REGENERATED, OK, REGENERATED


def pivot_summary(frame: pd.DataFrame, *, run_id: str | None = None) -> dict[str, Any]:
    """What the pivot did: the ok rows (of `run_id`, or of every run) that replaced a row truncated under
    a lower cap, and the tokens that cost.

    An extended row paid only for its new tokens (``completion_tokens - prefix_tokens``); its prefix is what
    regenerating it would have paid again (``tokens_saved``). A regenerated row paid all its tokens.
    """
    n = len(frame)
    pivot = Coded(frame["pivot"] if "pivot" in frame.columns else pd.Series([None] * n, dtype=object))
    prefix = (frame["prefix_tokens"].fillna(0).to_numpy(dtype=np.int64) if "prefix_tokens" in frame.columns
              else np.zeros(n, dtype=np.int64))
    tokens = frame["completion_tokens"].fillna(0).to_numpy(dtype=np.int64) if n else np.zeros(0, np.int64)
    ok = Coded(frame["status"]).eq(OK) if n else np.zeros(0, dtype=bool)
    if run_id is not None and n:
        ok &= Coded(frame["run_id"]).eq(run_id)
    finished = ~Coded(frame["finish_reason"]).eq("length") if n else np.zeros(0, dtype=bool)
    ext, regen, fallback = ok & pivot.eq(EXTENDED), ok & pivot.eq(REGENERATED), ok & pivot.eq(FALLBACK_REGENERATED)
    joined = (frame["text_joined"].fillna(False).to_numpy(dtype=bool) if "text_joined" in frame.columns
              else np.zeros(n, dtype=bool))
    new = int((tokens - prefix)[ext].sum())
    again = int(tokens[regen | fallback].sum())
    # Rows extended by the pilot's tail measurement (`generate.measure`), before any cap was chosen: the
    # same mechanism, but not the pivot's doing, so the lines saying what the pivot did name them apart.
    measured = ext & (frame["chunk"].to_numpy(dtype=np.int64) == MEASURE_CHUNK) if n else ext
    return {
        "extended": int(ext.sum()),
        "extended_measuring": int(measured.sum()),
        "extended_finished": int((ext & finished).sum()),  # the rest were cut again at their new cap
        "extended_new_tokens": new,
        "regenerated": int(regen.sum()),
        "fallback_regenerated": int(fallback.sum()),  # extend asked for, but the row had no token ids
        "regenerated_tokens": again,
        "tokens_spent": new + again,
        "tokens_saved": int(prefix[ext].sum()),
        # Extended rows whose text joins two decodings (the server had no /detokenize): where the cut fell
        # inside a character, their seam holds U+FFFD.
        "joined_seams": int((ext & joined).sum()),
    }


def pivot_text(p: dict[str, Any]) -> str | None:
    """One line saying what the pivot did, for logs, status and the report (None: no pivot rows)."""
    if not p or not (p["extended"] or p["regenerated"] or p["fallback_regenerated"]):
        return None
    parts = []
    if p["extended"]:
        measuring = p.get("extended_measuring") or 0
        who = (f" ({measuring:,} of them by the pilot's tail measurement, {p['extended'] - measuring:,} by the "
               "pivot to the chosen cap)" if measuring else "")
        parts.append(f"{p['extended']:,} rows extended from their tokens{who} ({p['extended_finished']:,} now "
                     f"finish), {p['extended_new_tokens']:,} new tokens spent, {p['tokens_saved']:,} saved "
                     "against regenerating them")
    if p["regenerated"]:
        parts.append(f"{p['regenerated']:,} rows regenerated")
    if p["fallback_regenerated"]:
        parts.append(f"{p['fallback_regenerated']:,} rows regenerated because they had no token ids")
    if p["regenerated"] or p["fallback_regenerated"]:
        parts.append(f"{p['regenerated_tokens']:,} tokens spent regenerating")
    return "; ".join(parts)
