"""Trace size and load speed at scale: 500 sites x 10,000 steps at the default cadence.

Packets go through the real background writer (the same code path as training), with statistics vectors computed
by the real kernels on random tensors of varied magnitude. Prints the file size and the time to load the per-step
table and one statistic's [steps x sites] array. Run: .venv/bin/python benchmarks/trace_io.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ampdoctor
from ampdoctor.collect import options
from ampdoctor.collect import stats as K
from ampdoctor.trace.messages import SiteMsg, StepPacket
from ampdoctor.trace.vectors import Entry
from ampdoctor.trace.writer import Writer

SITES = {"act": 200, "grad_out": 200, "param_grad": 100}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=options.DEFAULT_EVERY)
    ap.add_argument("--hist-every", type=int, default=options.DEFAULT_HIST_EVERY)
    args = ap.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "big.db")
    w = Writer(path)
    w.start()
    sid = 0
    layout = []
    for kind, n in SITES.items():
        for i in range(n):
            w.put(SiteMsg(sid, f"blocks.{i}.{kind}", f"blocks.{i}", kind, "Linear", "float16", "256x512", 0))
            layout.append((sid, {"act": "fwd", "grad_out": "bwd", "param_grad": "param"}[kind]))
            sid += 1
    g = torch.Generator().manual_seed(0)
    pool = [K.full(torch.randn(4096, generator=g) * 2.0 ** float(e)).numpy() for e in range(-20, 10)]
    t0 = time.perf_counter()
    for step in range(args.steps):
        full = step % args.every == 0 or step % args.hist_every == 0
        n = len(layout)
        if full:
            values = np.concatenate([pool[(step + s) % len(pool)] for s, _ in layout] + [np.array([1.0, 0.5])])
            entries = [Entry(s, ph, [(i * K.FULL_LEN, "f", 4096)]) for i, (s, ph) in enumerate(layout)]
            bases = {"p": 0, "f": 0, "x": n * K.FULL_LEN}
        else:
            mm = np.random.default_rng(step).normal(size=2 * n)
            values = np.concatenate([np.sort(mm.reshape(n, 2), axis=1).ravel(), np.array([1.0, 0.5])])
            entries = [Entry(s, ph, [(2 * i, "p", 4096)]) for i, (s, ph) in enumerate(layout)]
            bases = {"p": 0, "f": 2 * n, "x": 2 * n}
        row = {
            "time": time.time(),
            "step_time": 0.1,
            "data_time": 0.01,
            "samples": 256,
            "lr": [1e-3],
            "microbatches": 1,
            "peak_mem": None,
            "level": 2 if step % args.hist_every == 0 else int(full),
        }
        w.put(
            StepPacket(
                step=step,
                row=row,
                values=values,
                bases=bases,
                entries=entries,
                loss=1.0 / (1 + step),
                scale=65536.0,
                scale_next=65536.0,
                grad_norm=1.0,
                skipped=False,
                nonfinite=False,
                store_hist=step % args.hist_every == 0,
            )
        )
    w.close(timeout=600)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    tr = ampdoctor.load(path)
    df = tr.steps()
    t_steps = time.perf_counter() - t0
    t0 = time.perf_counter()
    arr = tr.records("absmax", "grad_out")
    t_stat = time.perf_counter() - t0
    t0 = time.perf_counter()
    peak = tr.records("peak", "act")
    t_peak = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, counts = tr.hist(sid // 2, "grad_out")
    t_hist = time.perf_counter() - t0
    print(
        f"trace: {len(layout)} sites x {len(df)} steps, full statistics every {args.every}, histograms every "
        f"{args.hist_every} (written in {write_s:.1f} s by the background writer)"
    )
    print(f"file size                         {size / 2**20:8.1f} MB   (target < 100 MB)")
    print(f"load steps() table                {t_steps:8.3f} s    (target < 2 s)")
    print(f"load records('absmax', grad_out)  {t_stat:8.3f} s    shape {arr.shape}")
    print(f"load records('peak', act)         {t_peak:8.3f} s    shape {peak.shape}")
    print(f"load one site's histograms        {t_hist:8.3f} s    shape {counts.shape}")


if __name__ == "__main__":
    main()
