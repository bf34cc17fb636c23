"""divergence: the optimisation blew up (learning rate too high for the model), read off the loss and gradient-norm
trend before the first non-finite step. Not a loss-scaling problem: lowering the scale cannot fix it, and the
other scaler rules (init-scale-too-high, loss-scale-collapse) defer to this one through the engine."""

from __future__ import annotations

import math

import numpy as np

from .. import formats
from . import advice as A
from .fix import code, text
from .result import finding
from .scaling import forward_nonfinite_steps, nonfinite_origins

FP16 = formats.FP16

# Non-finite (or skipped) steps needed before a run counts as blown up: one or two are a scaler calibrating.
MIN_BAD_STEPS = 3
# The loss went the wrong way: its largest finite value around the first non-finite step is twice where it started.
# Skipped steps do not change the weights, so a scale problem alone never raises the loss; an update that overshoots
# does. A noisy small-batch loss wobbles by up to ~1.6x between batches early on; doubling is beyond that.
MIN_LOSS_RISE = 2.0
# The gradient norm grew tenfold over its start on the steps that went through: the weights left the region the
# learning rate suits (a too-high scale leaves the unscaled norm where it was).
MIN_NORM_GROWTH = 10.0
# A reference (FP32) run can diverge without a single non-finite value (its range is wide): a loss that rose 4x.
FINITE_RISE = 4.0
# Steps after the first non-finite one in which the loss and norm trends are read (the blow-up takes a few steps).
WINDOW = 10
# A step that overflowed at a scale of 1 or below overflowed without any scaling: no scale can fix it.
EVERY_SCALE = 1.0
# Optimizers whose update is normalised by the gradient's running RMS: clipping the norm does not shorten a step.
ADAPTIVE = (
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adafactor",
    "SparseAdam",
    "Lamb",
    "LAMB",
    "AdamW8bit",
    "FusedAdam",
    "DeepSpeedCPUAdam",
)
# The fix: one decade lower, ramped up over a warm-up of this many steps.
LR_FACTOR = 10.0
WARMUP_STEPS = 100


def _bad(run) -> np.ndarray:
    st = run.steps
    loss = st["loss"].to_numpy(float)
    bad = st["skipped"].to_numpy(bool) | st["nonfinite"].to_numpy(bool)
    if np.isfinite(loss).any():  # the run logs its loss: a missing one is a NaN
        bad |= ~np.isfinite(loss)
    return bad


def trend(run, window=WINDOW) -> dict | None:
    """Loss and gradient-norm trend from the start to shortly after the first non-finite step, or None."""
    st = run.steps
    bad = _bad(run)
    if bad.sum() < MIN_BAD_STEPS:
        return None
    first = int(np.flatnonzero(bad)[0])
    if first == 0:
        return None  # no finite history before it: no trend to read
    loss = st["loss"].to_numpy(float)
    end = min(len(st), first + window + 1)
    start = loss[:first][np.isfinite(loss[:first])]
    seen = loss[:end][np.isfinite(loss[:end])]
    if not len(start) or not (start[0] > 0):
        return None
    base = float(np.median(start[:3]))
    rise = float(seen.max()) / base
    norm = st["grad_norm"].to_numpy(float)
    ok = np.isfinite(norm) & ~bad
    ok[end:] = False
    growth = math.nan
    if ok[:first].any() and ok.sum() >= 2:
        n0 = float(norm[:first][ok[:first]][0])
        growth = float(norm[ok].max()) / n0 if n0 > 0 else math.nan
    scales = st["loss_scale"].to_numpy(float)
    low = float(np.nanmin(scales[bad])) if run.scaler_on and np.isfinite(scales[bad]).any() else 1.0
    bound = _overflow_growth(run, bad, first, end)
    both = [x for x in (growth, bound) if math.isfinite(x)]
    return {
        "first_nonfinite_step": int(st["step"].iloc[first]),
        "blowup_step": int(st["step"].iloc[first]),
        "nonfinite_steps": int(bad.sum()),
        "loss_start": base,
        "loss_peak": float(seen.max()),
        "loss_rise": rise,
        "grad_norm_growth": growth,
        "grad_growth_from_overflow": bound,
        "gradient_growth": max(both) if both else math.nan,
        "lowest_scale_still_nonfinite": low,
        "nonfinite_at_every_scale": low <= EVERY_SCALE,
    }


def finite_blowup(run) -> dict | None:
    """A run that diverged without a single non-finite value (FP32 and BF16 hold a blown-up loss): its loss over
    the second half of the run stayed at FINITE_RISE x where it started. None otherwise."""
    st = run.steps
    loss = st["loss"].to_numpy(float)
    fin = np.flatnonzero(np.isfinite(loss))
    if len(fin) < 2 * MIN_BAD_STEPS or _bad(run).sum() >= MIN_BAD_STEPS or not loss[fin[0]] > 0:
        return None
    start = float(loss[fin[0]])
    late = float(np.median(loss[fin[len(fin) // 2 :]]))
    if late < FINITE_RISE * start:
        return None
    at = int(fin[np.argmax(loss[fin] >= MIN_LOSS_RISE * start)])
    norm = st["grad_norm"].to_numpy(float)
    ok = np.flatnonzero(np.isfinite(norm) & (norm > 0))
    growth = float(norm[ok].max() / norm[ok[0]]) if len(ok) >= 2 else math.nan
    return {
        "first_nonfinite_step": None,
        "blowup_step": int(st["step"].iloc[at]),
        "nonfinite_steps": 0,
        "loss_start": start,
        "loss_peak": float(np.nanmax(loss)),
        "loss_late_median": late,
        "loss_rise": late / start,
        "grad_norm_growth": growth,
        "grad_growth_from_overflow": math.nan,
        "gradient_growth": growth,
        "lowest_scale_still_nonfinite": None,
        "nonfinite_at_every_scale": False,
    }


def _overflow_growth(run, bad: np.ndarray, first: int, end: int) -> float:
    """A lower bound on how much the largest gradient grew: a step whose gradients overflowed at scale S held a
    gradient >= 65504 / S, against the largest gradient of the clean steps before the first non-finite one (the
    replay's definition of the largest unscaled gradient). NaN without a scaler or a clean start."""
    if not run.scaler_on:
        return math.nan
    g = run.gradient_peaks.fp16_equivalent
    start = g[:first][np.isfinite(g[:first]) & ~bad[:first]]
    if not len(start) or not start.max() > 0:
        return math.nan
    forward = forward_nonfinite_steps(run)  # those overflow at any scale: no bound on the gradients
    over = [t for t in np.flatnonzero(bad[:end] & run.steps["skipped"].to_numpy(bool)[:end]) if t not in forward]
    scales = run.steps["loss_scale"].to_numpy(float)
    bounds = [FP16.max / scales[t] for t in over if np.isfinite(scales[t]) and scales[t] > 0]
    return float(max(bounds) / start.max()) if bounds else math.nan


def _reference_diverged(ref, min_loss_rise: float) -> bool | None:
    """Did the reference run diverge too? None without one."""
    if ref is None:
        return None
    t = trend(ref) or finite_blowup(ref)
    if t is not None:
        return t["loss_rise"] >= min_loss_rise or t["nonfinite_at_every_scale"]
    loss = ref.steps["loss"].to_numpy(float)
    fin = loss[np.isfinite(loss)]
    return bool(len(fin) and fin[0] > 0 and fin.max() / fin[0] >= FINITE_RISE)


def divergence(run, *, min_loss_rise=MIN_LOSS_RISE, min_norm_growth=MIN_NORM_GROWTH):
    t = trend(run) or finite_blowup(run)
    if t is None or t["loss_rise"] < min_loss_rise:
        return None  # the loss did not go the wrong way: a scale problem, not this
    bad = run.steps.loc[_bad(run), "step"].astype(int).tolist()
    if bad and nonfinite_origins(run, bad)["input"] * 2 > len(bad):
        return None  # non-finite input batches: a data problem (loss-scale-collapse)
    ref = _reference_diverged(run.reference, min_loss_rise)
    if ref is False:
        return None  # the reference trains fine: the precision is at fault
    grew = math.isfinite(t["gradient_growth"]) and t["gradient_growth"] >= min_norm_growth
    if not (grew or t["nonfinite_at_every_scale"] or ref):
        return None
    opt = (run.config.get("optimizer") or {}).get("class") or "the optimizer"
    lrs = run.steps["lr"].to_numpy(float)
    first = t["blowup_step"]
    lr = float(lrs[first]) if len(lrs) > first and math.isfinite(lrs[first]) else None
    adaptive = opt in ADAPTIVE
    if t["first_nonfinite_step"] is not None:
        signs = [
            f"the loss rose {t['loss_rise']:.1f}x (from {A.fmt_num(t['loss_start'])} to "
            f"{A.fmt_num(t['loss_peak'])}) by the first non-finite step ({first})"
        ]
    else:
        signs = [
            f"the loss rose from {A.fmt_num(t['loss_start'])} to {A.fmt_num(t['loss_peak'])} from step {first} "
            f"on and stayed {t['loss_rise']:.1f}x its start (no value was non-finite: the format held it)"
        ]
    if grew:
        how = (
            "norm on the steps that went through, or the scale they overflowed at against the first steps' "
            "largest gradient"
            if t["nonfinite_steps"]
            else "gradient norm"
        )
        signs.append(f"the gradients grew at least {t['gradient_growth']:.0f}x ({how})")
    if t["nonfinite_at_every_scale"]:
        signs.append(
            f"non-finite values persist at a loss scale of {A.fmt_num(t['lowest_scale_still_nonfinite'])} "
            f"(no scaling at all)"
        )
    if ref:
        signs.append("the reference run diverges too")
    new_lr = f"{lr / LR_FACTOR:.3g}" if lr else None
    fix = [
        text(
            "Lower the learning rate (one decade) and warm it up"
            + ("; a different loss scale cannot help:" if run.scaler_on else ":")
        ),
        code(
            "for group in optimizer.param_groups:",
            f'    group["lr"] = {new_lr}  # was {lr:.3g}' if new_lr else f'    group["lr"] /= {LR_FACTOR:g}',
            f"# ramp the learning rate up over the first {WARMUP_STEPS} steps "
            "(call scheduler.step() after every optimizer step):",
            f"scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / "
            f"{WARMUP_STEPS}))",
        ),
    ]
    if adaptive:
        fix.append(
            code(
                f"# Clipping the gradient norm does not help {opt}: it divides each update by the gradient's "
                "running RMS, so a smaller gradient does not make a smaller step."
            )
        )
    else:
        fix += [
            text(f"Also clip the gradient norm ({opt}'s step is proportional to the gradient):"),
            code(
                "scaler.unscale_(optimizer)  # with a GradScaler: unscale before clipping"
                if run.scaler_on
                else "# before optimizer.step():",
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
            ),
        ]
    return finding(
        "critical",
        "Training diverged",
        (
            "The run diverged rather than overflowing by its loss scale: "
            if t["nonfinite_steps"]
            else "The run diverged: "
        )
        + "; ".join(signs)
        + ". "
        + (f"The learning rate was {lr:.3g} ({opt})." if lr else f"Optimizer: {opt}."),
        steps=[first, int(run.steps["step"].iloc[-1])],
        evidence={
            **t,
            "lr": lr,
            "optimizer": opt,
            "adaptive_optimizer": adaptive,
            "reference_diverged": ref,
            "suggested_lr": float(new_lr) if new_lr else None,
            "warmup_steps": WARMUP_STEPS,
        },
        fix=fix,
    )
