"""Format what-if from a trace: the share of each site's values that FP8 (E4M3, E5M2, with the delayed-scaling
recipe) and FP16/BF16 (at the recorded loss scale) would saturate or flush to zero, from the recorded exponent
histograms and per-step peaks, without the model. Offline side: numpy/pandas only.

Boundaries are those of a round-to-nearest-even cast (checked against real torch casts in tests/test_whatif.py):
a value flushes to zero iff |x| <= min_subnormal / 2 (the tie goes to the even 0); it overflows (Inf in FP16, BF16
and E5M2; E4M3 has no Inf and torch saturates it to 448) iff |x| > max + ulp(max)/2, or >= when max's last mantissa
bit is odd and the tie rounds away (E5M2 61440, FP16 65520, BF16 (2-2^-8)*2^127; E4M3 448's bit is even: > 464).
A histogram holds binades [2^e, 2^(e+1)), so a share is known exactly except for the one binade a boundary cuts:
every share is an interval (lo: values certainly lost, hi: possibly lost), a single number when that binade is empty
or the recorded abs max settles it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from . import formats
from .trace.bulk import Hists
from .trace.peaks import Windows
from .trace.reduce import group_median
from .trace.schema import HIST_HI, HIST_LO
from .trace.view import View

if TYPE_CHECKING:
    from .trace import Trace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Pair = tuple[npt.NDArray[Any], npt.NDArray[Any]]  # (lo, hi) counts or shares; (over, flush) masks for ``lost``
# ``whatif_rows``' columns by name: per histogram row, floats (shares, scales), ints (step, span, window), bools
# (clean): the dtype is the column's.
Columns = dict[str, npt.NDArray[Any]]

FP8 = {"e4m3": formats.FP8_E4M3, "e5m2": formats.FP8_E5M2}
HALF = {"fp16": formats.FP16, "bf16": formats.BF16}
FORMATS = {**HALF, **FP8}
# Transformer Engine's DelayedScaling defaults: amax over the last 1024 steps, margin 0, the "max" algorithm.
HISTORY, MARGIN = 1024, 0
# Recorded amax values a delayed scale must rest on before a step is judged: a scale from the first few steps is the
# recipe's start-up transient, not its steady state; and with the observation tiers the peaks are sampled (every
# peak_every steps, the calibration steps), so a short run's window holds a handful of early values only.
MIN_HELD = 16
_E = np.arange(-127, 128, dtype=np.float64)  # binade of column j is j - 127; column 0 is (0, 2^-126)
_LOWER = np.where(_E == -127, 0.0, np.exp2(_E))
_UPPER = np.exp2(_E + 1)


@dataclass(frozen=True)
class Edges:
    """Where a round-to-nearest-even cast to a format stops representing a value."""

    overflow: float  # |x| above this saturates (E4M3) or becomes Inf
    overflow_tie: bool  # True: |x| == overflow itself overflows (the tie rounds away from max)
    flush: float  # 0 < |x| <= flush rounds to zero


def edges(fmt: formats.Format) -> Edges:
    ulp_max = 2.0 ** (fmt.max_exp - fmt.mantissa_bits)
    odd = round(fmt.max / ulp_max) % 2 == 1  # ties go to the even neighbour: away from an odd max
    return Edges(fmt.max + ulp_max / 2, odd, fmt.min_subnormal / 2)


def lost(values: Any, fmt: formats.Format) -> Pair:
    """Value by value (exact): (would overflow/saturate, would flush to zero) masks of a cast to ``fmt``."""
    a = np.abs(np.asarray(values, dtype=np.float64))
    e = edges(fmt)
    over = a >= e.overflow if e.overflow_tie else a > e.overflow
    return over, (a > 0) & (a <= e.flush)


def above(counts: npt.NDArray[np.int64], edge: npt.ArrayLike, tie: bool, absmax: npt.ArrayLike | None = None) -> Pair:
    """(lo, hi) counts of histogram rows (last axis: 255 binades) with |x| > edge (>= when ``tie``); ``edge`` and
    ``absmax`` broadcast per row."""
    at = np.asarray(edge, dtype=np.float64)[..., None]
    certain = (at < _LOWER) | ((at == _LOWER) & tie)
    possible = at < _UPPER
    lo, hi = (counts * certain).sum(-1), (counts * possible).sum(-1)
    if absmax is not None:
        am = np.asarray(absmax, dtype=np.float64)
        clear = (am < at[..., 0]) | ((am == at[..., 0]) & (not tie))
        lo, hi = np.where(clear, 0, lo), np.where(clear, 0, hi)
        lo = np.where(~clear & np.isfinite(am) & (hi > 0), np.maximum(lo, 1), lo)
    return lo, hi


def below(counts: npt.NDArray[np.int64], edge: npt.ArrayLike) -> Pair:
    """(lo, hi) counts of histogram rows with 0 < |x| <= edge."""
    at = np.asarray(edge, dtype=np.float64)[..., None]
    return (counts * (at >= _UPPER)).sum(-1), (counts * (at >= _LOWER)).sum(-1)


def delayed_scales(
    amax: npt.ArrayLike, fmt: formats.Format, history: int = HISTORY, margin: int = MARGIN
) -> tuple[FloatArray, FloatArray]:
    """The per-step scale of the delayed-scaling recipe, fmt.max / (max of the amax of the previous ``history``
    steps) / 2^margin, and how many finite amax values that window held. A step whose window holds none keeps the
    previous scale (1.0 at first, as Transformer Engine starts); a non-finite amax (an overflowed step) is left out.
    ``amax``: one value per step, or [steps x sites] (every column at once)."""
    values = np.asarray(amax, dtype=np.float64)
    a = pd.DataFrame(np.where(np.isfinite(values) & (values > 0), values, np.nan).reshape(len(values), -1)).shift(1)
    window = a.rolling(history, min_periods=1)
    scale: FloatArray = pd.DataFrame(fmt.max / window.max().to_numpy() / 2.0**margin).ffill().fillna(1.0).to_numpy()
    held: FloatArray = window.count().fillna(0).to_numpy()
    return (scale, held) if values.ndim > 1 else (scale[:, 0], held[:, 0])


def shares(
    counts: npt.NDArray[np.int64], absmax: npt.ArrayLike, fmt: formats.Format, scale: npt.ArrayLike
) -> dict[str, Any]:
    """Per row: saturated and flushed shares (lo, hi) of the non-zero values when x * scale is cast to ``fmt``."""
    e = edges(fmt)
    by = np.asarray(scale, dtype=np.float64)
    total = counts.sum(-1).astype(np.float64)
    n = np.where(total > 0, total, 1.0)
    s_lo, s_hi = above(counts, e.overflow / by, e.overflow_tie, absmax)
    f_lo, f_hi = below(counts, e.flush / by)
    return {"sat": (s_lo / n, s_hi / n), "flush": (f_lo / n, f_hi / n), "nonzero": total}


# -- over a trace -------------------------------------------------------------------------------------------------
# The histogram steps read are trace.view.View.hist_steps (all of them, or 256 evenly spaced over a long run); every
# site of a kind is computed at once from the histograms as recorded (one query), with the shares summed over the
# binades a boundary leaves on each side (prefix sums of the counts: the same integers the dense sums add).
class Inputs:
    """What the what-if reads for the sites of one kind, read once (through a trace.view.View): the abs max and the
    stored peak at each histogram step, the factor that turns stored values into real ones (output gradients carry the
    loss scale), the anomalous steps, and the delayed-scaling scales of every site at the histogram steps."""

    def __init__(self, tr: Trace | View, kind: str) -> None:
        self.view = View.of(tr)
        self.kind = kind
        self.sites = self.view.sites(kind)
        self.ids = self.sites["id"].to_numpy(dtype=np.int64)
        self.column = {int(s): j for j, s in enumerate(self.ids)}
        steps = self.view.steps
        self.anomalous = steps["skipped"].to_numpy(bool) | steps["nonfinite"].to_numpy(bool)
        self.hsteps = self.view.hist_steps
        self.absmax = self.view.stat("absmax", kind, self.hsteps)  # [hist steps x sites]
        self.stored: FloatArray = np.ones(len(steps))
        if kind == "grad_out":  # output gradients are stored as backward carries them: scaled
            ls = steps["loss_scale"].to_numpy(float)
            self.stored = np.where(np.isfinite(ls) & (ls > 0), ls, 1.0)
        self._scales: dict[tuple[str, int, int], tuple[FloatArray, FloatArray]] = {}
        self._whatif: dict[tuple[int, int], tuple[Hists, Columns]] = {}
        self._half: tuple[Hists, Columns] | None = None
        self._peak_at: FloatArray | None = None

    @staticmethod
    def of(tr: Trace | View, kind: str) -> Inputs:
        """The Inputs of a kind made once per View: the diagnosis' FP8 verdict and the report's formats table read
        the same what-if of the same rows."""
        view = View.of(tr)
        key = ("whatif.Inputs", kind)
        if key not in view.derived:
            view.derived[key] = Inputs(view, kind)
        inp: Inputs = view.derived[key]
        return inp

    def whatif(self, history: int = HISTORY, margin: int = MARGIN) -> tuple[Hists, Columns]:
        """Every site's histogram rows (``rows()``) and ``whatif_rows`` over them (none: no row), once per recipe."""
        if (history, margin) not in self._whatif:
            h = self.rows()
            self._whatif[(history, margin)] = (h, whatif_rows(self, h, history, margin) if len(h) else {})
        return self._whatif[(history, margin)]

    def half(self) -> tuple[Hists, Columns]:
        """``whatif()`` without the FP8 columns (no amax history read): the FP16 / BF16 shares, span and ``clean``."""
        if self._half is None:
            h = self.rows()
            self._half = (h, whatif_rows(self, h, HISTORY, MARGIN, fp8=False) if len(h) else {})
        return self._half

    def _cols(self, w: Windows) -> IntArray:
        """This kind's sites among the columns of the peaks windows."""
        where = {int(c): i for i, c in enumerate(w.cols)}
        return np.array([where[int(s)] for s in self.ids], dtype=np.int64)

    def scales(self, name: str, history: int, margin: int) -> tuple[FloatArray, FloatArray]:
        """[hist steps x sites] delayed-scaling scales and amax counts (``delayed_scales`` at the histogram steps):
        fmt.max / (max amax of the window before the step) / 2^margin; a step whose window holds none keeps the last
        scale, which rests on the last amax before it; 1.0 before any."""
        key = (name, history, margin)
        if key not in self._scales:
            w = self.view.windows(history)
            assert w.last is not None  # (a scan's windows always hold the last amax)
            c = self._cols(w)
            wmax, held, last = w.wmax[history][:, c], w.count[history][:, c], w.last[:, c]
            fmt = FP8[name]
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(held > 0, fmt.max / wmax / 2.0**margin, fmt.max / last / 2.0**margin)
            scale = np.where(np.isnan(scale), 1.0, scale)
            self._scales[key] = (scale, held.astype(np.float64))
        return self._scales[key]

    @property
    def peak_at(self) -> FloatArray:
        """[hist steps x sites]: the stored peak at each histogram step (NaN: NaN, or not observed), read at those
        steps alone (a few hundred rows; the pass over the peaks holds the same values: tests/test_whatif.py)."""
        if self._peak_at is None:
            self._peak_at = self.view.trace.records("peak", self.kind, fill=np.nan, steps=self.hsteps)
        return self._peak_at

    def rows(self, ids: Iterable[int] | None = None) -> Hists:
        """The histograms (trace.bulk.Hists) of these sites (default: all of the kind) at the histogram steps."""
        view = self.view
        return view.hists.take(view.rows_of(self.ids if ids is None else np.asarray(list(ids), dtype=np.int64)))


def _rows_shares(h: Hists, absmax: FloatArray, fmt: formats.Format, scale: npt.ArrayLike) -> dict[str, Any]:
    """``shares`` over histogram rows as recorded (trace.bulk.Hists), row by row."""
    e = edges(fmt)
    by = np.asarray(scale, dtype=np.float64)
    total = h.totals
    n = np.where(total > 0, total, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        over, flush = e.overflow / by, e.flush / by
    # (0-d arrays: Hists.between broadcasts a binade number as it does an array of them, but is annotated with arrays)
    lowest, top = np.asarray(HIST_LO), np.asarray(HIST_HI + 1)
    certain = np.searchsorted(_LOWER, over, side="left" if e.overflow_tie else "right")  # first binade above
    possible = np.searchsorted(_UPPER, over, side="right")
    s_lo = np.where(np.isnan(over), 0.0, h.between(certain + HIST_LO, top))
    s_hi = np.where(np.isnan(over), 0.0, h.between(possible + HIST_LO, top))
    am = np.asarray(absmax, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        clear = (am < over) | ((am == over) & (not e.overflow_tie))
    s_lo, s_hi = np.where(clear, 0, s_lo), np.where(clear, 0, s_hi)
    s_lo = np.where(~clear & np.isfinite(am) & (s_hi > 0), np.maximum(s_lo, 1), s_lo)
    f_lo = np.where(np.isnan(flush), 0.0, h.between(lowest, np.searchsorted(_UPPER, flush, side="right") + HIST_LO))
    f_hi = np.where(np.isnan(flush), 0.0, h.between(lowest, np.searchsorted(_LOWER, flush, side="right") + HIST_LO))
    return {"sat": (s_lo / n, s_hi / n), "flush": (f_lo / n, f_hi / n), "nonzero": total}


def _span(h: Hists) -> IntArray:
    """Per row: binades from the smallest to the largest non-zero |x|, both included."""
    per = h.offsets[1:] - h.offsets[:-1]
    pos = np.arange(len(h.counts)) - np.repeat(h.offsets[:-1], per)
    nz = h.counts > 0
    first = np.minimum.reduceat(np.where(nz, pos, np.iinfo(np.int64).max), h.offsets[:-1]) if len(h) else pos
    last = np.maximum.reduceat(np.where(nz, pos, -1), h.offsets[:-1]) if len(h) else pos
    span: IntArray = np.where(last >= 0, last - first + 1, 0)
    return span


def whatif_rows(inp: Inputs, h: Hists, history: int, margin: int, fp8: bool = True) -> Columns:
    """``site_whatif``'s columns for histogram rows of one kind (any sites), as arrays (``fp8=False``: without the
    E4M3 / E5M2 columns, ``history`` and ``window``)."""
    r = np.searchsorted(inp.hsteps, h.step)
    j = np.searchsorted(inp.ids, h.site)
    out: Columns = {"step": h.step}
    am = inp.absmax[r, j]
    for name, fmt in HALF.items():
        _put(out, name, _rows_shares(h, am, fmt, 1.0))
    held = None
    for name, fmt in FP8.items() if fp8 else ():
        sc, held = (a[r, j] for a in inp.scales(name, history, margin))
        s = sc / inp.stored[h.step]  # stored value v = real x * stored; cast x * sc
        _put(out, name, _rows_shares(h, am, fmt, s))
        out[f"{name}_scale"] = sc
    out["nonzero"] = h.totals
    out["span"] = _span(h)
    if held is not None:  # (the FP8 columns' amax history)
        out["history"] = held
        out["window"] = np.full(len(h), history)
    out["clean"] = ~inp.anomalous[h.step] & np.isfinite(inp.peak_at[r, j])
    return out


def judged_mask(out: Columns, fp8: bool = True) -> BoolArray:
    """``judged`` as a row mask over ``whatif_rows``' arrays."""
    clean: BoolArray = out["clean"]
    if not fp8:
        return clean
    return clean & (out["history"] >= np.minimum(out["window"], MIN_HELD))


def site_whatif(
    tr: Trace, site: int | str, kind: str, *, history: int = HISTORY, margin: int = MARGIN, inputs: Inputs | None = None
) -> pd.DataFrame:
    """One row per histogram step of one site: for FP16/BF16 (values as recorded, i.e. output gradients at the
    recorded loss scale) and E4M3/E5M2 (real values times the delayed-scaling scale) the saturated and flushed
    shares, as lo/hi columns (``e4m3_sat_lo``, ``e4m3_sat_hi``, ...), the scales, the non-zero count, ``history``
    (finite amax values the recipe's window held) and ``clean`` (a finished step without NaN/Inf: the ones to judge
    by; an overflowed step's histogram is partial). ``inputs``: an ``Inputs(tr, kind)`` shared by many calls."""
    inp = inputs if inputs is not None else Inputs(tr, kind)
    sid = inp.view.trace.site_id(site, kind)
    h = inp.view.site_hists(sid)
    if not len(h):
        return pd.DataFrame({"step": h.step})
    return pd.DataFrame(whatif_rows(inp, h, history, margin))


def judged(df: pd.DataFrame, fp8: bool = True) -> pd.DataFrame:
    """The histogram steps a verdict rests on: clean ones, and for FP8 those whose scale rests on an amax history
    of at least MIN_HELD values (or the whole window, when shorter)."""
    if not len(df):
        return df
    keep = df["clean"] & (df["history"] >= np.minimum(df["window"], MIN_HELD)) if fp8 else df["clean"]
    return df[keep]


def _put(out: dict[str, Any], name: str, sh: dict[str, Any]) -> None:
    for what in ("sat", "flush"):
        out[f"{name}_{what}_lo"], out[f"{name}_{what}_hi"] = sh[what]


def site_medians(values: FloatArray, sites: IntArray, keep: BoolArray) -> dict[int, float]:
    """site id -> the median of its kept rows' values (sites without a kept row are left out)."""
    g, med = group_median(values[keep], sites[keep])
    return dict(zip(g.tolist(), med.tolist()))


def formats_table(
    tr: Trace | View,
    kinds: Sequence[str] = ("act", "grad_out"),
    *,
    history: int = HISTORY,
    margin: int = MARGIN,
    fp8: bool = True,
) -> pd.DataFrame:
    """Per site: the median over histogram steps of the certainly lost share (saturated + flushed, lo) in each
    format (FP8 only over steps that had an amax history), the FP16 and BF16 headroom in binades (log2 of the
    overflow edge over the largest recorded |x|, at the full-statistics steps read) and the median span of the values
    in binades (FP8 per-tensor scaling can hold log2(448 / 2^-9) = 17.8 binades in E4M3, 31.8 in E5M2).
    ``fp8=False``: without the E4M3 / E5M2 columns, whose delayed scaling needs the amax of every observed step (the
    pass over the peaks, most of the reading of a long run); the other columns are the same numbers."""
    rows = []
    names = FORMATS if fp8 else HALF
    for kind in kinds:
        inp = Inputs.of(tr, kind)
        h, out = inp.whatif(history, margin) if fp8 else inp.half()
        if not len(h):
            continue
        count = dict(zip(*np.unique(h.site, return_counts=True)))
        meds = {}
        for name in names:
            keep = judged_mask(out, name in FP8)
            meds[name] = (
                site_medians(out[f"{name}_sat_lo"] + out[f"{name}_flush_lo"], h.site, keep),
                site_medians(out[f"{name}_sat_hi"] + out[f"{name}_flush_hi"], h.site, keep),
            )
        span = site_medians(out["span"].astype(np.float64), h.site, judged_mask(out, False))
        absmax = inp.view.stat("absmax", kind)  # abs max at the full-statistics steps read
        finite = np.isfinite(absmax)
        with np.errstate(invalid="ignore"):  # (a site without a finite value: NaN)
            top = np.where(finite.any(axis=0), np.where(finite, absmax, -np.inf).max(axis=0, initial=-np.inf), np.nan)
        overflow = {name: edges(fmt).overflow for name, fmt in HALF.items()}
        # the sites' columns as lists, not rows of the frame: a wide model has thousands of sites
        for j, (sid, path, dtype) in enumerate(
            zip(inp.ids.tolist(), inp.sites["path"].tolist(), inp.sites["dtype"].tolist())
        ):
            if sid not in count:
                continue
            row = {"path": path, "kind": kind, "dtype": dtype, "hist_steps": int(count[sid])}
            for name in names:
                row[f"{name}_lost"] = float(meds[name][0].get(sid, math.nan))
                row[f"{name}_lost_hi"] = float(meds[name][1].get(sid, math.nan))
            am = float(top[j])
            for name in HALF:
                row[f"{name}_headroom"] = math.log2(overflow[name] / am) if am > 0 else math.nan
            row["span"] = float(span.get(sid, math.nan))
            rows.append(row)
    return pd.DataFrame(rows)
