"""What a trace observed and what observing cost: the lines ``ampdoctor info``, the dashboard overview and the report
show, from a steps DataFrame or, for a run of any length, from a few aggregate queries over the steps table (Summary:
no row of it read into Python but the steps that are the answer, e.g. the skipped ones). Offline side: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import checks, schema

_LEVEL_NAMES = {
    schema.LEVEL_SENTINEL: "sentinel only",
    schema.LEVEL_PEAK: "peaks",
    schema.LEVEL_FULL: "full statistics",
    schema.LEVEL_HIST: "full statistics + histograms",
}
# a value SQLite holds as a number, finite (a NaN REAL is NULL there; the writer stores NaN as the text 'nan')
_FINITE = "(typeof({c}) IN ('integer', 'real') AND abs({c}) <= 1.7976931348623157e308)"
# what the reader accepts in a number column: a number, NULL, or the writer's NaN/Inf texts
_NUMBER = "(typeof({c}) IN ('integer', 'real', 'null') OR {c} IN ('nan', 'inf', '-inf'))"


@dataclass
class Summary:
    """The figures of a trace's steps that ``info`` prints, from aggregate queries (``summarize``)."""

    steps: int
    levels: dict  # level -> steps
    reasons: dict  # reason -> steps, most frequent first
    cost: dict | None  # observer_cost's
    scale: dict | None  # first, first_step, last, last_step, min, max, next_last (None: no scale recorded)
    skipped: list = field(default_factory=list)  # steps
    loss: dict | None = None  # first, first_step, last, last_step, nonfinite (steps); None: no finite loss
    lr_last: float | None = None


def summarize(trace) -> Summary:
    """A trace's Summary (ampdoctor.trace.Trace): one scan of the steps table for the counts and sums, index reads
    for the first and last values; the number columns it aggregates are checked in the same scan."""
    q = trace._query
    have = {r[1] for r in q("PRAGMA table_info(steps)")}
    col = lambda c: c if c in have else "NULL"  # noqa: E731 (a trace from before the later columns)
    with trace.snapshot():
        n = q("SELECT count(*) FROM steps")[0][0]
        numbers = ("step_time", "observer_time", "loss", "loss_scale", "loss_scale_next", "skipped", "level")
        bad = " + ".join(f"(NOT {_NUMBER.format(c=col(c))})" for c in numbers)
        ok = f"{_FINITE.format(c=col('step_time'))} AND {_FINITE.format(c=col('observer_time'))}"
        sums = q(
            f"SELECT {bad}, sum(CASE WHEN {ok} THEN {col('step_time')} END), "
            f"sum(CASE WHEN {ok} THEN {col('observer_time')} END), count({col('observer_time')}), "
            f"min(CASE WHEN {_FINITE.format(c=col('loss_scale'))} THEN loss_scale END), "
            f"max(CASE WHEN {_FINITE.format(c=col('loss_scale'))} THEN loss_scale END) FROM steps"
        )[0]
        if sums[0]:
            raise checks.Invalid("table steps: a number column holds a value that is not a number")
        groups = q(f"SELECT {col('level')}, {col('reason')}, count(*), min(step) FROM steps GROUP BY 1, 2")
        scale = _first_last(q, "loss_scale", have)
        nxt = _first_last(q, "loss_scale_next", have)
        loss = _first_last(q, "loss", have, finite=True)
        skipped = [r[0] for r in q("SELECT step FROM steps WHERE skipped IS NOT NULL AND skipped != 0 ORDER BY step")]
        bad_loss = (
            [r[0] for r in q(f"SELECT step FROM steps WHERE NOT {_FINITE.format(c='loss')} ORDER BY step")]
            if loss is not None
            else []
        )
        lr = q("SELECT lr FROM steps ORDER BY step DESC LIMIT 1") if "lr" in have else []
    levels: dict = {}
    reasons: dict = {}
    first_seen: dict = {}
    for level, reason, count, first in groups:
        if level is not None:
            lv = int(level) if float(level).is_integer() else level
            levels[lv] = levels.get(lv, 0) + count
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + count
            first_seen[reason] = min(first_seen.get(reason, first), first)
    order = sorted(reasons, key=lambda r: (-reasons[r], first_seen[r]))
    cost = None
    if sums[3] and sums[1] is not None and sums[1] > 0:
        cost = {"share": (sums[2] or 0.0) / sums[1], "seconds": sums[2] or 0.0, "run_seconds": sums[1]}
    return Summary(
        steps=n,
        levels=levels,
        reasons={r: reasons[r] for r in order},
        cost=cost,
        scale=None if scale is None else {**scale, "min": sums[4], "max": sums[5], "next_last": nxt and nxt["last"]},
        skipped=skipped,
        loss=None if loss is None else {**loss, "nonfinite": bad_loss},
        lr_last=_lr(lr[0][0]) if lr else None,
    )


def _first_last(q, c: str, have: set, finite: bool = False) -> dict | None:
    """The first and the last value of a column (non-NULL; with ``finite``, finite numbers) and their steps."""
    if c not in have:
        return None
    where = _FINITE.format(c=c) if finite else f"{c} IS NOT NULL AND {_FINITE.format(c=c)}"
    first = q(f"SELECT step, {c} FROM steps WHERE {where} ORDER BY step LIMIT 1")
    if not first:
        return None
    last = q(f"SELECT step, {c} FROM steps WHERE {where} ORDER BY step DESC LIMIT 1")
    return {"first": float(first[0][1]), "first_step": first[0][0], "last": float(last[0][1]), "last_step": last[0][0]}


def _lr(text) -> float | None:
    v = checks.parse_json(text, "steps.lr") if text else None
    if v is None:
        return None
    checks.check_value(v, [(checks.NUM, None)], "steps.lr")
    return float(v[0]) if v and v[0] is not None else None


def observer_cost(steps) -> dict | None:
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


def cost_line(steps) -> str | None:
    """ "ampdoctor cost 1.8% of this run (0.42 s of 23.1 s on the training thread)", or None. ``steps``: the steps
    DataFrame or a Summary."""
    c = observer_cost(steps)
    if c is None:
        return None
    return (
        f"ampdoctor cost {100 * c['share']:.1f}% of this run ({c['seconds']:.3g} s of {c['run_seconds']:.3g} s "
        "on the training thread)"
    )


def observation_line(meta: dict, steps) -> str:
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
