"""Loss-scale replay: simulate PyTorch's dynamic loss scaler (GradScaler) over the gradients a trace recorded.

Offline side: reads a trace, never imports torch.

The scaler (``torch._amp_update_scale_``): on a step with an inf/NaN gradient the scale is multiplied by
``backoff_factor`` and the growth tracker resets; otherwise the tracker counts up and, on reaching
``growth_interval``, the scale is multiplied by ``growth_factor`` (unless that would make the FP32 scale infinite)
and the tracker resets. The scale is an FP32 tensor: products are taken in double and rounded to FP32, as torch does.

Overflow model. At a scale S a step overflows when some gradient, scaled by S, exceeds the largest value of the
format it is computed in (FP16: 65504). Per step the trace gives the unscaled magnitudes: every grad_out peak divided
by the loss scale it carried, and every param_grad peak (already unscaled). What is *known* is used first:
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

Underflow. From the exponent histograms (recorded every ``hist_every`` steps) of the gradients computed in FP16:
the share of the non-zero elements that would fall below the FP16 smallest normal (2^-14: subnormal, precision lost)
and below the smallest subnormal (2^-24: flushed to zero) at the simulated scale. Elements already zero at the
recorded scale are not counted (a flushed gradient cannot be told from an exact zero).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from . import formats
from .trace import Trace, load
from .trace.schema import ROOT

# torch.amp.GradScaler defaults: what a run without a recorded scaler is replayed with
TORCH_DEFAULTS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
_FP32_MAX = formats.FP32.max
_LOG2_NORMAL = formats.FP16.normal_exp          # -14: below this an FP16 value is subnormal
_LOG2_SUBNORMAL = formats.FP16.subnormal_exp    # -24: below this it rounds to zero

# --suggest search space. Powers of two only: a power-of-two scale multiplies and divides gradients exactly, which is
# also why the factors stay at the run's (2 / 0.5 by default) rather than being searched.
SUGGEST_INIT_EXPONENTS = range(0, 25)           # 1 .. 2^24 (MindSpore's default init is 2^24)
SUGGEST_INTERVALS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class Replay:
    """Per-step result of simulating a dynamic loss scaler over a trace (arrays indexed like ``trace.steps()``)."""

    settings: dict                 # init_scale, growth_factor, backoff_factor, growth_interval
    steps: np.ndarray              # step numbers
    scales: np.ndarray             # scale in force at each step (as trace.steps()["loss_scale"])
    skipped: np.ndarray            # bool: the step overflowed and the optimizer step was skipped
    underflow: np.ndarray          # share of non-zero FP16 gradient elements below 2^-14; NaN without a histogram
    flushed: np.ndarray            # share below 2^-24 (lost to zero); NaN without a histogram
    estimated: np.ndarray          # bool: the skip decision rests on neighbouring steps (see the module docstring)
    final_scale: float             # scale after the last step's update
    assumed_fp16: bool = False     # the run computed no gradient in FP16: every gradient was treated as FP16
    growth_tracker: int = 0        # tracker value the simulation started from

    @property
    def n_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def mean_underflow(self) -> float:
        """Mean underflow share over the steps with a histogram whose update was applied (NaN if none)."""
        return _nanmean(self.underflow[~self.skipped])

    @property
    def mean_flushed(self) -> float:
        return _nanmean(self.flushed[~self.skipped])

    @property
    def lost(self) -> float:
        """Share of gradient information lost: a skipped step loses all of it, an applied step its underflow share.

        The --suggest objective: (skipped + sum over applied steps of underflow) / steps, the mean underflow standing
        in for applied steps without a histogram.
        """
        n = len(self.steps)
        if not n:
            return math.nan
        u = self.mean_underflow
        u = 0.0 if math.isnan(u) else u
        return (self.n_skipped + (n - self.n_skipped) * u) / n

    def summary(self) -> dict:
        return {"steps": len(self.steps), "skipped": self.n_skipped,
                "skipped_share": self.n_skipped / len(self.steps) if len(self.steps) else math.nan,
                "min_scale": float(np.min(self.scales)) if len(self.scales) else math.nan,
                "max_scale": float(np.max(self.scales)) if len(self.scales) else math.nan,
                "final_scale": self.final_scale, "mean_underflow": self.mean_underflow,
                "mean_flushed": self.mean_flushed, "lost": self.lost, "estimated": int(self.estimated.sum())}


@dataclass
class Suggestion:
    """Best scaler settings found by ``suggest`` and the replays behind them."""

    settings: dict
    replay: Replay
    baseline: Replay               # the run's own settings
    device: str = "cuda"
    searched: int = 0              # settings tried
    notes: list = field(default_factory=list)

    @property
    def improves(self) -> bool:
        return self.replay.lost < self.baseline.lost

    @property
    def code(self) -> str:
        """The GradScaler line to paste (arguments left at torch's defaults are omitted, init_scale always shown)."""
        return gradscaler_code(self.settings, self.device)


def gradscaler_code(settings: dict, device: str = "cuda") -> str:
    args = [f'"{device}"', f"init_scale={float(settings['init_scale'])!r}"]
    for key in ("growth_factor", "backoff_factor", "growth_interval"):
        if settings[key] != TORCH_DEFAULTS[key]:
            args.append(f"{key}={settings[key]!r}")
    return f"torch.amp.GradScaler({', '.join(args)})"


# -- evidence: what the trace says about each step, prepared once per trace -----------------------------------------
@dataclass
class _Evidence:
    steps: np.ndarray
    rec_scale: np.ndarray          # scale in force (NaN: no scaler recorded)
    rec_next: np.ndarray           # scale after update
    rec_over: np.ndarray           # overflowed at the recorded scale (skipped; without a scaler: non-finite grads)
    always: np.ndarray             # non-finite forward or loss: overflows at every scale
    threshold: np.ndarray          # estimated largest scale that does not overflow
    from_neighbours: np.ndarray    # threshold of an overflowed step (estimate from neighbouring steps)
    hist: dict                     # step index -> (log2 lower edge of each unscaled binade, counts)
    run_settings: dict
    has_scaler: bool
    assumed_fp16: bool
    device: str


def _site_limits(tr: Trace, grads, acts) -> tuple[np.ndarray, bool]:
    """Largest value of the format each gradient site is computed in; a param_grad is computed in its module's
    compute dtype (its act site), whatever the dtype of the .grad it lands in."""
    act_dtype = dict(zip(acts["path"], acts["dtype"]))
    dtypes = []
    for site in grads.itertuples():
        d = site.dtype
        if site.kind == "param_grad":
            d = act_dtype.get(site.module, d)
        dtypes.append(str(d or "float32").replace("torch.", ""))
    fp16 = np.array([d in ("float16", "half") for d in dtypes], dtype=bool)
    if not fp16.any():                       # an FP32/BF16 run: replay it as if its gradients were FP16
        return np.full(len(dtypes), formats.FP16.max), np.ones(len(dtypes), bool), True
    limits = np.array([formats.DTYPE_FORMATS.get(d, formats.FP32).max for d in dtypes])
    return limits, fp16, False


def _gather(tr: Trace) -> _Evidence:
    st = tr.steps()
    n = len(st)
    if not n:
        raise ValueError(f"{tr.path}: the trace has no steps yet")
    cfg = tr.config
    sc = cfg.get("scaler") or {}
    has_scaler = bool(sc.get("enabled")) and st["loss_scale"].notna().any()
    run = dict(TORCH_DEFAULTS)
    if has_scaler:
        for key in run:
            if sc.get(key) is not None:
                run[key] = type(run[key])(sc[key])
        run["init_scale"] = float(st["loss_scale"].dropna().iloc[0])   # the scale in force when the trace began

    rec_scale = st["loss_scale"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    rec_next = st["loss_scale_next"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    carried = np.where(np.isnan(rec_scale), 1.0, rec_scale)        # the scale grad_out values carry

    go, pg, acts = tr.sites("grad_out"), tr.sites("param_grad"), tr.sites("act")
    grads = go.assign(kind="grad_out")._append(pg.assign(kind="param_grad")) if hasattr(go, "_append") else \
        __import__("pandas").concat([go, pg], ignore_index=True)
    grads = grads.reset_index(drop=True)
    limits, fp16, assumed = _site_limits(tr, grads, acts)
    peaks = np.concatenate([tr.records("peak", "grad_out") / carried[:, None],
                            tr.records("peak", "param_grad")], axis=1)             # unscaled magnitudes
    if peaks.shape[1]:
        finite = np.isfinite(peaks)
        ratio = np.where(finite, peaks, 0.0) / limits[None, :]                      # magnitude / format max
        ratio = np.where(finite.any(axis=1), ratio.max(axis=1), np.nan)
        grad_nonfinite = (~finite & ~np.isnan(peaks)).any(axis=1) | (np.isnan(peaks) & _observed(tr, peaks)).any(axis=1)
    else:
        ratio, grad_nonfinite = np.full(n, np.nan), np.zeros(n, bool)
    loss = st["loss"].to_numpy(float)
    if str(cfg.get("loss_dtype") or "").replace("torch.", "") == "float16":    # an FP16 loss is scaled in FP16
        ratio = np.fmax(ratio, np.abs(loss) / formats.FP16.max)

    act = tr.records("peak", "act")
    always = (act.shape[1] > 0 and True) and _nonfinite_observed(tr, act) | ~np.isfinite(np.where(np.isnan(loss), 0, loss))
    if not act.shape[1]:
        always = ~np.isfinite(np.where(np.isnan(loss), 0, loss))
    rec_over = st["skipped"].to_numpy(bool) if has_scaler else grad_nonfinite
    rec_over = rec_over | always if not has_scaler else rec_over

    threshold, from_nb = _thresholds(rec_scale if has_scaler else np.ones(n), rec_over, always, ratio)
    return _Evidence(steps=st["step"].to_numpy(int), rec_scale=rec_scale, rec_next=rec_next, rec_over=rec_over,
                     always=always, threshold=threshold, from_neighbours=from_nb,
                     hist=_histograms(tr, grads, fp16, n), run_settings=run, has_scaler=has_scaler,
                     assumed_fp16=assumed, device=str(tr.meta.get("run", {}).get("device") or "cuda"))
