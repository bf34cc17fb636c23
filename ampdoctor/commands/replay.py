"""``ampdoctor replay TRACE``: recorded vs simulated loss-scale history for other GradScaler settings."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pandas as pd

from ..lossscale import TORCH_DEFAULTS, Replay, gradscaler_code, replay, suggest
from ..trace import Trace, load
from ..trace.checks import invalid_settings_note, scaler_setting_problem
from .common import EXIT_OK, UsageError, exact, pct, ranges


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (.db)")
    parser.add_argument(
        "--init-scale",
        type=float,
        default=None,
        metavar="X",
        help="initial loss scale to simulate (default: the run's own)",
    )
    parser.add_argument(
        "--growth-factor", type=float, default=None, metavar="X", help="growth factor (> 1; default: the run's own)"
    )
    parser.add_argument(
        "--backoff-factor",
        type=float,
        default=None,
        metavar="X",
        help="backoff factor (between 0 and 1; default: the run's own)",
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=None,
        metavar="N",
        help="steps without overflow before the scale grows (default: the run's own)",
    )
    parser.add_argument(
        "--suggest",
        action="store_true",
        help="search init_scale and growth_interval for the fewest skipped steps and least underflow",
    )


def _column(r: Replay) -> dict[str, str]:
    n = len(r.steps)
    return {
        "skipped steps": f"{r.n_skipped} ({pct(r.n_skipped / n)})",
        "scale range": f"{exact(float(r.scales.min()))} .. {exact(float(r.scales.max()))}",
        "final scale": exact(r.final_scale),
        "underflow": pct(r.mean_underflow),
        "flushed to 0": pct(r.mean_flushed),
        "gradient lost": pct(r.lost),
    }


def _settings_line(s: dict[str, float]) -> str:
    return (
        f"init_scale {exact(s['init_scale'])}, growth_factor {s['growth_factor']:g}, "
        f"backoff_factor {s['backoff_factor']:g}, growth_interval {s['growth_interval']}"
    )


def run(args: argparse.Namespace) -> int:
    tr = load(args.trace)
    if not tr.n_steps:
        raise UsageError(f"{args.trace}: the trace has no steps yet")
    try:
        base = replay(tr)
        sim = replay(
            tr,
            init_scale=args.init_scale,
            growth_factor=args.growth_factor,
            backoff_factor=args.backoff_factor,
            growth_interval=args.growth_interval,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    st = tr.steps()
    recorded_scaler = bool((tr.config.get("scaler") or {}).get("enabled")) and st["loss_scale"].notna().any()
    n = len(st)
    print(f"replay of {args.trace}: {n} steps")
    if recorded_scaler:
        print(f"recorded   {_settings_line(base.settings)}")
        for note in _recorded_notes(tr.config, st):
            print(f"note: {note}")
        rec = _column(base)
        rec["skipped steps"] = f"{int(st['skipped'].sum())} ({pct(st['skipped'].sum() / n)})"
    else:
        print("recorded   no GradScaler (unscaled gradients); simulated with torch's defaults unless given")
        rec = {k: "-" for k in _column(base)}
        rec["skipped steps"] = "0 (no scaler)"
        rec["underflow"] = pct(_at_scale_one(tr))
    print(f"simulated  {_settings_line(sim.settings)}")
    print()
    width = max(len(k) for k in rec)
    cols = _column(sim)
    print(f"{'':{width}s}  {'recorded':>20s}  {'simulated':>20s}")
    for key in rec:
        print(f"{key:{width}s}  {rec[key]:>20s}  {cols[key]:>20s}")
    if sim.n_skipped:
        print(f"simulated skips at step(s) {ranges([int(s) for s in sim.steps[sim.skipped]])}")
    if recorded_scaler:
        rec_scales = st["loss_scale"].to_numpy(float)
        off = np.flatnonzero(~np.isnan(rec_scales) & (base.scales != rec_scales))
        if len(off):
            print(
                f"note: the recorded scale departs from GradScaler's rule at step {int(base.steps[off[0]])} "
                "(a manual update(new_scale) or a scaler state loaded mid-run?); the simulation follows the rule"
            )
        elif sim.settings == base.settings:
            print("(the run's own settings: the replay reproduces the recorded scale history)")
    if sim.estimated.any():
        print(
            f"note: {int(sim.estimated.sum())} skip decision(s) estimated from neighbouring steps (the recorded "
            "step overflowed at a higher scale)"
        )
    if sim.assumed_fp16:
        print("note: the run computed no gradient in FP16; replayed as if it had (what FP16 would do)")
    if args.suggest:
        from tqdm.auto import tqdm

        sg = suggest(
            tr,
            progress=lambda grid: tqdm(
                grid, desc="replaying scaler settings", unit="setting", disable=None, leave=False
            ),
        )
        print()
        best = sg.replay
        print(
            f"suggested  {_settings_line(sg.settings)}  ({sg.searched} settings tried; objective: the share "
            "of gradient lost = skipped steps + underflow of the applied ones)"
        )
        print(
            f"           skipped {best.n_skipped}, underflow {pct(best.mean_underflow)}, gradient lost "
            f"{pct(best.lost)} (run's own settings: {pct(sg.baseline.lost)})"
        )
        if not sg.improves:
            print("           the run's own settings are already as good as any tried")
        print(f"    scaler = {gradscaler_code(sg.settings, sg.device)}")
        for note in sg.notes:
            print(f"note: {note}")
    return EXIT_OK


def _at_scale_one(tr: Trace) -> float:
    """Underflow of a run without a scaler: the shares at scale 1 (what happened)."""
    u = replay(tr, init_scale=1.0, growth_interval=10**9).underflow
    u = u[~np.isnan(u)]
    return float(u.mean()) if len(u) else float("nan")


def _recorded_notes(config: dict[str, Any], st: pd.DataFrame) -> list[str]:
    """What of the run's own settings the replay could not take from the trace (replaced by torch's defaults)."""
    notes = [invalid_settings_note(config)]
    first = st["loss_scale"].dropna()
    if len(first) and scaler_setting_problem("init_scale", float(first.iloc[0])):
        notes.append(
            f"the recorded scale of the first step ({first.iloc[0]:g}) cannot start a GradScaler (not a positive "
            f"finite number); the replay starts from torch's default {TORCH_DEFAULTS['init_scale']:g}"
        )
    return [n for n in notes if n]
