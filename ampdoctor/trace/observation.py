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
LEVEL_NAMES = _LEVEL_NAMES  # public: the dashboard's observation line reads it
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
    """A trace's Summary (ampdoctor.trace.Trace): one scan of the steps table for the counts and sums, two for the
    levels and reasons of the steps that observed something, index reads for the first and last values; the number
    columns it aggregates are checked (max() in the same scan, and value by value where that finds text)."""
    q = trace.query
    have = {r[1] for r in q("PRAGMA table_info(steps)")}
    col = lambda c: c if c in have else "NULL"  # noqa: E731 (a trace from before the later columns)
    with trace.snapshot():
        numbers = ("step_time", "observer_time", "loss", "loss_scale", "loss_scale_next", "skipped", "level")
        st, ot, ls = col("step_time"), col("observer_time"), col("loss_scale")
        fin = "({c} - {c} = 0 AND typeof({c}) != 'text')"  # finite (inf - inf is NaN, which SQLite calls NULL)

        def aggregates(f: str) -> str:  # f: a finiteness test (a cheaper one when a column holds no text)
            both = f"{f.format(c=st)} AND {f.format(c=ot)}"
            return (
                f"sum(CASE WHEN {both} THEN {st} END), sum(CASE WHEN {both} THEN {ot} END), count({ot}), "
                f"min(CASE WHEN {f.format(c=ls)} THEN {ls} END), max(CASE WHEN {f.format(c=ls)} THEN {ls} END)"
            )

        # one scan: counts and sums, and max() of every number column, which is text or a blob when any value is
        # (SQLite orders NULL < numbers < text < blobs): then the column is checked value by value, and the sums
        # taken again with the text left out
        sums = q(
            f"SELECT count(*), {aggregates('({c} - {c} = 0)')}, "
            f"group_concat(CASE WHEN {col('skipped')} IS NOT NULL AND {col('skipped')} != 0 THEN step END), "
            f"group_concat(CASE WHEN {fin.format(c=col('loss'))} THEN NULL ELSE step END), "  # NULL, NaN, Inf
            + ", ".join(f"max({col(c)})" for c in numbers)
            + " FROM steps"
        )[0]
        n = sums[0]
        for c, top in zip(numbers, sums[8:]):
            if isinstance(top, (str, bytes)) and q(f"SELECT 1 FROM steps WHERE NOT {_NUMBER.format(c=c)} LIMIT 1"):
                raise checks.Invalid(f"table steps: column {c} holds a value that is not a number")
        if any(isinstance(sums[i], str) for i in (8, 9, 11)):  # a 'nan' text in step_time, observer_time, loss_scale
            sums = (sums[0], *q(f"SELECT {aggregates(fin)} FROM steps")[0], *sums[6:])
        lv, why = col("level"), col("reason")
        # the levels and reasons of the steps that observed something, grouped (the sentinel's: the rest)
        levels_seen = q(f"SELECT {lv}, count(*) FROM steps WHERE {lv} IS NOT -1 GROUP BY 1")
        reasons_seen = q(f"SELECT {why}, count(*), min(step) FROM steps WHERE {why} IS NOT 'sentinel' GROUP BY 1")
        sentinel_first = q(f"SELECT min(step) FROM steps WHERE {why} = 'sentinel'")[0][0]
        groups = [(v, None, k, 0) for v, k in levels_seen] + [(-1, None, n - sum(k for _, k in levels_seen), 0)]
        groups += [(None, r, k, first) for r, k, first in reasons_seen]
        groups.append((None, "sentinel", n - sum(k for _, k, _ in reasons_seen), sentinel_first))
        scale = _first_last(q, "loss_scale", have)
        nxt = _first_last(q, "loss_scale_next", have)
        loss = _first_last(q, "loss", have, finite=True)
        skipped = _steps(sums[6])
        bad_loss = _steps(sums[7]) if loss is not None else []
        lr = q("SELECT lr FROM steps ORDER BY step DESC LIMIT 1") if "lr" in have else []
    levels: dict = {}
    reasons: dict = {}
    first_seen: dict = {}
    for level, reason, count, first in groups:
        if not count:
            continue
        if level is not None:
            lv = int(level) if float(level).is_integer() else level
            levels[lv] = levels.get(lv, 0) + count
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + count
            first_seen[reason] = min(first_seen.get(reason, first), first)
    order = sorted(reasons, key=lambda r: (-reasons[r], first_seen[r]))
    cost = None
    run_s, obs_s, timed = sums[1], sums[2], sums[3]
    if timed and run_s is not None and run_s > 0:
        cost = {"share": (obs_s or 0.0) / run_s, "seconds": obs_s or 0.0, "run_seconds": run_s}
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


def _steps(text) -> list:
    """Steps from a group_concat of integers (None: none)."""
    return [int(v) for v in text.split(",")] if text else []


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
