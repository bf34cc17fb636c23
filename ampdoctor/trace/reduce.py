"""Medians over steps for many sites at once, equal to numpy's one site at a time (np.median of the values: the middle
one, or the mean of the two middle ones) without a Python loop over sites and without numpy's all-NaN warnings.
Offline side: numpy only."""

from __future__ import annotations

import numpy as np


def col_median(a: np.ndarray) -> np.ndarray:
    """Per column of ``a``: the median of its non-NaN values (np.nanmedian), NaN for a column without any."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or not a.shape[1]:
        return np.full(a.shape[1] if a.ndim == 2 else 0, np.nan)
    s = np.sort(a, axis=0)  # NaN last
    k = (~np.isnan(a)).sum(axis=0)
    cols = np.arange(a.shape[1])
    lo, hi = np.maximum((k - 1) // 2, 0), np.maximum(k // 2, 0)
    x, y = s[np.minimum(lo, len(s) - 1), cols], s[np.minimum(hi, len(s) - 1), cols]
    with np.errstate(invalid="ignore", over="ignore"):
        med = np.where(lo == hi, x, (x + y) / 2)
    return np.where(k > 0, med, np.nan)


def group_median(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct groups, the median of each group's values): np.median per group; a NaN in a group makes its
    median NaN, as np.median does."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    if not len(values):
        return groups[:0], np.zeros(0)
    order = np.lexsort((values, groups))  # NaN sort last within a group
    g, v = groups[order], values[order]
    uniq, start, count = np.unique(g, return_index=True, return_counts=True)
    lo, hi = start + (count - 1) // 2, start + count // 2
    with np.errstate(invalid="ignore", over="ignore"):
        med = np.where(lo == hi, v[lo], (v[lo] + v[hi]) / 2)
    has_nan = np.isnan(v[start + count - 1])  # the last of a group is NaN when any is
    return uniq, np.where(has_nan, np.nan, med)
