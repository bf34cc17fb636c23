"""How a finding reads on a card (the HTML report, the dashboard, a notebook): its evidence as labelled short rows,
its steps and ranks as labels. Neutral ground: numbers and text only, so that the notebook views (imported by the
trace and the rules for display) and the dashboards share one wording."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# evidence keys the rules write -> what a reader calls them (the rest: underscores to spaces, first letter up)
LABELS = {
    "module": "module",
    "module_type": "module type",
    "dtype": "dtype",
    "param_dtype": "parameter dtype",
    "steps_affected": "steps affected",
    "first_step": "first step",
    "value": "value produced",
    "max_finite_output": "largest finite output",
    "max_finite_step": "at step",
    "headroom_factor": "headroom (factor to the format's max)",
    "headroom_binades": "headroom (binades)",
    "format_max": "format max",
    "nonfinite_losses": "non-finite losses",
    "tipped_over_by": "tipped over by",
    "other_modules": "other modules that overflowed (steps)",
    "skipped_early": "skipped early steps",
    "window": "early window (steps)",
    "skipped_steps": "skipped steps",
    "init_scale": "initial loss scale",
    "max_unscaled_grad": "largest unscaled gradient",
    "fp16_max": "FP16 max",
    "scale_at_skips": "loss scale at the skips",
    "suggested_init_scale": "suggested init_scale",
    "suggested_settings": "suggested scaler settings",
    "replay_skipped": "skipped steps in the replay with the suggestion",
    "recorded_skipped": "skipped steps recorded",
    "lowest_scale": "lowest loss scale",
    "final_scale": "final loss scale",
    "skipped": "skipped steps",
    "steps": "steps",
    "skip_share_after_calibration": "skipped share after calibration",
    "origins": "where the non-finite values came from",
    "scale_in_force": "loss scale in force",
    "underflow_share": "underflow share per layer",
    "min_share": "threshold (share)",
    "zeros_share_worst": "zero share (worst layer)",
    "flushed_share_worst": "flushed share (worst layer)",
    "lost_norm_bound_worst": "lost norm bound (worst layer)",
    "vanished": "layers flushed to zero",
    "dead_not_underflow": "dead, not underflow",
    "reachable_scale": "largest scale without overflow",
    "suggested_scale": "suggested loss scale",
    "suggested_growth_interval": "suggested growth_interval",
    "severity_because": "severity because",
    "fp16_min_normal": "FP16 smallest normal",
    "full_steps_used": "full-statistics steps used",
    "lost_share": "updates lost",
    "per_parameter": "updates lost per parameter",
    "update_to_half_ulp": "median update / half ULP",
    "optimizer": "optimizer",
    "steps_measured": "steps measured",
    "grad_rms": "gradient RMS per layer",
    "median_grad_rms": "median gradient RMS",
    "outliers": "outliers (decades from the median)",
    "weight_faults": "weights off their fan-in scale",
    "tensors": "tensors",
    "params": "parameters",
    "eps": "optimizer eps",
    "eps_in_format": "eps as stored",
    "gradients_finite": "gradients finite",
    "data_share_median": "data wait share (median)",
    "data_time_median_s": "data wait, median (s)",
    "step_time_median_s": "step time, median (s)",
    "recorded_step_time_median_s": "recorded step time, median (s)",
    "observer_time_median_s": "ampdoctor's own time, median (s)",
    "samples_per_s_median": "samples/s (median)",
    "overflow_modules": "modules that would overflow FP16",
    "max_grad": "largest gradient",
    "underflow_at_scale": "underflow share at that scale",
    "ranks": "ranks",
    "evidence_from_rank": "evidence from rank",
    "steps_nonfinite_by_rank": "non-finite steps per rank",
    "one_rank_steps": "steps non-finite on one rank only",
    "first_module": "first module",
    "skipped_on_every_rank": "skipped on every rank",
    "steps_compared": "steps compared",
    "loss_scale_before": "loss scale before",
    "loss_scale_after": "loss scale after",
    "applied_with_nonfinite_gradients": "applied with non-finite gradients",
    "steps_with_different_scales": "steps with different scales",
    "level": "loss level",
    "reference_steps": "reference reached it at step",
    "ratio": "steps ratio",
    "ratios_by_level": "steps ratio by level",
    "p_value": "p-value",
    "lr": "learning rate",
    "reference_lr": "reference learning rate",
    "skip_share": "skipped share",
    "late_steps": "late steps",
    "metric": "metric",
}
_MAX_ITEMS = 8


def label(key: Any) -> str:
    """An evidence key as a reader calls it (``max_unscaled_grad`` -> "largest unscaled gradient")."""
    k = str(key)
    if k in LABELS:
        return LABELS[k]
    words = k.replace("_", " ").strip()
    return words[:1].upper() + words[1:] if words and k.islower() else k


def _short(v: Any) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if v is None:
        return "–"
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return ("NaN/Inf" if not math.isfinite(f) else f"{f:.4g}") if not f.is_integer() or abs(f) >= 1e6 else f"{f:g}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}" if abs(int(v)) >= 10_000 else str(int(v))
    if isinstance(v, dict):
        inner = ", ".join(f"{label(a)} {_short(b)}" for a, b in list(v.items())[:4])
        return f"({inner})"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in list(v)[:4]) + (", …" if len(v) > 4 else "") + "]"
    return str(v)


def _empty(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, (list, tuple, dict, str)) and not v:
        return True
    return isinstance(v, float) and math.isnan(v)


def evidence_items(d: Any) -> list[tuple[str, str]]:
    """A finding's evidence as (label, short text) rows: human labels, numbers to 4 digits, long lists and maps cut
    at 8 items with the total; values that are absent (None, empty) are left out rather than shown as "None"."""
    out = []
    for k, v in (getattr(d, "evidence", None) or {}).items():
        if _empty(v):
            continue
        if isinstance(v, dict):
            items = [(a, b) for a, b in v.items() if not _empty(b)]
            if not items:
                continue
            text = ", ".join(f"{a}: {_short(b)}" for a, b in items[:_MAX_ITEMS])
            text += f", … ({len(items)} in all)" if len(items) > _MAX_ITEMS else ""
        elif isinstance(v, (list, tuple, np.ndarray)):
            items = list(v)
            text = ", ".join(_short(x) for x in items[:_MAX_ITEMS])
            text += f", … ({len(items)} in all)" if len(items) > _MAX_ITEMS else ""
        else:
            text = _short(v)
        out.append((label(k), text))
    return out


def ranks_label(d: Any) -> str:
    """ "rank 1" / "ranks 0, 1" for a finding of a multi-rank run, "" for one trace."""
    ranks = list(getattr(d, "ranks", None) or [])
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""


def steps_label(d: Any) -> str:
    steps = list(getattr(d, "steps", None) or [])
    if len(steps) != 2:
        return ""
    return f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}–{steps[1]}"
