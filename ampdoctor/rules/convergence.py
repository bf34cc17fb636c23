"""Training-curve rules: slow-convergence (against a reference run)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import precision
from .fix import Part, code, text
from .result import Diagnosis, finding
from .runview import FloatArray, RunView
from .scaling import MAX_SKIP_SHARE

# Steps needed to reach the same loss: 1.5x the reference's is beyond run-to-run noise of a small seed-matched run
# and is what "clearly slower" means in the troubleshooting table.
SLOW_RATIO = 1.5
# Levels of the reference's own improvement (start -> best) at which the two runs are compared.
LEVELS = (0.5, 0.8)
MIN_STEPS = 10
# One-sided Mann-Whitney U over the raw losses between the reference's and this run's arrival at the level: the
# gap must be significant at 1%, not a few noisy batches.
ALPHA = 0.01


def smooth(values: FloatArray) -> FloatArray:
    """Rolling median over ~5% of the run (at least 3 steps): one noisy batch does not reach a level early."""
    w = max(3, len(values) // 20)
    out: FloatArray = pd.Series(values).rolling(w, min_periods=1, center=True).median().to_numpy()
    return out


def first_at_or_below(curve: FloatArray, level: float) -> int | None:
    hit = np.flatnonzero(curve <= level)
    return int(hit[0]) if len(hit) else None


def material(own: Diagnosis, underflow: Diagnosis) -> bool:
    """Suppression (registry): gradient underflow beyond advice (warning or critical) explains slow convergence."""
    return bool(underflow.severity != "info")


def slow_convergence(
    run: RunView, *, ratio: float = SLOW_RATIO, max_skip_share: float = MAX_SKIP_SHARE, alpha: float = ALPHA
) -> Diagnosis | None:
    ref = run.reference
    if ref is None:
        return None  # needs the reference run's curve as evidence
    a = run.steps["loss"].to_numpy(float)
    b = ref.steps["loss"].to_numpy(float)
    if np.isfinite(a).sum() < MIN_STEPS or np.isfinite(b).sum() < MIN_STEPS:
        return None
    if run.steps["skipped"].mean() > max_skip_share or not np.isfinite(a).all():
        return None  # skipped or non-finite steps explain it: other rules cover that
    if precision.measured_culprits(run):
        return None  # a layer measured losing precision explains it (precision-loss)
    sa, sb = smooth(a), smooth(b)
    n = min(len(sa), len(sb))
    start, best = sb[0], float(np.nanmin(sb))
    if not start > best:
        return None
    rows: dict[float, tuple[float, int, int | None]] = {}
    for k in LEVELS:
        level = start - k * (start - best)
        rb, ra = first_at_or_below(sb[:n], level), first_at_or_below(sa[:n], level)
        if rb is None:
            continue
        rows[k] = (level, rb, ra)
    if not rows:
        return None
    ratios = {k: ((ra if ra is not None else n) / max(rb, 1)) for k, (_, rb, ra) in rows.items()}
    k = LEVELS[0] if LEVELS[0] in ratios else min(ratios)  # the half-way level unless only another was reached
    if ratios[k] < ratio:
        return None
    level, rb, ra = rows[k]
    end = ra if ra is not None else n
    from scipy.stats import mannwhitneyu  # scipy only when a comparison is actually made

    window = slice(rb, max(end, rb + 5))
    p_value = float(mannwhitneyu(a[window], b[window], alternative="greater").pvalue)
    if not p_value < alpha:
        return None
    lr = float(run.steps["lr"].dropna().iloc[-1]) if run.steps["lr"].notna().any() else None
    lr_ref = float(ref.steps["lr"].dropna().iloc[-1]) if ref.steps["lr"].notna().any() else None
    reached = f"at step {ra}" if ra is not None else f"not within {n} steps"
    plain = "Nothing numeric (skips, non-finite values, underflow) explains it. "
    fix: list[Part]
    if lr and lr_ref and lr < lr_ref:
        # A lower learning rate than the reference's explains a gap larger than the usual AMP adjustment can close.
        fix = [
            text(
                plain + f"This run's learning rate {lr:.3g} is below the reference's {lr_ref:.3g}; start from "
                "the reference's:"
            ),
            code("for group in optimizer.param_groups:", f'    group["lr"] = {lr_ref:.3g}  # was {lr:.3g}'),
            text("With the same learning rate, raise it 10-30%, the usual AMP adjustment:"),
        ]
    else:
        fix = [text(plain + "Raise the learning rate 10-30%, the usual AMP adjustment:")]
    if lr:
        fix.append(
            code("for group in optimizer.param_groups:", f'    group["lr"] = {lr * 1.2:.3g}  # was {lr:.3g} (+20%)')
        )
    else:
        fix.append(code("for group in optimizer.param_groups:", '    group["lr"] *= 1.2'))
    return finding(
        "warning",
        "Convergence slower than the reference",
        f"The reference reached loss {level:.4g} at step {rb}, this run {reached} "
        f"({ratios[k]:.1f}x the steps); no skipped steps, non-finite values or underflow explain the gap.",
        steps=[0, n - 1],
        evidence={
            "level": level,
            "reference_steps": rb,
            "steps": ra,
            "ratio": ratios[k],
            "ratios_by_level": {f"{int(100 * q)}%": r for q, r in ratios.items()},
            "p_value": p_value,
            "lr": lr,
            "reference_lr": lr_ref,
            "skip_share": float(run.steps["skipped"].mean()),
        },
        fix=fix,
    )
