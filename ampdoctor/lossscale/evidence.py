"""Evidence: what a trace says about each step, read once per trace for the scaler model (scaler.py).

Overflow model. At a scale S a step overflows when some gradient, scaled by S, rounds past the largest value of
the format it is computed in (FP16: |x| >= 65520, formats.Format.finite_limit; 65519 rounds down to 65504). Per
step the trace gives the unscaled magnitudes: every grad_out peak divided by the loss scale it carried, every
param_grad peak (already unscaled), and on every step, observed or not, the largest unscaled parameter gradient (the
sentinel's `grad_max`) - ``gradient_peaks``, the one definition the diagnosis rules share. The output gradient of a
0-d output (a loss the model returns: 1 x scale, the backward seed) is not a model gradient and counts only where it
was FP16. What is *known* is used first:
- the recorded scale of the step: its recorded skip (so the run's own settings reproduce its history exactly);
- a non-finite forward activation or loss: the step overflows at every scale (scaling cannot fix it);
- overflow is monotone in S: a step that overflowed at S_rec overflows at any S >= S_rec, one that did not
  overflow at S_rec does not at any S <= S_rec;
- a finite step simulated at S > S_rec: its own recorded peaks decide.
What is *estimated*: a step that overflowed at S_rec, simulated at a lower scale. Its true magnitude is only known
to be >= max/S_rec. Its weights are those of the nearest finite steps (a skipped step does not update them), so
the estimate is the larger of the magnitudes of the nearest finite step before and after (and of its own finite
sites), capped so that the step still overflows at S_rec. Such decisions are flagged in ``Replay.estimated``.
Gradients the collector did not observe (inside a module, the input gradient of the first layer) are invisible.
A loss computed in FP16 is itself scaled in FP16 and counts as one more gradient. A run that computed no gradient in
FP16 (FP32, BF16) is replayed as if it had (``Replay.assumed_fp16``): what a switch to FP16 + GradScaler would meet.

Underflow. The exponent histograms (recorded every ``hist_every`` steps) of the gradients computed in FP16, shifted
to unscaled binades; the scaler model takes their shares below FP16's limits at the simulated scale. Elements
already zero at the recorded scale are not counted (a flushed gradient cannot be told from an exact zero).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from .. import formats
from ..trace import Trace, load
from ..trace.view import View, containers
from .defaults import TORCH_DEFAULTS, Settings

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Histogram = tuple[FloatArray, FloatArray]  # (log2 lower edge of each unscaled binade, counts)
Histograms = dict[int, Histogram]  # step index -> its histogram


@dataclass
class Evidence:
    """What the trace says about each step (arrays indexed like ``trace.steps()``), prepared once per trace."""

    steps: IntArray
    rec_scale: FloatArray  # scale in force (NaN: no scaler recorded)
    rec_next: FloatArray  # scale after update
    rec_over: BoolArray  # overflowed at the recorded scale (skipped; without a scaler: non-finite grads)
    always: BoolArray  # non-finite forward or loss: overflows at every scale
    threshold: FloatArray  # estimated largest scale that does not overflow
    from_neighbours: BoolArray  # threshold of an overflowed step (estimate from neighbouring steps)
    hist: Histograms  # step index -> (log2 lower edge of each unscaled binade, counts)
    run_settings: Settings  # init_scale, growth_factor, backoff_factor, growth_interval
    has_scaler: bool
    assumed_fp16: bool
    device: str

    def to_arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The evidence as named numpy arrays (no pickle: numpy's own .npz), for a cache on disk; ``from_arrays``
        gives back the same values, bit for bit, and the histograms in the same order."""
        keys = list(self.hist)
        sizes = np.array([len(self.hist[k][0]) for k in keys], dtype=np.int64)
        edges, counts = ([np.zeros(0)] + [self.hist[k][i] for k in keys] for i in (0, 1))
        return {
            **{f: getattr(self, f) for f in _ARRAYS},
            "hist_steps": np.array(keys, dtype=np.int64),
            "hist_offsets": np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
            "hist_edges": np.concatenate(edges).astype(np.float64),
            "hist_counts": np.concatenate(counts).astype(np.float64),
            "run_settings": np.array([float(self.run_settings[k]) for k in TORCH_DEFAULTS], dtype=np.float64),
            "flags": np.array([self.has_scaler, self.assumed_fp16], dtype=bool),
            "device": np.array(self.device),
        }

    @staticmethod
    def from_arrays(a: dict[str, npt.NDArray[Any]]) -> Evidence:
        """The evidence ``to_arrays`` wrote (a KeyError or ValueError for anything else)."""
        off = a["hist_offsets"]
        hist = {
            int(t): (a["hist_edges"][off[i] : off[i + 1]], a["hist_counts"][off[i] : off[i + 1]])
            for i, t in enumerate(a["hist_steps"].tolist())
        }
        values = a["run_settings"].tolist()
        if len(values) != len(TORCH_DEFAULTS) or len(off) != len(a["hist_steps"]) + 1:
            raise ValueError("not an evidence of this ampdoctor")
        run = {k: type(TORCH_DEFAULTS[k])(v) for k, v in zip(TORCH_DEFAULTS, values)}
        has_scaler, assumed = (bool(x) for x in a["flags"].tolist())
        return Evidence(
            **{f: a[f] for f in _ARRAYS},
            hist=hist,
            run_settings=run,
            has_scaler=has_scaler,
            assumed_fp16=assumed,
            device=str(a["device"]),
        )


_ARRAYS = ("steps", "rec_scale", "rec_next", "rec_over", "always", "threshold", "from_neighbours")
_DERIVED = ("lossscale.Evidence",)  # the key of a View's gathered evidence in View.derived


@dataclass(eq=False)
class GradientPeaks:
    """The one definition of "the largest unscaled gradient" (rules and replay alike).

    Per step, over every observed gradient (grad_out divided by the loss scale it carried, param_grad as stored):
    the largest magnitude relative to the max of the format it is computed in. The gradient of a loss with respect
    to itself (a model that returns its loss: the output gradient of a 0-d output) is the backward seed, 1 x scale,
    not a gradient the model computed; it counts only where it really was FP16 (an FP16 loss overflows when scaled).
    """

    ratio: FloatArray  # per step: max |unscaled gradient| / format max (NaN: nothing observed)
    nonfinite: BoolArray  # per step: some observed gradient held Inf/NaN
    assumed_fp16: bool  # no gradient was computed in FP16: every one is judged against the FP16 max
    sites: pd.DataFrame  # grad_out then param_grad sites, with their compute dtype and whether a seed

    @property
    def fp16_equivalent(self) -> FloatArray:
        """Per step, the largest unscaled gradient in FP16 terms: the scale s overflows FP16 when s * this rounds
        past 65504 (> finite_limit, i.e. >= 65520)."""
        return self.ratio * formats.FP16.finite_limit


def gradient_peaks(tr: Trace | View) -> GradientPeaks:
    """Per step, over the peaks of every gradient site (one pass over the peaks: View.scan)."""
    view = View.of(tr)
    st = view.steps
    g = view.gradients
    fp16 = g.sites["fp16"].to_numpy(bool)
    # peaks as stored: -1 = site not seen that step, NaN = the tensor held a NaN, inf = an inf
    scan = view.scan
    assert scan.ratio is not None  # (the full scan computes the gradient ratio)
    ratio = view.per_step(scan.ratio, np.nan)  # nothing observed: no information
    nonfinite = view.per_step(scan.bad["grad"], False)
    # The sentinel's largest unscaled parameter gradient, recorded on every step (steps that observe no site
    # included): the weight gradients are computed in their module's dtype, so it counts against that format's max.
    if "grad_max" in st:
        gmax = st["grad_max"].to_numpy(float)
        on_pg = fp16[~g.scaled]
        pg_limit = (
            formats.FP16.finite_limit if (on_pg.any() if len(on_pg) else fp16.any()) else formats.FP32.finite_limit
        )
        with np.errstate(invalid="ignore"):
            ratio = np.fmax(ratio, np.where(np.isfinite(gmax) & (gmax >= 0), gmax / pg_limit, np.nan))
        nonfinite |= np.isinf(gmax)  # (NaN there is also what a trace without the column reads)
    return GradientPeaks(ratio=ratio, nonfinite=nonfinite, assumed_fp16=g.assumed_fp16, sites=g.sites)


def gather(tr: Trace | View) -> Evidence:
    """The evidence of every step of a trace (a trace without steps is a ValueError), once per View: the rules'
    search, the replay and a caller that keeps it (the dashboard's cache) read the same object."""
    view = View.of(tr)
    if _DERIVED not in view.derived:
        view.derived[_DERIVED] = _gather(view)
    ev: Evidence = view.derived[_DERIVED]
    return ev


def keep(tr: Trace | View, ev: Evidence) -> None:
    """Make ``ev`` (gathered from this same content before, e.g. kept on disk) the View's evidence: ``gather``
    returns it instead of reading the trace again."""
    View.of(tr).derived[_DERIVED] = ev


def _gather(view: View) -> Evidence:
    st = view.steps
    n = len(st)
    if not n:
        raise ValueError(f"{view.trace.path}: the trace has no steps yet")
    cfg = view.config
    sc = cfg.get("scaler") or {}
    has_scaler = bool(sc.get("enabled")) and bool(st["loss_scale"].notna().any())
    run = dict(TORCH_DEFAULTS)
    if has_scaler:
        for key in run:
            if sc.get(key) is not None:
                run[key] = type(TORCH_DEFAULTS[key])(sc[key])
        run["init_scale"] = float(st["loss_scale"].dropna().iloc[0])  # the scale in force when the trace began

    rec_scale = st["loss_scale"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    rec_next = st["loss_scale_next"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    peaks = gradient_peaks(view)
    grads = peaks.sites
    fp16 = grads["fp16"].to_numpy(bool) & ~grads["seed"].to_numpy(bool)
    ratio = peaks.ratio.copy()
    loss = st["loss"].to_numpy(float)
    if str(cfg.get("loss_dtype") or "").replace("torch.", "") == "float16":  # an FP16 loss is scaled in FP16
        ratio = np.fmax(ratio, np.abs(loss) / formats.FP16.finite_limit)

    # a non-finite forward (or loss) makes the step overflow whatever the scale
    always = view.per_step(view.scan.bad["act"], False) | np.isinf(loss)
    if np.isfinite(loss).any():  # the loss is logged in this run: NaN means a NaN loss
        always |= np.isnan(loss)
    if has_scaler:
        rec_over = st["skipped"].to_numpy(bool)
        always &= rec_over  # a non-finite value that did not make the recorded step overflow never mattered
        assumed_scale = rec_scale
    else:  # no scaler: a non-finite gradient at scale 1 is an overflow
        rec_over = peaks.nonfinite | always
        assumed_scale = np.ones(n)
    threshold, from_nb = _thresholds(assumed_scale, rec_over, always, ratio)
    return Evidence(
        steps=st["step"].to_numpy(int),
        rec_scale=rec_scale,
        rec_next=rec_next,
        rec_over=rec_over,
        always=always,
        threshold=threshold,
        from_neighbours=from_nb,
        hist=_histograms(view, grads, fp16, int((grads["kind"] == "grad_out").sum()), n),
        run_settings=run,
        has_scaler=has_scaler,
        assumed_fp16=peaks.assumed_fp16,
        device=str(view.meta.get("run", {}).get("device") or "cuda"),
    )


def _thresholds(
    scale: FloatArray, over: BoolArray, always: BoolArray, ratio: FloatArray
) -> tuple[FloatArray, BoolArray]:
    """Per step, the largest scale that does not overflow (the step overflows at S > threshold).

    Finite step: max / its largest unscaled magnitude, and at least the scale it survived. Overflowed step: the larger
    magnitude of the nearest finite steps before and after (a skipped step does not change the weights), capped at
    the scale it overflowed at; with no finite step at all, the smallest scale any step overflowed at.
    """
    n = len(scale)
    with np.errstate(divide="ignore"):
        own = np.where(np.isnan(ratio), np.nan, 1.0 / ratio)  # ratio 0 -> inf: never overflows
    ok = ~over & ~np.isnan(own)
    idx = np.arange(n)
    prev = np.where(ok, idx, -1)
    prev = np.maximum.accumulate(prev)
    nxt = np.where(ok, idx, n)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1]
    before = np.concatenate(([-1], prev[:-1]))  # nearest finite step strictly before each step
    after = np.concatenate((nxt[1:], [n]))  # and strictly after
    nb_ratio = np.full(n, np.nan)
    for ref in (before, after):
        has = (ref >= 0) & (ref < n)
        r = np.full(n, np.nan)
        r[has] = ratio[ref[has]]
        nb_ratio = np.fmax(nb_ratio, r)
    floor = np.nanmin(np.where(over & ~always, scale, np.nan)) if (over & ~always).any() else np.nan

    def inverse(r: FloatArray) -> FloatArray:  # 1 / r for r > 0, inf for r <= 0, NaN for NaN
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(np.isnan(r), np.nan, np.where(r > 0, 1.0 / np.where(r > 0, r, 1.0), np.inf))
            return out

    def larger(a: FloatArray, b: FloatArray) -> FloatArray:  # Python's max(a, b): b only where it is strictly larger
        out: FloatArray = np.where(b > a, b, a)
        return out

    with np.errstate(invalid="ignore"):
        borrowed = inverse(nb_ratio)
        unseen = np.where(np.isnan(nb_ratio), np.inf, larger(scale, borrowed))  # nothing recorded this step
        seen = larger(own, scale)
        est = inverse(np.fmax(nb_ratio, ratio))  # its own finite sites are a lower bound on its magnitude
        est = np.where(np.isnan(est), floor, est)
        capped = np.where(np.isnan(est), scale, np.where(scale < est, scale, est))
    threshold = np.where(always, 0.0, np.where(~over, np.where(np.isnan(own), unseen, seen), capped))
    from_nb = ~always & (over | np.isnan(own))
    return threshold, from_nb


def _histograms(view: View, grads: pd.DataFrame, fp16: BoolArray, n_go: int, n: int) -> Histograms:
    """Step index -> (log2 of the lower edge of each unscaled binade, counts), over the gradient sites computed in
    FP16 at the histogram steps read (View.hist_steps). Container modules are left out: their grad_out is their last
    child's. Counts of one step in the same unscaled binade are added (one entry per binade and step)."""
    paths = grads["path"].tolist()
    outer = containers(paths[:n_go])
    keep = fp16 & ~np.array([k == "grad_out" and p in outer for k, p in zip(grads["kind"].tolist(), paths)], dtype=bool)
    ids = grads["id"].to_numpy(dtype=np.int64)[keep]
    if not len(ids):
        return {}
    h = view.hists.take(view.rows_of(ids))
    ok = (h.step < n) & (h.totals > 0)
    h = h.take(np.flatnonzero(ok))
    if not len(h):
        return {}
    hs = view.hist_steps
    carried = np.ones(len(h))
    for kind in ("grad_out", "param_grad"):
        kid = view.sites(kind)["id"].to_numpy()
        sc = view.stat("scale", kind, hs)
        mine = np.isin(h.site, kid)
        if mine.any():
            carried[mine] = sc[np.searchsorted(hs, h.step[mine]), np.searchsorted(kid, h.site[mine])]
    carried = np.where(np.isfinite(carried) & (carried > 0), carried, 1.0)
    per_row = h.offsets[1:] - h.offsets[:-1]
    row = np.repeat(np.arange(len(h)), per_row)
    binade = (np.arange(len(h.counts)) - np.repeat(h.offsets[:-1], per_row) + np.repeat(h.lo, per_row)).astype(float)
    edge = binade - np.log2(carried)[row]
    step = h.step[row]
    nz = h.counts > 0
    step, edge, c = step[nz], edge[nz], h.counts[nz].astype(float)
    order = np.lexsort((edge, step))
    step, edge, c = step[order], edge[order], c[order]
    new = np.ones(len(step), bool)
    new[1:] = (step[1:] != step[:-1]) | (edge[1:] != edge[:-1])
    starts = np.flatnonzero(new)
    step, edge, c = step[starts], edge[starts], np.add.reduceat(c, starts)
    bounds = np.flatnonzero(np.diff(step)) + 1
    return {int(s[0]): (e, cc) for s, e, cc in zip(np.split(step, bounds), np.split(edge, bounds), np.split(c, bounds))}


def open_trace(trace_or_path: Trace | View | str | os.PathLike[str]) -> Trace | View:
    """A Trace (or a View of one) as given, or the one a path names."""
    if isinstance(trace_or_path, (Trace, View)):
        return trace_or_path
    if isinstance(trace_or_path, (str, os.PathLike)):
        return load(trace_or_path)
    raise TypeError(f"Argument trace_or_path should be an ampdoctor.Trace or a path, but given {type(trace_or_path)}")
