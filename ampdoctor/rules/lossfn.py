"""loss-nonfinite: the loss function made the NaN/Inf from finite model outputs, its value or its gradient w.r.t.
the model's output (the first gradient of the backward pass). The classic case: ``log(softmax(x))`` in FP16, where
softmax rounds the small probabilities to 0, log gives -inf and its gradient 1/p gives Inf/NaN; clipping or a lower
loss scale cannot help (the loss-scale-collapse it causes is suppressed by this finding)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .. import formats
from ..trace.schema import ROOT
from . import advice as A
from .fix import Part, code, text
from .policy import SOFTMAX_TYPES
from .result import Diagnosis, Evidence, finding
from .runview import RunView
from .scaling import output_gradient_steps

FP16 = formats.FP16
# softmax rounds a probability to 0 in FP16 below half the smallest subnormal, 2^-25: a logit that far below the
# row's largest, ln(2^25) = 17.3, is enough.
LOG_FLUSH_GAP = 25 * math.log(2.0)
# Critical when at least this share of the steps lost to it (half the updates gone).
CRITICAL_SHARE = 0.5
# A gradient at the output that overflows while the scaler calibrates (before the first step that went through) is
# the scale's, not the loss function's; after it, one such step can be a growth attempt: two make a pattern.
MIN_GRADIENT_STEPS = 2


def collapse_from_loss(own: Diagnosis, theirs: Diagnosis) -> bool:
    """Suppression (registry): a loss scale collapsing because the loss function keeps producing Inf/NaN."""
    return bool(own.evidence.get("cause_origin") == "loss")


def skips_from_loss(own: Diagnosis, theirs: Diagnosis) -> bool:
    """Suppression (registry): early skips that are, for the most part, the loss function's overflows (its gradient
    at the model's output), not a too-high initial scale: they recur at every scale the scaler falls to."""
    skipped = set(own.evidence.get("skipped_steps", []))
    ours = set(theirs.evidence.get("loss_value_steps", [])) | set(theirs.evidence.get("output_gradient_steps", []))
    return bool(skipped) and 2 * len(skipped & ours) >= len(skipped & set(theirs.evidence.get("observed_bad", [])))


def loss_nonfinite(run: RunView, *, critical_share: float = CRITICAL_SHARE) -> Diagnosis | None:
    ev = run.events
    value = sorted(set(ev.loc[ev["phase"] == "loss", "step"].astype(int)))
    grad = sorted(output_gradient_steps(run) - set(value))
    clean = np.flatnonzero(~run.steps["skipped"].to_numpy(bool))
    calibrated = int(run.steps["step"].iloc[clean[0]]) if len(clean) else None
    grad = [s for s in grad if calibrated is not None and s > calibrated]
    if len(grad) < MIN_GRADIENT_STEPS:
        grad = []
    if not value and not grad:
        return None
    steps = value + grad
    st = run.steps
    lost = int((st["skipped"].to_numpy(bool) | st["nonfinite"].to_numpy(bool)).sum())
    share = lost / max(run.n_steps, 1)
    out = _output(run, steps)
    loss_dtype = run.config.get("loss_dtype")
    setup = A.Setup.of(run)
    mech, decided, sure, fix = _mechanism(run, setup, out, loss_dtype, value, grad)
    where = (
        f"the loss itself was non-finite from finite module outputs on {len(value)} step(s)"
        if value
        else f"the loss was finite ({A.fmt_num(out['loss'])}) but the first gradient of the backward pass, the "
        f"loss's gradient w.r.t. the model's output {out['path']}, was non-finite on {len(grad)} step(s)"
    )
    if value and grad:
        where += f", and on {len(grad)} more its gradient w.r.t. the model's output"
    severity = "critical" if share >= critical_share else "warning"
    if not sure:
        severity = "warning"
    return finding(
        severity,
        "The loss function produced NaN/Inf",
        f"{where} (first at step {min(steps)}; {lost} of {run.n_steps} steps lost in all). {mech}. "
        f"Decided by: {decided}.",
        layers=[out["path"]] if out["path"] else [],
        steps=run.step_range(steps),
        evidence={
            "loss_value_steps": value[:20],
            "observed_bad": _observed_bad(run)[:200],
            "output_gradient_steps": grad[:20],
            "steps_lost": lost,
            "share_lost": share,
            "loss_dtype": loss_dtype,
            "output_module": out["path"],
            "output_dtype": out["dtype"],
            "output_peak": out["peak"],
            "output_zeros_share": out["zeros"],
            "output_is_probability": out["probability"],
            "mechanism": mech,
            "decided_by": decided,
            "certain": sure,
        },
        fix=fix,
    )


def _observed_bad(run: RunView) -> list[int]:
    """Skipped or non-finite steps that observed their sites (their origin is known)."""
    st = run.steps
    bad = st["skipped"].to_numpy(bool) | st["nonfinite"].to_numpy(bool)
    seen = st["level"].fillna(-1).to_numpy(float) >= 0
    observed: list[int] = st.loc[bad & seen, "step"].astype(int).tolist()
    return observed


def _output(run: RunView, steps: list[int]) -> Evidence:
    """The model's output on those steps: path, dtype, largest |value|, share of exact zeros, a probability?"""
    acts = run.sites("act")
    paths = acts["path"].tolist()
    out: dict[str, Any] = {
        "path": None,
        "dtype": None,
        "peak": None,
        "zeros": None,
        "probability": False,
        "loss": None,
        "total": None,
    }
    loss = run.steps.set_index("step")["loss"]
    fin = [float(loss[s]) for s in steps if s in loss.index and np.isfinite(loss[s])]
    out["loss"] = fin[0] if fin else None
    if not paths:
        return out
    j = paths.index(ROOT) if ROOT in paths else len(paths) - 1
    # the module that made the output: the root passes on its last child's, which names the operation
    last = _last_leaf(paths, acts)
    name = last if last is not None else paths[j]
    out["path"] = paths[j] if paths[j] != ROOT else name
    out["dtype"] = str(acts["dtype"].iloc[j])
    rows = [s for s in steps if s < run.n_steps]
    peak = run.at("peak", "act", rows)[:, j] if rows else np.zeros(0)
    absmax = run.at("absmax", "act", rows)[:, j] if rows else np.zeros(0)
    zeros = run.at("zeros", "act", rows)[:, j] if rows else np.zeros(0)
    numel = run.at("numel", "act", rows)[:, j] if rows else np.zeros(0)
    mean = run.at("mean", "act", rows)[:, j] if rows else np.zeros(0)
    with np.errstate(all="ignore"):
        total = np.abs(mean) * numel
    total = total[np.isfinite(total)]
    out["total"] = float(total.max()) if len(total) else None
    out["numel"] = float(np.nanmax(numel)) if np.isfinite(numel).any() else None
    out["mean"] = float(np.nanmax(np.abs(mean))) if np.isfinite(mean).any() else None
    vals = np.concatenate([peak[np.isfinite(peak)], absmax[np.isfinite(absmax)]])
    out["peak"] = float(vals.max()) if len(vals) else None
    with np.errstate(all="ignore"):
        z = zeros / numel
    z = z[np.isfinite(z)]
    out["zeros"] = float(np.median(z)) if len(z) else None
    mtype = dict(zip(acts["path"], acts["module_type"])).get(name, "")
    nonneg = bool(len(mean[np.isfinite(mean)])) and float(np.nanmin(mean)) > 0
    out["probability"] = bool(
        mtype in SOFTMAX_TYPES
        or mtype == "Sigmoid"
        or (out["peak"] is not None and out["peak"] <= 1.0 and nonneg and (out["zeros"] or 0) > 0)
    )
    out["module"] = name
    out["module_type"] = mtype
    return out


def _last_leaf(paths: list[str], acts: pd.DataFrame) -> str | None:
    """The last module to complete that is not a container of others (its output is the model's, for a
    Sequential-style model)."""
    for p in reversed(paths):
        if p != ROOT and not any(q.startswith(p + ".") for q in paths):
            return p
    return None


def _mechanism(
    run: RunView, setup: A.Setup, out: Evidence, loss_dtype: str | None, value: list[int], grad: list[int]
) -> tuple[str, str, bool, list[Part]]:
    """(mechanism, the evidence that decided it, sure?, fix parts)."""
    half_out = out["dtype"] in formats.REDUCED
    peak = out["peak"]
    total = out.get("total")
    if value and (loss_dtype in formats.REDUCED or half_out) and total is not None and total > FP16.max:
        mech = (
            f"A sum over the model's output in {loss_dtype if loss_dtype in formats.REDUCED else out['dtype']} "
            f"overflows: {out['numel']:.0f} elements with a mean magnitude of {A.fmt_num(out['mean'])} add up to "
            f"about {A.fmt_num(total)}, past the FP16 max {A.fmt_num(FP16.max)} (a Dice or IoU loss sums every "
            "pixel), and inf / inf is NaN"
        )
        decided = (
            f"the loss itself was non-finite from finite outputs, and their sum ({A.fmt_num(total)}) does not fit "
            "FP16 while each of them does"
        )
        return mech, decided, True, [text("Compute the loss in FP32 from the model output:"), A.loss_in_fp32(setup)]
    if out["probability"] and half_out:
        module = out["module"]
        mech = (
            f"The model outputs {out['dtype']} probabilities ({out['module_type'] or module}) with exact zeros "
            f"({A.pct(out['zeros'] or 0)} of them): log of a probability rounded to 0 is -inf, and its gradient 1/p "
            "is Inf/NaN"
        )
        decided = (
            f"the output is a probability (values in [0, 1], {A.pct(out['zeros'] or 0)} exact zeros) and the loss "
            "function, not a module, made the first non-finite value"
        )
        fix = [
            text(
                f"Compute the softmax and the log together from the logits, in FP32: have the model return the "
                f"logits (drop {module}) and use cross_entropy (or log_softmax + nll_loss), which never forms the "
                f"probability. Until then, keep {module} in FP32 so that its probabilities do not round to 0:"
            ),
            *A.keep_fp32(setup, [module]),
        ]
        return mech, decided, True, fix
    spread = 2.0 * peak if peak is not None else None
    flush = spread is not None and spread >= LOG_FLUSH_GAP
    if half_out and (grad or flush or (peak is not None and not _squares_overflow(peak))):
        scales = run.steps.set_index("step")["loss_scale"]
        at = [float(scales[s]) for s in grad + value if s in scales.index and np.isfinite(scales[s])]
        scale = max(at) if at else None
        if flush:
            how = (
                f"the logits reach +-{A.fmt_num(peak)}, and a logit {LOG_FLUSH_GAP:.1f} below its row's largest has a "
                "probability under 2^-25 that FP16 rounds to 0: log(0) is -inf and log's gradient 1/p is Inf/NaN"
            )
        else:
            how = (
                f"with logits within +-{A.fmt_num(peak)} no probability rounds to 0 (that takes a gap of "
                f"{LOG_FLUSH_GAP:.1f}), so it is the size of log's gradient: 1/p for a small probability"
                + (f", times the loss scale {A.pow2(scale)}," if scale else "")
                + f" passes the FP16 max {A.fmt_num(FP16.max)}"
            )
        mech = (
            f"Softmax and log in {out['dtype']} (log(softmax(x)) or a hand-written cross-entropy in the loss "
            f"function, on the model's {out['dtype']} output): {how}"
        )
        decided = (
            "the first non-finite value came from the loss function (the loss "
            + ("was finite, its gradient w.r.t. the output was not" if grad and not value else "itself")
            + f") with finite {out['dtype']} outputs; clipping or a lower scale cannot reach the loss function"
        )
        fix = [
            text(
                "Compute the loss from the logits with cross_entropy (or log_softmax + nll_loss) in FP32: it never "
                "forms the probability, and its gradient (softmax - target) is bounded by 1:"
            ),
            _cross_entropy(setup),
            text("Or keep your loss function and run it in FP32 (FP32 rounds a probability to 0 only 103 below):"),
            A.loss_in_fp32(setup),
        ]
        return mech, decided, True, fix
    if loss_dtype in formats.REDUCED and value and peak is not None and _squares_overflow(peak):
        mech = (
            f"The loss was computed in {loss_dtype} from outputs up to {A.fmt_num(peak)}: their squares (or sums) "
            f"pass the FP16 max {A.fmt_num(FP16.max)}, so the loss overflows"
        )
        decided = f"the recorded loss dtype ({loss_dtype}) and outputs whose squares exceed the FP16 max"
        return mech, decided, True, [text("Compute the loss in FP32 from the model output:"), A.loss_in_fp32(setup)]
    mech = (
        "The trace does not show which operation of the loss function made it (outputs up to "
        f"{A.fmt_num(peak) if peak is not None else '?'}, loss dtype {loss_dtype}): a log of 0, a division by 0 "
        "or an overflow in the loss"
    )
    decided = "only that the loss function, not a module, made the first non-finite value (the mechanism is unsure)"
    fix = [
        text(
            "Compute the loss in FP32 and guard its log and division inputs (e.g. clamp a probability with "
            "clamp_min(1e-7) before log, or use the log_softmax / cross_entropy / binary_cross_entropy_with_logits "
            "forms that never take log of 0):"
        ),
        A.loss_in_fp32(setup),
    ]
    return mech, decided, False, fix


def _squares_overflow(peak: float) -> bool:
    return peak * peak > FP16.max


def _cross_entropy(setup: A.Setup) -> Part:
    if setup.autocast is not None:
        return code(
            f'with torch.autocast(device_type="{A.dev(setup)}", dtype=torch.{setup.autocast}):',
            "    logits = model(x)",
            "loss = torch.nn.functional.cross_entropy(logits.float(), y)",
        )
    return code("loss = torch.nn.functional.cross_entropy(model(x).float(), y)")
