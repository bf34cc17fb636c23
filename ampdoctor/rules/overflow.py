"""forward-overflow: a module's own computation produced Inf/NaN in the forward pass."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .. import formats
from ..trace.schema import ROOT, observed_ancestor
from . import advice as A
from . import anomaly
from .fix import text
from .result import Diagnosis, finding
from .runview import FloatArray, Origins, RunView

# Critical when at least this share of steps had a non-finite forward: the run is then mostly skipped or NaN.
CRITICAL_SHARE = 0.5


def _looks_like_attention(path: str, mtype: str) -> bool:
    text = f"{path} {mtype}".lower()
    return "attn" in text or "attention" in text


def origins(run: RunView) -> Origins | None:
    ev = run.events
    fwd = ev[ev["phase"] == "fwd"]
    wev = run.weight_events
    if len(wev) and len(fwd):
        # Weights that went NaN/Inf in an optimizer step make the next forwards non-finite from finite inputs:
        # that is the update's fault (e.g. Adam's eps lost in FP16), not a forward overflow.
        first = int(wev["step"].min())
        owners = {p.rpartition(".")[0] or ROOT for d in wev["data"] for p in d.get("params", [])}
        fwd = fwd[~((fwd["step"] > first) & fwd["path"].isin(owners))]
    if not len(fwd):
        return None
    counts = (
        fwd.groupby("path")["step"].agg(["count", "min", "max"]).sort_values(["count", "min"], ascending=[False, True])
    )
    # The module whose outputs approached the limit, not the last straw: when the modules just before the first
    # overflowing one already ran within a binade of the max, the earliest of them produced the values.
    acts = run.sites("act")
    top = run.view.peak_max("act")  # per module: its largest finite output over every observed step
    culprit, tipped = _producer(acts, top, counts, formats.FP16.max)
    # Where a replay traced the step down to its operations, they decide: a value made inside a module's own forward
    # is that module's, whatever child carried it out (the module walk only sees module outputs).
    steps = set(fwd["step"].astype(int))
    ops = [r for r in anomaly.replays(run) if r["step"] in steps and (r.get("operation") or {}).get("phase") == "fwd"]
    if ops:
        paths = set(acts["path"])
        made = [observed_ancestor((anomaly.where_made(r) or r["operation"])["module"], paths) for r in ops]
        culprit = max(set(made), key=made.count)
        seen = {observed_ancestor(r["operation"]["module"], paths) for r in ops} - {culprit}
        tipped = [p for p in seen if not culprit.startswith(p + ".") and p != ROOT]
    return Origins(fwd, counts, culprit, tipped, ops)


def after_blowup(own: Diagnosis, divergence: Diagnosis) -> bool:
    """Suppression (registry): an overflow that starts at or after the first non-finite step of a diverged run is
    the blow-up's symptom, divergence's finding."""
    first = divergence.evidence.get("first_nonfinite_step")
    return first is not None and bool(own.evidence["first_overflow_step"] >= first)


def forward_overflow(run: RunView, *, min_steps: int = 1, critical_share: float = CRITICAL_SHARE) -> Diagnosis | None:
    o = run.overflow_origins
    if o is None or len(o.events) < min_steps:
        return None
    fwd, counts, culprit, tipped = o.events, o.counts, o.culprit, o.tipped
    acts = run.sites("act")
    top = run.view.peak_max("act")  # per module: its largest finite output over every observed step
    first_at = run.view.scan.site_argmax[acts["id"].to_numpy()]  # the step of that output (-1: none)
    steps = fwd["step"].astype(int).tolist()
    own = fwd.loc[fwd["path"].isin([culprit] + tipped), "step"].astype(int).tolist()
    if not own:  # the replays found the values made inside a module the module walk did not name: its steps
        own = sorted({int(r["step"]) for r in o.operations or []} or set(fwd["step"].astype(int)))
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
    share = len(anomaly.lasting(run, sorted(set(steps)))) / max(run.n_steps, 1)
    affected = len(anomaly.lasting(run, sorted(set(own))))  # (a lasting overflow's unobserved steps count too)
    loss = run.steps["loss"].to_numpy(float)
    # a NaN loss is stored as NULL: count missing losses only where the run logs a loss at all
    loss_bad = int((~np.isfinite(loss)).sum()) if np.isfinite(loss).any() or run.steps["nonfinite"].all() else 0
    severity = "critical" if share >= critical_share or (loss_bad and not run.scaler_on) else "warning"
    fmt = formats.get(dtype) if dtype in formats.DTYPE_FORMATS else formats.FP16
    value = fwd["data"].iloc[0].get("value", "inf")
    others = [str(p) for p in counts.index]
    where = culprit if not others else f"{culprit} (and {', '.join(others)}, which overflowed too)"
    setup = A.Setup.of(run)
    ops = o.operations or []
    checked = anomaly.checked_fixes(run, ops, note_failed_keep=True)
    fixes = checked.parts
    kept = set(checked.keep["modules"]) if checked.keep else set()
    if not checked.keep_fp32_failed and not kept >= {culprit, *others}:  # not printed twice
        fixes += [
            text(
                f"Run {where} in FP32 inside autocast (loss scaling cannot fix a forward overflow; its FP32 "
                "output also keeps the modules after it from overflowing):"
            ),
            *A.keep_fp32(setup, [culprit] + others),
        ]
    if _looks_like_attention(culprit, mtype):
        fixes.append(
            text(
                f"Or scale the attention scores by 1/sqrt(d) in {mtype}'s forward (its absence is the usual cause), on "
                "the query before the product, since q @ k^T itself overflows: scores = (q / math.sqrt(q.shape[-1])) "
                "@ k.transpose(-2, -1) (q, k: its query and key tensors), or use "
                "torch.nn.functional.scaled_dot_product_attention(q, k, v)."
            )
        )
    weights = next((w for p, w in run.weight_faults.items() if w["module"] == culprit), None)
    if weights:
        fixes = [
            text(
                f"The values come from {culprit}'s weights, {A.fmt_num(weights['ratio'])}x the scale their "
                "fan-in gives (see grad-range-anomaly): FP32 only makes room for them; only re-initialising "
                "the weights (a change of the model) removes the cause."
            )
        ] + fixes
    if dtype == "float16" and checked.bf16 is None:
        fixes += A.bf16_note(setup)
    # Evidence that the updates, not the format, drove the values there, short of deciding it (divergence decides
    # where it is decisive and hides this finding): say so, and do not call the range the cause with certainty.
    b = run.blowup
    doubt = b.partial if b is not None and not b.decisive and min(own) >= b.first_step else []
    if doubt:
        severity = "warning"
        fixes = [
            text(
                "Not certain this is a range problem: "
                + "; ".join(doubt)
                + ". If the same run in FP32 (or BF16) does not learn either, the learning rate is the cause: lower "
                "it instead (see the divergence rule)."
            )
        ] + fixes
    headroom = fmt.max / last_finite if last_finite else None
    if headroom:
        peak_text = (
            f"its largest finite output was {A.fmt_num(last_finite)} (step {peak_step}), "
            f"{headroom:.3g}x ({math.log2(headroom):.2f} binades) under the {fmt.name.upper()} max "
            f"{A.fmt_num(fmt.max)}"
        )
    else:
        peak_text = f"it never produced a finite output (the {fmt.name.upper()} max is {A.fmt_num(fmt.max)})"
    tip = f"; {', '.join(tipped)} then tipped those values over the max" if tipped else ""
    op = anomaly.where_made(ops[0]) if ops else None
    made_by = f" ({op['op']} at {op['line']})" if op is not None and op.get("line") else ""
    return finding(
        severity,
        f"Forward overflow in {culprit}",
        f"{culprit} ({mtype}, {dtype}) {'produced values at the edge of the range' if tipped else 'produced ' + value}"
        f"{made_by} from finite inputs: {affected} of {run.n_steps} steps overflowed there "
        f"(first at step {min(own)}){tip}; {peak_text}." + (f" Unsure: {'; '.join(doubt)}." if doubt else ""),
        layers=[culprit] + tipped + others,
        steps=run.step_range(steps),
        evidence={
            "module": culprit,
            "module_type": mtype,
            "dtype": dtype,
            "steps_affected": affected,
            "first_step": min(own),
            "first_overflow_step": min(steps),
            "value": value,
            "max_finite_output": last_finite,
            "max_finite_step": peak_step,
            "headroom_factor": headroom,
            "headroom_binades": math.log2(headroom) if headroom else None,
            "format_max": fmt.max,
            "nonfinite_losses": loss_bad,
            "tipped_over_by": tipped,
            "other_modules": {str(k): int(v) for k, v in counts["count"].items()},
            "doubt": doubt,
            "operation": op,
            "checks": [c for r in ops for c in r.get("checks", [])],
        },
        fix=fixes,
    )


def _producer(acts: pd.DataFrame, top: FloatArray, counts: pd.DataFrame, limit: float) -> tuple[str, list[str]]:
    """(producer, modules that tipped its values over). From each module where an overflow showed, walk back in
    execution order through the modules whose finite outputs came within a binade of the limit: the earliest of that
    unbroken chain produced the values (a chain of one: the module itself). The producer behind the most overflowing
    steps is the culprit; the others that lead back to it only tipped its values over."""
    paths: list[str] = acts["path"].tolist()
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

    steps: dict[str, int] = {}
    first: dict[str, int] = {}
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
