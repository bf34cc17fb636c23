"""What each of ampdoctor's every-step entry points, and their main parts, costs inside a training loop: per-call
wall time measured where it runs (``time.perf_counter_ns`` around the function, accumulated), on the small model of
overhead.py with the sampled tiers off (only what runs on every step: the sentinel, the replay's capture).

Inside a loop a piece costs several times what it costs in a tight loop: the training step between two hooks
evicts ampdoctor's code and data from the caches, so each distinct torch call, attribute read and object pays its
misses again (session 16: ``torch.is_grad_enabled()`` 3.5 us, ``torch.is_autocast_enabled(dev)`` 5 us, the RNG
state 11-15 us, against 0.1-1.6 us in a tight loop). Nested rows are part of the row above them; the timers add
~0.1 us each.

Run: .venv/bin/python benchmarks/step_costs.py [--steps N] [--threads T] [--no-replay] [--no-lane]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sentinel_pieces import make

from ampdoctor.collect import (
    anomaly,
    boundary,
    boundary_hooks,
    collector,
    compiled,
    flights,
    lane,
    replays,
    session,
    stats,
    steploop,
)

# (class, method, label): every entry from training, then the parts of each, indented under it. The clean steps take
# the lane (lane.py) first; the general path's entries are timed where a step goes that way.
PIECES = [
    (lane.Lane, "root_pre", "lane: root pre-hook"),
    (lane.Lane, "_call_extras", "  a step's first call: rows to the writer"),
    (lane.Lane, "root_out", "lane: root forward hook (the seed)"),
    (lane.Lane, "opt_pre", "lane: optimizer pre-hook (figures, verdict)"),
    (lane.Lane, "opt_post", "lane: optimizer post-hook"),
    (lane.Lane, "_after_end", "  the next step's own start, the budget"),
    (lane.Lane, "flush", "lane: rows to the writer"),
    (collector.Collector, "on_root_pre", "root pre-hook"),
    (flights.Flights, "on_step_start", "  the finished step to the writer"),
    (anomaly.Capture, "on_call", "  the replay's capture of the call"),
    (replays.Replays, "on_root_output", "root forward hook"),
    (anomaly.Capture, "on_output", "  the seed's hook"),
    (boundary_hooks.BoundaryHooks, "on_opt_pre", "optimizer pre-hook"),
    (boundary.StepEnd, "early_verdict", "  early verdict"),
    (boundary.StepEnd, "figures", "    gradient norm and peak"),
    (boundary_hooks.BoundaryHooks, "on_opt_post", "optimizer post-hook: the step end"),
    (steploop.StepLoop, "begin_step", "  the next step's plan and state"),
    (boundary.StepEnd, "close", "  close (figures, row, flight)"),
    (flights.Flights, "add", "  verdict, flight recorder"),
    (session.Doctor, "log_loss", "log_loss after the step (both paths)"),
    (lane.Lane, "log_loss", "  on a held step"),
]
# (a held step's parts run in C++, inside the lane's hooks: csrc/step_record.cpp, HeldSteps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--no-lane", action="store_true", help="every step on the general path (the lane off)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    stats.native(wait=True)
    compiled.wait()
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    now = time.perf_counter_ns
    for cls, name, label in PIECES:
        original = getattr(cls, name)

        def timed(*a, _f=original, _label=label, **k):
            t0 = now()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] += now() - t0
                calls[_label] += 1

        setattr(cls, name, timed)
    variant = "+".join(["no-lane"] * args.no_lane + ["no-replay"] * args.no_replay) or "replay"
    run = make(variant)  # (sentinel_pieces' variants: "no-lane" sets core.LANE = False for its attach)
    run.block(300)
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    run.block(args.steps)
    step = (time.perf_counter() - t0) / args.steps
    print(f"small model, {args.threads} torch thread(s), {args.steps} steps, {1e6 * step:.0f} us a step in all")
    print(f"  {'piece':42s} {'us/step':>8s} {'calls/step':>11s}")
    for _, _, label in PIECES:
        if calls[label]:
            us = spent[label] / args.steps / 1000
            print(f"  {label:42s} {us:8.1f} {calls[label] / args.steps:11.2f}")
    run.doctor.close()


if __name__ == "__main__":
    main()
