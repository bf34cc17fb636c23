"""Overhead of the precision-loss probe, side by side with the bare model and ampdoctor's defaults.

Same reference model and method as benchmarks/overhead.py (8 x [Linear(512, 512), LayerNorm, GELU], batch 256, BF16
autocast on the CPU, SGD; interleaved rounds in shuffled order, the writer's catch-up timed in its block). Variants:
ampdoctor's defaults (live=False, so that the rules' thread does not blur the probe's figure), the same with a probe
every step (the cost of one probed step: every module recomputed in FP32 from its inputs, one extra forward of the
model's modules per nesting level) and with a probe every ``--cadence`` steps (the amortised cost). Also the one-off
``ampdoctor.probe`` against one plain forward pass.
Run: .venv/bin/python benchmarks/probe_overhead.py [--rounds N] [--steps N] [--cadence N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from overhead import BATCH, DEPTH, WIDTH, make_model, measure, setup_ampdoctor

import ampdoctor


def one_off(repeats: int = 10) -> tuple[float, float]:
    """Median seconds of a plain BF16 forward and of ampdoctor.probe on the same model and batch."""
    model = make_model()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    fwd, prb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ampdoctor.probe(model, x, dtype=torch.bfloat16)
        prb.append(time.perf_counter() - t0)
    return statistics.median(fwd), statistics.median(prb)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    ap.add_argument("--cadence", type=int, default=100, help="probe_every of the amortised variant")
    args = ap.parse_args()
    variants = [
        ("bare", None),
        ("ampdoctor defaults (live=False)", setup_ampdoctor(live=False)),
        ("ampdoctor + probe every step", setup_ampdoctor(live=False, probe_every=1)),
        (f"ampdoctor + probe every {args.cadence} steps", setup_ampdoctor(live=False, probe_every=args.cadence)),
    ]
    print(
        f"reference: {DEPTH} x [Linear({WIDTH},{WIDTH}), LayerNorm, GELU], batch {BATCH}, BF16 autocast, CPU, "
        f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps per variant"
    )
    print(f"{'variant':50s} {'mean step':>10s} {'ratio':>7s} {'median of round ratios':>24s}")
    rows = measure(variants, args.rounds, args.steps)
    for name, mean, ratio, per_round in rows:
        print(f"{name:50s} {mean * 1e3:7.2f} ms  x{ratio:5.2f}  x{per_round:5.2f}", flush=True)
    base, defaults, probed = rows[0][1], rows[1][1], rows[2][1]
    extra = probed - defaults  # what one probed step adds to a step of the defaults
    for every in (args.cadence, 1000):
        print(
            f"amortised over probe_every={every}: x{(defaults + extra / every) / base:5.3f} "
            f"(defaults x{defaults / base:5.3f}; a probed step adds {extra / base:4.2f} bare steps)"
        )
    f, p = one_off()
    print(f"one-off ampdoctor.probe: {p * 1e3:.1f} ms = {p / f:.1f} plain BF16 forward passes ({f * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
