"""Loss-scaler rules: init-scale-too-high, loss-scale-collapse."""
from __future__ import annotations

import numpy as np

from .. import formats
from . import advice as A
from .engine import finding

# A GradScaler halves its scale once per overflowing step, so a run started at 2^16 whose gradients need 2^13
# skips 3 steps while calibrating; PyTorch's own default skips "a handful". Five or more skips in the
# calibration window means the start value was at least 2^5 = 32x too high.
MIN_EARLY_SKIPS = 5
# Calibration window: the first 100 steps (or the first 10% of a longer run) is where an init_scale shows.
EARLY_STEPS = 100
# Collapse: a scale of 1 or less means scaling does nothing any more (or shrinks gradients into underflow).
COLLAPSE_SCALE = 1.0
# "Halving without recovery": after calibration the scale ended at least 2^4 below its highest value ...
COLLAPSE_HALVINGS = 4
# ... while more than 5% of post-calibration steps were skipped (a healthy run: one per few hundred steps).
MAX_SKIP_SHARE = 0.05


def grad_out_peaks(run):
    """(unscaled max |grad_out| per step [n], clean-step mask): the gradient magnitudes backward carried in FP16."""
    peaks = run.records("peak", "grad_out")
    st = run.steps
    scale = st["loss_scale"].to_numpy(float)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    if peaks.shape[1] == 0:
        return np.full(len(st), np.nan), np.zeros(len(st), bool)
    with np.errstate(all="ignore"):
        per_step = np.nanmax(np.where(np.isnan(peaks), -1.0, peaks), axis=1)
    finite = np.isfinite(per_step) & (per_step >= 0)
    clean = finite & ~st["skipped"].to_numpy(bool)
    return np.where(finite, per_step, np.nan) / scale, clean


def _observed_nonfinite(run) -> np.ndarray:
    """Steps that observed their sites and held a NaN/Inf: the rows where a NaN peak is a value, not the NaN that
    fills a step observed by the sentinel only."""
    st = run.steps
    return st["nonfinite"].to_numpy(bool) & (st["level"].fillna(0).to_numpy(float) >= 0)


def forward_nonfinite_steps(run) -> set:
    """Steps in which a forward output or the loss was non-finite (loss scaling cannot cause or fix these)."""
    ev = run.events
    steps = set(ev.loc[ev["phase"].isin(["fwd", "loss"]), "step"].astype(int))
    acts = run.records("peak", "act")
    if acts.shape[1]:
        steps |= set(np.flatnonzero((~np.isfinite(acts)).any(axis=1) & _observed_nonfinite(run)).tolist())
    loss = run.steps["loss"].to_numpy(float)
    steps |= set(np.flatnonzero(~np.isfinite(loss) & ~np.isnan(loss)).tolist())
    return steps


def init_scale_too_high(run, *, min_skips=MIN_EARLY_SKIPS, early_steps=EARLY_STEPS):
    if not (run.scaler_on and run.fp16):
        return None
    st = run.steps
    window = max(int(early_steps), int(0.1 * len(st)))
    early = st.iloc[:window]
    skipped = early.loc[early["skipped"], "step"].astype(int).tolist()
    if len(skipped) < min_skips:
        return None
    if forward_nonfinite_steps(run) & set(skipped):
        return None                      # the forward pass overflowed: a scale cannot be the cause
    g, clean = grad_out_peaks(run)
    if not clean.any():
        return None
    gmax = float(np.nanmax(g[clean]))
    suggested = A.suggest_scale(gmax)
    if not (gmax > 0) or gmax * A.SCALE_MARGIN > formats.FP16.max:
        return None                      # unscaled gradients do not fit FP16: not a scaling problem
    scales = st.loc[st["step"].isin(skipped), "loss_scale"].to_numpy(float)
    over = [s for s in scales if s * gmax > formats.FP16.max / 2]   # the scale alone pushed the max out of range
    init = float(run.scaler.get("init_scale") or st["loss_scale"].iloc[0])
    if not over or suggested >= init:
        return None
    if float(early["loss_scale_next"].iloc[-1]) >= init:
        return None                      # the scale ended the window no lower than it started: the skips are
                                         # growth/overflow cycles (late-degradation), not a too-high start
    return finding(
        "warning", "Initial loss scale too high",
        f"{len(skipped)} of the first {len(early)} steps were skipped while the loss scale fell from {A.pow2(init)} "
        f"to {A.pow2(float(st['loss_scale_next'].iloc[len(early) - 1]))}; the unscaled gradients peak at "
        f"{A.fmt_num(gmax)}, so any scale above {A.pow2(formats.FP16.max / gmax)} overflows FP16.",
        steps=run.step_range(skipped),
        evidence={"skipped_early": len(skipped), "window": len(early), "skipped_steps": skipped[:20],
                  "init_scale": init, "max_unscaled_grad": gmax, "fp16_max": formats.FP16.max,
                  "scale_at_skips": [float(s) for s in scales[:20]], "suggested_init_scale": suggested},
        recommendation=(f"Start the scaler at {A.pow2(suggested)} (the largest power of two that keeps the largest "
                        f"observed gradient {A.fmt_num(gmax)} a factor {A.SCALE_MARGIN:g} under the FP16 max):\n"
                        + A.scaler_line(run, init_scale=suggested)))


def _origins(run, steps: list[int]) -> dict:
    """Where the non-finite values of these steps came from: counts per origin class and culprit layer."""
    ev = run.events
    ev = ev[ev["step"].isin(steps)]
    acts = run.records("peak", "act")
    act_bad = set(np.flatnonzero((~np.isfinite(acts)).any(axis=1) & _observed_nonfinite(run)).tolist()
                  ) if acts.shape[1] else set()
    out = {"forward": {}, "loss": 0, "input": 0, "gradient": {}, "unknown": 0}
    by_step = {int(s): g for s, g in ev.groupby("step")}
    for s in steps:
        g = by_step.get(int(s))
        fwd = g[g["phase"] == "fwd"] if g is not None else None
        if fwd is not None and len(fwd):
            p = fwd["path"].iloc[0]
            out["forward"][p] = out["forward"].get(p, 0) + 1
        elif g is not None and (g["phase"] == "loss").any():
            out["loss"] += 1
        elif s in act_bad:
            out["input"] += 1            # every module saw a non-finite input: the batch itself
        elif g is not None and len(g):
            p = g["path"].iloc[0]
            out["gradient"][p] = out["gradient"].get(p, 0) + 1
        else:
            out["unknown"] += 1
    return out


def loss_scale_collapse(run, *, collapse_scale=COLLAPSE_SCALE, halvings=COLLAPSE_HALVINGS,
                        max_skip_share=MAX_SKIP_SHARE):
    if not run.scaler_on:
        return None
    st = run.steps
    nxt = st["loss_scale_next"].to_numpy(float)
    cur = st["loss_scale"].to_numpy(float)
    skipped = st["skipped"].to_numpy(bool)
    if not np.isfinite(nxt).any() or not skipped.any():
        return None
    # the lowest scale a backoff produced: a run that simply starts at a low init_scale has not collapsed
    lowest = float(np.nanmin(nxt[skipped])) if np.isfinite(nxt[skipped]).any() else float("inf")
    clean = np.flatnonzero(~skipped)
    after = clean[0] if len(clean) else 0          # calibration ends at the first step that went through
    post = skipped[after:]
    share = float(post.mean()) if len(post) else 0.0
    peak_scale = float(np.nanmax(cur[after:])) if len(post) else float("nan")
    end = float(nxt[-1])
    collapsed = lowest <= collapse_scale
    # Until one step has gone through, the scaler is still calibrating (a high init_scale halves for a dozen
    # steps): a trace read live during those steps is init-scale-too-high's case, not a collapse.
    sliding = len(clean) > 0 and share > max_skip_share and end <= peak_scale / 2.0 ** halvings
    if not (collapsed or sliding):
        return None
    bad = st.loc[skipped, "step"].astype(int).tolist()
    org = _origins(run, bad)
    fwd = sorted(org["forward"].items(), key=lambda kv: -kv[1])
    grad = sorted(org["gradient"].items(), key=lambda kv: -kv[1])
    layers = [p for p, _ in fwd] + [p for p, _ in grad if p not in dict(fwd)]
    if fwd and fwd[0][1] >= max(org["input"], org["loss"], 1):
        cause = f"a forward overflow in {fwd[0][0]} ({fwd[0][1]} of the {len(bad)} skipped steps)"
        fix = ("Fix the forward overflow (see the forward-overflow finding): run that module in FP32 or rescale it, "
               "e.g.\n" + A.keep_fp32_line([fwd[0][0]]))
    elif org["input"] >= max(org["loss"], 1):
        cause = f"non-finite input batches ({org['input']} of the {len(bad)} skipped steps had no finite module output)"
        fix = ("Find and drop the bad samples; guard the loop:\n"
               "if not torch.isfinite(x).all():\n    continue  # skip a corrupt batch instead of training on it")
    elif org["loss"]:
        cause = f"a non-finite loss from finite model outputs ({org['loss']} skipped steps)"
        fix = ("Compute the loss in FP32 and guard its inputs (log of 0, division by 0):\n"
               "loss = loss_fn(out.float(), y)")
    elif grad:
        cause = (f"non-finite gradients first seen at {grad[0][0]} ({grad[0][1]} skipped steps) with finite "
                 "forward values")
        fix = ("These gradients overflow even at a small scale: look for a layer with exploding gradients "
               "(see grad-range-anomaly), clip them, or compute that module in FP32:\n"
               "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)")
    else:
        return None                      # no recorded origin: no evidence to point at
    severity = "critical" if collapsed or share > 0.5 else "warning"
    return finding(
        severity, "Loss scale collapsed",
        f"The loss scale fell to {A.fmt_num(lowest)} with {len(bad)} of {len(st)} steps skipped "
        f"({A.pct(share)} after calibration); the non-finite values come from {cause}.",
        layers=layers, steps=run.step_range(bad),
        evidence={"lowest_scale": lowest, "final_scale": end, "skipped": len(bad), "steps": len(st),
                  "skip_share_after_calibration": share, "origins": {
                      "forward": dict(fwd), "gradient": dict(grad), "input_batch": org["input"],
                      "loss": org["loss"]}},
        recommendation="Lowering the scale does not help; remove the source of the non-finite values. " + fix)
