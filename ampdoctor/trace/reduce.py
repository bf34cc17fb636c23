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


# Theil-Sen takes every pair of points: up to this many points a trend is fitted on the points themselves (2 million
# pairs, ~0.1 s); more are cut into this many runs of consecutive points (x sorted), each standing for its median x
# and median y. The median of a run of m noisy values has noise ~1.25 sigma / sqrt(m), so the slope's confidence
# interval on the runs is about the one on every point, at a bounded cost.
TREND_POINTS = 2048


def theil_sen_line(y: np.ndarray, x: np.ndarray, max_points: int = TREND_POINTS) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line, as scipy.stats.theilslopes gives them (intercept: median(y) - slope *
    median(x)); the slope over runs past ``max_points`` points, the intercept over every point."""
    slope = theil_sen(y, x, max_points=max_points)[0]
    return slope, float(np.median(y) - slope * np.median(x))


def run_medians(x: np.ndarray, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(median x, median y) of k runs of consecutive points, as equal in length as they can be."""
    bounds = np.linspace(0, len(x), k + 1).astype(np.int64)
    size = np.diff(bounds)
    out_x, out_y = np.empty(k), np.empty(k)
    for m in np.unique(size):  # runs of one length at a time: a [runs x m] median
        runs = np.flatnonzero(size == m)
        idx = bounds[runs][:, None] + np.arange(m)[None, :]
        out_x[runs], out_y[runs] = np.median(x[idx], axis=1), np.median(y[idx], axis=1)
    return out_x, out_y


def theil_sen(
    y: np.ndarray, x: np.ndarray, alpha: float = 0.95, max_points: int = TREND_POINTS
) -> tuple[float, float, float]:
    """(slope, low, high): the Theil-Sen slope of y over x and its confidence interval, the numbers
    scipy.stats.theilslopes gives (its code, Sen 1968 eq. 2.6), with the pairwise slopes made a block of rows at a
    time (scipy holds several n x n arrays: 150 MB for 2,048 points) and the order statistics picked by partition,
    without importing scipy.stats (a second or more on a loaded machine). Past ``max_points`` points (x sorted), over
    the medians of ``max_points`` runs of consecutive points."""
    from statistics import NormalDist

    x, y = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if max_points and len(x) > max_points:
        x, y = run_medians(x, y, max_points)
    parts = []
    rows = max(1, (1 << 20) // max(len(x), 1))
    for i in range(0, len(x), rows):
        dx = x[i : i + rows, None] - x[None, :]
        dy = y[i : i + rows, None] - y[None, :]
        up = dx > 0
        parts.append(dy[up] / dx[up])
    slopes = np.concatenate(parts) if parts else np.zeros(0)
    nt = len(slopes)
    if not nt:
        return np.nan, np.nan, np.nan
    a = 1.0 - alpha if alpha > 0.5 else alpha
    z = NormalDist().inv_cdf(a / 2.0)
    reps = [_repeats(x), _repeats(y)]
    ny = len(y)
    sigsq = 1 / 18.0 * (ny * (ny - 1) * (2 * ny + 5) - sum(int((k * (k - 1) * (2 * k + 5)).sum()) for k in reps))
    sigma = np.sqrt(sigsq)
    ru = min(int(np.round((nt - z * sigma) / 2.0)), nt - 1)
    rl = max(int(np.round((nt + z * sigma) / 2.0)) - 1, 0)
    mid = ((nt - 1) // 2, nt // 2)
    part = np.partition(slopes, sorted({*mid, rl, ru}))
    med = part[mid[0]] if mid[0] == mid[1] else (part[mid[0]] + part[mid[1]]) / 2
    return float(med), float(part[rl]), float(part[ru])


def _repeats(a: np.ndarray) -> np.ndarray:
    """How often each value that occurs more than once occurs."""
    _, counts = np.unique(a, return_counts=True)
    return counts[counts > 1].astype(np.int64)
