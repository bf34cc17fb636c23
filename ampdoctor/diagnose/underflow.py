"""Gradient range rules: grad-underflow (FP16 run) and fp16-readiness (an FP32/BF16 run judged for FP16)."""
from __future__ import annotations

import math

import numpy as np

from .. import formats
from . import advice as A
from .engine import finding

FP16 = formats.FP16
# A value in FP16's subnormal range [2^-24, 2^-14) keeps fewer than 10 mantissa bits (relative error up to 50% at
# the bottom) and the tail below it is flushed to zero: 1% of a layer's gradient elements there is material.
MIN_SHARE = 0.01
# A layer whose FP16 gradient is this share of exact zeros has vanished (everything flushed), whatever ReLU masks.
VANISHED_ZEROS = 0.999


def _clean_full_steps(run) -> np.ndarray:
    st = run.steps
    ok = ~st["skipped"].to_numpy(bool) & ~st["nonfinite"].to_numpy(bool)
    fs = run.full_steps
    return fs[ok[fs]] if len(fs) else fs


def _layer(site) -> str:
    return site.module if site.kind in ("param_grad", "weight", "update") else site.path


def underflow_shares(run, kinds=("grad_out", "param_grad"), vanished=False):
    """Per FP16 gradient site: median share of elements in the FP16 subnormal range over clean full-statistics
    steps; rows (site, share, zeros share, unscaled max). ``vanished``: an all-zero gradient counts as flushed."""
    steps = _clean_full_steps(run)
    rows = []
    if not len(steps):
        return rows
    for kind in kinds:
        sites = run.sites(kind)
        half = np.flatnonzero(sites["dtype"].to_numpy() == "float16")
        if not len(half):
            continue
        n = run.records("numel", kind)[np.ix_(steps, half)]
        sub = run.records("fp16_sub", kind)[np.ix_(steps, half)]
        zeros = run.records("zeros", kind)[np.ix_(steps, half)]
        absmax = run.records("absmax", kind)[np.ix_(steps, half)]
        scale = run.records("scale", kind)[np.ix_(steps, half)]
        with np.errstate(all="ignore"):
            share = sub / n
            zshare = zeros / n
            if vanished:
                share = np.where(zshare >= VANISHED_ZEROS, 1.0, share)
            unscaled = absmax / np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
        for j, col in enumerate(half):
            ok = np.isfinite(share[:, j])
            if not ok.any():
                continue
            rows.append((sites.iloc[col], float(np.median(share[ok, j])), float(np.median(zshare[ok, j])),
                         float(np.nanmax(unscaled[:, j]))))
    return rows


def grad_underflow(run, *, min_share=MIN_SHARE):
    if not run.fp16:
        return None
    rows = underflow_shares(run)
    if not any(r[1] >= min_share for r in rows):
        return None
    if not run.scaler_on:
        # nothing lifts these gradients, and others sit at the FP16 floor: an all-zero one was flushed (with a
        # scaler on, an all-zero gradient is more likely a dead ReLU than underflow)
        rows = underflow_shares(run, vanished=True)
    bad = sorted([r for r in rows if r[1] >= min_share], key=lambda r: -r[1])
    layers = list(dict.fromkeys(_layer(r[0]) for r in bad))
    gmax = max((r[3] for r in rows if math.isfinite(r[3])), default=float("nan"))
    suggested = A.suggest_scale(gmax)
    steps = _clean_full_steps(run)
    in_force = run.steps["loss_scale"].to_numpy(float)[steps] if run.scaler_on else np.ones(len(steps))
    scale_now = float(np.nanmedian(in_force)) if len(in_force) else 1.0
    worst = bad[0]
    per_layer = {_layer(r[0]) + f" ({r[0].kind})": round(r[1], 4) for r in bad[:10]}
    if run.scaler_on:
        fix = (f"The scale in force ({A.pow2(scale_now)}) is too small for these gradients; the largest unscaled "
               f"gradient ({A.fmt_num(gmax)}) allows {A.pow2(suggested)}. Start there and let it grow sooner:\n"
               + A.scaler_line(run, init_scale=suggested, growth_interval=200))
    else:
        fix = (f"Enable dynamic loss scaling; the largest unscaled gradient ({A.fmt_num(gmax)}) allows a scale of "
               f"{A.pow2(suggested)}:\n" + A.scaler_line(run, init_scale=suggested) + "\n"
               "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()")
    fix += A.bf16_note(run)
    return finding(
        "warning", "Gradients lost to FP16 underflow",
        f"{len(bad)} gradient site(s) keep at least {A.pct(min_share)} of their elements below the FP16 normal "
        f"range (2^-14) at the loss scale in force ({A.pow2(scale_now)}); worst: {_layer(worst[0])} with "
        f"{A.pct(worst[1])} subnormal or flushed.",
        layers=layers, steps=run.step_range(steps),
        evidence={"scale_in_force": scale_now, "underflow_share": per_layer, "min_share": min_share,
                  "zeros_share_worst": worst[2], "max_unscaled_grad": gmax, "suggested_scale": suggested,
                  "fp16_min_normal": FP16.min_normal, "full_steps_used": len(steps)},
        recommendation=fix)


def _hist_underflow(run, kind: str, j_site: int, site_id: int, scale: float) -> float | None:
    """Share of a site's elements that would sit below the FP16 normal range at ``scale`` (its histograms)."""
    steps, counts = run.trace.hist(site_id)
    if not len(steps):
        return None
    ok = ~run.steps["skipped"].to_numpy(bool)[steps] & ~run.steps["nonfinite"].to_numpy(bool)[steps]
    if not ok.any():
        return None
    counts = counts[ok]
    numel = run.records("numel", kind)[steps[ok], j_site]
    shift = int(round(np.log2(scale)))
    cut = FP16.normal_exp - shift + 127          # column of binade 2^(-14 - log2 scale)
    below = counts[:, :max(cut, 0)].sum(axis=1)
    with np.errstate(all="ignore"):
        share = below / numel
    share = share[np.isfinite(share)]
    return float(np.median(share)) if len(share) else None


def fp16_readiness(run, *, min_share=MIN_SHARE):
    if run.fp16 or run.scaler_on:
        return None                                   # an FP16 run speaks for itself; a scaler means amp-inactive
    acts = run.sites("act")
    peaks = run.records("peak", "act")
    over = []
    if peaks.shape[1]:
        with np.errstate(all="ignore"):
            mx = np.nanmax(np.where(np.isfinite(peaks), peaks, np.nan), axis=0)
        for j in np.flatnonzero(mx > FP16.max):
            over.append((acts["path"].iloc[j], float(mx[j]),
                         int((peaks[:, j] > FP16.max).sum())))
    # execution order (site order): the first module that overflows is where it starts, later ones inherit it;
    # a container (the root included) that overflows only because a child does is left out
    over_paths = [p for p, *_ in over]
    inner = [o for o in over if not any(q != o[0] and (o[0] == "(model)" or q.startswith(o[0] + "."))
                                        for q in over_paths)]
    gsites = run.sites("grad_out")
    g_peaks = run.records("peak", "grad_out")
    clean = ~run.steps["skipped"].to_numpy(bool) & ~run.steps["nonfinite"].to_numpy(bool)
    gmax = float(np.nanmax(g_peaks[clean])) if g_peaks.shape[1] and clean.any() else float("nan")
    scale = A.suggest_scale(gmax)
    under = []
    for j, site in enumerate(gsites.itertuples()):
        share = _hist_underflow(run, "grad_out", j, int(site.id), scale)
        if share is not None and share >= min_share:
            under.append((site.path, share))
    under.sort(key=lambda u: -u[1])
    if not inner and not under:
        return None
    parts, fix = [], []
    if inner:
        parts.append(f"{len(inner)} module(s) output values above the FP16 max (worst {inner[0][0]}: "
                     f"{A.fmt_num(inner[0][1])} on {inner[0][2]} steps)")
        fix += [f"Keep {', '.join(p for p, *_ in inner[:5])} in FP32 under FP16 autocast:",
                A.keep_fp32_line([p for p, *_ in inner[:5]])]
    if under:
        parts.append(f"at a loss scale of {A.pow2(scale)} {len(under)} gradient site(s) would keep at least "
                     f"{A.pct(min_share)} of their elements below the FP16 normal range (worst {under[0][0]}: "
                     f"{A.pct(under[0][1])})")
    fix += [f"Start FP16 training with this scale (largest observed gradient {A.fmt_num(gmax)}, a factor "
            f"{A.SCALE_MARGIN:g} under the FP16 max):", A.scaler_line(run, init_scale=scale)]
    if run.bf16_supported and run.compute_dtype != "bfloat16":
        fix.append("BF16 avoids both problems on this device:\n" + A.autocast_block(run, "bfloat16"))
    return finding(
        "info", "FP16 readiness",
        "In FP16 this run would not train as is: " + "; ".join(parts) + ".",
        layers=[p for p, *_ in inner] + [p for p, _ in under if p not in dict((q, 0) for q, *_ in inner)],
        steps=[0, run.n_steps - 1],
        evidence={"overflow_modules": {p: {"max": m, "steps": n} for p, m, n in inner},
                  "fp16_max": FP16.max, "suggested_scale": scale, "max_grad": gmax,
                  "underflow_at_scale": {p: round(s, 4) for p, s in under[:10]}},
        recommendation="\n".join(fix))
