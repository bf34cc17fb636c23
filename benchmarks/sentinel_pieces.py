"""What each piece of ampdoctor's every-step work costs inside a training loop, measured by switching it off.

overhead.py measures whole variants, each in its own process; the pieces of one step are each a few percent of it,
below the noise between processes on a shared machine. Here one process trains the bare small model (overhead.py's
``small``) and several attached copies in turn: blocks of N steps, R rounds in a new shuffled order each, one torch
thread by default (the second core takes the machine's noise). Every attached copy has the sampled tiers off
(``every``, ``peak_every``, ``hist_every`` = 10^9: only what runs on every step) and ``live=False``. Printed per
variant: the median block time and the median of the per-round ratios to bare, wall and CPU (this process's).

Variants: bare; empty hooks (root pre-/post-hooks, optimizer pre-/post-hooks, ``loss.item()``); the sentinel's least
(those hooks, the gradient norm and peak before the update by ampdoctor's C++ read, else its numba kernel, the loss,
one row appended to a list); ampdoctor
with the replay and without (``replay=False``); and ampdoctor with one piece switched off, by replacing it on that
Doctor only (a benchmark's own reach into ampdoctor's parts: what is switched off is named per variant):

  no-figures   the gradient norm and peak (the step's figures are 1.0)
  no-write     the step packets are not sent to the writer (on the general path: implies no-lane)
  no-end       the step end (the next step is only begun; on the general path: implies no-lane)
  no-loss      log_loss (the loop reads the loss itself)
  no-seed      the hook that keeps the gradient reaching the root's output (the replay's backward seed)
  no-call      the replay's capture of the root call (arguments, versions, RNG and autocast state)
  no-lane      every step on the general path: the clean steps' short way (collect/lane.py) off

no-figures, no-seed and no-call switch off the general path's parts: a step the lane holds does all three in C++
(HeldSteps, csrc/step_record.cpp), which no variant reaches into; combine them with no-lane to measure them.

Run: .venv/bin/python benchmarks/sentinel_pieces.py [--rounds R] [--steps N] [--threads T]
     [--variants replay,no-replay,no-seed,no-seed+no-call,...]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import overhead

import ampdoctor
from ampdoctor.collect import compiled, stats
from ampdoctor.collect import core as wiring
from ampdoctor.trace.messages import StepPacket

# what a variant may switch off (joined by '+'), as the docstring lists them
PIECES = {"no-figures", "no-write", "no-end", "no-loss", "no-seed", "no-call", "no-lane", "no-replay"}
OFF = {"every": 10**9, "peak_every": 10**9, "hist_every": 10**9, "live": False}


class Run:
    """One model, its optimizer and batch, the loop's call after each step, and its Doctor (if any)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model, xs, ys = overhead.small()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(*xs), torch.randn(*ys)
        self.after = None
        self.doctor = None

    def block(self, n: int) -> tuple[float, float]:
        model, opt, x, y, after = self.model, self.opt, self.x, self.y, self.after
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after is not None:
                after(loss)
        if self.doctor is not None:
            self.doctor.flush()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def empty_hooks() -> Run:
    r = Run()
    r.model.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    r.model.register_forward_hook(lambda m, a, o: None)
    r.opt.register_step_pre_hook(lambda o, a, k: None)
    r.opt.register_step_post_hook(lambda o, a, k: None)
    r.after = lambda loss: loss.item()
    return r


def least() -> Run:
    """The sentinel's least: the step's start time, the gradient norm and peak before the update (one native read),
    the loss, one row per step."""
    r = Run()
    params = list(r.model.parameters())
    kernels = stats.native(wait=True)
    ext = compiled.wait()  # the C++ read where it is built (session 16 on), as ampdoctor reads it
    read = ext.Grads(params).figures if ext is not None else None
    rows: list[tuple] = []
    step = {"t": 0.0, "n": 0, "loss": None, "figures": None}

    def start(m, a, k):
        step["t"] = time.perf_counter()
        step["n"] += 1

    def figures(o, a, k):
        if read is not None:
            step["figures"] = read()
        else:
            step["figures"] = stats.grad_norm_peak(kernels, [p.grad for p in params]) if kernels else None

    def end(o, a, k):
        rows.append((step["n"], time.time(), step["t"], step["figures"], step["loss"]))
        if len(rows) > 1000:
            rows.clear()

    def loss(value):
        step["loss"] = value.item()

    r.model.register_forward_pre_hook(start, with_kwargs=True)
    r.opt.register_step_pre_hook(figures)
    r.opt.register_step_post_hook(end)
    r.after = loss
    return r


def attached(pieces: set[str], replay: bool = True) -> Run:
    r = Run()
    wiring.LANE = not pieces & {"no-lane", "no-write", "no-end"}  # (these two switch off the general path's parts)
    doc = r.doctor = ampdoctor.attach(
        r.model, optimizer=r.opt, trace=os.path.join(tempfile.mkdtemp(), "t.db"), replay=replay, **OFF
    )
    wiring.LANE = True
    r.after = doc.log_loss
    core = doc._core
    if "no-figures" in pieces:
        core.loop.end._grad_figures = lambda params: (1.0, 1.0)
    if "no-write" in pieces:
        put = core.flights.put
        core.flights.put = lambda item: None if type(item) is StepPacket else put(item)
    if "no-end" in pieces:
        loop = core.loop
        loop._finish = lambda skipped: loop.begin_step(loop.collector.state.index + 1)
    if "no-loss" in pieces:
        r.after = lambda loss: loss.item()
    if "no-seed" in pieces:
        core.replays.capture.on_output = lambda *a: None
    if "no-call" in pieces:
        core.collector.on_root_call = None
    return r


def make(name: str) -> Run:
    if name == "empty hooks":
        return empty_hooks()
    if name == "least":
        return least()
    if name == "replay":
        return attached(set())
    if name == "no-replay":
        return attached(set(), replay=False)
    pieces = set(name.split("+"))
    if not pieces <= PIECES:
        raise ValueError(f"unknown variant {name!r}: pieces are {', '.join(sorted(PIECES))}")
    replay = "no-replay" not in pieces
    return attached(pieces - {"no-replay"}, replay=replay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variants",
        default="replay,no-replay,no-lane,no-lane+no-replay,no-seed,no-seed+no-call",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    stats.native(wait=True)
    names = ["bare", "empty hooks", "least", *[v for v in args.variants.split(",") if v]]
    runs = {n: Run() if n == "bare" else make(n) for n in names}
    print(f"small model, {args.threads} torch thread(s), {args.rounds} rounds of {args.steps} steps")
    interleave(runs, args.rounds, args.steps)
    for r in runs.values():
        if r.doctor is not None:
            r.doctor.close()


def interleave(runs: dict[str, Run], rounds: int, steps: int) -> None:
    """Blocks of ``steps`` steps of every run, ``rounds`` times in a new shuffled order, after a warm-up (the
    allocator, the calibration steps); prints each run's median step and median per-round ratios to ``runs["bare"]``
    (wall time and this process's CPU time)."""
    for r in runs.values():
        r.block(60)
    wall: dict[str, list[float]] = {n: [] for n in runs}
    cpu: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(rounds):
        order = list(runs)
        random.shuffle(order)
        for n in order:
            w, c = runs[n].block(steps)
            wall[n].append(w)
            cpu[n].append(c)
    print(f"  {'variant':58s} {'step':>8s} {'ratio':>7s} {'cpu':>7s}")
    for n in runs:
        ratio = statistics.median(b / a for a, b in zip(wall["bare"], wall[n]))
        cpu_ratio = statistics.median(b / a for a, b in zip(cpu["bare"], cpu[n]))
        print(f"  {n:58s} {1e6 * statistics.median(wall[n]):6.0f}us x{ratio:6.3f} x{cpu_ratio:6.3f}")


if __name__ == "__main__":
    main()
