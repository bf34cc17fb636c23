"""clip-before-unscale: gradient clipping applied to the scaled gradients (``clip_grad_norm_`` before
``scaler.unscale_(optimizer)``). The clip cuts the scaled norm to max_norm and the scaler then divides by the scale:
every applied gradient has norm max_norm / scale, and an optimizer whose step follows the gradient stalls with no
NaN. Read off the sentinel (every step): the applied gradient norm times the loss scale in force is the same number,
max_norm, on every step."""

from __future__ import annotations

import numpy as np

from . import advice as A
from .divergence import ADAPTIVE
from .fix import code, text
from .result import Diagnosis, finding
from .runview import RunView

# clip_grad_norm_ scales the gradients by max_norm / (norm + 1e-6): the clipped norm is max_norm to ~1e-6 relative,
# and the recorded norm carries float32 rounding (~1e-7). The norms of gradients no clip touched vary between
# batches by far more than 1e-3.
TOLERANCE = 1e-3
# Share of the clean steps whose applied norm x scale sits at that one value: at any useful scale the scaled norm
# exceeds max_norm on every step, so the clip applies on (nearly) every one.
MIN_SHARE = 0.9
# Steps needed before a constant product means anything.
MIN_STEPS = 10
# Below a scale of 16 the updates shrink by less than that: not what stalls a run.
MIN_SCALE = 16.0
# With the scale constant the product alone cannot tell max_norm = c (clipping the scaled gradients) from
# max_norm = c / scale (clipping unscaled ones at a tiny threshold); people set max_norm between 0.01 and 1000, and
# no one clips at 1e-4 (that is 1.0 / 2^13 and below: what a max_norm of ~1 over a scale of 2^13 or more leaves).
PLAUSIBLE_MAX_NORM = (1e-2, 1e3)
IMPLAUSIBLE_APPLIED = 1e-4


def clip_before_unscale(
    run: RunView, *, tolerance: float = TOLERANCE, min_share: float = MIN_SHARE
) -> Diagnosis | None:
    if not run.scaler_on:
        return None
    st = run.steps
    norm = st["grad_norm"].to_numpy(float)
    scale = st["loss_scale"].to_numpy(float)
    ok = ~st["skipped"].to_numpy(bool) & np.isfinite(norm) & np.isfinite(scale) & (norm > 0) & (scale > 0)
    if ok.sum() < MIN_STEPS:
        return None
    product = norm[ok] * scale[ok]
    max_norm = float(np.median(product))
    at = np.abs(product / max_norm - 1.0) <= tolerance
    share = float(at.mean())
    if share < min_share:
        return None
    scales = scale[ok][at]
    if float(np.median(scales)) < MIN_SCALE:
        return None
    applied = norm[ok][at]
    followed = len(np.unique(scales)) >= 2  # the scale changed and the applied norm followed 1 / scale
    lo, hi = PLAUSIBLE_MAX_NORM
    if not followed and not (lo <= max_norm <= hi and float(np.median(applied)) < IMPLAUSIBLE_APPLIED):
        return None  # a constant norm at a constant scale that a plausible max_norm does not explain either way
    shown = float(f"{max_norm:.3g}")
    opt = (run.config.get("optimizer") or {}).get("class") or "the optimizer"
    adaptive = opt in ADAPTIVE
    if followed:
        decided = (
            f"the scale took {len(np.unique(scales))} values and the applied norm followed 1/scale exactly "
            f"(norm x scale = {A.fmt_num(max_norm)} on {int(at.sum())} of {int(ok.sum())} steps)"
        )
    else:
        decided = (
            f"norm x scale = {A.fmt_num(max_norm)} on {int(at.sum())} of {int(ok.sum())} steps at a constant scale "
            f"({A.pow2(float(scales[0]))}): a max_norm of {A.fmt_num(max_norm)} applied to the scaled gradients "
            f"explains it; one of {A.fmt_num(float(np.median(applied)))} applied to unscaled ones would too, but is "
            "not a value people set (the scale never changed, so the norms alone cannot rule it out)"
        )
    effect = (
        f"{opt}'s step follows the gradient, so every update is {A.pow2(float(np.median(scales)))}x too small: "
        "training stalls"
        if not adaptive
        else f"{opt} normalises its step, so the update's size mostly survives, but every step is clipped and its "
        "eps (1e-8 by default) weighs against gradients this small"
    )
    return finding(
        "critical" if not adaptive and followed else "warning",
        "Gradient clipping applied to the scaled gradients",
        f"The applied gradient norm was {A.fmt_num(float(np.median(applied)))} = {A.fmt_num(max_norm)} / loss scale "
        f"on {A.pct(share)} of the steps that went through: clip_grad_norm_ ran on the scaled gradients (no "
        f"scaler.unscale_(optimizer) before it) and the scaler then divided the clipped gradients by the scale. "
        f"{effect}. Decided by: {decided}.",
        steps=run.step_range(st["step"].to_numpy(int)[ok][at]),
        evidence={
            "max_norm": max_norm,
            "applied_norm_median": float(np.median(applied)),
            "scale_median": float(np.median(scales)),
            "scales_seen": len(np.unique(scales)),
            "share_at_max_norm_over_scale": share,
            "steps_measured": int(ok.sum()),
            "scale_changes_followed": followed,
            "optimizer": opt,
            "decided_by": decided,
        },
        fix=[
            text(
                "Unscale the gradients in place before clipping them (scaler.step() then does not unscale them "
                "again, and still skips a step with Inf/NaN gradients); the step of your loop becomes:"
            ),
            code(
                "scaler.scale(loss).backward()",
                "scaler.unscale_(optimizer)  # the gradients, unscaled in place: clip what the optimizer applies",
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={shown!r})",
                "scaler.step(optimizer)",
                "scaler.update()",
            ),
        ],
    )
