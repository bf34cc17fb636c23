"""The precision bound that the probe (collect/) and the precision-loss rule (rules/) share: the relative error k
random roundings in a format explain (sqrt(k)*u), the verdict on a probed layer and the probe's table. Neutral ground:
it imports neither side, so the training side never imports the rules.

The bound. A layer's output element sums k terms (Linear: k = in_features; see collect/recompute.py). In half
precision each term carries one rounding of relative size <= u (the operand or the product rounded to the format;
u = 2^-11 in FP16, 2^-8 in BF16), and the output itself one more. The worst case adds them: k*u (Higham, Accuracy and
Stability of Numerical Algorithms, eq. 3.5, gamma_k); independent, zero-mean rounding errors add in quadrature and stay
below lambda*sqrt(k)*u except with probability ~2*exp(-lambda^2/2) (Higham & Mary, SIAM J. Sci. Comput. 2019). Both
bound the error relative to the terms' magnitude, which equals the output's magnitude only when the terms do not
cancel. When the output is a small difference of large quantities (catastrophic cancellation), the same roundings are
amplified by the ratio of the terms to the result, and the error escapes any multiple of sqrt(k)*u: that is what the
rule looks for. A container is judged like a leaf with k = the sum of its children's (its error composes theirs) and
is not named when one of its descendants is (the child explains it).
"""

from __future__ import annotations

import math

from .islands import code_line
from .trace.schema import ROOT

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
# An order of magnitude above sqrt(k)*u: healthy layers measure 0.05-1x it (tests/test_probe.py measures MLPs,
# LayerNorm, BatchNorm, attention, GELU, dropout); lambda = 10 leaves a random-rounding excess a probability of
# ~2e-22, and the cancellation cases of the tests measure ~90x (an RBF layer's expanded distance) and ~1000x (a
# one-pass variance of features around 100).
MIN_RATIO = 10.0


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
    return code_line(paths) if paths else ""


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
