"""Precision configuration rules: amp-inactive (AMP intended, not active), precision-policy (FP32-only work in
half precision)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import formats
from . import advice as A
from .fix import code, text
from .result import Diagnosis, finding
from .runview import RunView

NORM_TYPES = (
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "SyncBatchNorm",
    "LayerNorm",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "RMSNorm",
    "LocalResponseNorm",
)
SOFTMAX_TYPES = ("Softmax", "LogSoftmax", "Softmin", "Softmax2d")
# Softmax outputs in half precision: probabilities under the format's normal range lose bits and the ones under
# its smallest subnormal become 0 (log(0) = -inf later); 1% of the outputs there is harm, not noise.
MIN_SOFTMAX_UNDERFLOW = 0.01


def _reduced_acts(run: RunView) -> pd.DataFrame:
    acts = run.sites("act")
    return acts[acts["dtype"].isin(formats.REDUCED)]


def amp_inactive(run: RunView) -> Diagnosis | None:
    ac = run.autocast
    if not (run.scaler_on or ac.get("enabled")):
        return None  # no sign that AMP was intended
    acts = run.sites("act")
    if not len(acts) or len(_reduced_acts(run)):
        return None
    params = run.config.get("param_dtypes", {}) or {}
    if any(k in formats.REDUCED for k in params):
        return None
    dtypes = acts.groupby("dtype").size().to_dict()
    if run.scaler_on and not ac.get("enabled"):
        what = "a GradScaler is enabled but no autocast region covered the forward pass"
    else:
        what = f"autocast ({ac.get('dtype')}) was on, yet every module computed in FP32"
    setup = A.Setup.of(run)
    fix = [
        text(
            "Wrap the forward pass and the loss in autocast"
            + (" (the GradScaler alone only multiplies the loss):" if run.scaler_on else ":")
        ),
        code(A.autocast_block(run, "float16"), *A.backward_lines(setup, run.scaler_on)),
    ]
    if run.bf16_supported:
        fix += [
            text("Or use BF16 autocast and drop the scaler (this device supports BF16):"),
            code(A.autocast_block(run, "bfloat16"), *A.backward_lines(setup, False)),
        ]
    fix += [text("If FP32 training was intended, remove the GradScaler."), *A.tf32_note(run)]
    return finding(
        "warning",
        "Mixed precision intended but not active",
        f"AMP is not running: {what}; all {len(acts)} observed module outputs are FP32.",
        layers=[],
        steps=[0, run.n_steps - 1],
        evidence={
            "scaler_enabled": run.scaler_on,
            "autocast": ac,
            "activation_dtypes": dtypes,
            "param_dtypes": params,
            "device": run.device,
        },
        fix=fix,
    )


def precision_policy(run: RunView, *, min_softmax_underflow: float = MIN_SOFTMAX_UNDERFLOW) -> Diagnosis | None:
    items = []  # (layer, what, evidence, fix)
    loss_dtype = run.config.get("loss_dtype")
    if loss_dtype in formats.REDUCED:
        fmt = formats.get(loss_dtype)
        loss = run.steps["loss"].dropna()
        level = float(loss.median()) if len(loss) else float("nan")
        items.append(
            (
                "(loss)",
                f"the loss was computed in {loss_dtype}",
                {
                    "loss_dtype": loss_dtype,
                    "median_loss": level,
                    "loss_resolution": fmt.ulp(level) if level == level else None,
                },
                [text("Compute the loss in FP32 from the model output:"), A.loss_in_fp32(A.Setup.of(run))],
            )
        )
    types = run.module_types
    pdt = run.config.get("module_param_dtypes", {}) or {}
    acts = run.sites("act")
    for path, mtype in types.items():
        if mtype in NORM_TYPES and pdt.get(path) in formats.REDUCED:
            items.append(
                (
                    path,
                    f"{mtype} keeps its parameters/statistics in {pdt[path]}",
                    {"module_type": mtype, "param_dtype": pdt[path]},
                    [
                        text(f"Keep {path} in FP32 (its mean/variance need the range and bits):"),
                        *A.fp32_island(A.Setup.of(run), [path]),
                    ],
                )
            )
    soft = acts[acts["module_type"].isin(SOFTMAX_TYPES) & acts["dtype"].isin(formats.REDUCED)]
    if len(soft):
        fs = run.stat_steps  # the full-statistics steps read (all of them, or evenly spaced ones)
        n = run.stat("numel", "act")
        under = run.stat("fp16_sub", "act") + run.stat("fp16_flush", "act")
        column = {int(sid): j for j, sid in enumerate(acts["id"])}
        for _idx, site in soft.iterrows():
            j = column[int(site["id"])]
            with np.errstate(all="ignore"):
                share = under[:, j] / n[:, j] if site["dtype"] == "float16" else np.zeros(len(fs))
            share = share[np.isfinite(share)]
            if len(share) and float(np.median(share)) >= min_softmax_underflow:
                items.append(
                    (
                        site["path"],
                        f"{site['module_type']} ran in {site['dtype']}",
                        {
                            "module_type": site["module_type"],
                            "dtype": site["dtype"],
                            "underflow_share": float(np.median(share)),
                        },
                        A.keep_fp32(A.Setup.of(run), [site["path"]]),
                    )
                )
    if not items:
        return None
    layers = [p for p, *_ in items if p != "(loss)"]
    return finding(
        "warning",
        "FP32-only work ran in half precision",
        "; ".join(_grouped([w for _, w, _, _ in items])) + " (loss, normalisation and softmax belong in FP32).",
        layers=layers,
        steps=[0, run.n_steps - 1],
        evidence={p: ev for p, _, ev, _ in items},
        fix=[part for *_, f in items for part in f],
    )


def _grouped(whats: list[str]) -> list[str]:
    """Each distinct statement once, with how many modules it is true of ("... (6 modules)")."""
    counts = {w: whats.count(w) for w in dict.fromkeys(whats)}
    return [w if n == 1 else f"{w} ({n} modules)" for w, n in counts.items()]
