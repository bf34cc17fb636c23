"""Loss-scaler rules: init-scale-too-high, loss-scale-collapse."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import numpy as np

from .. import formats
from . import advice as A
from .fix import code, text
from .result import Diagnosis, finding
from .runview import BoolArray, FloatArray, RunView

if TYPE_CHECKING:
    from ..lossscale import Suggestion

# A GradScaler halves its scale once per overflowing step, so a run started at 2^16 whose gradients need 2^13
# skips 3 steps while calibrating; PyTorch's own default skips "a handful". Five or more skips in the
# calibration window means the start value was at least 2^5 = 32x too high.
MIN_EARLY_SKIPS = 5
# Calibration window: the first 100 steps (or the first 10% of a longer run) is where an init_scale shows.
EARLY_STEPS = 100
# Collapse: a scale of 1 or less means scaling does nothing any more (or shrinks gradients into underflow).
COLLAPSE_SCALE = 1.0
# "Halving without recovery": after calibration the scale ended at least 2^4 below its highest value ...
COLLAPSE_HALVINGS = 4
# ... while more than 5% of post-calibration steps were skipped (a healthy run: one per few hundred steps).
MAX_SKIP_SHARE = 0.05


class NonfiniteOrigins(TypedDict):
    """Where the non-finite values of some steps came from (``nonfinite_origins``): steps per origin."""

    forward: dict[str, int]  # module -> steps whose first non-finite value was its output
    loss: int
    input: int
    gradient: dict[str, int]  # module -> steps whose first non-finite value was its gradient
    unknown: int


def grad_out_peaks(run: RunView) -> tuple[FloatArray, BoolArray]:
    """(largest unscaled gradient per step in FP16 terms [n], clean-step mask), as the replay defines it (output and
    parameter gradients; a returned loss's gradient w.r.t. itself is not one): replay.GradientPeaks."""
    peaks = run.gradient_peaks
    g = peaks.fp16_equivalent
    clean = np.isfinite(g) & ~peaks.nonfinite & ~run.steps["skipped"].to_numpy(bool)
    return g, clean


def _observed_nonfinite(run: RunView) -> BoolArray:
    """Steps that observed their sites and held a NaN/Inf: the rows where a NaN peak is a value, not the NaN that
    fills a step observed by the sentinel only."""
    st = run.steps
    observed: BoolArray = st["nonfinite"].to_numpy(bool) & (st["level"].fillna(0).to_numpy(float) >= 0)
    return observed


def _act_bad(run: RunView) -> BoolArray:
    """Per step: some module output was NaN/Inf or not observed (a step without peaks observed none), from the one
    pass over the peaks."""
    view = run.view
    scan = view.scan
    bad: BoolArray = view.per_step(scan.bad["act"] | scan.unseen["act"], True)
    return bad


def forward_nonfinite_steps(run: RunView) -> set[int]:
    """Steps in which a forward output or the loss was non-finite (loss scaling cannot cause or fix these)."""
    ev = run.events
    steps = set(ev.loc[ev["phase"].isin(["fwd", "loss"]), "step"].astype(int))
    if len(run.sites("act")):
        steps |= set(np.flatnonzero(_act_bad(run) & _observed_nonfinite(run)).tolist())
    loss = run.steps["loss"].to_numpy(float)
    steps |= set(np.flatnonzero(~np.isfinite(loss) & ~np.isnan(loss)).tolist())
    return steps


def init_scale_too_high(
    run: RunView, *, min_skips: float = MIN_EARLY_SKIPS, early_steps: float = EARLY_STEPS
) -> Diagnosis | None:
    if not (run.scaler_on and run.fp16):
        return None
    st = run.steps
    window = max(int(early_steps), int(0.1 * len(st)))
    early = st.iloc[:window]
    skipped = early.loc[early["skipped"], "step"].astype(int).tolist()
    if len(skipped) < min_skips:
        return None
    if forward_nonfinite_steps(run) & set(skipped):
        return None  # the forward pass overflowed: a scale cannot be the cause
    g, clean = grad_out_peaks(run)
    if not clean.any():
        return None
    gmax = float(np.nanmax(g[clean]))
    if not (gmax > 0) or gmax * A.SCALE_MARGIN > formats.FP16.max:
        return None  # unscaled gradients do not fit FP16: not a scaling problem
    scales = st.loc[st["step"].isin(skipped), "loss_scale"].to_numpy(float)
    over = [s for s in scales if s * gmax > formats.FP16.max / 2]  # the scale alone pushed the max out of range
    recorded = run.scaler.get("init_scale")
    first = float(st["loss_scale"].iloc[0])
    init = float(recorded) if isinstance(recorded, (int, float)) and 0 < recorded < float("inf") else first
    if not over or float(early["loss_scale_next"].iloc[-1]) >= init:
        return None  # the scale ended the window no lower than it started: the skips are
        # growth/overflow cycles (late-degradation), not a too-high start
    sug = run.suggestion  # the replay's answer, so that this finding and `replay --suggest` agree
    if sug is None:
        return None  # the replay cannot start from the recorded scaler settings
    suggested = float(sug.settings["init_scale"])
    if suggested >= init:
        return None
    return finding(
        "warning",
        "Initial loss scale too high",
        f"{len(skipped)} of the first {len(early)} steps were skipped while the loss scale fell from {A.pow2(init)} "
        f"to {A.pow2(float(st['loss_scale_next'].iloc[len(early) - 1]))}; the unscaled gradients peak at "
        f"{A.fmt_num(gmax)}, so any scale above {A.pow2(formats.FP16.finite_limit / gmax)} overflows FP16.",
        steps=run.step_range(skipped),
        evidence={
            "skipped_early": len(skipped),
            "window": len(early),
            "skipped_steps": skipped[:20],
            "init_scale": init,
            "max_unscaled_grad": gmax,
            "fp16_max": formats.FP16.max,
            "scale_at_skips": [float(s) for s in scales[:20]],
            "suggested_init_scale": suggested,
            "suggested_settings": sug.settings,
            "replay_skipped": sug.replay.n_skipped,
            "recorded_skipped": int(st["skipped"].sum()),
        },
        fix=[
            text(
                f"Start the scaler at {A.pow2(suggested)} (the replay of this run's gradients finds it loses "
                f"the least: {sug.replay.n_skipped} skipped step(s) instead of {int(st['skipped'].sum())}; "
                "`ampdoctor replay TRACE --suggest` shows the same):"
            ),
            code(suggestion_line(sug)),
        ],
    )


def suggestion_line(sug: Suggestion) -> str:
    """The replay's suggested GradScaler as a line to paste (the same code `replay --suggest` prints)."""
    return "scaler = " + sug.code


def output_gradient_steps(run: RunView) -> set[int]:
    """Steps whose loss was finite but whose first non-finite value was the first gradient of the backward pass (the
    loss's gradient w.r.t. the model's output: no finite gradient came before it). The loss function's own backward
    made it, e.g. log's 1/p at a probability rounded to 0."""
    ev = run.events
    bwd = ev[ev["phase"] == "bwd"]
    if not len(bwd):
        return set()
    acts = set(run.sites("act")["id"].astype(int))
    step, loss = run.steps["step"].to_numpy(np.int64), run.steps["loss"].to_numpy(float)  # (steps in order)
    return {
        int(s)
        for s, d in zip(bwd["step"], bwd["data"])
        if isinstance(d, dict) and d.get("after") in acts and _finite_at(step, loss, int(s))
    }


def _finite_at(step: np.ndarray, values: FloatArray, s: int) -> bool:
    """Whether step ``s`` has a finite value (``step`` sorted; a step not recorded has none). A seek, not a dict of
    every step (10^6 Python objects for a few events)."""
    i = int(np.searchsorted(step, s))
    return i < len(step) and int(step[i]) == s and bool(np.isfinite(values[i]))


def nonfinite_origins(run: RunView, steps: list[int]) -> NonfiniteOrigins:
    """Where the non-finite values of these steps came from: counts per origin class and culprit layer ("loss": the
    loss function, its value or its gradient w.r.t. the model's output, from finite model outputs)."""
    ev = run.events
    ev = ev[ev["step"].isin(steps)]
    act_bad = set(np.flatnonzero(_act_bad(run) & _observed_nonfinite(run)).tolist()) if len(run.sites("act")) else set()
    out: NonfiniteOrigins = {"forward": {}, "loss": 0, "input": 0, "gradient": {}, "unknown": 0}
    by_step = {int(s): g for s, g in ev.groupby("step")}
    at_output = output_gradient_steps(run)
    for s in steps:
        g = by_step.get(int(s))
        fwd = g[g["phase"] == "fwd"] if g is not None else None
        if fwd is not None and len(fwd):
            p = fwd["path"].iloc[0]
            out["forward"][p] = out["forward"].get(p, 0) + 1
        elif g is not None and ((g["phase"] == "loss").any() or int(s) in at_output):
            out["loss"] += 1
        elif s in act_bad:
            out["input"] += 1  # every module saw a non-finite input: the batch itself
        elif g is not None and len(g):
            p = g["path"].iloc[0]
            out["gradient"][p] = out["gradient"].get(p, 0) + 1
        else:
            out["unknown"] += 1
    return out


def loss_scale_collapse(
    run: RunView,
    *,
    collapse_scale: float = COLLAPSE_SCALE,
    halvings: float = COLLAPSE_HALVINGS,
    max_skip_share: float = MAX_SKIP_SHARE,
) -> Diagnosis | None:
    if not run.scaler_on:
        return None
    st = run.steps
    nxt = st["loss_scale_next"].to_numpy(float)
    cur = st["loss_scale"].to_numpy(float)
    skipped = st["skipped"].to_numpy(bool)
    if not np.isfinite(nxt).any() or not skipped.any():
        return None
    # the lowest scale a backoff produced: a run that simply starts at a low init_scale has not collapsed
    lowest = float(np.nanmin(nxt[skipped])) if np.isfinite(nxt[skipped]).any() else float("inf")
    clean = np.flatnonzero(~skipped)
    after = clean[0] if len(clean) else 0  # calibration ends at the first step that went through
    post = skipped[after:]
    share = float(post.mean()) if len(post) else 0.0
    peak_scale = float(np.nanmax(cur[after:])) if len(post) else float("nan")
    end = float(nxt[-1])
    collapsed = lowest <= collapse_scale
    # Until one step has gone through, the scaler is still calibrating (a high init_scale halves for a dozen
    # steps): a trace read live during those steps is init-scale-too-high's case, not a collapse.
    sliding = len(clean) > 0 and share > max_skip_share and end <= peak_scale / 2.0**halvings
    if not (collapsed or sliding):
        return None
    bad = st.loc[skipped, "step"].astype(int).tolist()
    org = nonfinite_origins(run, bad)
    # a module that only tipped another's near-limit values over: name the producer forward-overflow names
    o = run.overflow_origins
    producer = {t: o.culprit for t in o.tipped} if o is not None else {}
    merged: dict[str, int] = {}
    for p, n in org["forward"].items():
        merged[producer.get(p, p)] = merged.get(producer.get(p, p), 0) + n
    org["forward"] = merged
    fwd = sorted(org["forward"].items(), key=lambda kv: -kv[1])
    grad = sorted(org["gradient"].items(), key=lambda kv: -kv[1])
    layers = [p for p, _ in fwd] + [p for p, _ in grad if p not in dict(fwd)]
    setup = A.Setup.of(run)
    if fwd and fwd[0][1] >= max(org["input"], org["loss"], 1):
        origin = "forward"
        cause = f"a forward overflow in {fwd[0][0]} ({fwd[0][1]} of the {len(bad)} skipped steps)"
        fix = [
            text(
                "Fix the forward overflow (see the forward-overflow finding): run that module in FP32 or "
                "rescale it, e.g."
            ),
            *A.keep_fp32(setup, [fwd[0][0]]),
        ]
    elif org["input"] >= max(org["loss"], 1):
        origin = "input"
        cause = f"non-finite input batches ({org['input']} of the {len(bad)} skipped steps had no finite module output)"
        fix = [
            text(
                "Find and drop the bad samples; until then skip a corrupt batch instead of training on it (`loader` "
                "stands for your data loader, yielding (x, y) pairs):"
            ),
            code(
                "def finite_batches(batches):",
                "    for x, y in batches:",
                "        if torch.isfinite(x).all():",
                "            yield x, y",
                "",
                "",
                "loader = finite_batches(loader)",
            ),
        ]
    elif org["loss"]:
        origin = "loss"
        cause = (
            f"the loss function (its value, or its gradient w.r.t. the model's output) from finite model outputs "
            f"({org['loss']} skipped steps)"
        )
        fix = [text("Compute the loss in FP32 and guard its inputs (log of 0, division by 0):"), A.loss_in_fp32(setup)]
    elif grad:
        origin = "gradient"
        cause = (
            f"non-finite gradients first seen at {grad[0][0]} ({grad[0][1]} skipped steps) with finite forward values"
        )
        module = grad[0][0] if grad[0][0] in set(run.sites("act")["path"]) else grad[0][0].rpartition(".")[0]
        fix = [
            text(
                "These gradients overflow even at a small scale: look for a layer with exploding gradients "
                "(see grad-range-anomaly) and clip them:"
            ),
            code(*A.clip_lines(setup)),
        ]
        if module and module in set(run.sites("act")["path"]):
            fix += [text(f"or compute {module} in FP32:"), *A.keep_fp32(setup, [module])]
    else:
        return None  # no recorded origin: no evidence to point at
    severity = "critical" if collapsed or share > 0.5 else "warning"
    return finding(
        severity,
        "Loss scale collapsed",
        f"The loss scale fell to {A.fmt_num(lowest)} with {len(bad)} of {len(st)} steps skipped "
        f"({A.pct(share)} after calibration); the non-finite values come from {cause}.",
        layers=layers,
        steps=run.step_range(bad),
        evidence={
            "lowest_scale": lowest,
            "final_scale": end,
            "skipped": len(bad),
            "steps": len(st),
            "skip_share_after_calibration": share,
            "origins": {"forward": dict(fwd), "gradient": dict(grad), "input_batch": org["input"], "loss": org["loss"]},
            "cause_origin": origin,
            "cause_module": fwd[0][0] if origin == "forward" else None,
        },
        fix=[
            text("Lowering the scale does not help; remove the source of the non-finite values. " + fix[0].text),
            *fix[1:],
        ],
    )
