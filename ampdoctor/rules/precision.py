"""precision-loss: layers whose half-precision output is far less accurate than the format's unit roundoff explains
for their size, measured by the probe (``attach(probe_every=N)``: the layer recomputed in FP32 from the same
inputs). The bound and the verdict on one probed step are in ampdoctor/roundoff.py (shared with the probe); here,
the verdict over a run's probed steps and the finding."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..roundoff import (  # noqa: F401 (re-exported: the rule and its users read them here)
    MIN_RATIO,
    UNIT_ROUNDOFF,
    bound,
    culprits_of,
    fix_line,
    format_table,
    judge,
    relative,
    unit_roundoff,
)
from . import advice as A
from .fix import code, text
from .result import Diagnosis, finding
from .runview import RunView

# A layer is named when it exceeds the bound at at least half of the probed steps (one odd batch is not a layer).
MIN_SHARE = 0.5


# -- over a trace ------------------------------------------------------------------------------------------------
def compute_dtype(run: RunView) -> str:
    return run.compute_dtype or "float16"


def probes(run: RunView) -> pd.DataFrame:
    """The run's probe table (Trace.probes), read once per Run (``Run.probes``)."""
    return run.probes


def layer_verdicts(run: RunView, min_ratio: float = MIN_RATIO, min_share: float = MIN_SHARE) -> list[dict[str, Any]]:
    """Per probed layer over the probed steps: median and worst error, bound, share of steps over the bound; the
    named layers (``named``) worst first, then the rest. Keys: path, module_type, k, bound, rel_err_median,
    rel_err_max, max_err_median, ratio, share_over, probed_steps, steps ([first, last]), named. (Plain dicts: the
    dashboard's probe_series hands them on as such.)"""
    pr = probes(run)
    if not len(pr):
        return []
    dtype = compute_dtype(run)
    out: list[dict[str, Any]] = []
    for path, g in pr.groupby("path", sort=False):
        k = float(g["k"].max())
        b = bound(k, dtype)
        rel = g["rel_err"].to_numpy(float)
        out.append(
            {
                "path": str(path),
                "module_type": g["module_type"].iloc[0],
                "k": int(k),
                "bound": b,
                "rel_err_median": float(np.median(rel)),
                "rel_err_max": float(np.max(rel)),
                "max_err_median": float(np.median(g["max_err"].to_numpy(float))),
                "ratio": float(np.median(rel)) / b,
                "share_over": float(np.mean(rel >= min_ratio * b)),
                "probed_steps": len(g),
                "steps": [int(g["step"].min()), int(g["step"].max())],
            }
        )
    over = [v for v in out if v["share_over"] >= min_share and v["ratio"] >= min_ratio]
    keep = set(culprits_of([v["path"] for v in over]))
    for v in out:
        v["named"] = v["path"] in keep
    return sorted(out, key=lambda v: (not v["named"], -v["ratio"]))


def measured_culprits(run: RunView) -> list[tuple[str, str]]:
    """(layer, why) for the layers the probe measured losing precision; for val-oscillation's blame."""
    return [
        (
            v["path"],
            f"{v['module_type']} measured {v['rel_err_median']:.2g} relative error against FP32, "
            f"{v['ratio']:.0f}x sqrt(k)*u",
        )
        for v in layer_verdicts(run)
        if v["named"]
    ]


def _convert(path: str, dtype: str) -> str:
    m = A.attr(path)
    return (
        f"{m}.float()\n"
        f"{m}.register_forward_pre_hook(lambda m, args: tuple(a.float() if torch.is_tensor(a) and "
        f"a.is_floating_point() else a for a in args))\n"
        f"{m}.register_forward_hook(lambda m, args, out: out.to(torch.{dtype}))\n"
    )


def precision_loss(run: RunView, *, min_ratio: float = MIN_RATIO, min_share: float = MIN_SHARE) -> Diagnosis | None:
    verdicts = layer_verdicts(run, min_ratio, min_share)
    named = [v for v in verdicts if v["named"]]
    if not named:
        return None
    dtype = compute_dtype(run)
    paths = [v["path"] for v in named]
    worst = named[0]
    ev = {
        "dtype": dtype,
        "unit_roundoff": unit_roundoff(dtype),
        "min_ratio": min_ratio,
        "layers": {
            v["path"]: {
                k: v[k]
                for k in (
                    "module_type",
                    "k",
                    "rel_err_median",
                    "rel_err_max",
                    "max_err_median",
                    "bound",
                    "ratio",
                    "share_over",
                    "probed_steps",
                )
            }
            for v in named
        },
        "probed_layers": len(verdicts),
    }
    steps = [min(v["steps"][0] for v in named), max(v["steps"][1] for v in named)]
    summary = (
        f"Recomputed in FP32 from the same inputs, {worst['path']} ({worst['module_type']}) is off by "
        f"{worst['rel_err_median']:.2g} (norm-wise relative; worst element {worst['max_err_median']:.2g} of "
        f"the output's max), {worst['ratio']:.0f}x the sqrt(k)*u = {worst['bound']:.2g} that {dtype} rounding "
        f"explains for k = {worst['k']}"
        + (f"; also {', '.join(paths[1:])}" if len(paths) > 1 else "")
        + ": a difference of large, nearly equal quantities (catastrophic cancellation) computed in half "
        "precision."
    )
    fix = [
        text(
            "Compute these layers in FP32 (inputs cast to float32 inside autocast); or rewrite the computation "
            "without the cancellation (e.g. var = mean((x - mean)^2) instead of mean(x^2) - mean^2):"
        ),
        code(fix_line(paths)),
    ]
    if not run.autocast.get("enabled"):
        # keep_fp32 acts inside autocast only: a run with half-precision weights and no autocast needs the modules
        # converted and their inputs cast by hand
        fix = [
            text(
                "This run computes without autocast (half-precision weights), where keep_fp32 changes nothing. "
                "Run these layers in FP32 (weights, inputs cast up, outputs cast back for the next layer), or "
                "rewrite the computation without the cancellation:"
            ),
            code("".join(_convert(p, dtype) for p in paths)),
        ]
    return finding(
        "warning",
        "Precision lost in a layer (measured against FP32)",
        summary,
        layers=paths,
        steps=steps,
        evidence=ev,
        fix=fix,
    )
