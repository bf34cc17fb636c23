"""``ampdoctor layers TRACE``: per-layer statistics of one step, the way one prints gradients layer by layer;
``--probe``: each module's half-precision error against FP32 at a probed step."""

from __future__ import annotations

import argparse
import math

import numpy as np

from ..trace import Trace, load
from .common import EXIT_OK, UsageError, fmt, share

SORT_KEYS = ("order", "absmax", "minabs", "mean", "rms", "fp16_under", "fp16_over", "zeros", "nonfinite")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (.db)")
    parser.add_argument("--step", type=int, default=None, help="step (default: the last with full statistics)")
    parser.add_argument("--kind", default="grad_out", choices=["act", "grad_out", "param_grad", "weight", "update"])
    parser.add_argument("--sort", default="order", choices=SORT_KEYS, help="column to sort by (worst first)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="the precision-loss probe instead: each module's error against FP32 (needs probe_every)",
    )


def run(args: argparse.Namespace) -> int:
    tr = load(args.trace)
    if args.probe:
        return _run_probe(tr, args)
    sites = tr.sites(args.kind)
    full = tr.full_steps()
    if not len(full):
        raise UsageError(f"{args.trace}: no step with full statistics yet")
    step = int(full[-1]) if args.step is None else args.step
    if step not in set(full.tolist()):
        near = min(full.tolist(), key=lambda s: abs(s - step))  # Python ints: --step may exceed an int64
        raise UsageError(
            f"step {step} has no full statistics; nearest full step: {near} "
            f"(full statistics every {tr.meta.get('run', {}).get('every', '?')} steps and at anomalies)"
        )
    fields = (
        "numel",
        "absmax",
        "minabs",
        "mean",
        "rms",
        "fp16_sub",
        "fp16_flush",
        "fp16_over",
        "zeros",
        "nan",
        "inf",
        "scale",
    )
    cols = {f: v[0] for f, v in tr.stats_at(fields, args.kind, [step]).items()}  # the one step, one query
    rows = []
    for j, site in enumerate(sites.itertuples()):
        if math.isnan(cols["numel"][j]):
            continue
        n = cols["numel"][j]
        rows.append(
            {
                "order": j,
                "path": site.path,
                "type": site.module_type if isinstance(site.module_type, str) else "",  # NULL: pandas' NaN
                "dtype": site.dtype,
                **{f: cols[f][j] for f in fields},
                "fp16_under": (cols["fp16_sub"][j] + cols["fp16_flush"][j]) / n if n else 0.0,
                "nonfinite": cols["nan"][j] + cols["inf"][j],
            }
        )
    if not rows:
        print(f"no {args.kind} sites at step {step}")
        return EXIT_OK
    reverse = args.sort not in ("order", "minabs")
    rows.sort(
        key=lambda r: (
            (-np.inf if math.isnan(r[args.sort]) else r[args.sort])
            if reverse
            else (np.inf if math.isnan(r[args.sort]) else r[args.sort])
        ),
        reverse=reverse,
    )
    scale = rows[0]["scale"]
    note = f" (values scaled by the loss scale {scale:g})" if args.kind == "grad_out" and scale and scale != 1 else ""
    print(f"{args.kind} at step {step}{note}, sorted by {args.sort}")
    width = max(len(r["path"]) for r in rows)
    print(
        f"{'layer':{width}s} {'type':14s} {'dtype':9s} {'abs max':>10s} {'min |x|>0':>10s} {'mean':>10s} "
        f"{'rms':>10s} {'fp16 sub':>9s} {'fp16 ->0':>9s} {'fp16 ovf':>9s} {'zeros':>8s} {'nan/inf':>8s}"
    )
    for r in rows:
        print(
            f"{r['path']:{width}s} {r['type'][:14]:14s} {str(r['dtype'])[:9]:9s} {fmt(r['absmax'])} "
            f"{fmt(r['minabs'])} {fmt(r['mean'])} {fmt(r['rms'])} {share(r['fp16_sub'], r['numel']):>9s} "
            f"{share(r['fp16_flush'], r['numel']):>9s} {share(r['fp16_over'], r['numel']):>9s} "
            f"{share(r['zeros'], r['numel']):>8s} {int(r['nonfinite']):>8d}"
        )
    return EXIT_OK


def _run_probe(tr: Trace, args: argparse.Namespace) -> int:
    """``layers --probe``: each module's half-precision error against FP32 at one probed step, worst ratio first."""
    from ..roundoff import fix_line, format_table, unit_roundoff
    from ..rules import precision
    from ..rules.engine import Run

    pr = tr.probes()
    if not len(pr):
        raise UsageError(f"{args.trace}: no probe results; attach(..., probe_every=N) records them")
    probed = sorted(pr["step"].unique().tolist())
    step = probed[-1] if args.step is None else args.step
    if step not in probed:
        near = min(probed, key=lambda s: abs(s - step))
        raise UsageError(f"step {step} was not probed; nearest probed step: {near}")
    run = Run(tr)
    dtype = precision.compute_dtype(run)
    rows = pr[pr["step"] == step].to_dict("records")
    print(
        f"probe at step {step} ({len(probed)} probed steps): {dtype} output against FP32 from the same inputs; "
        f"bound sqrt(k)*u, u = {unit_roundoff(dtype):.3g}"
    )
    print(format_table(rows, dtype))
    ev = tr.events("probe")
    skipped = ev[ev["step"] == step]["data"].iloc[0].get("skipped", {}) if len(ev[ev["step"] == step]) else {}
    for path, why in skipped.items():
        print(f"skipped {path}: {why}")
    named = [v for v in precision.layer_verdicts(run) if v["named"]]
    if named:
        print(f"precision loss over the probed steps: {', '.join(v['path'] for v in named)}; fix:")
        print(fix_line([v["path"] for v in named]))
    else:
        print("no layer loses more precision than its size explains")
    return EXIT_OK
