"""One pass over the per-site peaks of a trace (the largest |x| of every observed site at every step that observed
sites): what the rules and the replay reduce them to, in memory bounded by a chunk of rows, never a [steps x sites]
array. A run of 10^6 steps with peaks every 10th holds 10^5 rows of one float32 per site; they are read once, in step
order, a few thousand rows at a time (Trace.peak_chunks) and reduced:

- per site: the largest finite peak, the first step it was reached, how many peaks round past FP16's max;
- per row, for groups of sites: whether a site of the group held NaN/Inf, whether one was not observed;
- per row, the largest gradient relative to its format's max (the replay's GradientPeaks), output gradients divided by
  the loss scale they carried;
- at a few query steps: the largest finite positive value over the steps before each (windows of given lengths), how
  many such values each window held, and the last such value before it (Transformer Engine's delayed scaling).

A peak value is NaN when the tensor held a NaN, Inf when it held an Inf (and no NaN); a negative stored value marks a
site not observed that step. Offline side: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import pandas as pd

from .. import formats

# The amax history lengths the format what-if evaluates (Transformer Engine's DelayedScaling default is 1024).
HISTORIES = (1, 16, 128, 1024)

T = TypeVar("T", bound=np.generic)


@dataclass
class Gradients:
    """The gradient sites (grad_out then param_grad, with ``compute_dtype``, ``fp16``, ``seed``) and what the ratio
    of the replay's GradientPeaks divides by: each site's format limit, the loss scale output gradients carry."""

    sites: pd.DataFrame
    ids: np.ndarray
    limits: np.ndarray
    scaled: np.ndarray  # bool per site: an output gradient (stored times the loss scale)
    carried: np.ndarray  # per step: the loss scale (1.0 where none is recorded)
    assumed_fp16: bool  # no gradient was computed in FP16: every one judged against the FP16 max


def _compute_dtypes(grads: pd.DataFrame, acts: pd.DataFrame) -> list[str]:
    """The dtype each gradient site is computed in: a grad_out its own; a param_grad its module's compute dtype (the
    module's act site), whatever the dtype of the .grad it lands in (an FP16 matmul's weight gradient is FP16)."""
    act_dtype = dict(zip(acts["path"].tolist(), acts["dtype"].tolist()))
    out = []
    for kind, module, dtype in zip(grads["kind"].tolist(), grads["module"].tolist(), grads["dtype"].tolist()):
        d = act_dtype.get(module, dtype) if kind == "param_grad" else dtype
        out.append(str(d or "float32").replace("torch.", ""))
    return out


def is_seed(kind: str, shape: object) -> bool:
    """The output gradient of a 0-d output: the backward pass's seed (a returned loss), not a model gradient."""
    return kind == "grad_out" and shape is not None and str(shape) == ""


def gradient_sites(go: pd.DataFrame, pg: pd.DataFrame, acts: pd.DataFrame, rec_scale: np.ndarray) -> Gradients:
    """The replay's definition of which format each gradient is judged against (see lossscale.evidence)."""
    grads = pd.concat([go, pg], ignore_index=True)
    dtypes = _compute_dtypes(grads, acts)
    seed = np.array([is_seed(k, sh) for k, sh in zip(grads["kind"].tolist(), grads["shape"].tolist())], dtype=bool)
    fp16 = np.array([d in ("float16", "half") for d in dtypes], dtype=bool)
    assumed = bool((~seed).any()) and not fp16[~seed].any()  # an FP32/BF16 run: judged as if computed in FP16
    if assumed:
        fp16 |= ~seed
    # a format's limit once, not once a site (a property: a few float operations each time)
    limit = {d: formats.DTYPE_FORMATS.get(d, formats.FP32).finite_limit for d in set(dtypes)}
    half = formats.FP16.finite_limit
    limits = np.array([half if f else limit[d] for f, d in zip(fp16, dtypes)], dtype=float)
    return Gradients(
        sites=grads.assign(compute_dtype=dtypes, fp16=fp16, seed=seed),
        ids=grads["id"].to_numpy(dtype=np.int64),
        limits=limits,
        scaled=np.arange(len(grads)) < len(go),
        carried=np.where(np.isnan(rec_scale), 1.0, rec_scale),
        assumed_fp16=assumed,
    )


@dataclass
class Ratio:
    """The largest |gradient| / format max per row over ``cols`` (output gradients, marked ``scaled``, divided by
    the loss scale ``carried`` of their step first); NaN where none of them was observed and finite."""

    cols: np.ndarray
    limits: np.ndarray
    scaled: np.ndarray  # bool per col: stored times the loss scale
    carried: np.ndarray  # per step: the loss scale the scaled values carry (1.0 without one)


@dataclass
class Windows:
    """Delayed-scaling windows: at each of ``queries`` (sorted steps), over the steps [q - h, q - 1] for each
    history h, the largest finite positive value of each of ``cols`` (divided by ``stored`` per step where
    ``divide``), how many such values the window held, and the last such value before q."""

    cols: np.ndarray
    divide: np.ndarray  # bool per col
    stored: np.ndarray  # per step
    queries: np.ndarray
    histories: tuple[int, ...]
    # h -> [queries x cols], NaN where the window held none
    wmax: dict[int, npt.NDArray[np.float64]] = field(default_factory=dict)
    count: dict[int, npt.NDArray[np.int64]] = field(default_factory=dict)  # h -> [queries x cols]
    last: np.ndarray | None = None  # [queries x cols], NaN where there was none
    at: np.ndarray | None = None  # [queries x cols]: the stored peak at the query step (NaN: none observed)


@dataclass
class Scan:
    """Everything one pass computes (see the module docstring)."""

    steps: np.ndarray  # the steps that have a peaks row
    site_max: np.ndarray  # per site: largest finite peak, NaN when none
    site_argmax: np.ndarray  # per site: the first step with that peak, -1 when none
    site_overflows: np.ndarray  # per site: peaks that round past FP16's max (Inf included)
    bad: dict[str, npt.NDArray[np.bool_]]  # group -> per row: a site of the group held NaN/Inf
    unseen: dict[str, npt.NDArray[np.bool_]]  # group -> per row: a site of the group was not observed
    ratio: np.ndarray | None  # per row (Ratio)
    windows: Windows | None


def scan(
    chunks: Iterable[tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]],
    n_sites: int,
    groups: dict[str, np.ndarray],
    ratio: Ratio | None = None,
    windows: Windows | None = None,
) -> Scan:
    """Reduce the peaks rows ``chunks`` yields ((steps, float32 [k x width]) in step order, -1 where a site was not
    observed) for ``n_sites`` sites; ``groups``: name -> site ids."""
    site_max = np.full(n_sites, -np.inf)
    site_arg = np.full(n_sites, -1, dtype=np.int64)
    over = np.zeros(n_sites, dtype=np.int64)
    edge = formats.FP16
    steps: list[npt.NDArray[np.int64]] = []
    bad: dict[str, list[npt.NDArray[np.bool_]]] = {g: [] for g in groups}
    unseen: dict[str, list[npt.NDArray[np.bool_]]] = {g: [] for g in groups}
    ratios: list[npt.NDArray[np.float64]] = []
    win = _WindowState(windows) if windows is not None else None
    take = {g: _columns(ids) for g, ids in groups.items()}
    r_cols = _columns(ratio.cols) if ratio is not None else None
    r_groups = _ratio_groups(ratio) if ratio is not None else []
    w_cols = _columns(win.spec.cols) if win is not None else None
    for st, block in chunks:
        vals = _width(block, n_sites)  # float32: masks and maxima are exact in it
        steps.append(st)
        with np.errstate(invalid="ignore"):
            seen = vals >= 0  # (NaN: False; -1: not observed)
            nonfinite = ~np.isfinite(vals)
            over += edge.overflows(vals).sum(axis=0)  # NaN and -1 (not observed) do not
            fin = np.where(seen & ~nonfinite, vals, -np.inf)
        top = fin.max(axis=0).astype(np.float64)
        better = np.flatnonzero(top > site_max)  # (after the first chunks: few sites, if any)
        if len(better):
            site_max[better] = top[better]
            site_arg[better] = st[_first_row(fin[:, better] == top[better].astype(np.float32))]
        for g, cols in take.items():
            bad[g].append(nonfinite[:, cols].any(axis=1))
            unseen[g].append(~(seen | nonfinite)[:, cols].all(axis=1))
        if ratio is not None:
            ratios.append(_ratio(vals[:, r_cols], st, ratio, r_groups))
        if win is not None:
            win.add(st, vals[:, w_cols].astype(np.float64))
    none = site_arg < 0
    site_max[none] = np.nan

    def cat(xs: list[npt.NDArray[T]], dt: npt.DTypeLike) -> npt.NDArray[T]:
        return np.concatenate(xs) if xs else np.zeros(0, dt)

    return Scan(
        steps=cat(steps, np.int64),
        site_max=site_max,
        site_argmax=site_arg,
        site_overflows=over,
        bad={g: cat(v, bool) for g, v in bad.items()},
        unseen={g: cat(v, bool) for g, v in unseen.items()},
        ratio=cat(ratios, np.float64) if ratio is not None else None,
        windows=win.finish() if win is not None else None,
    )


def _first_row(hit: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Per column, the first row that is True (one must be): ``argmax(axis=0)`` as a reduction over the rows, which
    numpy runs along the contiguous rows (argmax along axis 0 of a row-major array is several times slower)."""
    rows = np.arange(len(hit), dtype=np.int64)[:, None]
    first: npt.NDArray[np.int64] = np.where(hit, rows, len(hit)).min(axis=0)
    return first


def _last_row(hit: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Per column, the last row that is True; -1 where none is."""
    rows = np.arange(len(hit), dtype=np.int64)[:, None]
    last: npt.NDArray[np.int64] = np.where(hit, rows, -1).max(axis=0)
    return last


def _columns(ids: np.ndarray) -> slice | npt.NDArray[np.int64]:
    """A slice for ids that run on without a gap (a view, no copy), else the ids."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and np.array_equal(ids, np.arange(ids[0], ids[0] + len(ids))):
        return slice(int(ids[0]), int(ids[0]) + len(ids))
    return ids


def _width(block: np.ndarray, n: int) -> np.ndarray:
    """Rows cut or padded (-1: not observed) to ``n`` sites (float32, as stored)."""
    if block.shape[1] >= n:
        return block[:, :n]
    out = np.full((len(block), n), -1.0, dtype=np.float32)
    out[:, : block.shape[1]] = block
    return out


def _ratio_groups(r: Ratio) -> list[tuple[bool, float, slice | npt.NDArray[np.int64]]]:
    """The ratio's columns by (divided by the loss scale, format limit): a few groups (FP16 output gradients, FP16 and
    FP32 weight gradients), each reduced at once."""
    out = []
    for scaled in (True, False):
        for limit in np.unique(r.limits[r.scaled == scaled]).tolist():
            out.append((scaled, float(limit), _columns(np.flatnonzero((r.scaled == scaled) & (r.limits == limit)))))
    return out


def _ratio(
    vals: npt.NDArray[np.float32],
    st: np.ndarray,
    r: Ratio,
    groups: list[tuple[bool, float, slice | npt.NDArray[np.int64]]],
) -> np.ndarray:
    """evidence.gradient_peaks' reduction over a chunk of rows (float32 as stored, the ratio's columns): per group of
    columns sharing a loss-scale division and a limit, the largest stored value first, then the divisions, on one value
    a row. The same numbers as dividing every value (``_ratio_each``): a correctly rounded division by a positive
    number never reverses an order, so the largest quotient is the quotient of the largest value."""
    carried = r.carried[st]
    if not (np.isfinite(carried) & (carried > 0)).all():  # (a scale that is not a positive number: value by value)
        return _ratio_each(vals.astype(np.float64), st, r)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(vals) & (vals >= 0)
    clean = np.where(finite, vals, np.float32(0.0))
    out = np.zeros(len(vals))
    for scaled, limit, cols in groups:
        top = clean[:, cols].max(axis=1).astype(np.float64)  # (float32 to float64 is exact)
        if scaled:
            top /= carried
        np.maximum(out, top / limit, out=out)
    out[~finite.any(axis=1)] = np.nan
    return out


def _ratio_each(raw: np.ndarray, st: np.ndarray, r: Ratio) -> np.ndarray:
    """evidence.gradient_peaks' reduction, operation for operation, over a chunk of rows."""
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(raw) & (raw >= 0)
    unscaled = np.where(finite, raw, 0.0)
    unscaled[:, r.scaled] /= r.carried[st][:, None]
    out: npt.NDArray[np.float64] = (unscaled / r.limits[None, :]).max(axis=1, initial=0.0)
    out[~finite.any(axis=1)] = np.nan
    return out


class _WindowState:
    """The delayed-scaling windows, filled chunk by chunk (the windows of one query may span several chunks)."""

    def __init__(self, spec: Windows):
        self.spec = spec
        q, c = len(spec.queries), len(spec.cols)
        self.wmax = {h: np.full((q, c), -np.inf) for h in spec.histories}
        self.count = {h: np.zeros((q, c), dtype=np.int64) for h in spec.histories}
        self.last = np.full((q, c), np.nan)
        self.at = np.full((q, c), np.nan)
        self.running = np.full(c, np.nan)  # last finite positive value of the rows seen so far
        self.divided = _columns(np.flatnonzero(spec.divide))  # the columns divided by the stored factor
        self.done = 0  # queries whose last value is final

    def add(self, st: np.ndarray, vals: np.ndarray) -> None:
        """The rows ``vals`` (float64 [rows x cols], steps ``st``: overwritten) into the windows."""
        s, q = self.spec, self.spec.queries
        if not len(q):  # a trace without histogram steps: no window is asked for
            return
        qi = np.searchsorted(q, st)
        hit = (qi < len(q)) & (q[np.minimum(qi, len(q) - 1)] == st)
        if hit.any():
            self.at[qi[hit]] = np.where(vals[hit] >= 0, vals[hit], np.nan)  # NaN/Inf as stored; -1: not observed
        a = vals  # (the caller's float64 copy of the chunk: divided and masked in place, a few passes fewer)
        with np.errstate(all="ignore"):
            a[:, self.divided] /= s.stored[st][:, None]
            have = np.isfinite(a) & (a > 0)
            a[~have] = np.nan
        first = np.searchsorted(q, st[0], side="right")  # windows end before q: only queries after a row count
        for i in range(first, np.searchsorted(q, st[-1] + max(s.histories), side="right")):
            t = int(q[i])
            for h in s.histories:
                a0, b0 = np.searchsorted(st, t - h), np.searchsorted(st, t)
                if a0 < b0:
                    part = a[a0:b0]
                    self.wmax[h][i] = np.fmax(self.wmax[h][i], np.fmax.reduce(part, axis=0, initial=-np.inf))
                    self.count[h][i] += have[a0:b0].sum(axis=0)
        # queries at or before this chunk's last step: every row before them has been seen now; the running last
        # value is carried over the rows up to each query in turn, then over the rest of the chunk
        end = np.searchsorted(q, st[-1], side="right")
        upto = 0  # rows of this chunk carried into self.running
        for i in range(self.done, end):
            rows = int(np.searchsorted(st, q[i]))  # rows of this chunk before the query
            if rows > upto:
                self._carry(a[upto:rows], have[upto:rows])
                upto = rows
            self.last[i] = self.running
        self.done = max(self.done, int(end))
        if len(st) > upto:
            self._carry(a[upto:], have[upto:])

    def _carry(self, a: np.ndarray, have: npt.NDArray[np.bool_]) -> None:
        """The running last value per column after rows ``a`` (``have``: where a row holds one)."""
        last = _last_row(have)
        ok = np.flatnonzero(last >= 0)
        self.running[ok] = a[last[ok], ok]

    def finish(self) -> Windows:
        s = self.spec
        self.last[self.done :] = self.running
        for h in s.histories:
            self.wmax[h][np.isinf(self.wmax[h])] = np.nan
        s.wmax, s.count, s.last, s.at = self.wmax, self.count, self.last, self.at
        return s
