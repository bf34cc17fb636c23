"""forward-overflow: a module's own computation produced Inf/NaN in the forward pass."""
from __future__ import annotations

import numpy as np

from .. import formats
from . import advice as A
from .engine import finding

# Critical when at least this share of steps had a non-finite forward: the run is then mostly skipped or NaN.
CRITICAL_SHARE = 0.5


def _looks_like_attention(path: str, mtype: str) -> bool:
    text = f"{path} {mtype}".lower()
    return "attn" in text or "attention" in text


def forward_overflow(run, *, min_steps=1, critical_share=CRITICAL_SHARE):
    ev = run.events
    fwd = ev[ev["phase"] == "fwd"]
    wev = run.weight_events
    if len(wev) and len(fwd):
        # Weights that went NaN/Inf in an optimizer step make the next forwards non-finite from finite inputs:
        # that is the update's fault (e.g. Adam's eps lost in FP16), not a forward overflow.
        first = int(wev["step"].min())
        owners = {p.rpartition(".")[0] or "(model)" for d in wev["data"] for p in d.get("params", [])}
        fwd = fwd[~((fwd["step"] > first) & fwd["path"].isin(owners))]
    if len(fwd) < min_steps:
        return None
    counts = fwd.groupby("path")["step"].agg(["count", "min", "max"]).sort_values(
        ["count", "min"], ascending=[False, True])
    culprit = str(counts.index[0])
    steps = fwd["step"].astype(int).tolist()
    own = fwd.loc[fwd["path"] == culprit, "step"].astype(int).tolist()
    acts = run.sites("act")
    row = acts[acts["path"] == culprit]
    mtype = str(row["module_type"].iloc[0]) if len(row) else "?"
    dtype = str(row["dtype"].iloc[0]) if len(row) else "?"
    # How close the module's output ran to the FP16 max on the steps where it stayed finite.
    peaks = run.records("peak", "act")
    last_finite = None
    if len(row):
        col = peaks[:, int(np.flatnonzero(acts["path"].to_numpy() == culprit)[0])]
        ok = np.isfinite(col)
        last_finite = float(np.nanmax(col[ok])) if ok.any() else None
    share = len(set(steps)) / max(run.n_steps, 1)
    loss = run.steps["loss"].to_numpy(float)
    # a NaN loss is stored as NULL: count missing losses only where the run logs a loss at all
    loss_bad = int((~np.isfinite(loss)).sum()) if np.isfinite(loss).any() or run.steps["nonfinite"].all() else 0
    severity = "critical" if share >= critical_share or (loss_bad and not run.scaler_on) else "warning"
    fmt = formats.get(dtype) if dtype in formats.DTYPE_FORMATS else formats.FP16
    value = fwd["data"].iloc[0].get("value", "inf")
    others = [str(p) for p in counts.index[1:]]
    where = culprit if not others else f"{culprit} (and {', '.join(others)}, which overflowed too)"
    fixes = [f"Run {where} in FP32 inside autocast (loss scaling cannot fix a forward overflow):",
             A.keep_fp32_line([culprit] + others),
             "# or, by hand, inside its forward:",
             f'with torch.autocast(device_type="{A.dev(run)}", enabled=False):',
             "    out = self.block(x.float())"]
    if _looks_like_attention(culprit, mtype):
        fixes += ["Scale the attention scores by 1/sqrt(d) (its absence is the usual cause), on q before the "
                  "product, since q @ k^T itself overflows:",
                  "scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)",
                  "# or use torch.nn.functional.scaled_dot_product_attention(q, k, v)"]
    if dtype == "float16" and run.bf16_supported:
        fixes += ["Or train in BF16 (same exponent range as FP32; this device supports it):",
                  A.autocast_block(run, "bfloat16")]
    return finding(
        severity, f"Forward overflow in {culprit}",
        f"{culprit} ({mtype}, {dtype}) produced {value} from finite inputs in {len(own)} of {run.n_steps} "
        f"steps (first at step {min(own)}); its largest finite output was {A.fmt_num(last_finite)} against the "
        f"{fmt.name.upper()} max {A.fmt_num(fmt.max)}.",
        layers=[culprit] + others, steps=run.step_range(steps),
        evidence={"module": culprit, "module_type": mtype, "dtype": dtype, "steps_affected": len(own),
                  "first_step": min(own), "value": value, "max_finite_output": last_finite,
                  "format_max": fmt.max, "nonfinite_losses": loss_bad,
                  "other_modules": {str(k): int(v) for k, v in counts["count"].iloc[1:].items()}},
        recommendation="\n".join(fixes))
