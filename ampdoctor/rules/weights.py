"""Weight rules: weight-update-lost (half-precision weights swallow small updates), grad-range-anomaly (a layer's
gradients orders of magnitude off, traced back to the weights whose scale is at fault)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from .. import formats
from ..trace.schema import ROOT
from . import advice as A
from .fix import code, text
from .policy import NORM_TYPES
from .result import Diagnosis, finding
from .runview import FloatArray, RunView, WeightFault

# An update below half an ULP of its weight rounds back to the weight: the element did not move although its
# gradient was non-zero. 10% of the parameters frozen that way is material; 90% means training has stalled.
MIN_LOST_SHARE = 0.10
STALLED_SHARE = 0.90
# Default inits (kaiming/xavier/PyTorch's uniform) give a weight RMS within ~2x of 1/sqrt(fan_in); 1.5 decades
# (~30x) off that cannot come from an init formula or from ordinary training drift.
WEIGHT_DECADES = 1.5
# Gradient RMS of weight matrices in a healthy net stays within a couple of decades across layers; a layer three
# decades away from the median of the others is the "gradient of 1e8" of the troubleshooting table.
GRAD_DECADES = 3.0
NO_FAN_IN = NORM_TYPES + ("Embedding", "EmbeddingBag")


def weight_update_lost(
    run: RunView, *, min_lost_share: float = MIN_LOST_SHARE, stalled_share: float = STALLED_SHARE
) -> Diagnosis | None:
    w = run.sites("weight")
    half = w[w["dtype"].isin(formats.REDUCED)]
    if not len(half):
        return None
    up = run.sites("update")
    pg = run.sites("param_grad")
    # at the full-statistics steps read: row i is step fs[i]
    fs = run.stat_steps
    upd_zero, upd_n = run.stat("zeros", "update"), run.stat("numel", "update")
    g_zero, g_n = run.stat("zeros", "param_grad"), run.stat("numel", "param_grad")
    g_rms = run.stat("rms", "param_grad")
    w_rms = run.stat("rms", "weight")
    skipped = run.steps["skipped"].to_numpy(bool)[fs]
    lr = run.steps["lr"].to_numpy(float)[fs]
    lost_total, n_total, per, steps_used = 0.0, 0.0, {}, set()
    ratios = []
    up_col = {p: j for j, p in reversed(list(enumerate(up["path"])))}  # the first site of each path
    pg_col = {p: j for j, p in reversed(list(enumerate(pg["path"])))}
    w_col = {int(sid): j for j, sid in enumerate(w["id"])}
    for _, site in half.iterrows():
        jw = w_col[int(site["id"])]
        if site["path"] not in up_col or site["path"] not in pg_col:
            continue
        ju, jg = up_col[site["path"]], pg_col[site["path"]]
        rows = np.flatnonzero(np.isfinite(upd_n[:, ju]) & np.isfinite(g_n[:, jg]) & ~skipped)
        if not len(rows):
            continue
        with np.errstate(all="ignore"):
            moved_expected = 1.0 - g_zero[rows, jg] / g_n[rows, jg]  # elements with a non-zero gradient
            frozen = upd_zero[rows, ju] / upd_n[rows, ju]
        lost = np.clip(frozen - (1.0 - moved_expected), 0.0, 1.0)
        numel = float(upd_n[rows[0], ju])
        share = float(np.nanmean(lost))
        per[site["path"]] = share
        lost_total += share * numel
        n_total += numel
        steps_used.update(fs[rows].tolist())
        fmt = formats.get(site["dtype"])
        wr = np.nanmedian(w_rms[rows, jw]) if np.isfinite(w_rms[rows, jw]).any() else np.nan
        ur = np.nanmedian(lr[rows] * g_rms[rows, jg])
        if np.isfinite(wr) and wr > 0 and np.isfinite(ur):
            ratios.append(float(ur / (0.5 * fmt.ulp(wr))))
    if not n_total:
        return None
    share = lost_total / n_total
    if share < min_lost_share:
        return None
    worst = sorted(per.items(), key=lambda kv: -kv[1])
    dtype = str(half["dtype"].mode().iloc[0])
    severity = "critical" if share >= stalled_share else "warning"
    fix = [
        text("Keep the parameters in FP32 and let autocast compute in half precision (O1: FP32 master weights):"),
        A.master_weights(A.Setup.of(run), dtype),
        text(
            "Or keep an FP32 master copy (O2-style): step the optimizer on FP32 copies of the weights and copy "
            "them back into the half-precision model after each step."
        ),
    ]
    return finding(
        severity,
        "Weight updates lost to rounding",
        f"Parameters are stored in {dtype} and {A.pct(share)} of their elements did not change although their "
        f"gradient was non-zero: the updates are below half an ULP of the weights"
        + (f" (median update/half-ULP ratio {A.fmt_num(float(np.median(ratios)))})" if ratios else "")
        + ".",
        layers=list(dict.fromkeys(p.rpartition(".")[0] or p for p, _ in worst)),
        steps=run.step_range(steps_used),
        evidence={
            "param_dtype": dtype,
            "lost_share": share,
            "per_parameter": {p: round(s, 4) for p, s in worst[:10]},
            "update_to_half_ulp": float(np.median(ratios)) if ratios else None,
            "optimizer": (run.config.get("optimizer") or {}).get("class"),
            "steps_measured": len(steps_used),
        },
        fix=fix,
    )


def _fan_in(shape: str) -> int | None:
    try:
        dims = [int(d) for d in str(shape).split("x")]
    except ValueError:
        return None
    if len(dims) < 2:
        return None
    return math.prod(dims[1:])


fan_in = _fan_in  # public: rules/divergence.py reads it


def grad_range_anomaly(
    run: RunView, *, grad_decades: float = GRAD_DECADES, weight_decades: float = WEIGHT_DECADES
) -> Diagnosis | None:
    pg = run.sites("param_grad")
    types = run.module_types
    paths, modules = pg["path"].tolist(), pg["module"].tolist()  # (columns as lists: thousands of layers)
    mats = [
        j for j, shape in enumerate(pg["shape"].tolist()) if _fan_in(shape) and types.get(modules[j]) not in NO_FAN_IN
    ]
    if len(mats) < 3:
        return None  # "the others" needs at least two other layers
    st = run.steps
    clean = ~st["skipped"].to_numpy(bool) & ~st["nonfinite"].to_numpy(bool)
    rows = np.flatnonzero(clean[run.stat_steps])  # the clean full-statistics steps read
    fs = run.stat_steps[rows].tolist()
    if not fs:
        return None
    rms = run.stat("rms", "param_grad")[np.ix_(rows, np.array(mats, dtype=np.int64))]
    with np.errstate(all="ignore"):
        logr = np.log10(np.where(rms > 0, rms, np.nan))
    has = np.isfinite(logr).any(axis=0)  # an all-NaN column would make nanmedian warn
    g = np.full(logr.shape[1], np.nan)
    g[has] = np.nanmedian(logr[:, has], axis=0)
    ok = np.isfinite(g)
    if ok.sum() < 3:
        return None
    med = float(np.median(g[ok]))
    # each layer against the median of the *other* layers
    idx = np.flatnonzero(ok)
    dev = np.full(len(g), np.nan)
    dev[idx] = g[idx] - _median_of_others(g[idx])
    outliers = [(paths[mats[i]], float(dev[i]), float(10 ** g[i])) for i in idx if abs(dev[i]) >= grad_decades]
    faults = [
        (p, w["ratio"], w["rms"], w["fan_in_rms"], w["module"]) for p, w in weight_faults(run, weight_decades).items()
    ]
    if not outliers:
        return None
    outliers.sort(key=lambda o: -abs(o[1]))
    layers = [f[4] for f in faults] + [p.rpartition(".")[0] or p for p, _, _ in outliers]
    layers = list(dict.fromkeys(layers))
    if faults:
        path, ratio, wr, exp, mod = faults[0]
        cause = (
            f"the weights of {mod} are {A.fmt_num(ratio)}x the scale its fan-in gives "
            f"(RMS {A.fmt_num(wr)} vs about {A.fmt_num(exp)})"
        )
        mods = list(dict.fromkeys(f[4] for f in faults))
        fix = [
            text(
                f"Re-initialise {', '.join(mods)} (PyTorch's default for Linear/Conv is kaiming_uniform_ with "
                "a=sqrt(5); use kaiming_normal_ before a ReLU):"
            ),
            code(
                "import math",
                "",
                *[f"torch.nn.init.kaiming_uniform_({A.attr(f[0])}, a=math.sqrt(5))" for f in faults],
                f'# or: torch.nn.init.kaiming_normal_({A.attr(path)}, nonlinearity="relu")',
            ),
        ]
    else:
        cause = "no weight is off its fan-in scale, so look at the inputs or a custom op in those layers"
        fix = [
            text("Clip gradients while you find the cause, and check the inputs of these layers:"),
            code(*A.clip_lines(A.Setup.of(run))),
        ]
    return finding(
        "warning",
        "Gradient range anomaly",
        f"{len(outliers)} layer(s) have gradients at least {grad_decades:g} decades away from the other layers "
        f"(worst {outliers[0][0]}: RMS {A.fmt_num(outliers[0][2])}, {outliers[0][1]:+.1f} decades); {cause}.",
        layers=layers,
        steps=run.step_range(fs),
        evidence={
            "grad_rms": {paths[mats[i]]: float(10 ** g[i]) for i in np.flatnonzero(ok)},
            "median_grad_rms": 10**med,
            "outliers": {p: round(d, 2) for p, d, _ in outliers},
            "weight_faults": {p: {"rms": wr, "fan_in_rms": exp, "ratio": ratio} for p, ratio, wr, exp, _ in faults},
        },
        fix=fix,
    )


def _median_of_others(v: FloatArray) -> FloatArray:
    """For each element, np.median of all the other elements (k >= 2), without a loop: in sorted order, dropping the
    element at position p shifts the order statistics above p down by one."""
    k = len(v)
    order = np.argsort(v, kind="stable")
    a = v[order]
    pos = np.empty(k, dtype=np.int64)
    pos[order] = np.arange(k)
    m = k - 1  # elements left

    def nth(r: npt.NDArray[np.int64]) -> FloatArray:  # the r-th smallest of the others
        return a[np.where(r < pos, r, r + 1)]

    lo, hi = nth(np.full(k, (m - 1) // 2)), nth(np.full(k, m // 2))
    return np.where(m % 2 == 1, lo, (lo + hi) / 2)


def weight_faults(run: RunView, weight_decades: float = WEIGHT_DECADES) -> dict[str, WeightFault]:
    """Weight matrices whose RMS at their first record is at least ``weight_decades`` off 1/sqrt(fan_in), worst
    first: parameter path -> {"rms", "fan_in_rms", "ratio", "module"} (shared as ``Run.weight_faults``)."""
    w = run.sites("weight")
    w_rms = run.stat("rms", "weight")  # the first full-statistics step read is the run's first
    types = run.module_types
    faults: list[tuple[str, WeightFault]] = []
    for j, (path, module, shape) in enumerate(zip(w["path"].tolist(), w["module"].tolist(), w["shape"].tolist())):
        fan = _fan_in(shape)
        if not fan or types.get(module) in NO_FAN_IN:
            continue
        col = w_rms[:, j]
        col = col[np.isfinite(col)]
        if not len(col):
            continue
        ratio = float(col[0] * math.sqrt(fan))  # rms / (1/sqrt(fan_in)), at the first recorded step
        if ratio > 0 and abs(math.log10(ratio)) >= weight_decades:
            faults.append(
                (path, {"rms": float(col[0]), "fan_in_rms": 1.0 / math.sqrt(fan), "ratio": ratio, "module": module})
            )
    faults.sort(key=lambda f: -abs(math.log10(f[1]["ratio"])))
    return dict(faults)


# Optimizers whose update divides by sqrt(v) + eps: with eps rounded to 0 in the weights' format and v underflowed
# (a gradient below ~2^-12 squares below FP16's 2^-24), the update is m / 0 = Inf, or 0 / 0 = NaN.
EPS_OPTIMIZERS = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "SparseAdam")


def weights_nonfinite(run: RunView) -> Diagnosis | None:
    ev = run.weight_events
    if not len(ev):
        return None
    first = int(ev["step"].min())
    params = list(dict.fromkeys(p for d in ev["data"] for p in d.get("params", [])))
    count = max(int(d.get("count", 0)) for d in ev["data"])
    st = run.steps
    # the step's own gradients were finite and the step went through: the update itself made the NaN/Inf
    idx = np.flatnonzero(st["step"].to_numpy(int) == first)
    grads_finite = (
        bool(len(idx)) and not bool(run.gradient_peaks.nonfinite[idx[0]]) and not bool(st["skipped"].iloc[idx[0]])
    )
    w = run.sites("weight")
    dtypes = dict(zip(w["path"], w["dtype"]))
    pdt = run.config.get("param_dtypes", {}) or {}
    dtype = next((dtypes[p] for p in params if dtypes.get(p) in formats.REDUCED), None) or next(
        (d for d in pdt if d in formats.REDUCED), None
    )
    opt = run.config.get("optimizer") or {}
    cls = opt.get("class") or "the optimizer"
    eps = (opt.get("groups") or [{}])[0].get("eps")
    fmt = formats.get(dtype) if dtype else None
    eps_lost = bool(
        fmt is not None and cls in EPS_OPTIMIZERS and isinstance(eps, (int, float)) and eps <= fmt.min_subnormal / 2
    )
    why = (
        f"{cls}'s eps={eps:g} rounds to 0 in {dtype} (its smallest subnormal is {A.fmt_num(fmt.min_subnormal)}), "
        "so where the squared gradient underflows too its update divides by zero"
        if eps_lost and fmt is not None
        else f"the {cls} update produced values the {dtype or 'parameter'} weights cannot hold"
    )
    if dtype:
        ac = dtype if dtype in formats.REDUCED else "float16"
        fix = [
            text(
                "Keep FP32 master weights: the optimizer updates FP32 parameters, autocast computes in "
                f"{dtype} (tested fix):"
            ),
            A.master_weights(A.Setup.of(run), ac),
        ]
    else:
        fix = [
            text(
                "The update itself overflowed the FP32 weights: lower the learning rate, and keep steps with "
                "non-finite gradients out (a GradScaler skips them; without one, check before the step):"
            ),
            code(
                "if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):",
                "    optimizer.step()",
            ),
        ]
    if eps_lost and fmt is not None:
        fix += [
            text(
                f"Or, keeping {dtype} weights, an eps the format holds as a normal number "
                f"(>= {A.fmt_num(fmt.min_normal)}):"
            ),
            code("for group in optimizer.param_groups:", f'    group["eps"] = {_normal_eps(fmt):g}'),
        ]
    return finding(
        "critical",
        "The optimizer step made weights NaN/Inf",
        f"After the optimizer step of step {first} {count} parameter tensor(s) held NaN/Inf"
        + (" although that step's gradients were finite" if grads_finite else "")
        + f": {why}. Every later forward pass computes with them.",
        layers=list(dict.fromkeys(p.rpartition(".")[0] or ROOT for p in params)),
        steps=[first, int(st["step"].iloc[-1])],
        evidence={
            "first_step": first,
            "tensors": count,
            "params": params[:20],
            "param_dtype": dtype,
            "optimizer": cls,
            "eps": eps,
            "eps_in_format": 0.0 if eps_lost else eps,
            "eps_lost": eps_lost,
            "gradients_finite": grads_finite,
        },
        fix=fix,
    )


def eps_not_lost(own: Diagnosis, divergence: Diagnosis) -> bool:
    """Suppression (registry): weights that blew up with a diverged run are divergence's finding, unless an eps lost
    to the format explains them (then the update divides by zero whatever the learning rate)."""
    return not own.evidence.get("eps_lost")


def _normal_eps(fmt: formats.Format) -> float:
    """The smallest power of ten at or above the format's smallest normal (FP16: 1e-4)."""
    return 10.0 ** math.ceil(math.log10(fmt.min_normal))
