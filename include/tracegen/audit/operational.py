"""The audit's operational breakdowns: per chunk, per server (flagged when clearly worse than the fleet) and
the errors. They count every ledger row in scope, superseded or not: every attempt is evidence about a
server."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tracegen.audit.columns import Coded, group_table, rate
from tracegen.store.records import FAILED, INVALID, REJECTED

TOP_MESSAGES = 10


def chunks_and_servers(
    frame: pd.DataFrame,
    scope: np.ndarray,
    status: Coded,
    is_ok: np.ndarray,
    is_len: np.ndarray,
    tokens_all: np.ndarray,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(by chunk, by server) over the rows in `scope`."""
    if not scope.any():
        return [], []
    latency = frame["latency_s"].fillna(0.0).to_numpy(dtype=np.float64)
    cols = {
        "ok": is_ok[scope].astype(np.int64),
        "failed": status.eq(FAILED)[scope].astype(np.int64),
        "rejected": status.eq(REJECTED)[scope].astype(np.int64),
        "invalid": status.eq(INVALID)[scope].astype(np.int64),
        "truncated": is_len[scope].astype(np.int64),
        "latency_ok": np.where(is_ok, latency, 0.0)[scope],
        "tokens_ok": np.where(is_ok, tokens_all, 0)[scope],
    }
    return _by_chunk(frame, scope, cols), _by_server(frame, scope, cols, is_ok, latency)


def _by_chunk(frame: pd.DataFrame, scope: np.ndarray, cols: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    chunk_codes, chunk_labels = pd.factorize(frame["chunk"].to_numpy(dtype=np.int64)[scope], sort=True)
    chunks = group_table(chunk_codes, [int(c) for c in chunk_labels], cols)
    by_chunk = []
    for key, r in chunks.iterrows():
        ok = int(r["ok"])
        by_chunk.append(
            {
                "chunk": int(key),
                "rows": int(r["rows"]),
                "ok": ok,
                "failed": int(r["failed"]),
                "rejected": int(r["rejected"]),
                "invalid": int(r["invalid"]),
                "truncated": int(r["truncated"]),
                "truncation_rate": rate(int(r["truncated"]), ok),
                "mean_latency_s": rate(float(r["latency_ok"]), ok),
            }
        )
    return by_chunk


def _by_server(frame: pd.DataFrame, scope: np.ndarray, cols: dict[str, np.ndarray], is_ok: np.ndarray,
               latency: np.ndarray) -> list[dict[str, Any]]:
    srv = Coded(frame["server"])
    server_labels = [label or "(none)" for label in srv.labels]
    servers = group_table(srv.codes[scope], server_labels, cols)
    # Latency quantiles per server over ok rows only (failed rows carry no useful latency).
    ok_scope = is_ok & scope
    okf = pd.DataFrame({"server": np.asarray(server_labels, dtype=object)[srv.codes[ok_scope]],
                        "lat": latency[ok_scope]})
    lat_q = okf.groupby("server")["lat"].quantile([0.5, 0.9]).unstack() if len(okf) else pd.DataFrame()
    fleet = {
        "err": rate(int(servers["failed"].sum() + servers["rejected"].sum()), int(servers["rows"].sum())) or 0.0,
        "trunc": rate(int(servers["truncated"].sum()), int(servers["ok"].sum())) or 0.0,
        "p50": float(okf["lat"].median()) if len(okf) else 0.0,
    }
    by_server = []
    for key, r in servers.iterrows():
        n, ok = int(r["rows"]), int(r["ok"])
        errs = int(r["failed"] + r["rejected"])
        err_rate = errs / n if n else 0.0
        trunc_rate = rate(int(r["truncated"]), ok)
        p50 = float(lat_q.loc[key, 0.5]) if key in lat_q.index else None
        p90 = float(lat_q.loc[key, 0.9]) if key in lat_q.index else None
        by_server.append(
            {
                "server": str(key),
                "rows": n,
                "ok": ok,
                "errors": errs,
                "error_rate": err_rate,
                "truncated": int(r["truncated"]),
                "truncation_rate": trunc_rate,
                "latency_p50_s": p50,
                "latency_p90_s": p90,
                "tokens_per_s_per_request": rate(float(r["tokens_ok"]), float(r["latency_ok"])),
                "flags": _server_flags(n, ok, err_rate, trunc_rate, p50, fleet),
            }
        )
    return by_server


def _server_flags(n: int, ok: int, err_rate: float, trunc_rate: float | None, p50: float | None,
                  fleet: dict[str, float]) -> list[str]:
    """Why a server stands out. A server is flagged only when it is clearly worse than the fleet, not on a
    handful of rows."""
    flags = []
    if n >= 20 and err_rate > max(0.05, 3 * fleet["err"]):
        flags.append(f"error rate {err_rate:.1%} vs fleet {fleet['err']:.1%}")
    if trunc_rate is not None and ok >= 50:
        se = math.sqrt(max(fleet["trunc"] * (1 - fleet["trunc"]), 1e-9) / ok)
        if trunc_rate > fleet["trunc"] + 4 * se and trunc_rate > 1.5 * fleet["trunc"]:
            flags.append(f"truncation {trunc_rate:.1%} vs fleet {fleet['trunc']:.1%}")
    if p50 is not None and ok >= 20 and fleet["p50"] > 0 and p50 > 2 * fleet["p50"]:
        flags.append(f"median latency {p50:.1f}s vs fleet {fleet['p50']:.1f}s")
    return flags


def errors(frame: pd.DataFrame, scope: np.ndarray, status: Coded,
           current_by_status: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(errors, invalid): failed and rejected rows in scope, the indices still failed, and their commonest
    messages; the invalid dataset rows and theirs."""
    err_mask = scope & status.isin([FAILED, REJECTED])
    errs = {
        "failed_rows": int((scope & status.eq(FAILED)).sum()),
        "rejected_rows": int((scope & status.eq(REJECTED)).sum()),
        "current_failed": current_by_status[FAILED],
        "current_rejected": current_by_status[REJECTED],
        "top_messages": _top_messages(frame, err_mask),
    }
    inv_mask = scope & status.eq(INVALID)
    return errs, {"rows": int(inv_mask.sum()), "top_messages": _top_messages(frame, inv_mask)}


def _top_messages(frame: pd.DataFrame, mask: np.ndarray) -> list[dict[str, Any]]:
    if not mask.any():
        return []
    sub = frame.loc[mask, ["status", "error"]]  # only error rows: few enough for string operations
    # Digits vary per request (ids, ports, token counts); folding them groups the same failure together.
    # As objects first: a Categorical column (the lean ledger read's) takes no fill value outside its categories.
    msg = (sub["error"].astype(object).fillna("(no message)").astype(str).str.slice(0, 300)
           .str.replace(r"\d+", "N", regex=True))
    counts = pd.DataFrame({"status": sub["status"].to_numpy(), "message": msg.to_numpy()}).value_counts()
    return [
        {"status": str(s), "message": str(m), "count": int(c)} for (s, m), c in counts.head(TOP_MESSAGES).items()
    ]
