"""Loss-scale replay: simulate PyTorch's dynamic loss scaler (GradScaler) over the gradients a trace recorded.

Offline side: reads a trace, never imports torch.

The scaler (``torch._amp_update_scale_``): on a step with an inf/NaN gradient the scale is multiplied by
``backoff_factor`` and the growth tracker resets; otherwise the tracker counts up and, on reaching
``growth_interval``, the scale is multiplied by ``growth_factor`` (unless that would make the FP32 scale infinite)
and the tracker resets. The scale is an FP32 tensor: products are taken in double and rounded to FP32, as torch does.

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

Underflow. From the exponent histograms (recorded every ``hist_every`` steps) of the gradients computed in FP16:
the share of the non-zero elements that a cast to FP16 would round below the smallest normal (2^-14: subnormal,
precision lost) and to zero (|x| <= 2^-25, half the smallest subnormal 2^-24: values between 2^-25 and 2^-24 round
up to 2^-24 and are not lost) at the simulated scale. One bin per binade resolves the flush threshold (a binade
edge) up to exact ties and counts the binade below 2^-14 wholly as subnormal (docs/trace-format.md, hists).
Elements already zero at the recorded scale are not counted (a flushed gradient cannot be told from an exact zero).
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import formats
from .trace import Trace, load
from .trace.schema import ROOT

# torch.amp.GradScaler defaults: what a run without a recorded scaler is replayed with
TORCH_DEFAULTS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
_LOG2_NORMAL = formats.FP16.normal_exp          # -14: below this an FP16 value is subnormal (but a 2^-11 sliver)
_LOG2_FLUSH = math.log2(formats.FP16.flush_at)  # -25: at or below this it rounds to zero (binade -25 rounds up)

# --suggest search space. Powers of two only: a power-of-two scale multiplies and divides gradients exactly, which is
# also why the factors stay at the run's (2 / 0.5 by default) rather than being searched.
SUGGEST_INIT_EXPONENTS = range(0, 25)           # 1 .. 2^24 (MindSpore's default init is 2^24)
SUGGEST_INTERVALS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass(eq=False)
class Replay:
    """Per-step result of simulating a dynamic loss scaler over a trace (arrays indexed like ``trace.steps()``)."""

    settings: dict                 # init_scale, growth_factor, backoff_factor, growth_interval
    steps: np.ndarray              # step numbers
    scales: np.ndarray             # scale in force at each step (as trace.steps()["loss_scale"])
    skipped: np.ndarray            # bool: the step overflowed and the optimizer step was skipped
    underflow: np.ndarray          # share of non-zero FP16 gradient elements below 2^-14; NaN without a histogram
    flushed: np.ndarray            # share rounded to zero (<= 2^-25); NaN without a histogram
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


@dataclass(eq=False)
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

    ratio: np.ndarray              # per step: max |unscaled gradient| / format max (NaN: nothing observed)
    nonfinite: np.ndarray          # per step: some observed gradient held Inf/NaN
    assumed_fp16: bool             # no gradient was computed in FP16: every one is judged against the FP16 max
    sites: pd.DataFrame            # grad_out then param_grad sites, with their compute dtype and whether a seed

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
    carried = np.where(np.isnan(rec_scale), 1.0, rec_scale)          # the scale the grad_out values carry
    go, pg = tr.sites("grad_out"), tr.sites("param_grad")
    grads = pd.concat([go, pg], ignore_index=True)
    dtypes = _compute_dtypes(grads, tr.sites("act"))
    seed = np.array([_is_seed(k, sh) for k, sh in zip(grads["kind"], grads["shape"])], dtype=bool)
    fp16 = np.array([d in ("float16", "half") for d in dtypes], dtype=bool)
    assumed = bool((~seed).any()) and not fp16[~seed].any()    # an FP32/BF16 run: judged as if computed in FP16
    if assumed:
        fp16 |= ~seed
    limits = np.array([formats.FP16.finite_limit if f else formats.DTYPE_FORMATS.get(d, formats.FP32).finite_limit
                       for f, d in zip(fp16, dtypes)], dtype=float)
    # peaks with fill=-1: -1 = site not seen that step, NaN = the tensor held a NaN, inf = an inf
    raw = np.concatenate([tr.records("peak", "grad_out", fill=-1.0), tr.records("peak", "param_grad", fill=-1.0)],
                         axis=1)
    finite = np.isfinite(raw) & (raw >= 0)
    unscaled = np.where(finite, raw, 0.0)
    unscaled[:, :len(go)] /= carried[:, None]
    ratio = (unscaled / limits[None, :]).max(axis=1, initial=0.0)     # max over sites of magnitude / format max
    ratio[~finite.any(axis=1)] = np.nan                               # nothing observed: no information
    nonfinite = (~np.isfinite(raw)).any(axis=1)
    # The sentinel's largest unscaled parameter gradient, recorded on every step (steps that observe no site
    # included): the weight gradients are computed in their module's dtype, so it counts against that format's max.
    if "grad_max" in st:
        gmax = st["grad_max"].to_numpy(float)
        on_pg = fp16[len(go):]
        pg_limit = formats.FP16.finite_limit if (on_pg.any() if len(on_pg) else fp16.any()) \
            else formats.FP32.finite_limit
        with np.errstate(invalid="ignore"):
            ratio = np.fmax(ratio, np.where(np.isfinite(gmax) & (gmax >= 0), gmax / pg_limit, np.nan))
        nonfinite |= np.isinf(gmax)                  # (NaN there is also what a trace without the column reads)
    grads = grads.assign(compute_dtype=dtypes, fp16=fp16, seed=seed)
    return GradientPeaks(ratio=ratio, nonfinite=nonfinite, assumed_fp16=assumed, sites=grads)


def _gather(tr: Trace) -> _Evidence:
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
        run["init_scale"] = float(st["loss_scale"].dropna().iloc[0])   # the scale in force when the trace began

    rec_scale = st["loss_scale"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    rec_next = st["loss_scale_next"].to_numpy(float) if has_scaler else np.full(n, np.nan)
    peaks = gradient_peaks(tr)
    grads = peaks.sites
    fp16 = grads["fp16"].to_numpy(bool) & ~grads["seed"].to_numpy(bool)
    ratio = peaks.ratio.copy()
    loss = st["loss"].to_numpy(float)
    if str(cfg.get("loss_dtype") or "").replace("torch.", "") == "float16":   # an FP16 loss is scaled in FP16
        ratio = np.fmax(ratio, np.abs(loss) / formats.FP16.finite_limit)

    # a non-finite forward (or loss) makes the step overflow whatever the scale
    act = tr.records("peak", "act", fill=-1.0)
    always = (~np.isfinite(act)).any(axis=1) | np.isinf(loss)
    if np.isfinite(loss).any():                       # the loss is logged in this run: NaN means a NaN loss
        always |= np.isnan(loss)
    if has_scaler:
        rec_over = st["skipped"].to_numpy(bool)
        always &= rec_over            # a non-finite value that did not make the recorded step overflow never mattered
        assumed_scale = rec_scale
    else:                                             # no scaler: a non-finite gradient at scale 1 is an overflow
        rec_over = peaks.nonfinite | always
        assumed_scale = np.ones(n)
    threshold, from_nb = _thresholds(assumed_scale, rec_over, always, ratio)
    return _Evidence(steps=st["step"].to_numpy(int), rec_scale=rec_scale, rec_next=rec_next, rec_over=rec_over,
                     always=always, threshold=threshold, from_neighbours=from_nb,
                     hist=_histograms(tr, grads, fp16, int((grads["kind"] == "grad_out").sum()), n),
                     run_settings=run, has_scaler=has_scaler, assumed_fp16=peaks.assumed_fp16, device=str(tr.meta.get("run", {}).get("device") or "cuda"))


def _thresholds(scale, over, always, ratio) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the largest scale that does not overflow (the step overflows at S > threshold).

    Finite step: max / its largest unscaled magnitude, and at least the scale it survived. Overflowed step: the larger
    magnitude of the nearest finite steps before and after (a skipped step does not change the weights), capped at
    the scale it overflowed at; with no finite step at all, the smallest scale any step overflowed at.
    """
    n = len(scale)
    with np.errstate(divide="ignore"):
        own = np.where(np.isnan(ratio), np.nan, 1.0 / ratio)      # ratio 0 -> inf: never overflows
    ok = ~over & ~np.isnan(own)
    idx = np.arange(n)
    prev = np.where(ok, idx, -1)
    prev = np.maximum.accumulate(prev)
    nxt = np.where(ok, idx, n)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1]
    before = np.concatenate(([-1], prev[:-1]))          # nearest finite step strictly before each step
    after = np.concatenate((nxt[1:], [n]))              # and strictly after
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
            if np.isnan(own[t]):           # nothing recorded this step: borrow the neighbours' magnitude
                r = nb_ratio[t]
                threshold[t] = max(scale[t], 1.0 / r if r > 0 else math.inf) if not np.isnan(r) else math.inf
                from_nb[t] = True
            else:
                threshold[t] = max(own[t], scale[t])
        else:
            r = np.fmax(nb_ratio[t], ratio[t])   # its own finite sites are a lower bound on its magnitude
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
    col = {"grad_out": {sid: j for j, sid in enumerate(grads["id"][:n_go])},
           "param_grad": {sid: j for j, sid in enumerate(grads["id"][n_go:])}}
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


def _shares(hist: tuple, scale: float) -> tuple[float, float]:
    """(share below 2^-14, share rounded to zero) of the elements at ``scale``: whole binades below 2^-14 and at or
    below 2^-25 (edges of binades at power-of-two scales); at other scales a binade straddling a limit counts the
    fraction below it, values taken as log-uniform inside it."""
    lo, c = hist
    total = c.sum()
    if total <= 0 or scale <= 0:
        return (math.nan, math.nan) if total <= 0 else (1.0, 1.0)
    lo = lo + math.log2(scale)
    return (float((c * np.clip(_LOG2_NORMAL - lo, 0.0, 1.0)).sum() / total),
            float((c * np.clip(_LOG2_FLUSH - lo, 0.0, 1.0)).sum() / total))


# -- the simulation ------------------------------------------------------------------------------------------------
def _f32(x: float) -> float:
    """Round to FP32, as the scale tensor stores it (beyond the FP32 max: inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _check_settings(s: dict) -> None:
    real = (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool))
    if not (real(s["init_scale"]) and math.isfinite(s["init_scale"]) and s["init_scale"] > 0):
        raise ValueError(f"Argument init_scale should be a positive finite number, but given {s['init_scale']!r}")
    if not (real(s["growth_factor"]) and s["growth_factor"] > 1.0
            and math.isfinite(s["growth_factor"])):
        raise ValueError(f"Argument growth_factor should be a number > 1.0, but given {s['growth_factor']!r}")
    if not (real(s["backoff_factor"]) and 0.0 < s["backoff_factor"] < 1.0):
        raise ValueError(f"Argument backoff_factor should be a number in (0, 1), but given {s['backoff_factor']!r}")
    gi = s["growth_interval"]
    if not isinstance(gi, numbers.Integral) or isinstance(gi, bool) or gi < 1:
        raise ValueError(f"Argument growth_interval should be a positive int, but given {gi!r}")


def _initial_tracker(ev: _Evidence) -> int:
    """Consecutive unskipped steps the scaler had counted when the trace began (0 for a fresh GradScaler): read off
    the first growth when it comes before any skip."""
    if not ev.has_scaler:
        return 0
    gi = ev.run_settings["growth_interval"]
    for t in range(len(ev.steps)):
        if ev.rec_over[t]:
            return 0
        if ev.rec_next[t] > ev.rec_scale[t]:
            return max(gi - (t + 1), 0)
    return 0


def _simulate(ev: _Evidence, settings: dict, tracker: int = 0) -> Replay:
    n = len(ev.steps)
    scale = _f32(settings["init_scale"])
    growth, backoff, interval = settings["growth_factor"], settings["backoff_factor"], settings["growth_interval"]
    scales = np.empty(n)
    skipped = np.zeros(n, bool)
    estimated = np.zeros(n, bool)
    under = np.full(n, np.nan)
    flushed = np.full(n, np.nan)
    rec, over, always, thr, nb = ev.rec_scale, ev.rec_over, ev.always, ev.threshold, ev.from_neighbours
    for t in range(n):
        scales[t] = scale
        if scale == rec[t]:
            skip = bool(over[t])                         # the recorded outcome at the recorded scale
        elif always[t]:
            skip = True                                  # non-finite forward or loss: no scale helps
        elif ev.has_scaler and over[t] and scale > rec[t]:
            skip = True                                  # overflow is monotone in the scale
        elif ev.has_scaler and not over[t] and scale < rec[t]:
            skip = False
        else:
            skip = scale > thr[t]
            estimated[t] = bool(nb[t])
        skipped[t] = skip
        if t in ev.hist:
            under[t], flushed[t] = _shares(ev.hist[t], scale)
        if skip:
            scale = _f32(scale * backoff)
            tracker = 0
        else:
            tracker += 1
            if tracker >= interval:
                grown = _f32(scale * growth)
                if math.isfinite(grown):                 # torch never grows the scale to inf
                    scale = grown
                tracker = 0
    return Replay(settings=dict(settings), steps=ev.steps.copy(), scales=scales, skipped=skipped, underflow=under,
                  flushed=flushed, estimated=estimated, final_scale=scale, assumed_fp16=ev.assumed_fp16)


def _settings(ev: _Evidence, init_scale, growth_factor, backoff_factor, growth_interval) -> dict:
    s = dict(ev.run_settings)
    for key, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                       ("backoff_factor", backoff_factor), ("growth_interval", growth_interval)):
        if value is not None:
            s[key] = value
    _check_settings(s)
    s["init_scale"] = float(s["init_scale"])
    s["growth_factor"], s["backoff_factor"] = float(s["growth_factor"]), float(s["backoff_factor"])
    s["growth_interval"] = int(s["growth_interval"])
    return s


def _open(trace_or_path) -> Trace:
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, (str, os.PathLike)):
        return load(trace_or_path)
    raise TypeError(f"Argument trace_or_path should be an ampdoctor.Trace or a path, but given {type(trace_or_path)}")


def replay(trace_or_path, init_scale=None, growth_factor=None, backoff_factor=None, growth_interval=None) -> Replay:
    """Simulate GradScaler over a recorded trace; arguments left at None keep the run's own settings (torch's
    defaults for a run without a scaler). With no arguments the recorded scale history is reproduced exactly."""
    ev = _gather(_open(trace_or_path))
    s = _settings(ev, init_scale, growth_factor, backoff_factor, growth_interval)
    own = s["init_scale"] == ev.run_settings["init_scale"] and s["growth_interval"] == ev.run_settings["growth_interval"]
    tracker = _initial_tracker(ev) if own else 0
    out = _simulate(ev, s, tracker)
    out.growth_tracker = tracker
    return out


def suggest(trace_or_path, search_factors: bool = False, progress=None) -> Suggestion:
    """Search init_scale (powers of two, 1 .. 2^24) and growth_interval for the settings that lose the least
    gradient information (``Replay.lost``: skipped steps count fully, applied steps by their FP16 underflow share).

    Ties go to the growth_interval nearest the run's own, then to the run's own factors, then to the larger
    init_scale (more underflow headroom);
    when nothing beats the run's own settings, they are the suggestion.
    The factors stay at the run's own unless ``search_factors`` (then growth 2/4 and backoff 0.5/0.25 are tried).
    ``progress`` wraps the list of settings to try (e.g. ``tqdm``) to show the search advancing.
    """
    tr = _open(trace_or_path)
    ev = _gather(tr)
    own = _settings(ev, None, None, None, None)
    baseline = _simulate(ev, own, _initial_tracker(ev))
    n = len(ev.steps)
    longer = [i for i in SUGGEST_INTERVALS if i > n][:1]      # one interval that never grows within the trace
    intervals = sorted({i for i in SUGGEST_INTERVALS if i <= n} | set(longer) | {own["growth_interval"]})
    own_pair = (own["growth_factor"], own["backoff_factor"])
    factors = [own_pair]
    if search_factors:
        factors += sorted({(2.0, 0.5), (4.0, 0.5), (2.0, 0.25), (4.0, 0.25)} - {own_pair})
    best, best_key, tried = None, None, 0
    grid = [(growth, backoff, gi, e) for growth, backoff in factors for gi in intervals
            for e in SUGGEST_INIT_EXPONENTS]
    for growth, backoff, gi, e in (progress(grid) if progress else grid):
        s = {"init_scale": 2.0 ** e, "growth_factor": growth, "backoff_factor": backoff, "growth_interval": gi}
        r = _simulate(ev, s)
        tried += 1
        key = (round(r.lost, 12), abs(math.log2(gi / own["growth_interval"])), (growth, backoff) != own_pair, -e)   # ties: the run's own factors first
        if best_key is None or key < best_key:
            best, best_key = r, key
    if not best.lost < baseline.lost:          # nothing beats the run's own settings: keep them
        best = baseline
    notes = []
    if best.estimated.any():
        notes.append(f"{int(best.estimated.sum())} skip decision(s) estimated from neighbouring steps")
    if ev.assumed_fp16:
        notes.append("the run computed no gradient in FP16: replayed as if it had")
    if not ev.has_scaler:
        notes.append("the run had no GradScaler: compared with torch's defaults")
    return Suggestion(settings=best.settings, replay=best, baseline=baseline, device=ev.device, searched=tried,
                      notes=notes)


def _nanmean(a: np.ndarray) -> float:
    a = a[~np.isnan(a)]
    return float(a.mean()) if len(a) else math.nan
