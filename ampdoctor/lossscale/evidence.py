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

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import formats
from ..trace import Trace, load
from ..trace.schema import ROOT
from .scaler import TORCH_DEFAULTS


@dataclass
class Evidence:
    """What the trace says about each step (arrays indexed like ``trace.steps()``), prepared once per trace."""

    steps: np.ndarray
    rec_scale: np.ndarray  # scale in force (NaN: no scaler recorded)
    rec_next: np.ndarray  # scale after update
    rec_over: np.ndarray  # overflowed at the recorded scale (skipped; without a scaler: non-finite grads)
    always: np.ndarray  # non-finite forward or loss: overflows at every scale
    threshold: np.ndarray  # estimated largest scale that does not overflow
    from_neighbours: np.ndarray  # threshold of an overflowed step (estimate from neighbouring steps)
    hist: dict  # step index -> (log2 lower edge of each unscaled binade, counts)
    run_settings: dict
    has_scaler: bool
    assumed_fp16: bool
    device: str


def _compute_dtypes(grads, acts) -> list[str]:
    """The dtype each gradient site is computed in: a grad_out its own; a param_grad its module's compute dtype (the
    module's act site), whatever the dtype of the .grad it lands in (an FP16 matmul's weight gradient is FP16)."""
    act_dtype = dict(zip(acts["path"], acts["dtype"]))
    out = []
    for kind, module, dtype in zip(grads["kind"], grads["module"], grads["dtype"]):
        d = act_dtype.get(module, dtype) if kind == "param_grad" else dtype
        out.append(str(d or "float32").replace("torch.", ""))
    return out


@dataclass(eq=False)
class GradientPeaks:
    """The one definition of "the largest unscaled gradient" (rules and replay alike).

    Per step, over every observed gradient (grad_out divided by the loss scale it carried, param_grad as stored):
    the largest magnitude relative to the max of the format it is computed in. The gradient of a loss with respect
    to itself (a model that returns its loss: the output gradient of a 0-d output) is the backward seed, 1 x scale,
    not a gradient the model computed; it counts only where it really was FP16 (an FP16 loss overflows when scaled).
    """

    ratio: np.ndarray  # per step: max |unscaled gradient| / format max (NaN: nothing observed)
    nonfinite: np.ndarray  # per step: some observed gradient held Inf/NaN
    assumed_fp16: bool  # no gradient was computed in FP16: every one is judged against the FP16 max
    sites: pd.DataFrame  # grad_out then param_grad sites, with their compute dtype and whether a seed

    @property
    def fp16_equivalent(self) -> np.ndarray:
        """Per step, the largest unscaled gradient in FP16 terms: the scale s overflows FP16 when s * this rounds
        past 65504 (> finite_limit, i.e. >= 65520)."""
        return self.ratio * formats.FP16.finite_limit


def _is_seed(kind: str, shape) -> bool:
    """The output gradient of a 0-d output: the backward pass's seed (a returned loss), not a model gradient."""
    return kind == "grad_out" and shape is not None and str(shape) == ""


def gradient_peaks(tr: Trace) -> GradientPeaks:
    st = tr.steps()
    n = len(st)
    sc = tr.config.get("scaler") or {}
    has_scaler = bool(sc.get("enabled")) and bool(st["loss_scale"].notna().any())
    rec_scale = st["loss_scale"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    carried = np.where(np.isnan(rec_scale), 1.0, rec_scale)  # the scale the grad_out values carry
    go, pg = tr.sites("grad_out"), tr.sites("param_grad")
    grads = pd.concat([go, pg], ignore_index=True)
    dtypes = _compute_dtypes(grads, tr.sites("act"))
    seed = np.array([_is_seed(k, sh) for k, sh in zip(grads["kind"], grads["shape"])], dtype=bool)
    fp16 = np.array([d in ("float16", "half") for d in dtypes], dtype=bool)
    assumed = bool((~seed).any()) and not fp16[~seed].any()  # an FP32/BF16 run: judged as if computed in FP16
    if assumed:
        fp16 |= ~seed
    limits = np.array(
        [
            formats.FP16.finite_limit if f else formats.DTYPE_FORMATS.get(d, formats.FP32).finite_limit
            for f, d in zip(fp16, dtypes)
        ],
        dtype=float,
    )
    # peaks with fill=-1: -1 = site not seen that step, NaN = the tensor held a NaN, inf = an inf
    raw = np.concatenate(
        [tr.records("peak", "grad_out", fill=-1.0), tr.records("peak", "param_grad", fill=-1.0)], axis=1
    )
    finite = np.isfinite(raw) & (raw >= 0)
    unscaled = np.where(finite, raw, 0.0)
    unscaled[:, : len(go)] /= carried[:, None]
    ratio = (unscaled / limits[None, :]).max(axis=1, initial=0.0)  # max over sites of magnitude / format max
    ratio[~finite.any(axis=1)] = np.nan  # nothing observed: no information
    nonfinite = (~np.isfinite(raw)).any(axis=1)
    # The sentinel's largest unscaled parameter gradient, recorded on every step (steps that observe no site
    # included): the weight gradients are computed in their module's dtype, so it counts against that format's max.
    if "grad_max" in st:
        gmax = st["grad_max"].to_numpy(float)
        on_pg = fp16[len(go) :]
        pg_limit = (
            formats.FP16.finite_limit if (on_pg.any() if len(on_pg) else fp16.any()) else formats.FP32.finite_limit
        )
        with np.errstate(invalid="ignore"):
            ratio = np.fmax(ratio, np.where(np.isfinite(gmax) & (gmax >= 0), gmax / pg_limit, np.nan))
        nonfinite |= np.isinf(gmax)  # (NaN there is also what a trace without the column reads)
    grads = grads.assign(compute_dtype=dtypes, fp16=fp16, seed=seed)
    return GradientPeaks(ratio=ratio, nonfinite=nonfinite, assumed_fp16=assumed, sites=grads)


def gather(tr: Trace) -> Evidence:
    """The evidence of every step of a trace (a trace without steps is a ValueError)."""
    st = tr.steps()
    n = len(st)
    if not n:
        raise ValueError(f"{tr.path}: the trace has no steps yet")
    cfg = tr.config
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
    peaks = gradient_peaks(tr)
    grads = peaks.sites
    fp16 = grads["fp16"].to_numpy(bool) & ~grads["seed"].to_numpy(bool)
    ratio = peaks.ratio.copy()
    loss = st["loss"].to_numpy(float)
    if str(cfg.get("loss_dtype") or "").replace("torch.", "") == "float16":  # an FP16 loss is scaled in FP16
        ratio = np.fmax(ratio, np.abs(loss) / formats.FP16.finite_limit)

    # a non-finite forward (or loss) makes the step overflow whatever the scale
    act = tr.records("peak", "act", fill=-1.0)
    always = (~np.isfinite(act)).any(axis=1) | np.isinf(loss)
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
        hist=_histograms(tr, grads, fp16, int((grads["kind"] == "grad_out").sum()), n),
        run_settings=run,
        has_scaler=has_scaler,
        assumed_fp16=peaks.assumed_fp16,
        device=str(tr.meta.get("run", {}).get("device") or "cuda"),
    )


def _thresholds(scale, over, always, ratio) -> tuple[np.ndarray, np.ndarray]:
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
    threshold = np.empty(n)
    from_nb = np.zeros(n, bool)
    floor = np.nanmin(np.where(over & ~always, scale, np.nan)) if (over & ~always).any() else np.nan
    for t in range(n):
        if always[t]:
            threshold[t] = 0.0
        elif not over[t]:
            if np.isnan(own[t]):  # nothing recorded this step: borrow the neighbours' magnitude
                r = nb_ratio[t]
                threshold[t] = max(scale[t], 1.0 / r if r > 0 else math.inf) if not np.isnan(r) else math.inf
                from_nb[t] = True
            else:
                threshold[t] = max(own[t], scale[t])
        else:
            r = np.fmax(nb_ratio[t], ratio[t])  # its own finite sites are a lower bound on its magnitude
            est = (1.0 / r if r > 0 else math.inf) if not np.isnan(r) else floor
            threshold[t] = min(est, scale[t]) if not np.isnan(est) else scale[t]
            from_nb[t] = True
    return threshold, from_nb


def _histograms(tr: Trace, grads, fp16, n_go: int, n: int) -> dict:
    """Step index -> (log2 of the lower edge of each unscaled binade, counts), over the gradient sites computed in
    FP16. Container modules are left out: their grad_out is their last child's."""
    paths = list(grads["path"])
    go_paths = set(paths[:n_go])
    scale = {"grad_out": tr.records("scale", "grad_out"), "param_grad": tr.records("scale", "param_grad")}
    col = {
        "grad_out": {sid: j for j, sid in enumerate(grads["id"][:n_go])},
        "param_grad": {sid: j for j, sid in enumerate(grads["id"][n_go:])},
    }
    binades = np.arange(255, dtype=float) - 127.0
    edges: dict[int, list] = {}
    counts: dict[int, list] = {}
    for i, site in enumerate(grads.itertuples()):
        if not fp16[i]:
            continue
        if site.kind == "grad_out" and _is_container(site.path, go_paths):
            continue
        steps, hist = tr.hist(int(site.id))
        for s, row in zip(steps, hist):
            if s >= n or not row.any():
                continue
            carried = scale[site.kind][s, col[site.kind][int(site.id)]]
            carried = 1.0 if not np.isfinite(carried) or carried <= 0 else carried
            nz = np.flatnonzero(row)
            edges.setdefault(int(s), []).append(binades[nz] - math.log2(carried))
            counts.setdefault(int(s), []).append(row[nz].astype(float))
    return {s: (np.concatenate(edges[s]), np.concatenate(counts[s])) for s in edges}


def _is_container(path: str, paths: set) -> bool:
    if path == ROOT:
        return len(paths) > 1
    prefix = path + "."
    return any(p.startswith(prefix) for p in paths)


def open_trace(trace_or_path) -> Trace:
    """A Trace as given, or the one a path names."""
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, (str, os.PathLike)):
        return load(trace_or_path)
    raise TypeError(f"Argument trace_or_path should be an ampdoctor.Trace or a path, but given {type(trace_or_path)}")
