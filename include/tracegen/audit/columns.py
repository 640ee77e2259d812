"""Ledger columns as the audit's statistics read them: a string column as integer codes, per-group sums of
a million rows without groupby, and a rate that is None where there is nothing to divide by."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def rate(num: int | float, den: int | float) -> float | None:
    return float(num) / float(den) if den else None


class Coded:
    """A string column as integer codes plus labels. Factorising once is far cheaper than comparing a million
    Python strings (pandas 3 stores strings in Arrow; object arrays would copy them all)."""

    def __init__(self, col: pd.Series, missing: str = "(none)") -> None:
        codes, uniques = pd.factorize(col, use_na_sentinel=True)
        self.labels = [str(u) for u in uniques] + [missing]
        self.codes = np.where(codes < 0, len(uniques), codes).astype(np.int64)
        self.missing = len(uniques)

    def code(self, value: str | None) -> int:
        if value is None:
            return self.missing
        try:
            return self.labels.index(value, 0, self.missing)
        except ValueError:
            return -2  # matches nothing

    def eq(self, value: str | None) -> np.ndarray:
        return self.codes == self.code(value)

    def isin(self, values: tuple[str, ...] | list[str]) -> np.ndarray:
        return np.isin(self.codes, [self.code(v) for v in values])


def group_table(codes: np.ndarray, labels: list[Any], cols: dict[str, np.ndarray],
                limit: int | None = None) -> pd.DataFrame:
    """Per-group sums of ``cols`` (plus a ``rows`` count) keyed by label; bincount beats groupby here."""
    k = len(labels)
    sums = {name: np.bincount(codes, weights=v, minlength=k)[:k] for name, v in cols.items()}
    sums["rows"] = np.bincount(codes, minlength=k)[:k]
    g = pd.DataFrame(sums, index=pd.Index(labels, dtype=object))
    g = g[g["rows"] > 0]
    if not g.index.is_unique:  # e.g. a server recorded as "" and one missing: both read "(none)"
        g = g.groupby(level=0, sort=False).sum()
    if limit is not None and len(g) > limit:
        g = g.sort_values("rows", ascending=False)
        head, tail = g.iloc[:limit], g.iloc[limit:]
        other = tail.sum().to_frame().T
        other.index = ["(other)"]
        g = pd.concat([head, other])
    return g
