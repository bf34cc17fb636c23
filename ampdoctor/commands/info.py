"""``ampdoctor info TRACE``: a trace's summary (steps, sites, precision, loss scale, first non-finite); for a
directory or glob of one run's ranks, the ranks side by side."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..precision_label import describe_precision
from ..trace import Trace, load, shards
from ..trace.checks import invalid_settings_note
from ..trace.observation import cost_line, observation_line, summarize
from ..trace.run import is_multi, load_run, run_pattern
from ..trace.schema import LEVEL_FULL
from .common import EXIT_OK, approx, fmt, ranges


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="+", help="trace file (.db), or a directory, glob or files of one run's ranks")


def run(args: argparse.Namespace) -> int:
    if is_multi(args.trace):  # a directory or glob of one run's ranks
        return info_ranks(args.trace)
    tr = load(args.trace)
    with tr.snapshot():  # one state of the file for every line, its steps counted once (~0.03 s at 10^6 steps)
        return _info(tr, args)


def _info(tr: Trace, args: argparse.Namespace) -> int:
    meta, cfg = tr.meta, tr.config
    st = tr.checked(summarize, tr)  # the steps as numbers (the writer's blocks): no Python object per value
    sites = tr.site_rows()
    run = meta.get("run", {})
    print(f"trace      {args.trace}")
    print(
        f"run        {run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')} "
        f"({run.get('device_name', '')}); torch {run.get('torch', '?')}, ampdoctor {run.get('ampdoctor', '?')}"
    )
    print(
        f"steps      {st.steps} recorded"
        + (f", full statistics at {sum(k for lv, k in st.levels.items() if lv >= LEVEL_FULL)}" if st.steps else "")
        + ("" if "closed" in meta else " (run still open or ended without close())")
    )
    print("observed   " + observation_line(meta, st))
    cost = cost_line(st)
    if cost:
        print(f"overhead   {cost}")
    kinds = _counts(s.kind for s in sites)
    print("sites      " + (", ".join(f"{k} {v}" for k, v in kinds.items()) or "none"))
    dtypes = _counts(s.dtype for s in sites)
    print("dtypes     " + (", ".join(f"{k} ({v} sites)" for k, v in dtypes.items()) or "-"))
    ac = cfg.get("autocast", {})
    print("precision  " + describe_precision(cfg))
    if ac.get("enabled"):
        print(f"autocast   {ac.get('dtype')} on {ac.get('device_type')}")
    for line in fsdp_lines(cfg, shards.sharding_of(tr), args.trace):
        print(line)
    if cfg.get("optimizer"):
        print(f"optimizer  {cfg['optimizer']['class']}, lr {fmt(st.lr_last if st.steps else None, 0)}")
    sc = cfg.get("scaler")
    if sc:
        settings = ", ".join(f"{k} {sc[k]}" for k in ("growth_factor", "backoff_factor", "growth_interval") if k in sc)
        print(f"scaler     {sc.get('class')} ({'enabled' if sc.get('enabled') else 'disabled'}; {settings})")
        note = invalid_settings_note(cfg)  # settings out of range: taken as unknown by the reader
        if note:
            print(f"note       {note}")
        s = st.scale
        if s is not None:
            # "last" is the scale in force at the last step, as the report says; the update after it is named apart
            print(
                f"loss scale {s['first']:g} at step {s['first_step']}, last {s['last']:g} at step {s['last_step']}, "
                f"range {s['min']:g} .. {s['max']:g}"
                + (f"; {s['next_last']:g} after the last update" if s["next_last"] is not None else "")
            )
    print(f"skipped    {len(st.skipped)} step(s)" + (f": {ranges(st.skipped)}" if st.skipped else ""))
    if st.steps:
        loss = st.loss
        if loss is not None:
            line = f"loss       {loss['first']:.4g} at step {loss['first_step']}"
            if loss["last_step"] != loss["first_step"]:
                line += f" -> {loss['last']:.4g} at step {loss['last_step']}"
            if loss["nonfinite"]:
                line += f"; not finite at {len(loss['nonfinite'])} step(s): {ranges(loss['nonfinite'])}"
            print(line)
        elif tr.config.get("loss_dtype"):  # a loss was seen (its dtype is recorded), never finite
            print(f"loss       not finite at any of the {st.steps} step(s)")
    ev = tr.event_rows("nonfinite")
    if ev:
        first = ev[0]
        where = f"{first.path} ({first.site_kind})" if first.path else "the loss"
        print(
            f"non-finite {len(ev)} step(s); first at step {int(first.step)}: {where}, {first.phase} "
            f"phase, {first.data.get('value', '?')} — {first.message}"
        )
    unknown = tr.event_rows("nonfinite_unknown")
    if unknown:
        print(
            f"non-finite {len(unknown)} step(s) of unknown origin (observed by the sentinel only): "
            f"{ranges([int(e.step) for e in unknown])}"
        )
    elif not ev:
        print("non-finite none")
    changes = tr.event_rows("cadence")  # the overhead budget's changes, a lasting anomaly observed less often
    for i, e in enumerate(changes[-3:]):
        head = f"cadence    {len(changes)} change(s); " if i == 0 else "           "
        print(f"{head}at step {int(e.step)}: {e.message}")
    unheld = next((e for e in changes if e.data.get("held") is False), None)
    if unheld is not None:
        floor, budget = (unheld.data.get(k) for k in ("sentinel_share", "budget"))
        floor, budget = (v if isinstance(v, (int, float)) else math.nan for v in (floor, budget))  # (a file's data)
        print(
            f"budget     not held from step {int(unheld.step)}: the work on every step costs {floor:.1%} of a "
            f"step by itself, against a budget of {budget:.1%}"
        )
    wev = tr.event_rows("nonfinite_weights")
    if wev:
        first = wev[0]
        names = ", ".join(first.data.get("params", [])[:3])
        more = ", ..." if first.data.get("count", 0) > 3 else ""
        print(
            f"weights    NaN/Inf after the optimizer step of step {int(first.step)}: "
            f"{first.data.get('count', '?')} tensor(s) ({names}{more})"
        )
    return EXIT_OK


def _flagged(flags: npt.NDArray[np.float64]) -> int:
    """Steps whose flag is set (a missing flag: not set)."""
    return int(np.count_nonzero(flags[~np.isnan(flags)]))


def _median(values: npt.NDArray[np.float64]) -> float:
    """The median of the recorded values (NaN: none recorded)."""
    known = values[~np.isnan(values)]
    return float(np.median(known)) if len(known) else math.nan


def _counts(values: Iterable[str | None]) -> dict[str, int]:
    """value -> how many, in the values' sorted order; missing values (None) not counted."""
    counts = Counter(v for v in values if v is not None)
    return dict(sorted(counts.items()))


def info_ranks(spec: str) -> int:
    """The ranks of one distributed run side by side, one line per rank."""
    with load_run(spec) as rr:
        first = rr[rr.ranks[0]]
        run, cfg = first.meta.get("run", {}) or {}, first.config
        rid = run.get("run_id")
        print(
            f"run        {rr.source}: {len(rr)} rank(s) of world size {rr.world_size}"
            + (f", torchrun run id {rid}" if rid else "")
        )
        print(
            f"model      {run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')}; "
            f"{describe_precision(cfg)}"
        )
        if rr.missing:
            spans, n = rr.missing, rr.n_missing
            shown = ", ".join(map(str, spans[:12])) + (" ..." if len(spans) > 12 else "")
            print(f"missing    no trace for rank(s) {shown}" + (f" ({n:,} ranks)" if n > len(spans) else ""))
        print(
            f"{'rank':>4s} {'steps':>6s} {'skipped':>8s} {'non-finite':>10s} {'scale last':>10s} "
            f"{'step time':>10s} {'data wait':>10s} {'loss last':>10s}  host / trace"
        )
        for rank, tr in rr.items():
            st = tr.step_columns()  # (arrays from the writer's step blocks: no frame, no learning-rate JSON)
            host = (tr.meta.get("run", {}) or {}).get("host", "?")
            scale = st["loss_scale_next"][~np.isnan(st["loss_scale_next"])]
            loss = st["loss"][np.isfinite(st["loss"])]
            print(
                f"{rank:>4d} {len(st['step']):>6d} {_flagged(st['skipped']):>8d} {_flagged(st['nonfinite']):>10d} "
                f"{approx(float(scale[-1]) if len(scale) else None):>10s} "
                f"{approx(_median(st['step_time']) if len(st['step']) else None, ' s'):>10s} "
                f"{approx(_median(st['data_time']) if len(st['step']) else None, ' s'):>10s} "
                f"{approx(float(loss[-1]) if len(loss) else None):>10s}  {host} {tr.path}"
            )
        for line in fsdp_lines(cfg, None, None):
            print(line)
        if rr.sharded:
            norm, peak = rr.combined.grad_figures()
            done = np.flatnonzero(np.isfinite(norm))
            if len(done):
                at = int(done[-1])
                print(
                    f"combined   gradient norm {approx(float(norm[at]))}, largest |gradient| {approx(float(peak[at]))} "
                    f"at step {at}: the whole model's, from the ranks' shards (each rank's trace holds its shard's)"
                )
            if rr.combined.incomplete:
                print(
                    f"incomplete {len(rr.combined.incomplete)} parameter(s) lack a shard's trace: no whole-tensor "
                    "statistics for them"
                )
        print(f"details    ampdoctor info {first.path}; the rank rules: ampdoctor diagnose {rr.source}")
    return EXIT_OK


def fsdp_lines(cfg: dict[str, Any], sharding: shards.Sharding | None, path: str | None) -> list[str]:
    """FSDP's mixed-precision policy per group of units, and (one rank's trace) what share of the tensors it holds."""
    fsdp = cfg.get("fsdp") or {}
    units = fsdp.get("units") or {}
    out = []
    if units:
        groups: dict[tuple[tuple[str, Any], ...], list[str]] = {}
        for unit, u in units.items():
            key = tuple((k, v) for k, v in sorted(u.items()) if k not in ("params", "compute", "reduce"))
            groups.setdefault(key, []).append(unit)
        parts = []
        for key, paths in groups.items():
            u = dict(key)
            reduces = sorted({units[p]["reduce"] for p in paths if units[p].get("reduce")})
            reduce = u.get("reduce_dtype") or f"unset (reduces in {'/'.join(reduces) or 'param_dtype'})"
            text = f"param_dtype {u.get('param_dtype') or 'unset'}, reduce_dtype {reduce}"
            if fsdp.get("engine") == "fsdp1":
                text += f", buffer_dtype {u.get('buffer_dtype') or 'unset'}"
                text += ", low-precision gradients kept" if u.get("keep_low_precision_grads") else ""
            else:
                text += f", output_dtype {u.get('output_dtype') or 'unset'}"
                text += f", cast_forward_inputs {u.get('cast_forward_inputs')}"
            where = ", ".join(paths[:4]) + (f" +{len(paths) - 4}" if len(paths) > 4 else "")
            parts.append(f"{text} ({where})")
        engine = str(fsdp.get("engine") or "fsdp").upper()
        out.append(
            f"fsdp       {engine}, {len(units)} unit(s) on {fsdp.get('world_size', '?')} ranks: " + "; ".join(parts)
        )
    if sharding is not None and path is not None:
        params = sharding.params
        local = sum(sharding.local_numel(n) for n in params)
        whole = sum(sharding.whole_numel(n) for n in params) or 1
        how = ", ".join(sorted({p for sp in sharding.specs for p in sp.get("placements", [])}))
        out.append(
            f"sharded    {len(params)} parameter(s) ({how}); this rank holds {local:,} of their {whole:,} values "
            f"({100 * local / whole:.0f}%): its gradient norm and parameter-gradient, weight and update statistics "
            f"are its shard's; the whole tensors: ampdoctor info '{run_pattern(path)}'"
        )
    return out
