"""What a trace observed and what observing cost: the lines ``ampdoctor info``, the dashboard overview and the report
show. Offline side: no torch import."""

from __future__ import annotations

import numpy as np

from . import schema

_LEVEL_NAMES = {
    schema.LEVEL_SENTINEL: "sentinel only",
    schema.LEVEL_PEAK: "peaks",
    schema.LEVEL_FULL: "full statistics",
    schema.LEVEL_HIST: "full statistics + histograms",
}
LEVEL_NAMES = _LEVEL_NAMES  # public: the dashboard's observation line reads it


def observer_cost(steps) -> dict | None:
    """ampdoctor's host time on the training thread against the run's time (the sum of the step times, which
    include it): {"share", "seconds", "run_seconds"}; None for a trace that does not record it."""
    if "observer_time" not in steps or not steps["observer_time"].notna().any():
        return None
    ok = np.isfinite(steps["observer_time"]) & np.isfinite(steps["step_time"])
    run_s, obs_s = float(steps.loc[ok, "step_time"].sum()), float(steps.loc[ok, "observer_time"].sum())
    if run_s <= 0:
        return None
    return {"share": obs_s / run_s, "seconds": obs_s, "run_seconds": run_s}


def cost_line(steps) -> str | None:
    """ "ampdoctor cost 1.8% of this run (0.42 s of 23.1 s on the training thread)", or None."""
    c = observer_cost(steps)
    if c is None:
        return None
    return (
        f"ampdoctor cost {100 * c['share']:.1f}% of this run ({c['seconds']:.3g} s of {c['run_seconds']:.3g} s "
        "on the training thread)"
    )


def observation_line(meta: dict, steps) -> str:
    """Which steps observed what: the mode, and the steps per level and per reason."""
    run = meta.get("run", {})
    mode = run.get("mode")
    parts = []
    if mode is not None:
        cadence = (
            f"peaks every {run.get('peak_every')}, full every {run.get('every')}, first "
            f"{run.get('calibration')} in full"
            if mode == "default"
            else "every site, every step"
        )
        parts.append(f"mode {mode} ({cadence})")
    if len(steps):
        levels = steps["level"].dropna().astype(int).value_counts().sort_index(ascending=False)
        parts.append(", ".join(f"{_LEVEL_NAMES.get(lv, lv)} {n}" for lv, n in levels.items()))
        if "reason" in steps and steps["reason"].notna().any():
            why = steps["reason"].dropna().value_counts()
            parts.append("why: " + ", ".join(f"{k} {v}" for k, v in why.items() if k != "sentinel"))
    return "; ".join(parts) or "-"
