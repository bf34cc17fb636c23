"""late-degradation: the loss trend breaks late in training and a loss-scaler dynamic explains it (the scale stuck
while the gradients shrink into FP16 underflow, or repeated overflow/skip cycles)."""

from __future__ import annotations

import math

import numpy as np

from .. import formats
from ..lossscale import TORCH_DEFAULTS
from ..trace.reduce import theil_sen
from . import advice as A
from .fix import code, text
from .result import Diagnosis, Evidence, finding
from .runview import FloatArray, IntArray, RunView
from .scaling import MAX_SKIP_SHARE, forward_nonfinite_steps, grad_out_peaks

FP16 = formats.FP16
# "Late" is the second half of the run, "earlier" the first half: two segments long enough for a Theil-Sen slope
# each, and a break in the second half is what "late in training" means for a run of any length.
LATE_SHARE = 0.5
# Below 30 steps per segment a Theil-Sen confidence interval spans most plausible slopes: no verdict.
MIN_STEPS = 60
# Slopes are compared by their 95% Theil-Sen confidence intervals: two trends differ when the intervals are
# disjoint, a trend is non-zero when its interval excludes 0.
CONFIDENCE = 0.95
# Material degradation: over the late segment the run falls a further 25% behind the reference (or, without one,
# its own loss rises 25%). Seed-matched small runs differ by a few percent; 25% is a result a user would notice.
MIN_WORSENING = math.log(1.25)
# The unscaled gradients must fall at least one binade over the run for "gradients shrink" to explain anything.
MIN_DECLINE = 1.0
# The bulk of a gradient tensor sits 2-6 binades under its largest element (max/RMS is 2^1.7-2^2.4 for Gaussian
# tensors of 10^3-10^6 elements, up to 2^6 for heavy-tailed ones): with the largest scaled gradient fewer than 6
# binades above FP16's smallest normal (2^-14), the bulk is subnormal or flushed to zero.
MIN_HEADROOM = 6.0
# The scale has to double at least as fast as the gradients halve; twice as fast leaves room for the doubling that
# overflows (and halves it again) at the top.
GROWTH_MARGIN = 2.0
# Each growth attempt at the overflow limit costs one skipped step: an interval of 50 keeps that under 2%.
MIN_GROWTH_INTERVAL = 50
# Cycles explain a *late* break only when they are a late phenomenon: at least twice the earlier skip rate.
LATE_SKIP_FACTOR = 2.0
# A healthy scaler skips once every few hundred steps (DESIGN: numbers that matter); the skip-cycle fix aims there.
TARGET_SKIP_SHARE = 1 / 500


def _trend(y: FloatArray, x: IntArray) -> tuple[float, float, float]:
    """(slope, low, high): Theil-Sen slope of y over x (sorted) with its confidence interval; past 2,048 points,
    over the medians of 2,048 runs of consecutive points (reduce.theil_sen)."""
    return theil_sen(y, x, alpha=CONFIDENCE)


def _log_loss(run: RunView) -> tuple[IntArray, FloatArray]:
    st = run.steps
    loss = st["loss"].to_numpy(float)
    ok = np.isfinite(loss) & (loss > 0)
    return st["step"].to_numpy(int)[ok], np.log(loss[ok])


def trend_break(run: RunView, late_share: float = LATE_SHARE, min_worsening: float = MIN_WORSENING) -> Evidence | None:
    """The late loss trend is worse than the earlier one *and* the run degrades over the late segment: it falls
    further behind the reference run (log-loss gap rising) or, without a reference, its own loss rises."""
    steps, y = _log_loss(run)
    if len(y) < MIN_STEPS:
        return None
    cut = round(len(y) * (1.0 - late_share))
    early, late = _trend(y[:cut], steps[:cut]), _trend(y[cut:], steps[cut:])
    if not late[1] > early[2]:
        return None  # the late trend is not worse than the earlier one
    span = float(steps[-1] - steps[cut])
    out: Evidence = {
        "break_step": int(steps[cut]),
        "early_slope": early[0],
        "late_slope": late[0],
        "early_ci": [early[1], early[2]],
        "late_ci": [late[1], late[2]],
    }
    if run.reference is not None:
        rs, ry = _log_loss(run.reference)
        common, ia, ib = np.intersect1d(steps, rs, return_indices=True)
        late_rows = common >= steps[cut]
        if late_rows.sum() < MIN_STEPS * late_share:
            return None
        gap = y[ia] - ry[ib]
        g = _trend(gap[late_rows], common[late_rows])
        worsening = g[0] * span
        if not (g[1] > 0 and worsening >= min_worsening):
            return None  # not falling further behind the reference
        out.update(
            against="reference",
            gap_slope=g[0],
            gap_ci=[g[1], g[2]],
            gap_start=float(np.median(gap[late_rows][:10])),
            gap_end=float(np.median(gap[late_rows][-10:])),
        )
    else:
        worsening = late[0] * span
        if not (late[1] > 0 and worsening >= min_worsening):
            return None  # without a reference only a rising loss is degradation
        out["against"] = "own loss"
    out["worsening_factor"] = math.exp(worsening)
    return out


def stuck_scale(
    run: RunView, cut_step: int, min_decline: float = MIN_DECLINE, min_headroom: float = MIN_HEADROOM
) -> Evidence | None:
    """Dynamic (a): the scale did not grow over the late segment while the unscaled gradients fell into the FP16
    underflow range. Returns the evidence and the growth interval that keeps up with the decline, or None."""
    st = run.steps
    late = st["step"].to_numpy(int) >= cut_step
    cur, nxt = st["loss_scale"].to_numpy(float), st["loss_scale_next"].to_numpy(float)
    if (nxt[late] > cur[late]).any() or st["skipped"].to_numpy(bool)[late].mean() > MAX_SKIP_SHARE:
        return None  # the scale grew (or cycles): not stuck
    g, clean = grad_out_peaks(run)
    ok = clean & np.isfinite(g) & (g > 0)
    if ok.sum() < MIN_STEPS // 2 or not (ok & late).any():
        return None
    steps = st["step"].to_numpy(int)
    rate = _trend(np.log2(g[ok]), steps[ok])  # binades per step
    source = "this run"
    ref = run.reference
    if ref is not None:  # the reference's gradients are not floored by underflow
        rg, rclean = grad_out_peaks(ref)
        rok = rclean & np.isfinite(rg) & (rg > 0)
        if rok.sum() >= MIN_STEPS // 2:
            rate = _trend(np.log2(rg[rok]), ref.steps["step"].to_numpy(int)[rok])
            source = "the reference run"
    decline = -rate[0] * float(steps[-1] - steps[0])
    if not (rate[2] < 0 and decline >= min_decline):
        return None  # the gradients did not shrink
    scale = float(np.median(cur[late]))
    late_peak = float(np.median(g[ok & late]))
    headroom = math.log2(late_peak * scale) - FP16.normal_exp
    if headroom >= min_headroom:
        return None  # still clear of the underflow range at the stuck scale
    interval = int(max(MIN_GROWTH_INTERVAL, math.floor(1.0 / (GROWTH_MARGIN * -rate[0]))))
    current = int(run.scaler.get("growth_interval") or TORCH_DEFAULTS["growth_interval"])
    interval = min(interval, max(current // 2, 1))
    return {
        "dynamic": "scale stuck while gradients shrink",
        "scale_in_force": scale,
        "growth_interval": current,
        "gradient_decline_binades": decline,
        "decline_per_step": -rate[0],
        "decline_measured_on": source,
        "late_peak_grad_unscaled": late_peak,
        "headroom_binades_above_fp16_normal": headroom,
        "suggested_growth_interval": interval,
        # the start is the replay's (`replay --suggest`), as every suggested scale is; the interval is this
        # dynamic's own: the replay sees the recorded gradients, not how fast they keep shrinking
        "suggested_init_scale": max(float(run.suggestion.settings["init_scale"]), scale) if run.suggestion else scale,
    }


def skip_cycles(run: RunView, cut_step: int, max_skip_share: float = MAX_SKIP_SHARE) -> Evidence | None:
    """Dynamic (b): repeated overflow/skip cycles in the late segment: the scale regrows and overflows again."""
    st = run.steps
    late = st["step"].to_numpy(int) >= cut_step
    skipped = st["skipped"].to_numpy(bool)
    cur, nxt = st["loss_scale"].to_numpy(float), st["loss_scale_next"].to_numpy(float)
    share = float(skipped[late].mean()) if late.any() else 0.0
    before = float(skipped[~late].mean()) if (~late).any() else 0.0
    growths = int((nxt[late] > cur[late]).sum())
    if share <= max_skip_share or share < LATE_SKIP_FACTOR * before or growths < 2:
        return None  # no cycles, or cycles all along: not what changed late
    bad = set(st.loc[late & skipped, "step"].astype(int))
    if len(forward_nonfinite_steps(run) & bad) > len(bad) / 2:
        return None  # a forward overflow, not the scaler (forward-overflow covers it)
    current = int(run.scaler.get("growth_interval") or TORCH_DEFAULTS["growth_interval"])
    interval = max(2 * current, math.ceil(1.0 / TARGET_SKIP_SHARE))
    through = cur[late & ~skipped]
    return {
        "dynamic": "repeated overflow/skip cycles",
        "late_skip_share": share,
        "early_skip_share": before,
        "late_growths": growths,
        "growth_interval": current,
        "suggested_growth_interval": interval,
        "scale_range": [float(np.nanmin(cur[late])), float(np.nanmax(cur[late]))],
        # start where the cycles settled: the lowest scale a late step went through at
        "suggested_init_scale": float(np.nanmin(through)) if len(through) else float(np.nanmin(cur[late])),
    }


def explain(
    run: RunView, cut_step: int, min_decline: float = MIN_DECLINE, min_headroom: float = MIN_HEADROOM
) -> Evidence | None:
    """Which scaler dynamic of an FP16 + GradScaler run explains a late break, with the setting that fixes it."""
    if not (run.fp16 and run.scaler_on):
        return None
    return skip_cycles(run, cut_step) or stuck_scale(run, cut_step, min_decline, min_headroom)


def late_degradation(
    run: RunView,
    *,
    late_share: float = LATE_SHARE,
    min_worsening: float = MIN_WORSENING,
    min_decline: float = MIN_DECLINE,
    min_headroom: float = MIN_HEADROOM,
) -> Diagnosis | None:
    if not (run.fp16 and run.scaler_on):
        return None  # the dynamics below are those of an FP16 loss scaler
    brk = trend_break(run, late_share, min_worsening)
    if brk is None:
        return None
    cut = brk["break_step"]
    why = explain(run, cut, min_decline, min_headroom)
    if why is None:
        return None  # a break no scaler dynamic explains is not this rule's to report
    if brk["against"] == "reference":
        worse = f"falls a further {brk['worsening_factor']:.2f}x behind the reference run"
    else:
        worse = f"its loss rises {brk['worsening_factor']:.2f}x"
    if "late_skip_share" in why:
        n = why["suggested_growth_interval"]
        cause = (
            f"{A.pct(why['late_skip_share'])} of the late steps were skipped in overflow/skip cycles (the "
            f"scale regrew {why['late_growths']} times with growth_interval={why['growth_interval']} and "
            f"overflowed again)"
        )
        init = why["suggested_init_scale"]
        fix = [
            text(
                f"Start at the scale the cycles settled at ({A.pow2(init)}) and let it grow less often, so "
                f"that each failed growth costs one step in {n}:"
            ),
            code(
                A.scaler_line(run, init_scale=init, growth_interval=n),
                f'# DeepSpeed: "fp16": {{"loss_scale_window": {n}, "hysteresis": 2}}  '
                "# hysteresis: back off only after 2 overflows in a row",
            ),
        ]
    else:
        n, init = why["suggested_growth_interval"], why["suggested_init_scale"]
        cause = (
            f"the loss scale stayed at {A.pow2(why['scale_in_force'])} (growth_interval="
            f"{why['growth_interval']}) while the unscaled gradients fell "
            f"{why['gradient_decline_binades']:.1f} binades, so the largest late gradient sits "
            f"{why['headroom_binades_above_fp16_normal']:+.1f} binades from FP16's normal range"
        )
        fix = [
            text(
                f"Let the scale follow the shrinking gradients: they halve every "
                f"{1.0 / why['decline_per_step']:.0f} steps (measured on {why['decline_measured_on']}), so grow "
                f"it at least every {n} steps, starting where the replay of this run starts ({A.pow2(init)}):"
            ),
            code(A.scaler_line(run, init_scale=init, growth_interval=n)),
            *A.bf16_note(run),
        ]
    return finding(
        "warning",
        "Performance degrades late in training",
        f"From step {cut} the loss trend breaks (log-loss slope {brk['early_slope']:.2g} -> {brk['late_slope']:.2g} "
        f"per step); over the late segment the run {worse}. Cause: {cause}.",
        steps=[cut, int(run.steps["step"].iloc[-1])],
        evidence={**brk, **why},
        fix=fix,
    )
