"""divergence: the optimisation blew up (learning rate too high for the model), not the format's range. Read off the
loss and gradient-norm trend before the first non-finite step, and where the loss never rose (it went NaN at once,
or never left chance) off what the updates did to the weights: an update as large as the weights, a module's outputs
jumping many binades in one step, activations growing while the loss made no progress. Not a loss-scaling
problem: lowering the scale cannot fix it; the scaler and range rules are suppressed by this one (registry)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TypedDict

import numpy as np
import pandas as pd

from .. import formats
from ..trace.schema import ROOT
from . import advice as A
from .result import Diagnosis, finding
from .runview import Blowup, BoolArray, FloatArray, IntArray, RunView
from .scaling import forward_nonfinite_steps, nonfinite_origins
from .weights import NO_FAN_IN, fan_in

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
# An update as large as the weights' own scale replaces them rather than adjusting them (healthy training moves a
# weight matrix by ~1e-3 to 1e-2 of its scale per step). The scale: the matrix's RMS at an earlier record, else the
# 1/sqrt(fan_in) every default init gives it.
MAX_UPDATE_RATIO = 1.0
# The suggested learning rate brings the measured update to ~1% of the weights' scale per step.
TARGET_UPDATE_RATIO = 1e-2
# A module whose outputs moved 8 binades (256x) between two consecutive steps, and stayed there: its weights (or its
# inputs' weights) changed that much in one update. A format's range is the same on every step.
JUMP_BINADES = 8.0
# Activations that grew 6 binades (64x) while the loss made no progress: the updates inflate the weights without
# the model learning, until some product leaves the range. A learning run's activations grow a binade or two.
GROWTH_BINADES = 6.0
# No progress: the loss (median over 5 steps) never fell below 90% of where it started ...
NO_PROGRESS = 0.9
# ... over at least this many finite steps (fewer say nothing about progress).
MIN_FLAT_STEPS = 10


class _Trend(TypedDict):
    first_nonfinite_step: int | None
    blowup_step: int
    nonfinite_steps: int
    loss_start: float
    loss_peak: float
    loss_rise: float
    grad_norm_growth: float
    grad_growth_from_overflow: float
    gradient_growth: float
    lowest_scale_still_nonfinite: float | None
    nonfinite_at_every_scale: bool


class Trend(_Trend, total=False):
    """The loss and gradient-norm trend of a run that blew up (``trend``, ``finite_blowup``): divergence's evidence."""

    loss_late_median: float  # (finite_blowup's: the median loss over the run's second half)


def _bad(run: RunView) -> BoolArray:
    st = run.steps
    loss = st["loss"].to_numpy(float)
    bad: BoolArray = st["skipped"].to_numpy(bool) | st["nonfinite"].to_numpy(bool)
    if np.isfinite(loss).any():  # the run logs its loss: a missing one is a NaN
        bad |= ~np.isfinite(loss)
    return bad


def trend(run: RunView, window: int = WINDOW) -> Trend | None:
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
    # where the model started: the lowest of the first losses (Adam's first step with a too-high learning rate can
    # double the loss on step 1 already; a median over those would hide the rise it starts)
    base = float(np.min(start[:3]))
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


def blowup(
    run: RunView,
    max_update_ratio: float = MAX_UPDATE_RATIO,
    jump_binades: float = JUMP_BINADES,
    growth_binades: float = GROWTH_BINADES,
) -> Blowup | None:
    """The Blowup evidence of a run with non-finite (or skipped) steps after a finite start; None otherwise."""
    bad = _bad(run)
    if bad.sum() < MIN_BAD_STEPS or not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    if first == 0:
        return None  # no step before it: nothing the updates could have done
    st = run.steps
    b = Blowup(first_step=int(st["step"].iloc[first]))
    _update_ratio(run, first, b)
    _jump(run, first, bad, b)
    _flat_and_growth(run, first, b)
    if b.update_ratio is not None and b.update_ratio >= max_update_ratio:
        b.decisive.append(
            f"the update of step {b.update_step} moved {b.update_param} by {A.fmt_num(b.update_ratio)}x the weights' "
            "own scale (healthy training moves them ~0.001-0.01x a step)"
        )
    elif b.update_ratio is not None and b.update_ratio >= max_update_ratio / 10:
        b.partial.append(
            f"the update of step {b.update_step} moved {b.update_param} by {A.fmt_num(b.update_ratio)}x its scale"
        )
    if b.jump is not None and b.jump >= jump_binades:
        b.decisive.append(
            f"{b.jump_site}'s outputs jumped {b.jump:.1f} binades in the one update before step {b.jump_step} (from a "
            f"peak of {A.fmt_num(b.jump_from)}): the weights changed that much, the format's range did not"
        )
    elif b.jump is not None and b.jump >= jump_binades / 2:
        b.partial.append(f"{b.jump_site}'s outputs jumped {b.jump:.1f} binades in one step (step {b.jump_step})")
    grew = b.growth is not None and b.growth >= growth_binades
    if b.loss_flat and grew:
        b.decisive.append(
            f"the loss never left its start ({A.fmt_num(b.loss_start)}; best {A.fmt_num(b.loss_best)}) while "
            f"{b.growth_site}'s outputs grew {b.growth:.1f} binades (steps {b.growth_steps[0]}-{b.growth_steps[1]}): "
            "the updates inflate the weights without the model learning"
        )
    elif b.loss_flat:
        b.partial.append(f"the loss never left its start ({A.fmt_num(b.loss_start)}) before the first non-finite step")
    elif grew:
        b.partial.append(f"{b.growth_site}'s outputs grew {b.growth:.1f} binades before the first non-finite step")
    return b


# Steps of [steps x sites] statistics read at a time by the blow-up evidence: memory bounded whatever the run's length.
CHUNK = 2048


def _update_ratio(run: RunView, first: int, b: Blowup) -> None:
    """Largest update / weight scale over the weight matrices at the recorded update steps before ``first``. The
    scale: the weights' RMS at their last record before that step, else 1/sqrt(fan_in). Read a chunk of the
    full-statistics steps at a time, every site at once."""
    ups, ws = run.sites("update"), run.sites("weight")
    if not len(ups):
        return
    types = run.module_types
    fans = np.array([fan_in(s.shape) or 0 for s in ups.itertuples()], dtype=np.float64)
    use = (fans > 0) & ~ups["module"].map(lambda m: types.get(m) in NO_FAN_IN).to_numpy(bool)
    if not use.any():
        return
    w_col = {p: j for j, p in enumerate(ws["path"])}
    jw = np.array([w_col.get(p, -1) for p in ups["path"]], dtype=np.int64)
    skipped = run.steps["skipped"].to_numpy(bool)
    full = run.full_steps[run.full_steps < first]
    carry = np.full(len(ups), np.nan)  # per update site: its weights' last RMS > 0 recorded so far
    default = np.where(fans > 0, 1.0 / np.sqrt(np.where(fans > 0, fans, 1.0)), np.nan)
    best_ratio = np.full(len(ups), -np.inf)
    best_step = np.zeros(len(ups), dtype=np.int64)
    for lo in range(0, len(full), CHUNK):
        steps = full[lo : lo + CHUNK]
        u = run.at("rms", "update", steps)
        w = run.at("rms", "weight", steps)[:, np.maximum(jw, 0)] if len(ws) else np.full(u.shape, np.nan)
        w[:, jw < 0] = np.nan
        ok = np.isfinite(w) & (w > 0)
        last = np.maximum.accumulate(np.where(ok, np.arange(len(steps))[:, None], -1), axis=0)
        prev = np.vstack([np.full((1, len(ups)), -1), last[:-1]])  # the last record strictly before each row
        earlier = np.take_along_axis(w, np.maximum(prev, 0), axis=0)
        scale = np.where(prev >= 0, earlier, np.where(np.isfinite(carry), carry, default)[None, :])
        valid = np.isfinite(u) & ~skipped[steps][:, None] & use[None, :]
        with np.errstate(all="ignore"):
            ratio = np.where(valid, u / scale, -np.inf)
        k = np.argmax(ratio, axis=0)  # per site, its first largest in this chunk
        top = ratio[k, np.arange(len(ups))]
        better = top > best_ratio
        best_ratio[better], best_step[better] = top[better], steps[k[better]]
        has = ok.any(axis=0)
        carry[has] = w[last[-1, has], np.flatnonzero(has)]
    j = int(np.argmax(best_ratio))  # the first site with the largest
    if best_ratio[j] > -np.inf:
        b.update_ratio = float(best_ratio[j])
        b.update_param = str(ups["path"].iloc[j])
        b.update_step = int(run.steps["step"].iloc[int(best_step[j])])


def _observed(run: RunView) -> BoolArray:
    observed: BoolArray = run.steps["level"].fillna(-1).to_numpy(float) >= 0
    return observed


def _peak_blocks(run: RunView, rows: IntArray, ahead: int) -> Iterator[tuple[int, FloatArray]]:
    """(start, block): the output peaks at ``rows[start : start + CHUNK + ahead]`` (the next ``ahead`` rows too, for
    what a row's move is checked against), a chunk at a time."""
    for lo in range(0, len(rows), CHUNK):
        yield lo, run.at("peak", "act", rows[lo : lo + CHUNK + ahead])


def _jump(run: RunView, first: int, bad: BoolArray, b: Blowup) -> None:
    """Largest move of an output peak between two consecutive observed steps up to ``first`` (into a non-finite peak
    on the first bad step: the headroom it had, a lower bound). The module named is the first, in execution order,
    whose move on that step was at least half the largest: the modules after it carried its values. Only a move the
    later steps kept counts."""
    acts = run.sites("act")
    if not len(acts):
        return
    rows = np.flatnonzero(_observed(run))
    rows = rows[rows <= first + 1]
    limit = np.array(
        [formats.get(str(d)).max if d in formats.DTYPE_FORMATS else np.nan for d in acts["dtype"]], dtype=np.float64
    )
    not_root = (acts["path"] != ROOT).to_numpy(bool)
    best: tuple[tuple[float, bool], str, int, float, float] | None = None  # ((move, not root), site, row, peak before)
    prev_row = None  # the last row of the block before (the pair across two blocks)
    for lo, pk in _peak_blocks(run, rows, 3):
        n = min(CHUNK, len(rows) - lo)
        block = pk if prev_row is None else np.vstack([prev_row, pk])
        off = 0 if prev_row is None else 1  # block row of rows[lo]
        prev_row = pk[n - 1 : n]
        i = np.arange(lo, lo + n)  # the later step of each pair, as an index into rows
        pair = (i >= 1) & (rows[i] == rows[np.maximum(i - 1, 0)] + 1) & (rows[i] <= first)
        if not pair.any():
            continue
        i = i[pair]
        now, before = block[i - lo + off], block[i - lo + off - 1]
        with np.errstate(all="ignore"):
            fin = np.isfinite(now)
            up = before > 0
            move = np.where(fin, np.log2(now / before), np.log2(limit[None, :] / before))
            kept = np.ones(now.shape, dtype=bool)
            for d in range(1, 4):  # the next observed steps keep the move (within 2 binades, or non-finite)
                there = i + d < len(rows)
                later = block[np.minimum(i + d - lo + off, len(block) - 1)]
                kept &= ~there[:, None] | ~np.isfinite(later) | (later >= now / 4)
        ok = (
            np.isfinite(before)
            & up
            & np.where(fin, (now > 0) & kept, np.isfinite(limit)[None, :] & bad[rows[i]][:, None])
        )
        if not ok.any():
            continue
        m = np.where(ok, move, -np.inf)
        top = m.max()
        r = int(np.argmax(m.max(axis=1)))  # the first step pair with the largest move
        # the module named: the first in execution order whose move on that step was at least half the largest
        # (the modules after it carried its values), an inner module before the root
        cand = ok[r] & ((m[r] >= top / 2) if top > 0 else (m[r] == top))
        pref = cand & not_root
        j = int(np.flatnonzero(pref if pref.any() else cand)[0])
        key = (float(top), bool(not_root[j]))
        if best is None or key > best[0]:
            best = (key, str(acts["path"].iloc[j]), int(rows[i[r]]), float(before[r, j]), float(m[r, j]))
    if best is not None:
        _, b.jump_site, c, b.jump_from, b.jump = best
        b.jump_step = int(run.steps["step"].iloc[c])


def _flat_and_growth(run: RunView, first: int, b: Blowup) -> None:
    """Did the loss make progress before ``first``; how much did the output peaks grow meanwhile."""
    loss = run.steps["loss"].to_numpy(float)[:first]
    fin = loss[np.isfinite(loss)]
    if len(fin) >= MIN_FLAT_STEPS and fin[:3].min() > 0:
        smooth = pd.Series(fin).rolling(5, min_periods=1, center=True).median().to_numpy()
        b.loss_start, b.loss_best = float(fin[:3].min()), float(smooth.min())
        b.loss_flat = b.loss_best >= NO_PROGRESS * b.loss_start
    acts = run.sites("act")
    rows = np.flatnonzero(_observed(run)[:first])
    if len(rows) < 2 or not len(acts):
        return
    k = len(acts)
    start, end = np.full(k, np.nan), np.full(k, np.nan)  # per site: its first and last finite peak > 0 ...
    at_start, at_end = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)  # ... and their steps
    count = np.zeros(k, dtype=np.int64)
    for lo, pk in _peak_blocks(run, rows, 0):
        ok = np.isfinite(pk) & (pk > 0)
        if not ok.any():
            continue
        fresh = (count == 0) & ok.any(axis=0)
        f = np.argmax(ok, axis=0)
        start[fresh], at_start[fresh] = pk[f[fresh], fresh], rows[lo + f[fresh]]
        has = ok.any(axis=0)
        e = len(pk) - 1 - np.argmax(ok[::-1], axis=0)
        end[has], at_end[has] = pk[e[has], has], rows[lo + e[has]]
        count += ok.sum(axis=0)
    grow = count >= 2
    if not grow.any():
        return
    with np.errstate(all="ignore"):
        g = np.where(grow, np.log2(end / start), -np.inf)
    j = int(np.argmax(g))
    b.growth, b.growth_site, b.growth_steps = float(g[j]), str(acts["path"].iloc[j]), [int(at_start[j]), int(at_end[j])]


def finite_blowup(run: RunView) -> Trend | None:
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


def _overflow_growth(run: RunView, bad: BoolArray, first: int, end: int) -> float:
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


def _reference_diverged(ref: RunView | None, min_loss_rise: float) -> bool | None:
    """Did the reference run diverge too? None without one."""
    if ref is None:
        return None
    t = trend(ref) or finite_blowup(ref)
    if t is not None:
        return t["loss_rise"] >= min_loss_rise or t["nonfinite_at_every_scale"]
    loss = ref.steps["loss"].to_numpy(float)
    fin = loss[np.isfinite(loss)]
    return bool(len(fin) and fin[0] > 0 and fin.max() / fin[0] >= FINITE_RISE)


def divergence(
    run: RunView,
    *,
    min_loss_rise: float = MIN_LOSS_RISE,
    min_norm_growth: float = MIN_NORM_GROWTH,
    max_update_ratio: float = MAX_UPDATE_RATIO,
    jump_binades: float = JUMP_BINADES,
    growth_binades: float = GROWTH_BINADES,
) -> Diagnosis | None:
    t = trend(run) or finite_blowup(run)
    if t is None:
        return None
    bad = run.steps.loc[_bad(run), "step"].astype(int).tolist()
    if bad and nonfinite_origins(run, bad)["input"] * 2 > len(bad):
        return None  # non-finite input batches: a data problem (loss-scale-collapse)
    ref = _reference_diverged(run.reference, min_loss_rise)
    if ref is False:
        return None  # the reference trains fine: the precision is at fault
    rose = t["loss_rise"] >= min_loss_rise
    grew = math.isfinite(t["gradient_growth"]) and t["gradient_growth"] >= min_norm_growth
    b = run.blowup if t["first_nonfinite_step"] is not None else None
    by_trend = rose and (grew or t["nonfinite_at_every_scale"] or ref)
    if not (by_trend or (b is not None and b.decisive)):
        return None  # the loss did not go the wrong way and the updates did not ruin the weights: not this
    first = t["blowup_step"]
    signs = []
    if rose and t["first_nonfinite_step"] is not None:
        signs.append(
            f"the loss rose {t['loss_rise']:.1f}x (from {A.fmt_num(t['loss_start'])} to "
            f"{A.fmt_num(t['loss_peak'])}) by the first non-finite step ({first})"
        )
    elif rose:
        signs.append(
            f"the loss rose from {A.fmt_num(t['loss_start'])} to {A.fmt_num(t['loss_peak'])} from step {first} "
            f"on and stayed {t['loss_rise']:.1f}x its start (no value was non-finite: the format held it)"
        )
    if grew:
        how = (
            "norm on the steps that went through, or the scale they overflowed at against the first steps' "
            "largest gradient"
            if t["nonfinite_steps"]
            else "gradient norm"
        )
        signs.append(f"the gradients grew at least {t['gradient_growth']:.0f}x ({how})")
    if t["nonfinite_at_every_scale"] and (rose or not b or not b.decisive):
        signs.append(
            f"non-finite values persist at a loss scale of {A.fmt_num(t['lowest_scale_still_nonfinite'])} "
            f"(no scaling at all)"
        )
    if b is not None:
        signs += b.decisive
    if ref:
        signs.append("the reference run diverges too")
    opt = (run.config.get("optimizer") or {}).get("class") or "the optimizer"
    lr = _lr_before(run, t)
    decided = (
        "the loss rose and the values blew up at every scale"
        if by_trend
        else "what the updates did to the weights (the loss never rose: it "
        + ("went non-finite at once" if b is None or not b.loss_flat else "never left its start")
        + ")"
    )
    factor = LR_FACTOR
    ratio = _ratio_at(run, b, lr)
    if ratio is not None and ratio > TARGET_UPDATE_RATIO * LR_FACTOR:
        factor = ratio / TARGET_UPDATE_RATIO  # size the cut by the update measured: ~1% of the weights a step
    new_lr = _round_down(lr / factor) if lr else None
    range_note = (
        "; in FP32 or BF16 it would not learn either: a wider format only moves the NaN"
        if t["first_nonfinite_step"] is not None
        else ""
    )
    return finding(
        "critical",
        "Training diverged",
        (
            "The run diverged rather than overflowing the format's range: "
            if t["nonfinite_steps"]
            else "The run diverged: "
        )
        + "; ".join(signs)
        + ". "
        + (f"The learning rate was {lr:.3g} ({opt})" if lr else f"Optimizer: {opt}")
        + f"{range_note}. Decided by {decided}.",
        steps=[first, int(run.steps["step"].iloc[-1])],
        evidence={
            **t,
            **(b.evidence() if b is not None else {}),
            "decided_by": decided,
            "lr": lr,
            "optimizer": opt,
            "adaptive_optimizer": opt in ADAPTIVE,
            "reference_diverged": ref,
            "suggested_lr": new_lr,
            "warmup_steps": WARMUP_STEPS,
        },
        fix=A.lower_lr(run, lr, new_lr, WARMUP_STEPS, adaptive=opt in ADAPTIVE),
    )


def _ratio_at(run: RunView, b: Blowup | None, lr: float | None) -> float | None:
    """The update-to-weight ratio measured at its step, scaled to the learning rate in force at the blow-up (a
    warm-up's first step ran at a fraction of it; the update is proportional to the learning rate)."""
    if b is None or b.update_ratio is None or not lr:
        return None
    lrs = run.steps["lr"].to_numpy(float)
    at = np.flatnonzero(run.steps["step"].to_numpy(int) == b.update_step)
    then = float(lrs[at[0]]) if len(at) and math.isfinite(lrs[at[0]]) and lrs[at[0]] > 0 else lr
    return b.update_ratio * lr / then


def _lr_before(run: RunView, t: Trend) -> float | None:
    """The learning rate in force when the run blew up (the last one logged before the blow-up step)."""
    lrs = run.steps["lr"].to_numpy(float)
    at = min(int(np.searchsorted(run.steps["step"].to_numpy(int), t["blowup_step"])), len(lrs) - 1)
    seen = lrs[: at + 1][np.isfinite(lrs[: at + 1])]
    return float(seen[-1]) if len(seen) else None


def _round_down(x: float) -> float:
    """One significant digit, rounded down (0.0089 -> 0.008): a learning rate to paste."""
    e = math.floor(math.log10(x))
    unit: float = 10**e  # (an int for e >= 0, as before)
    return math.floor(x / unit) * unit
