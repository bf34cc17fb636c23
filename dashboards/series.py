"""The per-step figures of a trace as the views draw them, read by step range and reduced in SQLite: no plotly, no
dash, and never the whole steps table in memory.

A view asks for a step range and a point budget. A range that fits the budget comes back step by step (exact); a
longer one comes back as buckets of consecutive steps, each with the minimum, the maximum and the mean of every
column (a spike is never averaged away: the envelope keeps it) and the count of skipped and non-finite steps (a
band covers every bucket that holds one). Zooming in asks again for the smaller range, at full resolution.

The reader (ampdoctor.trace) has no range queries yet, so these read the file through the Trace's connection.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ampdoctor.trace import TraceError

if TYPE_CHECKING:
    from ampdoctor.trace import Trace

# per line: 1,000 buckets of (min, max) when a range is longer: about one bucket per pixel column of a chart (a chart
# is ~1,100 px wide on a laptop screen), whose extremes are the pixels drawn; more points are not seen, only drawn
# (each one costs the browser: four charts of 4,000 points took ~2.5 s to draw in Chromium on a loaded 2-core machine)
MAX_POINTS = 2000
# the columns the step charts draw (steps table); finite values only, NaN/Inf/NULL become NaN
COLUMNS = ("loss", "loss_scale", "grad_norm", "step_time", "data_time", "samples_per_s")
_FINITE = "CASE WHEN typeof({c}) IN ('integer', 'real') AND abs({c}) <= 1.7976931348623157e308 THEN {c} END"


def sql(tr: Trace, query: str, args: Any = ()) -> list[Any]:
    """Rows of a query on a trace, its errors as one-line TraceErrors (as the reader's own queries)."""
    try:
        return tr.connection.execute(query, args).fetchall()
    except sqlite3.DatabaseError as exc:
        raise TraceError(f"{tr.path}: corrupt or unreadable trace ({exc})") from None


def n_steps(tr: Trace) -> int:
    """Steps recorded (the step ids are dense from 0: the reader checks it when it opens a file)."""
    row = sql(tr, "SELECT max(step) FROM steps")[0][0]
    return 0 if row is None else int(row) + 1


@dataclass
class StepSeries:
    """What the step charts of a range [x0, x1] draw: ``x`` and per column ``lo``/``hi``/``mean`` (equal when
    ``exact``), and the skipped / non-finite / non-positive-scale steps as intervals [(first, last), ...]."""

    x0: int
    x1: int
    n: int  # steps in the whole trace
    exact: bool
    x: np.ndarray
    width: np.ndarray  # steps per point (1 when exact)
    lo: dict[str, np.ndarray] = field(default_factory=dict)
    hi: dict[str, np.ndarray] = field(default_factory=dict)
    mean: dict[str, np.ndarray] = field(default_factory=dict)
    skipped: list[tuple[int, int]] = field(default_factory=list)
    nonfinite: list[tuple[int, int]] = field(default_factory=list)
    scale_zero: list[tuple[int, int]] = field(default_factory=list)
    n_skipped: int = 0
    n_nonfinite: int = 0
    preview: bool = False  # evenly spaced steps only, while the summary is being built
    scale_after: float | None = None  # the loss scale the last step of the run left (its update), when in range

    def envelope(self, col: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of a line that passes through each bucket's minimum and maximum (the raw values when exact)."""
        if self.exact:
            return self.x, self.lo[col]
        lo, hi = self.lo[col], self.hi[col]
        mid = self.x + np.maximum(self.width // 2, 1) - 1
        x = np.empty(2 * len(self.x), dtype=np.int64)
        y = np.empty(2 * len(self.x))
        x[0::2], x[1::2] = self.x, np.maximum(mid, self.x)
        y[0::2], y[1::2] = lo, hi
        return x, y


def from_arrays(steps: Any, **columns: Any) -> StepSeries:
    """An exact StepSeries from arrays (a notebook's DataFrame columns): ``loss``, ``loss_scale``, ..., and the
    ``skipped`` / ``nonfinite`` flags."""
    x = np.asarray(steps, dtype=np.int64)
    n = len(x)
    cols = {c: np.full(n, np.nan) for c in COLUMNS}
    for c in COLUMNS:
        if c in columns and columns[c] is not None:
            v = np.asarray(columns[c], dtype=float)
            cols[c] = np.where(np.isfinite(v), v, np.nan)
    skipped = np.asarray(columns.get("skipped", np.zeros(n)), dtype=bool)
    loss = np.asarray(columns.get("loss", np.zeros(n)), dtype=float)
    bad = np.asarray(columns.get("nonfinite", ~np.isfinite(loss)), dtype=bool)
    s = StepSeries(int(x[0]) if n else 0, int(x[-1]) if n else -1, n, True, x, np.ones(n, np.int64), cols, cols, cols)
    s.skipped, s.nonfinite = intervals(x, skipped), intervals(x, bad)
    sc = cols["loss_scale"]
    s.scale_zero = intervals(x, ~np.isnan(sc) & (sc <= 0))
    s.n_skipped, s.n_nonfinite = int(skipped.sum()), int(bad.sum())
    return s


def clip_range(n: int, x0: Any = None, x1: Any = None) -> tuple[int, int]:
    """A step range inside [0, n - 1] (the whole run when not given or not numbers)."""
    a = _int(x0, 0)
    b = _int(x1, n - 1)
    a, b = max(0, min(a, n - 1)), max(0, min(b, n - 1))
    return (a, b) if a <= b else (b, a)


def _int(v: Any, default: int) -> int:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return math.floor(f) if math.isfinite(f) else default


def _col(v: Any) -> float:
    if v is None:
        return math.nan
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(v, math.nan)
    return float(v)


def read(
    tr: Trace, x0: Any = None, x1: Any = None, max_points: int = MAX_POINTS, summary: StepSummary | None = None
) -> StepSeries:
    """The step figures of [x0, x1] (the whole run by default) within ``max_points`` points per line: exact when
    the range fits, else from ``summary`` (buckets of every step), else a sampled preview (``preview``)."""
    n = n_steps(tr)
    if n == 0:
        empty = np.array([], dtype=np.int64)
        lo, hi, mean = ({c: np.array([]) for c in COLUMNS} for _ in range(3))
        return StepSeries(0, -1, 0, True, empty, empty, lo, hi, mean)
    a, b = clip_range(n, x0, x1)
    if b - a + 1 <= max_points:
        s = _exact(tr, a, b, n)
    elif summary is not None and summary.n_buckets * BUCKET > a:
        s = summary.view(tr, a, b, n, max_points)
    else:
        s = _preview(tr, a, b, n, max_points)
    if b == n - 1:  # GradScaler's update after the last step: the lowest scale of a collapse is often that one
        after = sql(tr, f"SELECT {_FINITE.format(c='loss_scale_next')} FROM steps WHERE step = ?", (b,))
        s.scale_after = float(after[0][0]) if after and after[0][0] is not None else None
    return s


def values_at(tr: Trace, col: str, steps: Any) -> np.ndarray:
    """One of COLUMNS at these steps (finite values, NaN otherwise): a rowid seek per step, never a scan."""
    steps = np.asarray(steps, dtype=np.int64)
    if col not in COLUMNS:
        raise ValueError(f"Argument col should be one of {', '.join(COLUMNS)}, but given {col!r}")
    out = np.full(len(steps), np.nan)
    if not len(steps):
        return out
    rows = sql(
        tr, f"SELECT step, {_FINITE.format(c=col)} FROM steps WHERE step IN ({','.join(map(str, steps.tolist()))})"
    )
    got = {int(a): b for a, b in rows if isinstance(a, int)}
    for i, st in enumerate(steps.tolist()):
        v = got.get(st)
        out[i] = np.nan if v is None else float(v)
    return out


def _select(tr: Trace, where: str, args: Any) -> np.ndarray:
    """[rows x (step, skipped, non-finite, *COLUMNS)] float64: finite values, NaN for NaN/Inf/NULL."""
    have = {r[1] for r in sql(tr, "PRAGMA table_info(steps)")}
    cols = [_FINITE.format(c=c) if c in have else "NULL" for c in COLUMNS]
    bad = (
        "ifnull(nonfinite, 0) != 0 OR "
        "(loss IS NOT NULL AND NOT (typeof(loss) IN ('integer','real') AND abs(loss) <= 1.7e308))"
    )
    rows = sql(tr, f"SELECT step, ifnull(skipped, 0) != 0, {bad}, {', '.join(cols)} FROM steps WHERE {where}", args)
    out = np.array(rows, dtype=float) if rows else np.zeros((0, 3 + len(COLUMNS)))
    return out.reshape(-1, 3 + len(COLUMNS))


def _from_rows(arr: np.ndarray, a: int, b: int, n: int, exact: bool = True) -> StepSeries:
    x = arr[:, 0].astype(np.int64)
    vals = {c: arr[:, 3 + i] for i, c in enumerate(COLUMNS)}
    skipped, bad = arr[:, 1] > 0, arr[:, 2] > 0
    s = StepSeries(a, b, n, exact, x, np.ones(len(x), dtype=np.int64), vals, vals, vals)
    s.skipped, s.nonfinite = intervals(x, skipped), intervals(x, bad)
    sc = vals["loss_scale"]
    s.scale_zero = intervals(x, ~np.isnan(sc) & (sc <= 0))
    s.n_skipped, s.n_nonfinite = int(skipped.sum()), int(bad.sum())
    return s


def _exact(tr: Trace, a: int, b: int, n: int) -> StepSeries:
    return _from_rows(_select(tr, "step BETWEEN ? AND ? ORDER BY step", (a, b)), a, b, n)


def _preview(tr: Trace, a: int, b: int, n: int, max_points: int) -> StepSeries:
    """Evenly spaced steps of [a, b] (rowid look-ups: fast on any length) while the summary is being built: not
    every spike is there yet, and the views say so."""
    steps = np.unique(np.linspace(a, b, max_points).astype(np.int64))
    arr = _select(tr, f"step IN ({','.join(map(str, steps.tolist()))}) ORDER BY step", ())
    s = _from_rows(arr, a, b, n, exact=False)
    s.preview = True
    return s


BUCKET = 16  # steps per bucket of the summary: any range longer than MAX_POINTS steps is drawn from it
_CHUNK = 1 << 16  # steps read at a time while building (a few MB of rows)


class StepSummary:
    """Every step of a run in buckets of BUCKET steps: per column the minimum, maximum, sum and count of its
    finite values, and per bucket the skipped, non-finite and non-positive-scale steps. Built in one pass (in
    chunks), topped up as a live trace grows: a view of any range longer than MAX_POINTS steps comes from it."""

    def __init__(self) -> None:
        k = len(COLUMNS)
        self.lo = np.zeros((0, k))
        self.hi = np.zeros((0, k))
        self.sum = np.zeros((0, k))
        self.cnt = np.zeros((0, k))
        self.flags = np.zeros((0, 3))  # skipped, non-finite, scale <= 0 (counts)
        self.key: tuple[Any, ...] | None = None  # (step, time) of the last summarised step: a different file resets it

    @property
    def n_buckets(self) -> int:
        return len(self.lo)

    def update(self, tr: Trace, limit: int | None = None) -> int:
        """Summarise the complete buckets written since the last call (at most ``limit`` steps); returns how many
        steps are summarised. A file whose summarised part changed (another run at the same path) starts over."""
        n = n_steps(tr)
        done = self.n_buckets * BUCKET
        if self.key is not None and done and _last_key(tr, done - 1) != self.key:
            self.__init__()  # type: ignore[misc]  # a fresh summary: every field as __init__ sets it
            done = 0
        end = (n // BUCKET) * BUCKET
        if limit is not None:
            end = min(end, done + (limit // BUCKET) * BUCKET)
        while done < end:
            stop = min(end, done + _CHUNK)
            arr = _select(tr, "step BETWEEN ? AND ? ORDER BY step", (done, stop - 1))
            if len(arr) != stop - done:  # a file that is not dense any more: leave it to the exact reads
                break
            self._append(arr)
            done = stop
        self.key = _last_key(tr, done - 1) if done else None
        return done

    @classmethod
    def of_steps(cls, tr: Trace, steps: Any) -> StepSummary:
        """The summary of a steps DataFrame already in memory (Trace.steps(), the rules' View of a run): the same
        buckets update() reads from the file, without reading the steps table again. A step is non-finite when
        flagged so or its loss is infinite (the writer flags a NaN loss; the file's NULL and 'nan' both read as NaN
        here)."""
        sm = cls()
        n = (len(steps) // BUCKET) * BUCKET
        if not n or not np.array_equal(steps["step"].to_numpy()[:n], np.arange(n)):
            return sm  # not dense from 0: update() reads the file instead
        for a in range(0, n, _CHUNK):
            b = min(n, a + _CHUNK)
            part = steps.iloc[a:b]
            loss = part["loss"].to_numpy(float)
            cols = [part[c].to_numpy(float) if c in part else np.full(b - a, np.nan) for c in COLUMNS]
            arr = np.column_stack(
                [
                    part["step"].to_numpy(float),
                    part["skipped"].to_numpy(bool),
                    part["nonfinite"].to_numpy(bool) | np.isinf(loss),
                    *(np.where(np.isfinite(c), c, np.nan) for c in cols),
                ]
            )
            sm._append(arr)
        sm.key = _last_key(tr, n - 1)
        return sm

    def _append(self, arr: np.ndarray) -> None:
        v = arr[:, 3:].reshape(-1, BUCKET, len(COLUMNS))
        ok = np.isfinite(v)
        with np.errstate(invalid="ignore"):
            lo = np.vstack([self.lo, np.where(ok, v, np.inf).min(axis=1)])
            self.hi = np.vstack([self.hi, np.where(ok, v, -np.inf).max(axis=1)])
        self.sum = np.vstack([self.sum, np.where(ok, v, 0.0).sum(axis=1)])
        self.cnt = np.vstack([self.cnt, ok.sum(axis=1)])
        sc = arr[:, 3 + COLUMNS.index("loss_scale")]
        flags = np.stack([arr[:, 1] > 0, arr[:, 2] > 0, ~np.isnan(sc) & (sc <= 0)], axis=1)
        self.flags = np.vstack([self.flags, flags.reshape(-1, BUCKET, 3).sum(axis=1)])
        self.lo = lo  # last: n_buckets (its length) grows once every array holds the new buckets

    def to_arrays(self) -> dict[str, np.ndarray]:
        key = np.array([np.nan if v is None else float(v) for v in (self.key or ())], dtype=float)
        return {"lo": self.lo, "hi": self.hi, "sum": self.sum, "cnt": self.cnt, "flags": self.flags, "key": key}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], tr: Trace) -> StepSummary | None:
        """A summary read back from disk, when it still describes the start of ``tr`` (else None)."""
        k = len(COLUMNS)
        try:
            lo, hi, tot, cnt, flags = (np.asarray(arrays[n], dtype=float) for n in ("lo", "hi", "sum", "cnt", "flags"))
            key = np.asarray(arrays["key"], dtype=float)
        except KeyError:
            return None
        nb = len(lo)
        if any(a.shape != (nb, k) for a in (lo, hi, tot, cnt)) or flags.shape != (nb, 3) or not nb:
            return None
        last = _last_key(tr, nb * BUCKET - 1)
        if last is None or not np.array_equal(
            np.array([np.nan if v is None else float(v) for v in last]), key, equal_nan=True
        ):
            return None
        sm = cls()
        sm.lo, sm.hi, sm.sum, sm.cnt, sm.flags, sm.key = lo, hi, tot, cnt, flags, last
        return sm

    def view(self, tr: Trace, a: int, b: int, n: int, max_points: int) -> StepSeries:
        """[a, b] in at most ``max_points // 2`` groups of whole buckets; steps past the summary read exactly. The
        arrays are taken once, at one length: a background update may be appending to them meanwhile."""
        parts = (self.lo, self.hi, self.sum, self.cnt, self.flags)
        done = min(len(p) for p in parts) * BUCKET
        if done <= a:
            return _exact(tr, a, b, n) if b - a + 1 <= max_points else _preview(tr, a, b, n, max_points)
        i0, i1 = a // BUCKET, min(b, done - 1) // BUCKET
        k = -(-(i1 - i0 + 1) // max(1, max_points // 2))  # buckets per group
        starts = np.arange(i0, i1 + 1, k)
        with np.errstate(invalid="ignore", divide="ignore"):
            at = starts - i0
            lo = np.minimum.reduceat(parts[0][i0 : i1 + 1], at, axis=0)
            hi = np.maximum.reduceat(parts[1][i0 : i1 + 1], at, axis=0)
            tot = np.add.reduceat(parts[2][i0 : i1 + 1], at, axis=0)
            cnt = np.add.reduceat(parts[3][i0 : i1 + 1], at, axis=0)
            flags = np.add.reduceat(parts[4][i0 : i1 + 1], at, axis=0)
            mean = np.where(cnt > 0, tot / cnt, np.nan)
        lo[~np.isfinite(lo)], hi[~np.isfinite(hi)] = np.nan, np.nan
        x = np.maximum(starts * BUCKET, a)
        ends = np.minimum(np.append(starts[1:] * BUCKET, (i1 + 1) * BUCKET) - 1, b)
        s = StepSeries(a, b, n, False, x.astype(np.int64), (ends - x + 1).astype(np.int64))
        for j, c in enumerate(COLUMNS):
            s.lo[c], s.hi[c], s.mean[c] = lo[:, j], hi[:, j], mean[:, j]
        s.skipped = intervals(x, flags[:, 0] > 0, ends)
        s.nonfinite = intervals(x, flags[:, 1] > 0, ends)
        s.scale_zero = intervals(x, flags[:, 2] > 0, ends)
        s.n_skipped, s.n_nonfinite = int(flags[:, 0].sum()), int(flags[:, 1].sum())
        if b >= done:  # the steps written since the last update; while a build is under way, the rest of the run
            at0 = max(done, a)  # (up to every step but the first buckets): previewed, never read row by row
            rest = _exact(tr, at0, b, n) if b - at0 + 1 <= max_points else _preview(tr, at0, b, n, max_points)
            s = _join(s, rest)
        return s


def _join(s: StepSeries, t: StepSeries) -> StepSeries:
    """Buckets ``s`` followed by the exact steps ``t``."""
    out = StepSeries(s.x0, t.x1, t.n, False, np.concatenate([s.x, t.x]), np.concatenate([s.width, t.width]))
    for c in COLUMNS:
        out.lo[c] = np.concatenate([s.lo[c], t.lo[c]])
        out.hi[c] = np.concatenate([s.hi[c], t.hi[c]])
        out.mean[c] = np.concatenate([s.mean[c], t.mean[c]])
    out.skipped, out.nonfinite, out.scale_zero = (
        _merge(s.skipped + t.skipped),
        _merge(s.nonfinite + t.nonfinite),
        _merge(s.scale_zero + t.scale_zero),
    )
    out.n_skipped, out.n_nonfinite = s.n_skipped + t.n_skipped, s.n_nonfinite + t.n_nonfinite
    out.preview = s.preview or t.preview
    return out


def _merge(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _last_key(tr: Trace, step: int) -> tuple[Any, ...] | None:
    rows = sql(tr, "SELECT step, time, loss_scale FROM steps WHERE step = ?", (step,))
    return tuple(rows[0]) if rows else None


def intervals(x: np.ndarray, flag: np.ndarray, ends: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Runs of consecutive flagged points as (first step, last step); ``ends``: the last step each point covers."""
    flag = np.asarray(flag, dtype=bool)
    if not flag.any():
        return []
    ends = x if ends is None else ends
    d = np.diff(np.concatenate([[0], flag.astype(np.int8), [0]]))
    starts, stops = np.flatnonzero(d == 1), np.flatnonzero(d == -1) - 1
    return [(int(x[i]), int(ends[j])) for i, j in zip(starts, stops)]


def smooth(y: np.ndarray, weight: float, width: Any = None) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start, NaN points skipped.

    ``weight`` is per step; a point that stands for ``width`` steps (a bucket) weighs ``weight ** width``.
    """
    y = np.asarray(y, dtype=float)
    out = np.full(len(y), np.nan)
    if not 0 < weight < 1:
        return y.copy()
    w = np.full(len(y), weight) if width is None else weight ** np.maximum(np.asarray(width, dtype=float), 1)
    last, debias = 0.0, 1.0
    for i, v in enumerate(y):  # a few thousand points at most
        if not math.isfinite(v):
            continue
        last = last * w[i] + (1 - w[i]) * v
        debias *= w[i]
        out[i] = last / (1 - debias) if debias < 1 else v
    return out


def metric_names(tr: Trace) -> list[str]:
    """Names of the scalars the run logged (log_metric), most frequent first."""
    rows = sql(tr, "SELECT name, count(*) FROM metrics GROUP BY name ORDER BY count(*) DESC, name")
    return [str(r[0]) for r in rows if isinstance(r[0], str)]


def metric(
    tr: Trace, name: str, x0: Any = None, x1: Any = None, max_points: int = MAX_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one logged metric in [x0, x1], thinned to ``max_points`` with each bucket's extremes."""
    n = n_steps(tr)
    a, b = clip_range(max(n, 1), x0, x1) if (x0 is not None or x1 is not None) else (0, 2**62)
    rows = sql(
        tr,
        "SELECT step, value FROM metrics WHERE name = ? AND step BETWEEN ? AND ? ORDER BY step, rowid",
        (name, a, b),
    )
    x = np.array([r[0] if isinstance(r[0], int) else -1 for r in rows], dtype=np.int64)
    y = np.array([_col(r[1]) for r in rows], dtype=float)
    keep = x >= 0
    x, y = x[keep], np.where(np.isfinite(y[keep]), y[keep], np.nan)
    return downsample(x, y, max_points)


def downsample(x: Any, y: Any, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points of (x, y): the min and the max of each bucket, in x order (a bucket without a
    finite value keeps its first point: a NaN gap stays a gap). Vectorised: 10^6 points in a few tens of ms."""
    x, y = np.asarray(x), np.asarray(y, dtype=float)
    n = len(y)
    if n <= max_points:
        return x, y
    nb = max(1, max_points // 2)
    starts = np.unique(np.linspace(0, n, nb + 1).astype(np.int64)[:-1])
    seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    finite = np.isfinite(y)
    lo, hi = np.where(finite, y, np.inf), np.where(finite, y, -np.inf)
    first_lo = _first_where(lo == np.minimum.reduceat(lo, starts)[seg], seg)
    first_hi = _first_where(hi == np.maximum.reduceat(hi, starts)[seg], seg)
    idx = np.unique(np.concatenate([first_lo, first_hi]))[:max_points]
    return x[idx], y[idx]


def _first_where(hit: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """The first index of each segment where ``hit`` holds (every segment has one: its extreme is attained)."""
    at = np.flatnonzero(hit)
    return at[np.unique(seg[at], return_index=True)[1]]
