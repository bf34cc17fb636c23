"""val-oscillation: a logged validation metric oscillates beyond its trend, and the layers whose precision explains
it (typically normalisation layers whose running statistics are kept in half precision)."""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from .. import formats
from ..trace.reduce import theil_sen_line
from ..trace.schema import ROOT
from . import advice as A
from . import precision
from .fix import text
from .policy import NORM_TYPES
from .result import Diagnosis, Evidence, finding
from .runview import FloatArray, IntArray, RunView

BATCHNORM_TYPES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")

# Metric names (``doctor.log_metric("val/loss", v)``) whose first component marks a validation metric.
VALIDATION_PREFIXES = ("val", "valid", "validation", "eval", "test")
# The first half of the logged points holds the initial descent (and, for BatchNorm, the running statistics
# warming up from their initial 0/1); oscillation is judged on the second half, where a healthy metric has settled.
LATE_SHARE = 0.5
# Fewer than 20 late points and a robust dispersion estimate (median absolute residual) is uncertain by a factor
# ~1.5: no verdict.
MIN_POINTS = 20
# With a reference run: the metric's dispersion around its trend at least 3x the reference's (run-to-run changes
# of a healthy run's dispersion stay within ~1.5x), and significant by a Fligner-Killeen test of equal dispersion
# (rank based, robust to the heavy tails an oscillating metric has) at p < 0.01.
MIN_RATIO = 3.0
ALPHA = 0.01
# Without a reference only strong evidence: the log metric swings by a robust sigma of 0.3 (about +-35%) around its
# trend. A healthy model evaluated on a fixed validation set moves a few percent between evaluations (up to ~20% for
# a loss near its noise floor).
MIN_DISPERSION = 0.3
# Oscillation, not a smooth curve around a straight trend: at least 20% of consecutive residuals change sign
# (independent noise gives 50%; a decaying or bending curve leaves residuals that change sign a few times, < 10%).
MIN_SIGN_CHANGES = 0.2


def _is_validation(name: str) -> bool:
    head = name.replace("_", "/").replace(".", "/").split("/")[0].lower()
    return head in VALIDATION_PREFIXES


class Residuals(TypedDict):
    """A metric's late segment around its trend (``residuals``)."""

    residuals: FloatArray
    dispersion: float
    sign_changes: float
    slope: float
    steps: list[int]
    points: int
    range: list[float]
    log_dispersion: float | None


def _series(run: RunView, name: str) -> tuple[IntArray, FloatArray]:
    m = run.metrics
    if not len(m):
        return np.array([], int), np.array([])
    m = m[m["name"] == name].groupby("step", as_index=False)["value"].last().sort_values("step")
    steps, v = m["step"].to_numpy(int), m["value"].to_numpy(float)
    ok = np.isfinite(v)
    return steps[ok], v[ok]


def _sigma(r: FloatArray) -> float:
    """Robust dispersion around the trend: the median absolute residual as a Gaussian sigma. About the trend, not
    about the residuals' median (MAD): a metric alternating between two levels has a MAD near 0."""
    return float(np.median(np.abs(r)) * 1.4826)  # 1.4826 = 1 / Phi^-1(3/4)


def residuals(steps: IntArray, values: FloatArray, late_share: float = LATE_SHARE) -> Residuals | None:
    """Late-segment residuals of the metric around its Theil-Sen trend, in its own units and (when positive) in
    log units, with their robust dispersions (``_sigma``) and the share of sign changes between neighbours."""
    cut = round(len(values) * (1.0 - late_share))
    x, v = steps[cut:].astype(float), values[cut:]
    if len(v) < MIN_POINTS:
        return None
    slope, intercept = theil_sen_line(v, x)  # scipy.stats.theilslopes' numbers, without importing scipy.stats
    r = v - (intercept + slope * x)
    tiny = 1e-9 * float(np.max(np.abs(v)))  # rounding residue of an exact fit is no sign
    signs = np.sign(r[np.abs(r) > tiny])
    flips = float(np.mean(signs[1:] != signs[:-1])) if len(signs) > 1 else 0.0
    out: Residuals = {
        "residuals": r,
        "dispersion": _sigma(r),
        "sign_changes": flips,
        "slope": float(slope),
        "steps": [int(x[0]), int(x[-1])],
        "points": len(v),
        "range": [float(v.min()), float(v.max())],
        "log_dispersion": None,
    }
    if (v > 0).all():
        y = np.log(v)
        lslope, lintercept = theil_sen_line(y, x)
        out["log_dispersion"] = _sigma(y - (lintercept + lslope * x))
    return out


def culprits(run: RunView) -> list[tuple[str, str]]:
    """(layer, why) for the layers whose precision is worst: normalisation layers whose parameters and running
    statistics are in half precision, then normalisation layers computing in half precision, then the other
    half-precision layers by their headroom under the format's max. Empty for an FP32 run. Layers the precision
    probe measured losing precision (precision-loss) come first: a measurement, not a guess."""
    measured = precision.measured_culprits(run)
    acts = run.sites("act")
    pdt = run.config.get("module_param_dtypes", {}) or {}
    types = run.module_types
    half_act = dict(zip(acts["path"], acts["dtype"]))
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path, mtype in types.items():
        if mtype in NORM_TYPES and pdt.get(path) in formats.REDUCED:
            out.append((path, f"{mtype} keeps its parameters and running statistics in {pdt[path]}"))
            seen.add(path)
    for path, mtype in types.items():
        if path not in seen and mtype in NORM_TYPES and half_act.get(path) in formats.REDUCED:
            out.append((path, f"{mtype} computes in {half_act[path]}"))
            seen.add(path)
    out = measured + [(p, why) for p, why in out if p not in {m for m, _ in measured}]
    if out:
        return out
    half = acts[acts["dtype"].isin(formats.REDUCED) & (acts["path"] != ROOT)]
    if not len(half):
        return []
    peaks = run.stat("absmax", "act")  # at the full-statistics steps read
    column = {int(sid): j for j, sid in enumerate(acts["id"])}
    scored = []
    for _, site in half.iterrows():
        j = column[int(site["id"])]
        col = peaks[:, j]
        col = col[np.isfinite(col) & (col > 0)]
        if len(col):
            fmt = formats.get(site["dtype"])
            headroom = math.log2(fmt.max / float(np.max(col)))
            scored.append(
                (
                    headroom,
                    site["path"],
                    f"{site['module_type']} in {site['dtype']}, {headroom:.1f} binades under its max",
                )
            )
    scored.sort()
    return [(p, why) for _, p, why in scored[:3]]


def _compare(
    run: RunView,
    name: str,
    late_share: float,
    min_ratio: float,
    alpha: float,
    min_dispersion: float,
    min_sign_changes: float,
) -> Evidence | None:
    steps, v = _series(run, name)
    own = residuals(steps, v, late_share)
    if own is None or own["sign_changes"] < min_sign_changes:
        return None  # too few points, or a smooth curve rather than an oscillation
    ev: Evidence = {
        "metric": name,
        "points": own["points"],
        "late_steps": own["steps"],
        "late_range": own["range"],
        "dispersion": own["dispersion"],
        "log_dispersion": own["log_dispersion"],
        "sign_change_share": own["sign_changes"],
        "trend_slope": own["slope"],
    }
    ref = run.reference
    other = residuals(*_series(ref, name), late_share) if ref is not None else None
    if other is not None:
        # in the metric's own units: a swing of 0.3 in a loss the reference holds at 0.03 +- 0.005 is the symptom
        # whatever the level it swings around
        from scipy.stats import fligner

        ratio = own["dispersion"] / other["dispersion"] if other["dispersion"] > 0 else math.inf
        p = float(fligner(own["residuals"], other["residuals"]).pvalue)
        if not (ratio >= min_ratio and p < alpha):
            return None  # no more oscillation than the reference: not a precision problem
        ev.update(
            against="reference",
            reference_dispersion=other["dispersion"],
            dispersion_ratio=ratio,
            fligner_p=p,
            reference_range=other["range"],
        )
        return ev
    if own["log_dispersion"] is None or own["log_dispersion"] < min_dispersion:
        return None  # without a reference only a strong (relative) oscillation is evidence
    ev["against"] = "own trend"
    return ev


def val_oscillation(
    run: RunView,
    *,
    late_share: float = LATE_SHARE,
    min_ratio: float = MIN_RATIO,
    alpha: float = ALPHA,
    min_dispersion: float = MIN_DISPERSION,
    min_sign_changes: float = MIN_SIGN_CHANGES,
) -> Diagnosis | None:
    m = run.metrics
    if not len(m):
        return None
    names = sorted(n for n in m["name"].unique() if _is_validation(str(n)))
    hits = [
        e
        for e in (_compare(run, n, late_share, min_ratio, alpha, min_dispersion, min_sign_changes) for n in names)
        if e is not None
    ]
    if not hits:
        return None
    layers = culprits(run)
    if not layers:
        return None  # nothing computed in half precision: not a precision fault
    # the strongest: a reference comparison before an own-trend verdict, then by its figure
    ev = max(hits, key=lambda e: (e["against"] == "reference", e.get("dispersion_ratio", e["log_dispersion"])))
    ev["layers"] = {p: why for p, why in layers}
    if len(hits) > 1:
        ev["also_oscillating"] = [e["metric"] for e in hits if e is not ev]
    paths = [p for p, _ in layers]
    if ev["against"] == "reference":
        how = (
            f"{ev['dispersion_ratio']:.1f}x the reference run's dispersion around the Theil-Sen trend "
            f"({A.fmt_num(ev['dispersion'])} vs {A.fmt_num(ev['reference_dispersion'])}, Fligner-Killeen "
            f"p={ev['fligner_p']:.2g})"
        )
    else:
        how = f"a log dispersion of {ev['log_dispersion']:.2f} around its Theil-Sen trend"
    lo, hi = ev["late_range"]
    fix = [
        text(
            "Keep these layers in FP32: their parameters and (BatchNorm) the running mean/variance that eval "
            "mode normalises with, whose every update (1-m)*r + m*batch rounds in half precision, and their "
            "inputs cast to FP32:"
        ),
        *A.fp32_island(A.Setup.of(run), paths),
    ]
    return finding(
        "warning",
        "Validation metric oscillates",
        f"{ev['metric']} swings between {A.fmt_num(lo)} and {A.fmt_num(hi)} over steps {ev['late_steps'][0]}-"
        f"{ev['late_steps'][1]}: {how}, {A.pct(ev['sign_change_share'])} of consecutive residuals change sign; "
        f"worst precision: {layers[0][1]} ({paths[0]}).",
        layers=paths,
        steps=ev["late_steps"],
        evidence=ev,
        fix=fix,
    )
