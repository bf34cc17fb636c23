"""forward-overflow: a module's own computation produced Inf/NaN in the forward pass."""

from __future__ import annotations

import math

import numpy as np

from .. import formats
from ..trace.schema import ROOT
from . import advice as A
from .fix import code, text
from .result import finding

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
        owners = {p.rpartition(".")[0] or ROOT for d in wev["data"] for p in d.get("params", [])}
        fwd = fwd[~((fwd["step"] > first) & fwd["path"].isin(owners))]
    if len(fwd) < min_steps:
        return None
    for d in run.findings_of("divergence"):
        if (
            d.evidence["first_nonfinite_step"] is not None
            and int(fwd["step"].min()) >= d.evidence["first_nonfinite_step"]
        ):
            return None  # activations that blew up with a diverging run: divergence's finding
    counts = (
        fwd.groupby("path")["step"].agg(["count", "min", "max"]).sort_values(["count", "min"], ascending=[False, True])
    )
    acts = run.sites("act")
    top = run.view.peak_max("act")  # per module: its largest finite output over every observed step
    first_at = run.view.scan.site_argmax[acts["id"].to_numpy()]
    # The module whose outputs approached the limit, not the last straw: when the modules just before the first
    # overflowing one already ran within a binade of the max, the earliest of them produced the values.
    culprit, tipped = _producer(acts, top, counts, formats.FP16.max)
    steps = fwd["step"].astype(int).tolist()
    own = fwd.loc[fwd["path"].isin([culprit] + tipped), "step"].astype(int).tolist()
    counts = counts.drop(index=[p for p in tipped if p in counts.index])
    if culprit in counts.index:
        counts = counts.drop(index=culprit)
    row = acts[acts["path"] == culprit]
    mtype = str(row["module_type"].iloc[0]) if len(row) else "?"
    dtype = str(row["dtype"].iloc[0]) if len(row) else "?"
    # How close the module's output ran to the FP16 max on the steps where it stayed finite.
    last_finite, peak_step = None, None
    if len(row):
        j = int(np.flatnonzero(acts["path"].to_numpy() == culprit)[0])
        if first_at[j] >= 0:
            peak_step, last_finite = int(first_at[j]), float(top[j])
    share = len(set(steps)) / max(run.n_steps, 1)
    loss = run.steps["loss"].to_numpy(float)
    # a NaN loss is stored as NULL: count missing losses only where the run logs a loss at all
    loss_bad = int((~np.isfinite(loss)).sum()) if np.isfinite(loss).any() or run.steps["nonfinite"].all() else 0
    severity = "critical" if share >= critical_share or (loss_bad and not run.scaler_on) else "warning"
    fmt = formats.get(dtype) if dtype in formats.DTYPE_FORMATS else formats.FP16
    value = fwd["data"].iloc[0].get("value", "inf")
    others = [str(p) for p in counts.index]
    where = culprit if not others else f"{culprit} (and {', '.join(others)}, which overflowed too)"
    fixes = [
        text(
            f"Run {where} in FP32 inside autocast (loss scaling cannot fix a forward overflow; its FP32 "
            "output also keeps the modules after it from overflowing):"
        ),
        code(
            A.keep_fp32_line([culprit] + others),
            "# or, by hand, inside its forward:",
            f'with torch.autocast(device_type="{A.dev(run)}", enabled=False):',
            "    out = self.block(x.float())",
        ),
    ]
    if _looks_like_attention(culprit, mtype):
        fixes += [
            text(
                "Scale the attention scores by 1/sqrt(d) (its absence is the usual cause), on q before the "
                "product, since q @ k^T itself overflows:"
            ),
            code(
                "scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)",
                "# or use torch.nn.functional.scaled_dot_product_attention(q, k, v)",
            ),
        ]
    weights = _weight_fault(run, culprit)
    if weights:
        fixes = [
            text(
                f"The values come from {culprit}'s weights, {A.fmt_num(weights['ratio'])}x the scale their "
                "fan-in gives (see grad-range-anomaly): FP32 only makes room for them; only re-initialising "
                "the weights (a change of the model) removes the cause."
            )
        ] + fixes
    if dtype == "float16" and run.bf16_supported:
        fixes += [
            text("Or train in BF16 (same exponent range as FP32; this device supports it):"),
            code(A.autocast_block(run, "bfloat16")),
        ]
    headroom = fmt.max / last_finite if last_finite else None
    if last_finite:
        peak_text = (
            f"its largest finite output was {A.fmt_num(last_finite)} (step {peak_step}), "
            f"{headroom:.3g}x ({math.log2(headroom):.2f} binades) under the {fmt.name.upper()} max "
            f"{A.fmt_num(fmt.max)}"
        )
    else:
        peak_text = f"it never produced a finite output (the {fmt.name.upper()} max is {A.fmt_num(fmt.max)})"
    tip = f"; {', '.join(tipped)} then tipped those values over the max" if tipped else ""
    return finding(
        severity,
        f"Forward overflow in {culprit}",
        f"{culprit} ({mtype}, {dtype}) {'produced values at the edge of the range' if tipped else 'produced ' + value}"
        f" from finite inputs: {len(set(own))} of {run.n_steps} steps overflowed there (first at step {min(own)})"
        f"{tip}; {peak_text}.",
        layers=[culprit] + tipped + others,
        steps=run.step_range(steps),
        evidence={
            "module": culprit,
            "module_type": mtype,
            "dtype": dtype,
            "steps_affected": len(set(own)),
            "first_step": min(own),
            "value": value,
            "max_finite_output": last_finite,
            "max_finite_step": peak_step,
            "headroom_factor": headroom,
            "headroom_binades": math.log2(headroom) if headroom else None,
            "format_max": fmt.max,
            "nonfinite_losses": loss_bad,
            "tipped_over_by": tipped,
            "other_modules": {str(k): int(v) for k, v in counts["count"].items()},
        },
        fix=fixes,
    )


def _producer(acts, top, counts, limit: float) -> tuple[str, list]:
    """(producer, modules that tipped its values over). From each module where an overflow showed, walk back in
    execution order through the modules whose finite outputs came within a binade of the limit: the earliest of that
    unbroken chain produced the values (a chain of one: the module itself). The producer behind the most overflowing
    steps is the culprit; the others that lead back to it only tipped its values over."""
    paths = acts["path"].tolist()
    top = np.where(np.isfinite(top), top, -1.0)  # per module: largest finite output (-1: none)
    where = {p: i for i, p in enumerate(paths)}

    def origin(path: str) -> str:
        if path not in where:
            return path
        i = where[path]
        producer = i
        for j in range(i - 1, -1, -1):
            if paths[j] == ROOT or paths[i].startswith(paths[j] + "."):
                continue  # an enclosing module: its output comes after its children's
            if not top[j] >= limit / 2:
                break
            producer = j
        return paths[producer]

    steps: dict = {}
    first: dict = {}
    for path, row in counts.iterrows():
        o = origin(str(path))
        steps[o] = steps.get(o, 0) + int(row["count"])
        first.setdefault(o, int(row["min"]))
    culprit = min(steps, key=lambda o: (-steps[o], first[o]))
    # containers between the producer and the tipping module pass its output on unchanged: not "tipping"
    tipped = [
        str(p)
        for p in counts.index
        if str(p) != culprit and origin(str(p)) == culprit and not culprit.startswith(str(p) + ".")
    ]
    return culprit, tipped


def _weight_fault(run, module: str) -> dict | None:
    """grad-range-anomaly's evidence that this module's weights are far off their fan-in scale (through the engine)."""
    for d in run.findings_of("grad-range-anomaly"):
        for path, w in d.evidence.get("weight_faults", {}).items():
            if path.rpartition(".")[0] == module:
                return w
    return None
