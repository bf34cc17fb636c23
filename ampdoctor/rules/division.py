"""division-by-zero: a module produced NaN (0/0) or Inf (x/0) from finite inputs far inside the format's range: a
normalisation divided by a norm or variance that the format rounded to 0, with an eps the format rounds to 0 too
(FP16 rounds anything below 2^-25, ~3e-8, to 0: F.normalize's default eps 1e-12, BERT's LayerNorm 1e-12). Not an
overflow: FP32 for that module, or an eps the format holds, removes it (forward-overflow defers to this finding)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .. import formats
from ..trace.schema import ROOT
from . import advice as A
from . import anomaly
from .fix import code, text
from .policy import NORM_TYPES
from .result import Diagnosis, Evidence, finding
from .runview import FloatArray, RunView

# A module whose finite outputs stayed 8 binades (256x) under its format's max did not overflow them.
MIN_HEADROOM_BINADES = 8.0
# Critical when at least this share of the steps produced it (most updates lost).
CRITICAL_SHARE = 0.5
# eps values that survive FP16: added to a variance (LayerNorm, RMSNorm: rsqrt(var + eps) <= 316), and clamping a
# norm (F.normalize: the backward divides by eps, and 1/eps must stay under 65504).
VARIANCE_EPS = 1e-5
NORM_EPS = 1e-4


def same_module(own: Diagnosis, division: Diagnosis) -> bool:
    """Suppression (registry): the module forward-overflow (or loss-scale-collapse) names is this division's."""
    return division.evidence["module"] in (own.evidence.get("module"), own.evidence.get("cause_module"))


def division_by_zero(
    run: RunView, *, min_headroom_binades: float = MIN_HEADROOM_BINADES, critical_share: float = CRITICAL_SHARE
) -> Diagnosis | None:
    o = run.overflow_origins
    if o is None:
        return None
    acts = run.sites("act")
    paths = acts["path"].tolist()
    found: list[
        tuple[str, int, int | None, list[int], Evidence]
    ] = []  # (module, column, input column, steps, evidence)
    for path in o.counts.index:
        path = str(path)
        if path not in paths:
            continue
        j = paths.index(path)
        i = _input_of(paths, j)
        steps = sorted(set(o.events.loc[o.events["path"] == path, "step"].astype(int)))
        ev = _division(run, acts, j, i, steps, min_headroom_binades)
        if ev is not None:
            found.append((path, j, i, steps, ev))
    if not found:
        return None
    path, j, i, steps, ev = max(found, key=lambda f: len(f[3]))
    mtype = str(acts["module_type"].iloc[j])
    dtype = ev["compute_dtype"]
    share = len(anomaly.lasting(run, steps)) / max(run.n_steps, 1)
    setup = A.Setup.of(run)
    inp = paths[i] if i is not None else None
    if ev["kind"] == "0/0":
        mech = (
            f"0/0: {inp}'s output, {path}'s input, held {ev['input_zeros']:.0f} exact zeros (e.g. all-zero rows of "
            f"padding) and {path} produced {ev['nan']:.0f} NaN over the {ev['full_steps_used']} steps observed in "
            f"full; a zero row's norm or variance is 0, and the eps "
            f"that should keep the denominator off 0 is lost: {dtype} rounds anything below "
            f"{A.fmt_num(formats.get(dtype).min_subnormal / 2)} to 0 (F.normalize's default 1e-12, BERT's LayerNorm "
            "1e-12)"
        )
    elif ev["kind"] == "x/0":
        mech = (
            f"x/0: {path} produced {ev['inf']:.0f} Inf from inputs as small as {A.fmt_num(ev['input_min'])} whose "
            f"squares {dtype} flushes to 0 (below {A.fmt_num(formats.get(dtype).min_subnormal / 2)}): the norm or "
            "variance it divides by is 0, and its eps is lost in the format too"
        )
    else:
        mech = (
            f"a division by a value {dtype} rounded to 0: {path} produced {ev['nan']:.0f} NaN and {ev['inf']:.0f} "
            "Inf from finite inputs far inside the range"
        )
    decided = (
        f"its finite outputs stayed within {A.fmt_num(ev['out_max'])}, {ev['headroom']:.0f} binades under the "
        f"{ev['out_format'].upper()} max of its {ev['out_dtype']} output, from inputs within "
        f"{A.fmt_num(ev['input_max'])}: nothing approached the range, so it is no overflow"
        + (
            f"; its NaN sit where its input held exact zeros ({ev['nan']:.0f} NaN, {ev['input_zeros']:.0f} zeros)"
            if ev["kind"] == "0/0"
            else ""
        )
    )
    fix = [
        text(
            f"Compute {path} in FP32 (there its eps holds and a zero row normalises to 0; its output stays FP32 for "
            "the modules after it):"
        ),
        *A.fp32_island(setup, [path]),
    ]
    if mtype in NORM_TYPES:
        fix += [
            text(f"Or give it an eps {dtype} holds ({VARIANCE_EPS:g}, PyTorch's default):"),
            code(f"{A.attr(path)}.eps = {VARIANCE_EPS!r}"),
        ]
    else:
        fix.append(
            text(
                f"Or give the division in {mtype}'s forward an eps {dtype} holds: at least {NORM_EPS:g} where it "
                f"clamps a norm (e.g. F.normalize(x, dim=-1, eps={NORM_EPS:g}): the backward divides by eps, and "
                f"1/eps must stay under 65504), at least {VARIANCE_EPS:g} where it is added to a variance."
            )
        )
    return finding(
        "critical" if share >= critical_share else "warning",
        f"{ev['kind'] if ev['kind'] != 'other' else 'Division by 0'} in {path}: a denominator rounded to 0",
        f"{path} ({mtype}) produced NaN/Inf from finite inputs on {len(steps)} of {run.n_steps} steps (first at "
        f"step {steps[0]}). {mech}. Decided by: {decided}.",
        layers=[path] + ([inp] if inp else []),
        steps=run.step_range(steps),
        evidence={
            "module": path,
            "module_type": mtype,
            "mechanism": ev["kind"],
            "input_module": inp,
            "steps_affected": len(steps),
            "first_step": steps[0],
            "compute_dtype": dtype,
            **{k: v for k, v in ev.items() if k not in ("kind", "compute_dtype")},
            "decided_by": decided,
        },
        fix=fix,
    )


def _input_of(paths: list[str], j: int) -> int | None:
    """The module whose output the module at ``j`` read, as far as the trace tells: the last to complete before it
    that is neither inside it nor a container of it."""
    me = paths[j]
    for k in range(j - 1, -1, -1):
        p = paths[k]
        if p == ROOT or p.startswith(me + ".") or me.startswith(p + "."):
            continue
        return k
    return None


def _division(
    run: RunView, acts: pd.DataFrame, j: int, i: int | None, steps: list[int], min_headroom: float
) -> Evidence | None:
    """The evidence that module ``j`` divided by 0 on ``steps`` (full statistics), or None."""
    full = set(run.full_steps.tolist())
    rows = [s for s in steps if s in full]
    if not rows or i is None:
        return None

    def rec(f: str, col: int) -> FloatArray:
        return run.at(f, "act", rows)[:, col]

    nan, inf, out_max = rec("nan", j), rec("inf", j), rec("absmax", j)
    in_zeros, in_max, in_min = rec("zeros", i), rec("absmax", i), rec("minabs", i)
    if not (np.isfinite(in_max).all() and (rec("nan", i) == 0).all() and (rec("inf", i) == 0).all()):
        return None  # its input was not finite: not where it started
    out_dtype, in_dtype = str(acts["dtype"].iloc[j]), str(acts["dtype"].iloc[i])
    out_fmt = formats.get(out_dtype) if out_dtype in formats.DTYPE_FORMATS else formats.FP32
    top = float(np.nanmax(out_max)) if np.isfinite(out_max).any() else 0.0
    headroom = math.log2(out_fmt.max / top) if top > 0 else math.inf
    in_top = float(np.nanmax(in_max))
    in_fmt = formats.get(in_dtype) if in_dtype in formats.DTYPE_FORMATS else formats.FP32
    if headroom < min_headroom or (in_top > 0 and math.log2(in_fmt.max / in_top) < min_headroom):
        return None  # values near the range: an overflow (forward-overflow's)
    compute = in_dtype if in_dtype in formats.REDUCED else (out_dtype if out_dtype in formats.REDUCED else None)
    if compute is None:
        return None  # nothing computed in half precision: not a rounding to 0
    fmt = formats.get(compute)
    n_nan, n_inf, zeros = float(nan.sum()), float(inf.sum()), float(in_zeros.sum())
    pos = in_min[np.isfinite(in_min) & (in_min > 0)]
    smallest = float(pos.min()) if len(pos) else math.nan
    # a normalisation keeps its input's shape: its NaN can then sit exactly where its input held zeros
    same_shape = bool((rec("numel", j) == rec("numel", i)).all())
    if same_shape and n_nan > 0 and n_inf == 0 and zeros > 0 and (nan <= in_zeros * 1.0001 + 0.5).all():
        kind = "0/0"
    elif same_shape and n_inf > 0 and math.isfinite(smallest) and smallest * smallest < fmt.min_subnormal / 2:
        kind = "x/0"
    elif _normalisation(acts, j):
        kind = "other"
    else:
        return None  # NaN from an unknown internal operation (an overflow inside it): forward-overflow's case
    return {
        "kind": kind,
        "compute_dtype": compute,
        "nan": n_nan,
        "inf": n_inf,
        "input_zeros": zeros,
        "input_max": in_top,
        "input_min": smallest,
        "out_max": top,
        "out_dtype": out_dtype,
        "out_format": out_fmt.name,
        "headroom": headroom,
        "full_steps_used": len(rows),
    }


def _normalisation(acts: pd.DataFrame, j: int) -> bool:
    mtype, path = str(acts["module_type"].iloc[j]), str(acts["path"].iloc[j])
    return mtype in NORM_TYPES or "norm" in mtype.lower() or "norm" in path.rsplit(".", 1)[-1].lower()
