"""precision-loss: layers whose half-precision output is far less accurate than the format's unit roundoff explains
for their size, measured by the probe (``attach(probe_every=N)``: the layer recomputed in FP32 from the same
inputs). Also the bound, the verdict and the table the probe report, ``ampdoctor layers --probe`` and the views share.

The bound. A layer's output element sums k terms (Linear: k = in_features; see collect/probe.py). In half precision
each term carries one rounding of relative size <= u (the operand or the product rounded to the format; u = 2^-11 in
FP16, 2^-8 in BF16), and the output itself one more. The worst case adds them: k*u (Higham, Accuracy and Stability
of Numerical Algorithms, eq. 3.5, gamma_k); independent, zero-mean rounding errors add in quadrature and stay below
lambda*sqrt(k)*u except with probability ~2*exp(-lambda^2/2) (Higham & Mary, SIAM J. Sci. Comput. 2019). Both bound
the error relative to the terms' magnitude, which equals the output's magnitude only when the terms do not cancel.
When the output is a small difference of large quantities (catastrophic cancellation), the same roundings are
amplified by the ratio of the terms to the result, and the error escapes any multiple of sqrt(k)*u: that is what the
rule looks for. So the scale is sqrt(k)*u (the random-rounding size, the tighter one), and a layer is named when its
norm-wise relative error is at least MIN_RATIO times it. A container is judged like a leaf with k = the sum of its
children's (its error composes theirs) and is not named when one of its descendants is (the child explains it).
"""

from __future__ import annotations

import math

import numpy as np

from ..trace.schema import ROOT
from . import advice as A
from .fix import code, text
from .result import finding

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
# An order of magnitude above sqrt(k)*u: healthy layers measure 0.05-1x it (tests/test_probe.py measures MLPs,
# LayerNorm, BatchNorm, attention, GELU, dropout); lambda = 10 leaves a random-rounding excess a probability of
# ~2e-22, and the cancellation cases of the tests measure ~90x (an RBF layer's expanded distance) and ~1000x (a
# one-pass variance of features around 100).
MIN_RATIO = 10.0
# A layer is named when it exceeds the bound at at least half of the probed steps (one odd batch is not a layer).
MIN_SHARE = 0.5


def relative(err: float, ref: float) -> float:
    """err / ref, with 0/0 = 0 and x/0 = inf (a non-zero output where FP32 gives exactly zero); NaN when either is
    not finite (a NaN/Inf in the output is an overflow, the forward-overflow rule's business, not a rounding)."""
    if not (math.isfinite(err) and math.isfinite(ref)):
        return math.nan
    if ref > 0:
        return err / ref
    return 0.0 if err == 0 else math.inf


def unit_roundoff(dtype: str | None) -> float:
    return UNIT_ROUNDOFF.get(str(dtype).replace("torch.", ""), UNIT_ROUNDOFF["float16"])


def bound(k: float, dtype: str | None) -> float:
    """sqrt(k)*u: the relative error k random roundings in ``dtype`` explain (module docstring)."""
    return math.sqrt(max(float(k), 1.0)) * unit_roundoff(dtype)


def _descendant(child: str, parent: str) -> bool:
    return child != parent and (parent == ROOT or child.startswith(parent + "."))


def culprits_of(paths: list[str]) -> list[str]:
    """The paths none of whose descendants is also in ``paths``."""
    return [p for p in paths if not any(_descendant(q, p) for q in paths)]


def judge(rows: list[dict], dtype: str, min_ratio: float = MIN_RATIO) -> list[dict]:
    """The rows (one per module, one probed step) the rule names, worst first, each with its bound and ratio."""
    scored = []
    for r in rows:
        b = bound(r["k"], dtype)
        scored.append(dict(r, bound=b, ratio=r["rel_err"] / b))
    over = [r for r in scored if r["ratio"] >= min_ratio]
    keep = set(culprits_of([r["path"] for r in over]))
    return sorted((r for r in over if r["path"] in keep), key=lambda r: -r["ratio"])


def fix_line(paths: list[str]) -> str:
    return A.keep_fp32_line(paths) if paths else ""


def format_table(rows: list[dict], dtype: str, min_ratio: float = MIN_RATIO) -> str:
    """The per-layer table, worst ratio first (the CLI's ``layers --probe`` and the one-off probe's report)."""
    if not rows:
        return "no layer was probed"
    flagged = {r["path"] for r in judge(rows, dtype, min_ratio)}
    scored = sorted(rows, key=lambda r: -r["rel_err"] / bound(r["k"], dtype))
    width = max(8, max(len(r["path"]) for r in scored))
    lines = [
        f"{'layer':{width}s} {'type':14s} {'dtype':9s} {'k':>6s} {'rel err':>9s} {'max err':>9s} "
        f"{'sqrt(k)u':>9s} {'ratio':>8s}"
    ]
    for r in scored:
        b = bound(r["k"], dtype)
        mark = "  <- precision loss" if r["path"] in flagged else ""
        lines.append(
            f"{r['path']:{width}s} {str(r['module_type'])[:14]:14s} {str(r['dtype'])[:9]:9s} "
            f"{int(r['k']):>6d} {r['rel_err']:9.2e} {r['max_err']:9.2e} {b:9.2e} "
            f"{r['rel_err'] / b:8.1f}{mark}"
        )
    return "\n".join(lines)


# -- over a trace ------------------------------------------------------------------------------------------------
def compute_dtype(run) -> str:
    return run.compute_dtype or "float16"


def probes(run):
    """The run's probe table (Trace.probes), read once per Run."""
    if "_probes" not in run.__dict__:
        run._probes = run.trace.probes()
    return run._probes


def layer_verdicts(run, min_ratio: float = MIN_RATIO, min_share: float = MIN_SHARE) -> list[dict]:
    """Per probed layer over the probed steps: median and worst error, bound, share of steps over the bound; the
    named layers (``named``) worst first, then the rest."""
    pr = probes(run)
    if not len(pr):
        return []
    dtype = compute_dtype(run)
    out = []
    for path, g in pr.groupby("path", sort=False):
        k = float(g["k"].max())
        b = bound(k, dtype)
        rel = g["rel_err"].to_numpy(float)
        out.append(
            {
                "path": str(path),
                "module_type": g["module_type"].iloc[0],
                "k": int(k),
                "bound": b,
                "rel_err_median": float(np.median(rel)),
                "rel_err_max": float(np.max(rel)),
                "max_err_median": float(np.median(g["max_err"].to_numpy(float))),
                "ratio": float(np.median(rel)) / b,
                "share_over": float(np.mean(rel >= min_ratio * b)),
                "probed_steps": len(g),
                "steps": [int(g["step"].min()), int(g["step"].max())],
            }
        )
    over = [v for v in out if v["share_over"] >= min_share and v["ratio"] >= min_ratio]
    keep = set(culprits_of([v["path"] for v in over]))
    for v in out:
        v["named"] = v["path"] in keep
    return sorted(out, key=lambda v: (not v["named"], -v["ratio"]))


def measured_culprits(run) -> list[tuple[str, str]]:
    """(layer, why) for the layers the probe measured losing precision; for val-oscillation's blame."""
    return [
        (
            v["path"],
            f"{v['module_type']} measured {v['rel_err_median']:.2g} relative error against FP32, "
            f"{v['ratio']:.0f}x sqrt(k)*u",
        )
        for v in layer_verdicts(run)
        if v["named"]
    ]


def _convert(path: str, dtype: str) -> str:
    m = A.attr(path)
    return (
        f"{m}.float()\n"
        f"{m}.register_forward_pre_hook(lambda m, args: tuple(a.float() if torch.is_tensor(a) and "
        f"a.is_floating_point() else a for a in args))\n"
        f"{m}.register_forward_hook(lambda m, args, out: out.to(torch.{dtype}))\n"
    )


def precision_loss(run, *, min_ratio=MIN_RATIO, min_share=MIN_SHARE):
    verdicts = layer_verdicts(run, min_ratio, min_share)
    named = [v for v in verdicts if v["named"]]
    if not named:
        return None
    dtype = compute_dtype(run)
    paths = [v["path"] for v in named]
    worst = named[0]
    ev = {
        "dtype": dtype,
        "unit_roundoff": unit_roundoff(dtype),
        "min_ratio": min_ratio,
        "layers": {
            v["path"]: {
                k: v[k]
                for k in (
                    "module_type",
                    "k",
                    "rel_err_median",
                    "rel_err_max",
                    "max_err_median",
                    "bound",
                    "ratio",
                    "share_over",
                    "probed_steps",
                )
            }
            for v in named
        },
        "probed_layers": len(verdicts),
    }
    steps = [min(v["steps"][0] for v in named), max(v["steps"][1] for v in named)]
    summary = (
        f"Recomputed in FP32 from the same inputs, {worst['path']} ({worst['module_type']}) is off by "
        f"{worst['rel_err_median']:.2g} (norm-wise relative; worst element {worst['max_err_median']:.2g} of "
        f"the output's max), {worst['ratio']:.0f}x the sqrt(k)*u = {worst['bound']:.2g} that {dtype} rounding "
        f"explains for k = {worst['k']}"
        + (f"; also {', '.join(paths[1:])}" if len(paths) > 1 else "")
        + ": a difference of large, nearly equal quantities (catastrophic cancellation) computed in half "
        "precision."
    )
    fix = [
        text(
            "Compute these layers in FP32 (inputs cast to float32 inside autocast); or rewrite the computation "
            "without the cancellation (e.g. var = mean((x - mean)^2) instead of mean(x^2) - mean^2):"
        ),
        code(fix_line(paths)),
    ]
    if not run.autocast.get("enabled"):
        # keep_fp32 acts inside autocast only: a run with half-precision weights and no autocast needs the modules
        # converted and their inputs cast by hand
        fix = [
            text(
                "This run computes without autocast (half-precision weights), where keep_fp32 changes nothing. "
                "Run these layers in FP32 (weights, inputs cast up, outputs cast back for the next layer), or "
                "rewrite the computation without the cancellation:"
            ),
            code("".join(_convert(p, dtype) for p in paths)),
        ]
    return finding(
        "warning",
        "Precision lost in a layer (measured against FP32)",
        summary,
        layers=paths,
        steps=steps,
        evidence=ev,
        fix=fix,
    )
