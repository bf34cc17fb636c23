"""The one-offs the anomaly replay caught (collect/anomaly.py: an anomalous step replayed exactly, observed in full,
traced down to the operation, its batch fingerprinted, precision fixes tried on it):

- outlier-batch: a NaN/Inf (or a spike) that one batch far beyond the run's usual inputs made;
- loss-spike: a finite loss or gradient-norm spike, the layers that jumped on that step against their recorded
  history, and whether a format limit was involved (numerical) or not (data, learning rate).

A fix a replay tried on the failing step is printed with what it did there ("checked on step 37: finite"); one that
did not remove the fault there is not printed as the fix."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import autocast_ops, formats
from ..trace import Trace, schema
from . import advice as A
from .fix import Part, code, text
from .result import Diagnosis, finding
from .runview import RunView

Replay = dict[str, Any]  # one replay event's data (collect/anomaly.py): step, why, batch, operation, checks, ...

# A replayed step whose batch peak was at least this many times the run's usual one (the median over recent
# sampled steps) had an outlier batch: ordinary batches vary by 2-3x at most in their peak.
OUTLIER_FACTOR = 8.0
# The data guard's limit, in multiples of the usual input peak: outliers at OUTLIER_FACTOR stay out, ordinary batches
# pass with room to spare.
GUARD_FACTOR = 4.0
# A layer "jumped" on a spike step when its peak exceeded its recorded history's median by this many binades.
JUMP_BINADES = 3.0
# A spike is numerical when a layer ran within this many binades of its format's max on that step (or overflowed).
NEAR_LIMIT_BINADES = 1.0
# Replays this few steps apart belong to one incident (the flight recorder's clean run is 5 steps): one finding, at
# the step where it began.
INCIDENT_GAP = 5
# A spike with no numerical cause, that the run shook off (the median loss of the INCIDENT_GAP steps after it back
# under HARM_FACTOR times the median before), is the data's ordinary noise (a hard batch late in training), not a
# finding, unless the loss jumped at least LASTING_FACTOR times: a batch that far off is broken even if survived.
LASTING_FACTOR = 100.0
# A gradient-norm spike (with no loss spike) is a finding only when the loss felt it: within INCIDENT_GAP steps the
# loss rose this many times its median before (or went non-finite).
HARM_FACTOR = 1.5


def within_steps(own: Diagnosis, outlier: Diagnosis) -> bool:
    """Suppression (registry): every step another finding concerns is the outlier batch's step."""
    return (
        bool(own.steps)
        and bool(outlier.steps)
        and outlier.steps[0] <= own.steps[0] <= own.steps[-1] <= outlier.steps[-1]
    )


def batches_collapsed_scale(own: Diagnosis, collapse: Diagnosis) -> bool:
    """Suppression (registry): an outlier batch with NaN/Inf inputs on a step of a loss-scale collapse that the
    non-finite input batches explain: one incident of a pattern the collapse already names (and fixes for every
    batch)."""
    return (
        collapse.evidence.get("cause_origin") == "input"
        and bool(own.evidence.get("nonfinite_inputs"))
        and bool(collapse.steps)
        and collapse.steps[0] <= own.evidence["step"] <= collapse.steps[-1]
    )


def lasting(run: RunView, located: list[int]) -> list[int]:
    """The ``located`` steps and the anomalous (non-finite or skipped) steps around them that nothing observed:
    within one unbroken run of anomalous steps, a step the flight recorder did not observe in full (from its
    STREAK_FULL-th step on, a lasting anomaly is observed at a power of two into it only) is presumed to have the
    fault the observed steps located. Steps that were observed and located nothing are not counted."""
    if not located:
        return []
    st = run.steps
    steps = st["step"].to_numpy(np.int64)
    bad = st["nonfinite"].to_numpy(bool) | st["skipped"].to_numpy(bool)
    unseen = bad & (st["level"].to_numpy(np.int64) < schema.LEVEL_FULL)  # (the flight recorder's steps are full)
    found = np.isin(steps, np.asarray(located, dtype=np.int64))
    keep = found.copy()
    # unbroken runs of anomalous steps: a run that holds a located step counts its unseen steps
    edges = np.flatnonzero(np.diff(np.concatenate([[0], bad.astype(np.int8), [0]])))
    for a, b in zip(edges[::2], edges[1::2]):
        if found[a:b].any():
            keep[a:b] |= unseen[a:b]
    return sorted(set(steps[keep].tolist()) | set(located))


def replays(run: RunView) -> list[Replay]:
    """The replay events' data, one per replayed step (the anomalies the default tiers would have lost); read once
    per Run (``Run.replays``)."""
    return run.replays


def replay_data(trace: Trace) -> list[Replay]:
    """The data of a trace's replay events that name their step (a replay that failed is left out)."""
    ev = trace.events("replay")
    return [d for d in ev["data"] if isinstance(d, dict) and "step" in d and "failed" not in d]


def passed(replay: Replay, fix: str) -> dict[str, Any] | None:
    """The first check of a kind (keep_fp32, bf16, loss_scale) that removed the fault on the replayed step."""
    return next((c for c in replay.get("checks", []) if c.get("fix") == fix and c.get("finite")), None)


def failed(replay: Replay, fix: str) -> list[dict[str, Any]]:
    return [c for c in replay.get("checks", []) if c.get("fix") == fix and not c.get("finite")]


def where_made(replay: Replay) -> dict[str, Any] | None:
    """The operation that made the values (the first of the producer chain, else the one that overflowed)."""
    chain: list[dict[str, Any]] = [*replay.get("producers", []), replay["operation"]] if replay.get("operation") else []
    return chain[0] if chain else None


def op_text(op: dict[str, Any]) -> str:
    line = f" at {op['line']}" if op.get("line") else ""
    return f"{op['op']} in {op['module']} ({op['dtype']}){line}"


def keep_checked(step: int, keep: dict[str, Any]) -> str:
    """What a passed keep_fp32 check says (the scale its backward needed, when below the step's)."""
    backoff = (
        f" (its backward at a loss scale of {keep['at_scale']:g}, which the GradScaler backs off to in a few skipped "
        "steps)"
        if keep.get("at_scale")
        else ""
    )
    modules = " and ".join(keep["modules"])
    return f"Checked on step {step} (the step replayed with this change): finite with {modules} in FP32{backoff}:"


@dataclass
class Checked:
    """What the replays' precision checks showed on their steps (``checked_fixes``): the fix parts of the checks that
    removed the NaN/Inf (the first of each kind, with its step), and what was tried."""

    parts: list[Part] = field(default_factory=list)
    keep: dict[str, Any] | None = None  # the first keep_fp32 check that removed it
    keep_failed: bool = False  # a replay tried keep_fp32 and none of its islands removed it
    bf16: bool | None = None  # whether the first BF16 check removed it (None: BF16 was not tried)

    @property
    def keep_fp32_failed(self) -> bool:
        """keep_fp32 was tried and did not remove the NaN/Inf on any replayed step: not the fix to print."""
        return self.keep_failed and self.keep is None


def checked_fixes(run: RunView, replays: list[Replay], *, note_failed_keep: bool = False) -> Checked:
    """The precision fixes the replays tried and that removed the NaN/Inf on their step, as fix parts, the first of
    each kind (keep_fp32, BF16, a lower loss scale) in the replays' order; an alternative to a fix before it reads
    "Or, checked". ``note_failed_keep``: also say (once) where keep_fp32 was tried and did not remove it."""
    setup = A.Setup.of(run)
    out = Checked()
    scale_seen = False
    for r in replays:
        step = r["step"]
        keep = passed(r, "keep_fp32")
        if keep is not None and out.keep is None:
            out.keep = keep
            out.parts += [text(keep_checked(step, keep)), *A.keep_fp32(setup, keep["modules"])]
        tried = failed(r, "keep_fp32")
        if note_failed_keep and tried and keep is None and not out.keep_failed:  # said once, at the first step tried
            out.keep_failed = True
            kept = "; ".join(" and ".join(t["modules"]) for t in tried)
            why = (
                "the forward was finite then, but the backward through the half-precision modules overflowed even "
                "at a loss scale 2^16 times lower"
                if tried[-1].get("forward_finite")
                else "the modules after them cast the values back to half precision, or they are beyond any "
                "format's reach"
            )
            out.parts.append(
                text(f"Keeping {kept} in FP32 was tried on step {step} and did not remove the NaN/Inf ({why}).")
            )
        bf16 = [c for c in r.get("checks", []) if c.get("fix") == "bf16"]
        if bf16 and out.bf16 is None:
            out.bf16 = bool(bf16[0].get("finite"))
            note = A.bf16_note(setup) if out.bf16 else []
            if note:
                lead = "Or, checked" if out.keep is not None else "Checked"  # an alternative to the FP32 module
                out.parts += [
                    text(f"{lead} on step {step}: finite in BF16 (FP32's exponent range, no loss scaling):"),
                    *note[1:],
                ]
        scale = passed(r, "loss_scale")
        if scale is not None and not scale_seen:
            scale_seen = True
            lead = "Or, checked" if out.parts else "Checked"
            out.parts += [
                text(f"{lead} on step {step}: finite at a loss scale of {scale['scale']:g}:"),
                code(A.scaler_line(run, init_scale=scale["scale"])),
            ]
    return out


def outlier_batch(
    run: RunView, *, min_factor: float = OUTLIER_FACTOR, guard_factor: float = GUARD_FACTOR
) -> list[Diagnosis]:
    found: list[Diagnosis] = []
    for r in replays(run):
        batch = r.get("batch", {})
        factor = batch.get("factor")
        nonfinite_inputs = sum(int(i.get("nonfinite", 0)) for i in batch.get("inputs", []))
        if not nonfinite_inputs and not (factor is not None and factor >= min_factor):
            continue
        step = r["step"]
        op = where_made(r)
        ids = batch.get("ids")
        who = f" (samples {', '.join(map(str, ids[:8]))}{', ...' if len(ids) > 8 else ''})" if ids else ""
        fingerprint = ", ".join(
            f"{'x'.join(map(str, i['shape']))} {i['dtype']}" + (f" #{i['sha1']}" if i.get("sha1") else "")
            for i in batch.get("inputs", [])[:4]
        )
        if nonfinite_inputs:
            what = f"held {nonfinite_inputs} NaN/Inf value(s) in its inputs"
        else:
            peaks = f"{batch['peak']:.4g} against {batch['usual_peak']:.4g}"
            what = f"held inputs {factor:.3g}x the run's usual peak ({peaks})"
        if op is not None:
            effect = f"; replayed, it made a NaN/Inf in {op_text(op)}"
        elif r.get("why") in ("grad_spike", "loss_spike"):
            effect = f"; it made a {r['why'].replace('_', ' ')}"
        elif nonfinite_inputs:
            effect = "; no operation made the NaN/Inf: the batch brought it"
        else:
            effect = ""
        usual = batch.get("usual_peak")
        limit = float(f"{guard_factor * usual:.3g}") if usual else None
        fix = checked_fixes(run, [r]).parts if not nonfinite_inputs else []
        fix += [
            text(
                f"Find that batch{who} in the data (its inputs: {fingerprint}) and clean or normalise it; or skip "
                "batches like it with a guard on the batch's inputs (`x`), called in the loop before the forward:"
            ),
            code(
                "def batch_ok(x, limit=" + (repr(limit) if limit else "float('inf')") + "):",
                "    # finite inputs within a few times their usual peak"
                + (f" ({usual:.4g} in this run)" if usual else ""),
                "    return bool(torch.isfinite(x).all()) and float(x.abs().max()) <= limit",
            ),
        ]
        if op is not None and not passed(r, "keep_fp32") and failed(r, "keep_fp32"):
            fix.append(
                text(
                    f"Keeping {failed(r, 'keep_fp32')[0]['modules'][0]} in FP32 was tried on step {step} and did "
                    "not remove the NaN/Inf: the values are out of any format's reach, or the next module casts them "
                    "back to half precision."
                )
            )
        # A NaN/Inf or a skipped step is harm; a finite spike the run absorbed is worth knowing, not more.
        severity = "warning" if r.get("why") in ("nonfinite", "skipped") else "info"
        found.append(
            finding(
                severity,
                f"Outlier batch at step {step}",
                f"The batch of step {step}{who} {what}{effect}."
                + (
                    " The replay was exact."
                    if r.get("exact")
                    else " The replay was not exact: " + "; ".join(r.get("not_exact", [])) + "."
                ),
                layers=[op["module"]] if op is not None else [],
                steps=[step, step],
                evidence={
                    "step": step,
                    "factor": factor,
                    "peak": batch.get("peak"),
                    "usual_peak": usual,
                    "nonfinite_inputs": nonfinite_inputs,
                    "inputs": batch.get("inputs", [])[:4],
                    "ids": ids or [],
                    "operation": op,
                    "exact": r.get("exact"),
                    "checks": r.get("checks", []),
                },
                fix=fix,
            )
        )
    return found


def loss_spike(
    run: RunView,
    *,
    jump_binades: float = JUMP_BINADES,
    near_limit: float = NEAR_LIMIT_BINADES,
    min_factor: float = OUTLIER_FACTOR,
    harm_factor: float = HARM_FACTOR,
) -> list[Diagnosis]:
    found: list[Diagnosis] = []
    last = -INCIDENT_GAP - 1
    for r in replays(run):
        if r.get("why") not in ("loss_spike", "grad_spike"):
            continue
        if r["step"] - last <= INCIDENT_GAP:
            last = r["step"]
            continue  # the same incident: the spike's first step is where it began
        last = r["step"]
        batch = r.get("batch", {})
        if batch.get("factor") is not None and batch["factor"] >= min_factor:
            continue  # an outlier batch: outlier-batch's finding
        step = r["step"]
        if step >= run.n_steps:
            continue
        st = run.steps
        row = st.iloc[step]
        loss_before = st["loss"].iloc[max(0, step - 20) : step].to_numpy(float)
        loss_before = loss_before[np.isfinite(loss_before)]
        base = float(np.median(loss_before)) if len(loss_before) else math.nan
        if r["why"] == "grad_spike" and not _hurt(st, step, base, harm_factor):
            continue  # a gradient-norm spike the loss did not feel (early training moves fast): no finding
        jumped, limits = _jumps(run, step, jump_binades, near_limit)
        numerical = bool(limits)
        jump = row["loss"] / base if base > 0 and np.isfinite(row["loss"]) else math.inf
        if not numerical and jump < LASTING_FACTOR and _shaken_off(st, step, base, harm_factor):
            continue
        what = (
            f"the loss jumped to {row['loss']:.4g} ({row['loss'] / base:.3g}x its recent median)"
            if r["why"] == "loss_spike" and base > 0
            else f"the gradient norm jumped to {row['grad_norm']:.4g}"
        )
        layers = [p for p, _ in jumped[:5]]
        if numerical:
            cause = (
                f"numerical: {', '.join(limits[:3])} ran within {near_limit:g} binade(s) of the format's max on that "
                "step"
            )
            fix = [
                text("Keep the layer that reached the limit in FP32 (checked on the next failing step by the replay):"),
                code(A.keep_fp32_line([limits[0].split(" ")[0]])),
            ]
        else:
            cause = "not numerical: no layer came near a format limit (the data or the learning rate)"
            fix = _clip_fix(run, step)
        found.append(
            finding(
                "warning",
                f"{'Loss' if r['why'] == 'loss_spike' else 'Gradient-norm'} spike at step {step}",
                f"At step {step} {what}; "
                + (f"the layers that jumped against their history: {', '.join(layers)}; " if layers else "")
                + f"{cause}.",
                layers=layers,
                steps=[step, step],
                evidence={
                    "step": step,
                    "kind": r["why"],
                    "jumped": {p: round(b, 2) for p, b in jumped[:10]},
                    "near_limit": limits[:10],
                    "numerical": numerical,
                    "exact": r.get("exact"),
                    "batch_factor": batch.get("factor"),
                },
                fix=fix,
            )
        )
    return found


def _hurt(st: pd.DataFrame, step: int, base: float, factor: float) -> bool:
    after = st["loss"].iloc[step : step + INCIDENT_GAP + 1].to_numpy(float)
    if not len(after) or not base > 0:
        return False
    return bool((~np.isfinite(after)).any() or after.max() >= factor * base)


def _shaken_off(st: pd.DataFrame, step: int, base: float, factor: float) -> bool:
    after = st["loss"].iloc[step + 1 : step + 1 + INCIDENT_GAP].to_numpy(float)
    if len(after) < INCIDENT_GAP or not base > 0 or not np.isfinite(after).all():
        return False  # the run ended there, or went non-finite: not shaken off
    return bool(np.median(after) < factor * base)


def _jumps(
    run: RunView, step: int, jump_binades: float, near_limit: float
) -> tuple[list[tuple[str, float]], list[str]]:
    """(layers whose peak at ``step`` exceeded their history's median by ``jump_binades`` binades, worst first;
    layers within ``near_limit`` binades of their format's max at ``step``). Output gradients are compared unscaled
    (a scale that grew is not a jump) and against the limit as stored (scaled: that is what the format held)."""
    jumped: list[tuple[str, float]] = []
    limits: list[str] = []
    scale = run.steps["loss_scale"].to_numpy(float)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    for kind in ("act", "grad_out"):
        sites = run.sites(kind)
        if not len(sites) or step >= run.n_steps:
            continue
        lo = max(0, step - 200)
        window = run.at("peak", kind, np.arange(lo, step + 1))  # the step and its history, whatever the run's length
        unscaled = window / scale[lo : step + 1, None] if kind == "grad_out" else window
        for j, (path, dtype) in enumerate(zip(sites["path"], sites["dtype"])):
            now, past = unscaled[-1, j], unscaled[:-1, j]
            past = past[np.isfinite(past) & (past > 0)]
            if np.isfinite(now) and now > 0 and len(past):
                binades = math.log2(now / float(np.median(past)))
                if binades >= jump_binades:
                    jumped.append((f"{path} ({kind})", binades))
            fmt = formats.get(dtype) if dtype in formats.DTYPE_FORMATS else None
            stored = window[-1, j]
            if fmt is not None and (not np.isfinite(stored) or stored >= fmt.max / 2**near_limit):
                limits.append(f"{path} ({kind}, {dtype})")
    jumped.sort(key=lambda pb: -pb[1])
    return jumped, limits


def _clip_fix(run: RunView, step: int) -> list[Part]:
    """Clip the gradient norm: one batch then cannot move the weights far (after unscaling, with a GradScaler)."""
    norms = run.steps["grad_norm"].to_numpy(float)[:step]
    norms = norms[np.isfinite(norms)]
    max_norm = float(f"{2 * float(np.median(norms)):.2g}") if len(norms) else 1.0
    lines = [f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm!r})  # ~2x the usual norm here"]
    if run.scaler_on:
        lines.insert(0, "scaler.unscale_(optimizer)  # the gradients unscaled before the norm is measured")
    return [
        text(
            "Clip the gradient norm in the loop, after the backward and before the optimizer step, so that one "
            f"batch cannot move the weights far (`model`, `optimizer`{', `scaler`' if run.scaler_on else ''}: "
            "yours):"
        ),
        code(*lines),
    ]


def healed(run: RunView) -> list[Diagnosis]:
    """heal=True kept modules in FP32 during the run: each intervention, and the line that makes it permanent."""
    ev = run.trace.events("heal")
    found: list[Diagnosis] = []
    for _, row in ev.iterrows():
        data = row["data"] if isinstance(row["data"], dict) else {}
        path = data.get("module")
        if not path:
            continue
        step = int(row["step"])
        confirmed = sorted(
            r["step"] for r in replays(run) if any(c.get("modules") == [path] and c.get("finite") for c in r["checks"])
        )
        found.append(
            finding(
                "info",
                f"{path} was kept in FP32 from step {step + 1} on (heal=True)",
                f"ampdoctor kept {path} in FP32 from step {step + 1} to the end of the run: the replays of steps "
                f"{', '.join(map(str, confirmed))} showed its forward overflow gone with that change. The run's later "
                "steps ran with it; a new run does not, unless you keep it:",
                layers=[path],
                steps=[step + 1, run.n_steps - 1],
                evidence={"module": path, "from_step": step + 1, "confirmed_on": confirmed},
                fix=[code(A.keep_fp32_line([path]))],
            )
        )
    return found


def on_cuda_in_fp32(op: dict[str, Any] | None) -> bool:
    """Whether CUDA autocast would compute this operation in FP32 (a fault of its half-precision output seen on the
    CPU would not happen there)."""
    return op is not None and autocast_ops.computes_in_float32_on(op["op"], "cuda")
