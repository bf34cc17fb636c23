"""Per-layer statistics as the Layers and Layer pages draw them: a statistic of every site of one kind over a step
range, binned to a few hundred columns with the worst value of each bin kept, and one site's statistic over the
steps. No plotly, no dash; read by step range, in chunks, never as a dense steps x sites array of the whole run.

The statistics and their worst direction are defined here once (the Layers heat map, the Layer page, the report and
the evidence links all name them by id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .series import MAX_POINTS, clip_range, n_steps, sql

if TYPE_CHECKING:
    from ampdoctor.trace import Trace

KIND_LABELS = {
    "act": "activations",
    "grad_out": "output gradients",
    "param_grad": "parameter gradients",
    "weight": "weights",
    "update": "weight updates",
}
KINDS = tuple(KIND_LABELS)


@dataclass(frozen=True)
class Stat:
    """A per-site statistic: its label, the SQL over one stats row that computes it (None: from the peaks), and
    whether it is drawn on a log2 scale. For every statistic the worst value of a site is its largest."""

    label: str
    expr: str | None
    log2: bool = False
    share: bool = False  # a share of the elements (0..1)
    nonfinite_is_worst: bool = True  # a step whose tensor held NaN/Inf is the worst value (not for shares)


STATS = {
    "absmax_log2": Stat("log2 abs max", None, log2=True),
    "fp16_under": Stat("FP16 underflow share", "(fp16_sub + fp16_flush) / numel", share=True, nonfinite_is_worst=False),
    "fp16_over": Stat("FP16 overflow count (incl. Inf)", "fp16_over + inf", nonfinite_is_worst=False),
    "bf16_under": Stat("BF16 underflow share", "(bf16_sub + bf16_flush) / numel", share=True, nonfinite_is_worst=False),
    "bf16_over": Stat("BF16 overflow count (incl. Inf)", "bf16_over + inf", nonfinite_is_worst=False),
    "nonfinite": Stat("NaN/Inf count", "nan + inf", nonfinite_is_worst=False),
    "zeros": Stat("zero share", "zeros / numel", share=True, nonfinite_is_worst=False),
    "rms_log2": Stat("log2 RMS", "rms", log2=True),
}
BAD = "ifnull(nan, 0) + ifnull(inf, 0) > 0"  # the tensor held NaN/Inf at that step
MAX_COLS = 600
EXACT_ROWS = 400_000  # rows a matrix reads at once in a request; more are read in the background (a preview first)
PREVIEW_COLS = 100
# rows a matrix read gets through in a second at best (1.1M for a stats statistic, 0.36M weighed rows for a peaks one,
# 10^6-step trace on the 2-core machine): a request does not wait for a read that cannot end within its wait
READ_ROWS_PER_S = 1_000_000


@dataclass
class LayerMatrix:
    """A statistic of every site of one kind: ``values[site, column]`` (binned: the worst of each bin) at
    ``steps`` (the first step of each bin), ``nonfinite`` where a bin held NaN/Inf, ``worst`` per site."""

    stat: str
    kind: str
    steps: np.ndarray
    site_ids: np.ndarray
    labels: list[str]
    types: list[str]
    values: np.ndarray
    nonfinite: np.ndarray | None = None
    preview: bool = False  # some recorded steps only, while the whole range is read in the background
    recorded: int = 0  # recorded steps in the range
    worst: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        v = np.where(np.isfinite(self.values), self.values, -np.inf)
        w = v.max(axis=1) if v.size else np.full(len(self.labels), -np.inf)
        bad = self.nonfinite.any(axis=1) if self.nonfinite is not None and self.nonfinite.size else None
        self.worst = np.where(np.isfinite(w), w, np.nan)
        if bad is not None and STATS[self.stat].nonfinite_is_worst:  # NaN/Inf: worse than any finite value
            self.worst = np.where(bad, np.inf, self.worst)

    @property
    def any_nonfinite(self) -> np.ndarray:
        """Per site: whether it held NaN/Inf at some recorded step of the range."""
        if self.nonfinite is None or not self.nonfinite.size:
            return np.zeros(len(self.labels), bool)
        return np.asarray(self.nonfinite.any(axis=1))

    @property
    def label(self) -> str:
        return STATS[self.stat].label

    @property
    def share(self) -> bool:
        return STATS[self.stat].share

    @property
    def kind_label(self) -> str:
        return KIND_LABELS.get(self.kind, self.kind)

    def order(self, by: str = "order") -> np.ndarray:
        """Row order: as recorded (forward order) or worst value first."""
        if by == "worst":
            key = np.where(np.isnan(self.worst), -np.inf, self.worst)
            return np.argsort(-key, kind="stable")
        return np.arange(len(self.labels))


def recorded_steps(tr: Trace, what: str, a: int = 0, b: int | None = None) -> np.ndarray:
    """Steps of [a, b] that recorded ``what``: "stats" (full statistics), "peaks" or "hists". The statistics and
    histogram steps are found by the reader's index seeks (Trace.full_steps / hist_steps: one per recorded step, no
    scan of the steps table or of the statistics' rows)."""
    b = n_steps(tr) - 1 if b is None else b
    if what == "peaks":
        rows = sql(tr, "SELECT step FROM peaks WHERE step BETWEEN ? AND ? ORDER BY step", (a, b))
        return np.array([r[0] for r in rows], dtype=np.int64)
    steps = tr.full_steps() if what == "stats" else tr.hist_steps()
    return steps[(steps >= a) & (steps <= b)]


def cost(tr: Trace, kind: str, stat: str, x0: Any = None, x1: Any = None) -> int:
    """Rows a matrix of [x0, x1] reads (what decides between reading it now and in the background)."""
    n = n_steps(tr)
    if not n:
        return 0
    a, b = clip_range(n, x0, x1)
    sites = tr.sites(kind)
    if STATS[stat].expr is None:
        return len(recorded_steps(tr, "peaks", a, b)) * 4  # a peaks row holds every site: weigh it as a few
    return len(recorded_steps(tr, "stats", a, b)) * len(sites)


def layer_matrix(
    tr: Trace,
    kind: str,
    stat: str,
    x0: Any = None,
    x1: Any = None,
    max_cols: int = MAX_COLS,
    preview: bool = False,
    memo: dict[Any, Any] | None = None,
) -> LayerMatrix:
    """``stat`` of every site of ``kind`` over [x0, x1] (the whole run by default), binned to ``max_cols``
    columns (worst kept). ``preview``: at most PREVIEW_COLS evenly chosen recorded steps, for the first paint of
    a range too long to read in a request. ``memo``: a dict kept across calls (the report's heat maps): the peaks
    are then read once for every site, whichever kinds the heat maps draw."""
    if stat not in STATS:
        raise ValueError(f"Argument stat should be one of {', '.join(STATS)}, but given {stat!r}")
    if kind not in KINDS:
        raise ValueError(f"Argument kind should be one of {', '.join(KINDS)}, but given {kind!r}")
    sites = tr.sites(kind)
    ids = sites["id"].to_numpy(dtype=np.int64)
    labels = [str(p) for p in sites["path"].tolist()]
    types = [t if isinstance(t, str) else "" for t in sites["module_type"].tolist()]
    n = n_steps(tr)
    if not n or not len(ids):
        return LayerMatrix(stat, kind, np.array([], np.int64), ids, labels, types, np.zeros((len(ids), 0)))
    a, b = clip_range(n, x0, x1)
    src = "peaks" if STATS[stat].expr is None else "stats"
    steps = recorded_steps(tr, src, a, b)
    total = len(steps)
    if preview and len(steps) > PREVIEW_COLS:
        steps = steps[np.unique(np.linspace(0, len(steps) - 1, PREVIEW_COLS).astype(int))]
    edges = _edges(steps, max_cols)  # bin j holds steps[edges[j]:edges[j+1]]
    sampled = preview and total > len(steps)
    if src == "peaks" and memo is not None:  # every site's peaks binned once, this kind's rows taken
        key = ("peaks", a, b, max_cols, preview)
        if key not in memo:
            every = tr.sites()["id"].to_numpy(dtype=np.int64)
            memo[key] = (every, *_binned(tr, every, steps, edges, STATS[stat], src, sampled))
        every, all_vals, all_bad = memo[key]
        rows = np.searchsorted(every, ids)
        vals, bad = all_vals[rows].copy(), all_bad[rows]
    else:
        vals, bad = _binned(tr, ids, steps, edges, STATS[stat], src, sampled)
    vals[np.isneginf(vals)] = np.nan
    if STATS[stat].log2:
        with np.errstate(divide="ignore", invalid="ignore"):
            vals = np.where(vals > 0, np.log2(np.where(vals > 0, vals, 1.0)), np.nan)
    m = LayerMatrix(stat, kind, steps[edges] if len(steps) else steps, ids, labels, types, vals, bad)
    m.preview, m.recorded = preview and total > len(steps), total
    return m


def _binned(
    tr: Trace, ids: np.ndarray, steps: np.ndarray, edges: np.ndarray, stat: Stat, src: str, sampled: bool
) -> tuple[np.ndarray, np.ndarray]:
    """([sites x bins] worst finite value, -inf where none; [sites x bins] NaN/Inf held) of ``ids`` at ``steps``."""
    vals = np.full((len(ids), len(edges)), -np.inf)
    bad = np.zeros((len(ids), len(edges)), dtype=bool)
    if not len(steps):
        return vals, bad
    if src == "stats" and not sampled and len(steps) * len(ids) > SQL_ROWS:
        _stat_bins(tr, ids, steps, edges, stat, vals, bad)
        return vals, bad
    starts = steps[edges]
    reader = _peak_chunks if src == "peaks" else _stat_chunks
    for st, v, nf in reader(tr, ids, steps, stat, sampled=sampled):
        _fold(vals, bad, np.searchsorted(starts, st, side="right") - 1, v, nf)
    if src == "peaks":
        vals[vals < 0] = -np.inf  # a negative peak: the site was not observed
    return vals, bad


def _fold(vals: np.ndarray, bad: np.ndarray, k: np.ndarray, v: np.ndarray, nf: np.ndarray) -> None:
    """Fold a chunk ``v`` [rows x sites] (-inf: no finite value) and ``nf`` (NaN/Inf held), whose rows fall in the
    non-decreasing bins ``k``, into ``vals`` / ``bad`` [sites x bins] in place: one reduction per chunk, not per row."""
    if not len(k):
        return
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    cols = k[starts]
    vals[:, cols] = np.maximum(vals[:, cols], np.maximum.reduceat(v, starts, axis=0).T)
    bad[:, cols] |= np.logical_or.reduceat(nf, starts, axis=0).T


def _edges(steps: np.ndarray, max_cols: int) -> np.ndarray:
    if len(steps) <= max_cols:
        return np.arange(len(steps))
    return np.unique(np.linspace(0, len(steps), max_cols + 1).astype(int)[:-1])


_CHUNK_ROWS = 200_000
_PEAK_CHUNK_VALUES = 1 << 20  # float32 peaks decoded at a time (4 MB)
SQL_ROWS = 1_000_000  # past this many rows a matrix is reduced in SQLite, bin by bin, not row by row in Python


def _stat_bins(
    tr: Trace, ids: np.ndarray, steps: np.ndarray, edges: np.ndarray, stat: Stat, vals: np.ndarray, bad: np.ndarray
) -> None:
    """Each bin's worst value per site computed by SQLite (one query per bin over its steps, in the stats table's key
    order): the rows never cross into Python. Fills ``vals`` and ``bad`` in place."""
    lo, hi = int(ids.min()), int(ids.max())
    finite = f"CASE WHEN abs({stat.expr}) <= 1.7e308 THEN {stat.expr} END"
    # the bin's steps listed: each is a seek on the key (step, site) to this kind's sites, not every site's rows
    query = (
        "SELECT site, max({f}), max({bad}) FROM stats WHERE step IN ({steps}) AND site BETWEEN ? AND ? GROUP BY site"
    )
    for j, part in enumerate(np.split(steps, edges[1:])):
        rows = sql(tr, query.format(f=finite, bad=BAD, steps=",".join(map(str, part.tolist()))), (lo, hi))
        if not rows:
            continue
        arr = np.array(rows, dtype=float).reshape(-1, 3)
        col = np.minimum(np.searchsorted(ids, arr[:, 0].astype(np.int64)), len(ids) - 1)
        keep = ids[col] == arr[:, 0]
        v = arr[keep, 1]
        ok = np.isfinite(v)
        vals[col[keep][ok], j] = v[ok]
        bad[col[keep], j] = arr[keep, 2] > 0


def _stat_chunks(tr: Trace, ids: np.ndarray, steps: np.ndarray, stat: Stat, sampled: bool) -> Any:
    """(steps, values [steps x sites], NaN/Inf held [steps x sites]) of the stats rows of ``steps``, a few hundred
    thousand rows at a time; only the rows of ``ids``'s sites (one kind) are kept (-inf where a site has none)."""
    lo, hi = int(ids.min()), int(ids.max())
    per = max(1, _CHUNK_ROWS // max(1, len(ids)))
    for i in range(0, len(steps), per):
        part = steps[i : i + per]
        where = (
            f"step IN ({','.join(map(str, part.tolist()))})" if sampled else f"step BETWEEN {part[0]} AND {part[-1]}"
        )
        rows = sql(
            tr,
            f"SELECT step, site, {stat.expr}, {BAD} FROM stats WHERE {where} AND site BETWEEN ? AND ?",
            (lo, hi),
        )
        if not rows:
            continue
        arr = np.array(rows, dtype=float)
        col = np.minimum(np.searchsorted(ids, arr[:, 1].astype(np.int64)), len(ids) - 1)
        keep = ids[col] == arr[:, 1]
        st, row = np.unique(arr[keep, 0].astype(np.int64), return_inverse=True)
        v = np.full((len(st), len(ids)), -np.inf)
        nf = np.zeros((len(st), len(ids)), dtype=bool)
        val = arr[keep, 2]
        ok = np.isfinite(val)
        v[row[ok], col[keep][ok]] = val[ok]
        nf[row, col[keep]] = arr[keep, 3] > 0
        yield st, v, nf


def _peak_chunks(tr: Trace, ids: np.ndarray, steps: np.ndarray, stat: Stat, sampled: bool) -> Any:
    """(steps, values [steps x sites], NaN/Inf held) of the peaks rows of ``steps`` (a float32 per site id, negative:
    not observed that step; -inf in the values where a site has no finite peak), decoded a chunk at a time."""
    width = int(ids.max()) + 1
    per = max(16, _PEAK_CHUNK_VALUES // width)
    for i in range(0, len(steps), per):
        part = steps[i : i + per]
        where = (
            f"step IN ({','.join(map(str, part.tolist()))})" if sampled else f"step BETWEEN {part[0]} AND {part[-1]}"
        )
        rows = [
            (s, b)
            for s, b in sql(tr, f"SELECT step, data FROM peaks WHERE {where} ORDER BY step")
            if isinstance(b, bytes) and not len(b) % 4
        ]
        if not rows:
            continue
        sizes = {len(b) for _, b in rows}
        if len(sizes) == 1 and min(sizes) >= 4 * width:  # every row holds these sites: one buffer
            full = np.frombuffer(b"".join(b for _, b in rows), dtype="<f4").reshape(len(rows), -1)
        else:
            full = np.full((len(rows), width), -1.0, dtype=np.float32)
            for j, (_, blob) in enumerate(rows):
                got = np.frombuffer(blob, dtype="<f4", count=min(len(blob) // 4, width))
                full[j, : len(got)] = got
        v = full if len(ids) == full.shape[1] and ids[-1] == len(ids) - 1 else full[:, ids]  # (every site: no copy)
        finite = np.isfinite(v)
        nonfinite = np.isnan(v) | (v == np.inf)  # NaN/Inf seen (negative, -inf included: not observed)
        # float32 kept (4 bytes a value); a negative value, or -inf, is "no finite peak" after the reduction
        yield np.array([s for s, _ in rows], dtype=np.int64), np.where(finite, v, np.float32(-np.inf)), nonfinite


# -- one site --------------------------------------------------------------------------------------------------
def site_series(
    tr: Trace, site_id: int, stat: str, x0: Any = None, x1: Any = None, max_points: int = MAX_POINTS
) -> Any:
    """(steps, values, NaN/Inf steps as [(first, last)]) of one site's ``stat`` over [x0, x1]: every recorded step
    of the range read, then at most ``max_points`` points kept with each bucket's minimum and maximum
    (series.downsample: a spike is never dropped); the NaN/Inf steps from every step. Values are the raw statistic
    (the figure takes log2 where the statistic says so)."""
    from .series import downsample, intervals

    n = n_steps(tr)
    if not n:
        return np.array([], np.int64), np.array([]), []
    a, b = clip_range(n, x0, x1)
    spec = STATS[stat]
    if spec.expr is None:  # the peaks table holds the peak steps only: a rowid range
        j = int(site_id)
        rows = sql(tr, f"SELECT step, substr(data, {4 * j + 1}, 4) FROM peaks WHERE step BETWEEN ? AND ?", (a, b))
        rows = [(s, blob) for s, blob in rows if isinstance(blob, bytes) and len(blob) == 4]
        x = np.array([s for s, _ in rows], dtype=np.int64)
        y = np.frombuffer(b"".join(blob for _, blob in rows), dtype="<f4").astype(np.float64)
        seen = ~(y < 0)  # negative: the site was not observed that step
        x, y = x[seen], y[seen]
        bad = ~np.isfinite(y)
    else:
        steps = recorded_steps(tr, "stats", a, b)
        if not len(steps):
            return steps, np.array([]), []
        rows = sql(
            tr,
            f"SELECT step, {spec.expr}, {BAD} FROM stats WHERE site = ? AND step IN "
            f"({','.join(map(str, steps.tolist()))}) ORDER BY step",
            (int(site_id),),
        )
        arr = np.array(rows, dtype=float).reshape(-1, 3)
        x, y, bad = arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2] > 0
    y = np.where(np.isfinite(y), y, np.nan)
    xs, ys = downsample(x, y, max_points)
    return xs, ys, intervals(x, bad)


def site_hist(tr: Trace, site_id: int, x0: Any = None, x1: Any = None, max_rows: int = 2000) -> Any:
    """(steps, counts[steps x 255]) of one site's exponent histograms over [x0, x1] (evenly chosen steps when
    there are more than ``max_rows``): looked up by step, never a scan of the whole histograms table."""
    from ampdoctor.trace.schema import HIST_HI, HIST_LO

    n = n_steps(tr)
    a, b = clip_range(max(n, 1), x0, x1)
    steps = recorded_steps(tr, "hists", a, b)
    if len(steps) > max_rows:
        steps = steps[np.unique(np.linspace(0, len(steps) - 1, max_rows).astype(int))]
    width = HIST_HI - HIST_LO + 1
    if not len(steps):
        return steps, np.zeros((0, width), dtype=np.int64)
    rows = sql(
        tr,
        f"SELECT step, lo, counts FROM hists WHERE site = ? AND step IN ({','.join(map(str, steps.tolist()))}) "
        "ORDER BY step",
        (int(site_id),),
    )
    out_steps, counts = [], []
    for step, lo, blob in rows:
        if not isinstance(lo, int) or not isinstance(blob, bytes) or len(blob) % 8:
            continue
        c = np.frombuffer(blob, dtype="<i8")
        if lo < HIST_LO or lo + len(c) - 1 > HIST_HI:
            continue
        row = np.zeros(width, dtype=np.int64)
        row[lo - HIST_LO : lo - HIST_LO + len(c)] = np.maximum(c, 0)
        out_steps.append(step)
        counts.append(row)
    if not counts:
        return np.array([], np.int64), np.zeros((0, width), dtype=np.int64)
    return np.array(out_steps, dtype=np.int64), np.vstack(counts)


def fmt(v: Any, share: bool = False) -> str:
    """A number as the tables show it: never cut (4 significant digits, a share as a percentage)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    v = float(v)
    if math.isinf(v):
        return "NaN/Inf"
    if share:
        return f"{100 * v:.3g}%"
    return f"{v:.4g}"
