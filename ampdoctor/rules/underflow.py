"""Gradient range rules: grad-underflow (FP16 run) and fp16-readiness (an FP32/BF16 run judged for FP16)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .. import formats
from ..trace.reader import SiteRow
from ..trace.reduce import col_median, group_median
from ..trace.schema import HIST_LO, ROOT
from ..trace.view import containers
from . import advice as A
from .fix import Part, code, text
from .result import Diagnosis, finding
from .runview import IntArray, RunView
from .scaling import grad_out_peaks, suggestion_line

if TYPE_CHECKING:
    from ..lossscale import Suggestion

FP16 = formats.FP16
# A value in FP16's subnormal range [2^-24, 2^-14) keeps fewer than 10 mantissa bits (relative error up to 50% at
# the bottom) and the tail below it is flushed to zero: 1% of a layer's gradient elements there is material.
MIN_SHARE = 0.01
# A layer whose FP16 gradient is this share of exact zeros has vanished (everything flushed or masked).
VANISHED_ZEROS = 0.999
# The bottom three binades of the subnormal range, [2^-24, 2^-21): a gradient whose non-zero elements reach down
# there has a tail below 2^-24 too (magnitudes spread smoothly over binades), so its zeros are flushed values.
FLOOR_BINADES = 3
# Flushing is material when it can cost the gradient more of its norm than FP16 already loses by rounding its
# largest elements (unit roundoff u = 2^-11): a flushed element is below half the smallest subnormal (round to
# nearest), so the lost share of the norm is at most 2^-25 * sqrt(flushed share) / rms (scaled rms, as recorded).
# The logits of a healthy classifier hit this: classes with p ~ 1e-9 flush, costing ~1e-10 of the gradient's norm.
MATERIAL_NORM_LOSS = 2.0 ** -(FP16.mantissa_bits + 1)


def _clean_full_steps(run: RunView) -> tuple[IntArray, IntArray]:
    """(the clean full-statistics steps the statistics are read at, their rows in ``run.stat(...)``)."""
    st = run.steps
    ok = ~st["skipped"].to_numpy(bool) & ~st["nonfinite"].to_numpy(bool)
    fs = run.stat_steps
    rows = np.flatnonzero(ok[fs]) if len(fs) else np.zeros(0, dtype=np.int64)
    return fs[rows], rows


def _layer(site: SiteRow) -> str:
    layer: str = site.module if site.kind in ("param_grad", "weight", "update") else site.path
    return layer


def _is_container(path: str, paths: Sequence[str]) -> bool:
    """A module whose output gradient is its last child's (the root included): counted once, at the child."""
    return (path == ROOT and len(paths) > 1) or any(p.startswith(path + ".") for p in paths)


def _outer(sites: pd.DataFrame) -> set[str]:
    """The container modules among these sites' paths (``_is_container`` for all of them, in linear time)."""
    return containers(sites["path"].tolist())


@dataclass
class Site:
    """One FP16 gradient site's underflow evidence over the clean full-statistics steps."""

    site: SiteRow  # the sites-table row
    share: float  # median share of elements in the subnormal range
    zeros: float  # median share of exact zeros
    unscaled_max: float
    floor: float = 0.0  # median share of non-zero elements in the bottom binades [2^-24, 2^-21)
    dead: str = ""  # the all-zero forward output that explains an all-zero gradient (dead path)
    rms: float = math.nan  # median RMS of the gradient as computed (scaled), over the same steps

    @property
    def layer(self) -> str:
        return _layer(self.site)

    @property
    def vanished(self) -> bool:
        return self.zeros >= VANISHED_ZEROS

    @property
    def flushed(self) -> float:
        """Estimated share of elements flushed to zero: all of a vanished (not dead) gradient; else the tail below
        2^-24, taken as no larger than the three binades above it hold (magnitudes thin out towards zero), and
        never more than the zeros seen."""
        if self.vanished and not self.dead:
            return 1.0
        return min(self.zeros, self.floor * (1.0 - self.zeros))

    @property
    def lost_norm(self) -> float:
        """Upper bound on the share of the gradient's norm that flushing removes (1.0 when nothing bounds it)."""
        if self.vanished and not self.dead:
            return 1.0
        if not (self.rms > 0):
            return 1.0
        return min(1.0, FP16.min_subnormal / 2 * math.sqrt(self.flushed) / self.rms)


def underflow_sites(run: RunView, kinds: Sequence[str] = ("grad_out", "param_grad")) -> list[Site]:
    """Per FP16 gradient site (containers left out): subnormal, zero and bottom-binade shares over clean
    full-statistics steps, and for an all-zero one the dead forward output that explains it, if any."""
    steps, srows = _clean_full_steps(run)
    rows: list[Site] = []
    if not len(steps):
        return rows
    for kind in kinds:
        sites = run.sites(kind)
        outer: set[str] = _outer(sites) if kind == "grad_out" else set()
        # every site at once (a wide model has thousands): FP16, not a container, a recorded shape
        wanted = (sites["dtype"].to_numpy() == "float16") & (sites["shape"].to_numpy() != "")
        half = np.flatnonzero(wanted & ~sites["path"].isin(outer).to_numpy())
        if not len(half):
            continue
        take = np.ix_(srows, half)
        n, sub, zeros = (run.stat(f, kind)[take] for f in ("numel", "fp16_sub", "zeros"))
        absmax, scale, rms = (run.stat(f, kind)[take] for f in ("absmax", "scale", "rms"))
        with np.errstate(all="ignore"):
            share, zshare = sub / n, zeros / n
            unscaled = absmax / np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
        ok = np.isfinite(share)  # per site, the medians over the steps where its share is known
        share_med = col_median(np.where(ok, share, np.nan))
        zeros_med = col_median(np.where(ok, zshare, np.nan))
        zeros_med[(ok & np.isnan(zshare)).any(axis=0)] = np.nan  # np.median of values holding a NaN
        with np.errstate(invalid="ignore"):
            top = np.where(np.isfinite(unscaled).any(axis=0), np.fmax.reduce(unscaled, axis=0), np.nan)
        rms_ok = np.where(ok, rms, np.nan)
        rms_med = np.where(np.isfinite(rms_ok).any(axis=0), col_median(rms_ok), np.nan)
        ids = sites["id"].to_numpy()[half]
        floor = _floor_shares(run, ids)
        named = zip(*(sites[f].to_numpy()[half].tolist() for f in SiteRow._fields))  # (no frame row per site)
        for j, site in enumerate(named):
            if not ok[:, j].any():
                continue
            rows.append(
                Site(
                    SiteRow._make(site),
                    float(share_med[j]),
                    float(zeros_med[j]),
                    float(top[j]),
                    floor=floor.get(int(ids[j]), 0.0),
                    rms=float(rms_med[j]),
                )
            )
    vanished = [r for r in rows if r.vanished]
    for r, dead in zip(vanished, _dead_outputs(run, [r.site for r in vanished])):
        r.dead = dead
    return rows


def _floor_shares(run: RunView, ids: IntArray) -> dict[int, float]:
    """Per site: the median share of its non-zero elements in the bottom binades of FP16's subnormal range, as
    recorded (over its histogram steps read; sites without one are left out)."""
    view = run.view
    h = view.hists.take(view.rows_of(ids))
    lo = FP16.subnormal_exp  # binade 2^-24
    with np.errstate(all="ignore"):
        share = h.between(lo, lo + FLOOR_BINADES) / h.totals
    ok = np.isfinite(share)
    sites, med = group_median(share[ok], h.site[ok])
    return dict(zip(sites.tolist(), med.tolist()))


def _dead_outputs(run: RunView, sites: list[SiteRow]) -> list[str]:
    """Per gradient site: the forward output that is all zero on its path, e.g. a dead ReLU: its own module's, a
    module run after it (the gradient flows back through that zero-masked output), or for a parameter gradient the
    module run just before (its input). Then an all-zero gradient is masked, not flushed. "" when none is. The
    outputs' zero shares are reduced once for all the sites."""
    if not sites:
        return []
    acts = run.sites("act")
    _, rows = _clean_full_steps(run)
    if not len(acts) or not len(rows):
        return [""] * len(sites)
    paths: list[str] = acts["path"].tolist()
    first = {p: i for i, p in reversed(list(enumerate(paths)))}  # (a path's first column, as list.index)
    with np.errstate(all="ignore"):
        zshare = run.stat("zeros", "act")[rows] / run.stat("numel", "act")[rows]
    medians = col_median(np.where(np.isfinite(zshare), zshare, np.nan))
    is_dead = np.isfinite(zshare).any(axis=0) & (medians >= VANISHED_ZEROS)
    dead = np.flatnonzero(is_dead)  # in execution order
    out = []
    for site in sites:
        module = _layer(site)
        i = first.get(module)
        if i is None:
            out.append("")
            continue
        before = [i - 1] if site.kind == "param_grad" and i > 0 and is_dead[i - 1] else []
        order = before + dead[np.searchsorted(dead, i) :].tolist()
        hit = (paths[j] for j in order if paths[j] != ROOT and not _is_container(paths[j], [module]))
        out.append(next(hit, ""))
    return out


def shares_at(run: RunView, kind: str, ids: Iterable[int], target: float) -> dict[int, float]:
    """Per site of ``kind`` (ids): the median share of its non-zero elements below the FP16 normal range had the loss
    scale been ``target`` (its histograms, shifted by target / the scale each row carried; exact for powers of two),
    over its clean histogram steps; sites without one are left out. All sites in one pass."""
    view = run.view
    h = view.hists.take(view.rows_of(np.asarray(list(ids), dtype=np.int64)))
    st = run.steps
    ok = ~st["skipped"].to_numpy(bool)[h.step] & ~st["nonfinite"].to_numpy(bool)[h.step]
    h = h.take(np.flatnonzero(ok))
    if not len(h):
        return {}
    kid = run.sites(kind)["id"].to_numpy()
    hs = view.hist_steps
    carried = view.stat("scale", kind, hs)[np.searchsorted(hs, h.step), np.searchsorted(kid, h.site)]
    carried = np.where(np.isfinite(carried) & (carried > 0), carried, 1.0)
    total = h.totals
    cut = FP16.normal_exp - np.round(np.log2(target / carried)).astype(np.int64) + 127  # column of 2^-14 at target
    with np.errstate(all="ignore"):
        share = h.between(HIST_LO, HIST_LO + np.maximum(cut, 0)) / total
    keep = total > 0
    sites, med = group_median(share[keep], h.site[keep])
    return dict(zip(sites.tolist(), med.tolist()))


def _severity(run: RunView, bad: list[Site], min_share: float, reachable: float) -> tuple[str, str]:
    """(severity, why) from the evidence of material loss: gradients flushed (lost) rather than only imprecise, and
    whether the scaler can still lift them (the scale's headroom) or only a change of precision can."""
    if any(r.vanished and not r.dead for r in bad):
        return "critical", "a layer's gradient is flushed to zero entirely: it receives no gradient at all"
    if not run.scaler_on:
        return "warning", "no loss scaler lifts them"
    lost = [r for r in bad if r.flushed >= min_share]
    if any(r.lost_norm >= MATERIAL_NORM_LOSS for r in lost):
        return "warning", "part of them is flushed to zero (lost), not only imprecise"
    if lost:
        worst = max(lost, key=lambda r: r.lost_norm)
        return "info", (
            f"the flushed elements are too small to matter: at most {worst.lost_norm:.1e} of "
            f"{worst.layer}'s gradient norm, less than FP16's rounding of its largest elements "
            f"({MATERIAL_NORM_LOSS:.1e})"
        )
    # only subnormal: fewer mantissa bits for the smallest elements, nothing lost; the scaler lifts them as it grows
    # unless the largest gradients cap the scale (then only FP32 for that layer or BF16 would)
    at = {
        k: shares_at(run, k, [r.site.id for r in bad if r.site.kind == k], reachable)
        for k in {r.site.kind for r in bad}
    }
    stuck = [r for r in bad if (at[r.site.kind].get(r.site.id) or 0.0) >= min_share]  # (one pass a kind)
    if stuck:
        return "info", (
            f"nothing is flushed, only imprecise; even the largest scale the gradients allow "
            f"({A.pow2(reachable)}) leaves {stuck[0].layer} partly subnormal"
        )
    return "info", (
        f"nothing is flushed and the scaler's growth lifts them: the gradients allow a scale up to {A.pow2(reachable)}"
    )


def grad_underflow(run: RunView, *, min_share: float = MIN_SHARE) -> Diagnosis | None:
    if not run.fp16:
        return None
    rows = underflow_sites(run)
    bad = sorted(
        [r for r in rows if r.share >= min_share or (r.vanished and not r.dead)],
        key=lambda r: (-(r.vanished and not r.dead), -r.share),
    )
    if not bad:
        return None
    layers = list(dict.fromkeys(r.layer for r in bad))
    g, clean = grad_out_peaks(run)
    gmax = float(np.nanmax(g[clean])) if (clean & np.isfinite(g)).any() else float("nan")
    reachable = A.suggest_scale(gmax, margin=1.0)  # the largest power of two that keeps gmax under the max
    steps, _ = _clean_full_steps(run)
    in_force = run.steps["loss_scale"].to_numpy(float)[steps] if run.scaler_on else np.ones(len(steps))
    scale_now = float(np.nanmedian(in_force)) if len(in_force) else 1.0
    init_rec = (
        float(run.steps["loss_scale"].dropna().iloc[0])
        if run.scaler_on and run.steps["loss_scale"].notna().any()
        else 1.0
    )
    severity, why = _severity(run, bad, min_share, reachable)
    sug = run.suggestion  # the replay's answer: `replay --suggest` says the same
    if sug is None:
        return None  # the replay cannot start from the recorded scaler settings: no scale to quote
    init, interval = float(sug.settings["init_scale"]), int(sug.settings["growth_interval"])
    worst = bad[0]
    per_layer = {f"{r.layer} ({r.site.kind})": round(r.share, 4) for r in bad[:10]}
    fix = _fix(run, sug, scale_now, worst.layer if "largest scale" in why else None)
    vanished = [r.layer for r in bad if r.vanished and not r.dead]
    dead = [f"{r.layer} (all zero because {r.dead} outputs only zeros)" for r in rows if r.vanished and r.dead]
    return finding(
        severity,
        "Gradients lost to FP16 underflow",
        f"{len(bad)} gradient site(s) keep at least {A.pct(min_share)} of their elements below the FP16 normal "
        f"range (2^-14) at the loss scale in force ({A.pow2(scale_now)})"
        + (f", {len(vanished)} of them flushed to zero entirely ({', '.join(vanished[:3])})" if vanished else "")
        + f"; worst: {worst.layer} with {A.pct(1.0 if worst.vanished else worst.share)} "
        f"{'flushed' if worst.vanished else 'subnormal or flushed'}. Severity: {why}.",
        layers=layers,
        steps=run.step_range(steps),
        evidence={
            "scale_in_force": scale_now,
            "initial_scale": init_rec,
            "scale_fell": bool(run.scaler_on and scale_now < init_rec),
            "underflow_share": per_layer,
            "min_share": min_share,
            "zeros_share_worst": worst.zeros,
            "flushed_share_worst": worst.flushed,
            "lost_norm_bound_worst": worst.lost_norm,
            "vanished": vanished,
            "dead_not_underflow": dead,
            "max_unscaled_grad": gmax,
            "reachable_scale": reachable,
            "suggested_scale": init,
            "suggested_growth_interval": interval,
            "severity_because": why,
            "fp16_min_normal": FP16.min_normal,
            "full_steps_used": len(steps),
        },
        fix=fix,
    )


def scale_fell(own: Diagnosis, overflow: Diagnosis) -> bool:
    """Suppression (registry): a scale that fell below its start because of a forward overflow holds the gradients
    low; fix the overflow first, the underflow may be gone with it."""
    return bool(own.evidence.get("scale_fell"))


def _fix(run: RunView, sug: Suggestion, scale_now: float, unliftable: str | None) -> list[Part]:
    """The replay's scaler (the same line `replay --suggest` prints), FP32 for a layer no scale lifts, BF16."""
    init, interval = float(sug.settings["init_scale"]), int(sug.settings["growth_interval"])
    found = (
        f"the replay of this run finds init_scale={A.pow2(init)}, growth_interval={interval} loses the least "
        f"(`ampdoctor replay TRACE --suggest`)"
    )
    setup = A.Setup.of(run)
    if setup.half_params:
        fix = [
            text(
                f"This run keeps its parameters in {setup.param_dtype} (model.half()), where a GradScaler cannot help: "
                'it refuses FP16 gradients ("Attempting to unscale FP16 gradients"). Keep FP32 parameters, let '
                f"autocast compute in FP16 and scale the loss; {found}:"
            ),
            A.master_weights(setup, "float16", scaler=suggestion_line(sug)),
        ]
    elif not run.scaler_on:
        fix = [
            text(f"Enable dynamic loss scaling; {found}:"),
            code(
                suggestion_line(sug),
                "# and in the loop:",
                "scaler.scale(loss).backward()",
                "scaler.step(optimizer)",
                "scaler.update()",
            ),
        ]
    elif init > scale_now:
        fix = [
            text(f"The scale in force ({A.pow2(scale_now)}) is lower than these gradients allow; {found}:"),
            code(suggestion_line(sug)),
        ]
    elif _own_settings(run, sug):
        fix = [
            text(
                f"This run's scaler (init_scale={A.pow2(init)}, growth_interval={interval}) is already the one "
                "the replay of this run finds to lose the least (`ampdoctor replay TRACE --suggest`); no scaler "
                "change helps:"
            ),
            code(suggestion_line(sug)),
        ]
    else:
        fix = [text(f"No other scaler setting loses less: {found}:"), code(suggestion_line(sug))]
    if unliftable:
        fix = [
            text(
                f"Loss scaling cannot lift {unliftable} (its gradients span more range than FP16 holds): "
                "compute it in FP32, or train in BF16:"
            ),
            *A.keep_fp32(setup, [unliftable]),
        ] + fix
    return fix + A.bf16_note(setup)


def _own_settings(run: RunView, sug: Suggestion) -> bool:
    """Whether the replay's suggestion is the scaler this run already has."""
    own = run.config.get("scaler") or {}
    keys = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    return all(k in own and own[k] is not None and float(own[k]) == float(sug.settings[k]) for k in keys)


def fp16_readiness(run: RunView, *, min_share: float = MIN_SHARE) -> Diagnosis | None:
    if run.fp16 or run.scaler_on:
        return None  # an FP16 run speaks for itself; a scaler means amp-inactive
    acts = run.sites("act")
    over: list[tuple[str, float, int]] = []
    if len(acts):
        mx = run.view.peak_max("act")  # per module: its largest finite output over every observed step
        count = run.view.scan.site_overflows[acts["id"].to_numpy()]
        for j in np.flatnonzero(FP16.overflows(mx)):  # rounds past 65504 in a cast (>= 65520)
            over.append((acts["path"].iloc[j], float(mx[j]), int(count[j])))
    # execution order (site order): the first module that overflows is where it starts, later ones inherit it;
    # a container (the root included) that overflows only because a child does is left out
    outer = containers([p for p, *_ in over])
    inner = [o for o in over if o[0] not in outer]
    gsites = run.sites("grad_out")
    g, clean = grad_out_peaks(run)  # as the replay reads them: a returned loss's own gradient is not one
    gmax = float(np.nanmax(g[clean])) if (clean & np.isfinite(g)).any() else float("nan")
    sug = run.suggestion  # the replay of this run as if in FP16: `replay --suggest` says the same
    if sug is None:
        return None
    scale = float(sug.settings["init_scale"])
    under: list[tuple[str, float]] = []
    outer = _outer(gsites)
    eligible = [site for site in gsites.itertuples() if site.path not in outer and str(site.shape) != ""]
    shares = shares_at(run, "grad_out", [site.id for site in eligible], scale)
    for site in eligible:
        share = shares.get(int(site.id))
        if share is not None and share >= min_share:
            under.append((site.path, share))
    under.sort(key=lambda u: -u[1])
    if not inner and not under:
        return None
    parts: list[str] = []
    if inner:
        parts.append(
            f"{len(inner)} module(s) output values above the FP16 max (worst {inner[0][0]}: "
            f"{A.fmt_num(inner[0][1])} on {inner[0][2]} steps)"
        )
    if under:
        parts.append(
            f"at a loss scale of {A.pow2(scale)} {len(under)} gradient site(s) would keep at least "
            f"{A.pct(min_share)} of their elements below the FP16 normal range (worst {under[0][0]}: "
            f"{A.pct(under[0][1])})"
        )
    setup = A.Setup.of(run)
    keep = [A.keep_fp32_line([p for p, *_ in inner[:5]])] if inner else []
    fix = [
        text(
            "To train in FP16: "
            + (f"keep {', '.join(p for p, *_ in inner[:5])} in FP32 under FP16 autocast, and " if inner else "")
            + f"start with the scaler the replay of this run finds best (largest observed gradient "
            f"{A.fmt_num(gmax)}; `ampdoctor replay TRACE --suggest` shows the same):"
        ),
        code(
            *keep,
            suggestion_line(sug),
            "# and in the loop:",
            A.autocast_block(setup, "float16"),
            *A.backward_lines(setup, True),
        ),
    ]
    if run.bf16_supported and run.compute_dtype != "bfloat16":
        fix += [
            text("BF16 avoids both problems on this device:"),
            code(A.autocast_block(run, "bfloat16"), *A.backward_lines(setup, False)),
        ]
    return finding(
        "info",
        "FP16 readiness",
        "In FP16 this run would not train as is: " + "; ".join(parts) + ".",
        layers=[p for p, *_ in inner] + [p for p, _ in under if p not in dict((q, 0) for q, *_ in inner)],
        steps=[0, run.n_steps - 1],
        evidence={
            "overflow_modules": {p: {"max": m, "steps": n} for p, m, n in inner},
            "fp16_max": FP16.max,
            "suggested_scale": scale,
            "max_grad": gmax,
            "underflow_at_scale": {p: round(s, 4) for p, s in under[:10]},
        },
        fix=fix,
    )
