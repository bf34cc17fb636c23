"""``ampdoctor info DIR_OR_GLOB``: the ranks of one distributed run side by side, one line per rank."""
from __future__ import annotations

import math

import numpy as np

from .trace.run import load_run


def _num(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.3g}{unit}"


def info_ranks(spec: str) -> int:
    from .cli import EXIT_OK, describe_precision
    with load_run(spec) as rr:
        first = rr[rr.ranks[0]]
        run, cfg = first.meta.get("run", {}) or {}, first.config
        rid = run.get("run_id")
        print(f"run        {rr.source}: {len(rr)} rank(s) of world size {rr.world_size}"
              + (f", torchrun run id {rid}" if rid else ""))
        print(f"model      {run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')}; "
              f"{describe_precision(cfg)}")
        if rr.missing:
            print(f"missing    no trace for rank(s) {', '.join(map(str, rr.missing))}")
        print(f"{'rank':>4s} {'steps':>6s} {'skipped':>8s} {'non-finite':>10s} {'scale last':>10s} "
              f"{'step time':>10s} {'data wait':>10s} {'loss last':>10s}  host / trace")
        for rank, tr in rr.items():
            st = tr.steps()
            host = (tr.meta.get("run", {}) or {}).get("host", "?")
            scale = st["loss_scale_next"].dropna()
            loss = st["loss"].replace([np.inf, -np.inf], np.nan).dropna()
            print(f"{rank:>4d} {len(st):>6d} {int(st['skipped'].sum()):>8d} {int(st['nonfinite'].sum()):>10d} "
                  f"{_num(float(scale.iloc[-1]) if len(scale) else None):>10s} "
                  f"{_num(float(st['step_time'].median()) if len(st) else None, ' s'):>10s} "
                  f"{_num(float(st['data_time'].median()) if len(st) else None, ' s'):>10s} "
                  f"{_num(float(loss.iloc[-1]) if len(loss) else None):>10s}  {host} {tr.path}")
        print(f"details    ampdoctor info {first.path}; the rank rules: ampdoctor diagnose {rr.source}")
    return EXIT_OK
