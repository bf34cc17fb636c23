"""What a trace observed and what observing cost: the lines ``ampdoctor info``, the dashboard overview and the report
show, from a steps DataFrame or a Summary of one (``summarize``: what ``info`` prints, read at once from the writer's
step blocks however long the run). Offline side: no torch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import schema

if TYPE_CHECKING:
    import pandas as pd  # (the frames' callers have it: `ampdoctor info` starts without pandas)

    from .reader import Trace

_LEVEL_NAMES: dict[float, str] = {
    schema.LEVEL_SENTINEL: "sentinel only",
    schema.LEVEL_PEAK: "peaks",
    schema.LEVEL_FULL: "full statistics",
    schema.LEVEL_HIST: "full statistics + histograms",
}
LEVEL_NAMES = _LEVEL_NAMES  # public: the dashboard's observation line reads it


# the step columns a Summary reads (at 10^6 steps each one is 8 MB read, copied and checked)
SUMMARY_FIELDS = ("level", "loss_scale", "loss_scale_next", "loss", "observer_time", "step_time", "skipped")


@dataclass
class Summary:
    """The figures of a trace's steps that ``info`` prints (``summarize``)."""

    steps: int
    levels: dict[float, int]  # level -> steps
    reasons: dict[str, int]  # reason -> steps, most frequent first
    cost: dict[str, float] | None  # observer_cost's
    scale: dict[str, Any] | None  # first, first_step, last, last_step, min, max, next_last (None: no scale recorded)
    skipped: list[int] = field(default_factory=list)  # steps
    loss: dict[str, Any] | None = None  # first, first_step, last, last_step, nonfinite (steps); None: no finite loss
    lr_last: float | None = None


def summarize(trace: Trace) -> Summary:
    """A trace's Summary (ampdoctor.trace.Trace), from its steps read as arrays (``Trace.step_columns``: the writer's
    step blocks at once, the rows after them; checked as they are read)."""
    st = trace.step_columns(SUMMARY_FIELDS)
    n = len(st["step"])
    step, level = st["step"], st["level"]
    seen = ~np.isnan(level) & (level != schema.LEVEL_SENTINEL)
    lv, k = np.unique(level[seen], return_counts=True)
    levels = {int(v) if float(v).is_integer() else float(v): int(c) for v, c in zip(lv, k)}
    if n - int(seen.sum()):
        levels[schema.LEVEL_SENTINEL] = n - int(seen.sum())
    reasons, first_seen = _tally(st["reason"], step)
    order = sorted(reasons, key=lambda r: (-reasons[r], first_seen[r]))
    scale = _first_last(step, st["loss_scale"])
    nxt = _first_last(step, st["loss_scale_next"])
    loss = _first_last(step, st["loss"])
    if scale is not None:
        finite = st["loss_scale"][np.isfinite(st["loss_scale"])]
        scale.update(min=float(finite.min()), max=float(finite.max()), next_last=nxt and nxt["last"])
    if loss is not None:
        loss["nonfinite"] = step[~np.isfinite(st["loss"])].tolist()
    ok = np.isfinite(st["observer_time"]) & np.isfinite(st["step_time"])
    run_s, obs_s = float(st["step_time"][ok].sum()), float(st["observer_time"][ok].sum())
    timed = bool((~np.isnan(st["observer_time"])).any()) and run_s > 0
    lr = st["lr"][-1] if n else np.nan
    return Summary(
        steps=n,
        levels=levels,
        reasons={r: reasons[r] for r in order},
        cost={"share": obs_s / run_s, "seconds": obs_s, "run_seconds": run_s} if timed else None,
        scale=scale,
        skipped=step[np.nan_to_num(st["skipped"]) != 0].tolist(),
        loss=loss,
        lr_last=None if np.isnan(lr) else float(lr),
    )


def _tally(reasons: npt.NDArray[np.object_], step: npt.NDArray[np.int64]) -> tuple[dict[str, int], dict[str, int]]:
    """reason -> steps, and reason -> its first step (None: no reason recorded, not counted). Most steps' reason is
    "sentinel": counted at once, the others (a step in ten or so) by one Counter."""
    common = reasons == "sentinel"
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    if common.any():
        counts["sentinel"], first["sentinel"] = int(common.sum()), int(step[np.argmax(common)])
    others = np.flatnonzero(~common)
    names, at = reasons[others].tolist(), step[others].tolist()
    firsts: dict[str | None, int] = dict(zip(reversed(names), reversed(at)))  # a name's last write: its first step
    for name, k in Counter(names).items():
        if name is not None:  # (steps without a reason)
            counts[name], first[name] = k, firsts[name]
    return counts, first


def _first_last(step: npt.NDArray[np.int64], values: npt.NDArray[np.float64]) -> dict[str, Any] | None:
    """The first and the last finite value of a column and their steps (None: no finite value)."""
    at = np.flatnonzero(np.isfinite(values))
    if not len(at):
        return None
    a, b = int(at[0]), int(at[-1])
    return {"first": float(values[a]), "first_step": int(step[a]), "last": float(values[b]), "last_step": int(step[b])}


def observer_cost(steps: pd.DataFrame | Summary) -> dict[str, float] | None:
    """ampdoctor's host time on the training thread against the run's time (the sum of the step times, which
    include it): {"share", "seconds", "run_seconds"}; None for a trace that does not record it."""
    if isinstance(steps, Summary):
        return steps.cost
    if "observer_time" not in steps or not steps["observer_time"].notna().any():
        return None
    ok = np.isfinite(steps["observer_time"]) & np.isfinite(steps["step_time"])
    run_s, obs_s = float(steps.loc[ok, "step_time"].sum()), float(steps.loc[ok, "observer_time"].sum())
    if run_s <= 0:
        return None
    return {"share": obs_s / run_s, "seconds": obs_s, "run_seconds": run_s}


def cost_line(steps: pd.DataFrame | Summary) -> str | None:
    """ "ampdoctor cost 1.8% of this run (0.42 s of 23.1 s on the training thread)", or None. ``steps``: the steps
    DataFrame or a Summary."""
    c = observer_cost(steps)
    if c is None:
        return None
    return (
        f"ampdoctor cost {100 * c['share']:.1f}% of this run ({c['seconds']:.3g} s of {c['run_seconds']:.3g} s "
        "on the training thread)"
    )


def observation_line(meta: dict[str, Any], steps: pd.DataFrame | Summary) -> str:
    """Which steps observed what: the mode, and the steps per level and per reason. ``steps``: the steps DataFrame
    or a Summary."""
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
    if isinstance(steps, Summary):
        levels, reasons, n = dict(sorted(steps.levels.items(), reverse=True)), steps.reasons, steps.steps
    else:
        n = len(steps)
        levels = steps["level"].dropna().astype(int).value_counts().sort_index(ascending=False).to_dict() if n else {}
        reasons = steps["reason"].dropna().value_counts().to_dict() if n and "reason" in steps else {}
    if n:
        parts.append(", ".join(f"{_LEVEL_NAMES.get(lv, lv)} {k}" for lv, k in levels.items()))
        if reasons:
            parts.append("why: " + ", ".join(f"{k} {v}" for k, v in reasons.items() if k != "sentinel"))
    return "; ".join(parts) or "-"
