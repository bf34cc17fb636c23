"""Step-time overhead of ampdoctor and its peers, measured side by side in one run.

Reference model: 8 x [Linear(512, 512), LayerNorm, GELU], batch 256, BF16 autocast on the CPU, SGD.
Every variant trains its own copy of the model; rounds interleave the variants (each round runs a block of steps
of every variant in turn), so machine noise hits all of them alike. Printed per variant: the mean step time over
all rounds (periodic costs such as ampdoctor's full-statistics steps included) and its ratio to the bare model,
plus the median of the per-round ratios as a noise check.
Each block ends by letting ampdoctor's writer catch up (timed, part of the block); the live-rules thread's share of
the wall time is charged to its variant's steps. DebugUnderflowOverflow and wandb.watch run in groups of their own
with their own baseline (wandb's service process would slow whatever runs next to it).
Two floors frame the figures: the work the every-step figures need with no bookkeeping at all (hooks, one aminmax
per tensor, the gradient norm) and the histogram alone that full statistics derive their counts from.
Run: .venv/bin/python benchmarks/overhead.py [--rounds N] [--steps N] [--peers]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ampdoctor  # noqa: E402

WIDTH, DEPTH, BATCH = 512, 8, 256


def make_model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


class Runner:
    """One model + optimizer + observer; ``block(n)`` trains n steps and returns the mean step time, including the
    time to let the observer's background writer catch up (``settle``), so that no variant's background work is
    timed in another variant's block."""

    def __init__(self, name, setup):
        self.name = name
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(BATCH, WIDTH, generator=g)
        self.y = torch.randn(BATCH, WIDTH, generator=g)
        self.step_hook = None
        self.settle = None              # called (and timed) after each block
        self.background = []            # threads whose CPU time is charged to this variant
        self.closer = setup(self) if setup else None

    def run(self, n):
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = self.model(self.x)
                loss = torch.nn.functional.mse_loss(out.float(), self.y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.step_hook:
                self.step_hook(loss)

    def block(self, n):
        t0 = time.perf_counter()
        self.run(n)
        if self.settle:
            self.settle()
        return (time.perf_counter() - t0) / n

    def background_cpu(self):
        total = 0.0
        for t in self.background:
            if t.is_alive():
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        return total


def setup_ampdoctor(**options):
    def setup(r):
        path = os.path.join(tempfile.mkdtemp(), "bench.db")
        doc = ampdoctor.attach(r.model, optimizer=r.opt, trace=path, **options)
        r.step_hook = doc.log_loss
        r.settle = doc.flush
        # live rules check every few seconds by the wall clock, so in whichever variant's block: their thread's
        # CPU share of the wall time is charged to this variant instead (as if all of it were taken from training)
        r.background = [doc._live] if doc._live is not None else []
        return doc.close
    return setup


def setup_debug_underflow(r):
    from transformers.debug_utils import DebugUnderflowOverflow
    DebugUnderflowOverflow(r.model)
    return None


def setup_wandb(r):
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=tempfile.mkdtemp())      # wandb.watch logs through the global run
    wandb.watch(r.model, log="all", log_freq=1)
    r.step_hook = lambda loss: wandb.log({"loss": loss.item()})
    return run.finish


def setup_naive_item(r):
    """What people write first: a forward and a backward hook per layer calling .item()."""
    def fwd(mod, args, out):
        if isinstance(out, torch.Tensor):
            out.abs().max().item()
            if out.requires_grad:
                out.register_hook(lambda g: g.abs().max().item() and None)
    for m in r.model.modules():
        m.register_forward_hook(fwd)
    return None


def _every_tensor(r, on_tensor, at_step):
    """Minimal hooks for the floors: ``on_tensor`` on every module output and its gradient (the root's output is
    its last child's, so the root is left out: ampdoctor reduces it once too), ``at_step(params)`` after each step."""
    def fwd(mod, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            on_tensor(out.detach())
            out.register_hook(on_tensor)
    for name, m in r.model.named_modules():
        if name:
            m.register_forward_hook(fwd)
    params = list(r.model.parameters())
    r.step_hook = lambda loss: at_step(params)


def setup_floor(r):
    """The least that "abs max of every activation and output gradient, every parameter gradient and the gradient
    norm, every step" costs with Python hooks on this machine: a forward hook and a tensor hook per module doing one
    aminmax each, one aminmax and one dot product per parameter gradient at the step. Nothing kept, no trace: the work
    the every-step figures need, without any bookkeeping."""
    def at_step(params):
        squares = []
        for p in params:
            g = p.grad.reshape(-1)
            torch.aminmax(g)
            squares.append(torch.dot(g, g))        # half the time of a norm; ampdoctor does the same
        torch.stack(squares).sum().sqrt()
    def peak(t):                    # a tensor hook must return None (or a replacement gradient)
        torch.aminmax(t)
    _every_tensor(r, peak, at_step)


def setup_hist_floor(r):
    """The least that full statistics every step cost here: the floor's hooks with, per tensor, only the exponent
    histogram that every count is derived from (two integer ops and torch.bincount, a serial loop) - no extremes, no
    sums, nothing kept."""
    def hist(t):
        key = (t.detach().float().reshape(-1).view(torch.int32) & 0x7FFFFFFF) >> 22
        torch.bincount(key, minlength=512)

    def at_step(params):
        for p in params:
            hist(p.grad)
    _every_tensor(r, hist, at_step)


def measure(variants, rounds, steps):
    """Interleaved rounds in shuffled order (every variant sees the same machine noise); returns rows (name, mean
    step, ratio, median of per-round ratios), the first variant being the baseline."""
    runners = []
    for name, setup in variants:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(open(os.devnull, "w")):
                warnings.simplefilter("ignore")
                runners.append(Runner(name, setup))
        except ImportError as exc:
            print(f"skipping {name}: {exc}")
    quiet = contextlib.redirect_stdout(open(os.devnull, "w"))
    with quiet:
        for r in runners:       # warm-up: allocator, autocast caches, first-step full statistics
            r.block(3)
        cpu0 = {r.name: r.background_cpu() for r in runners}
        wall0 = time.perf_counter()
        samples = {r.name: [] for r in runners}
        order = random.Random(0)
        for _ in range(rounds):
            for r in order.sample(runners, len(runners)):     # a new order each round: no variant always
                samples[r.name].append(r.block(steps))          # follows the same one

        # the live checks run by the wall clock for the whole measurement, not only in their variant's blocks: their
        # CPU share of the wall time is charged to every step of that variant
        share = {r.name: (r.background_cpu() - cpu0[r.name]) / (time.perf_counter() - wall0) for r in runners}
        for r in runners:
            if r.closer:
                r.closer()
    base_name = runners[0].name
    base = statistics.fmean(samples[base_name])
    rows = []
    for r in runners:
        mean = statistics.fmean(samples[r.name]) * (1.0 + share[r.name])
        per_round = statistics.median(a / b for a, b in zip(samples[r.name], samples[base_name]))
        rows.append((r.name, mean, mean / base, per_round))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    ap.add_argument("--peers", action="store_true", help="also time DebugUnderflowOverflow and wandb.watch")
    args = ap.parse_args()

    groups = [[("bare", None),
               ("ampdoctor defaults", setup_ampdoctor()),
               ("ampdoctor defaults, live=False", setup_ampdoctor(live=False)),
               ("ampdoctor full stats + histograms every step", setup_ampdoctor(every=1, hist_every=1)),
               ("floor: hooks + one aminmax per tensor + grad norm", setup_floor),
               ("histogram floor: hooks + one bincount per tensor", setup_hist_floor),
               ("naive per-layer .item() hooks", setup_naive_item)]]
    if args.peers:              # each peer with its own baseline: wandb's service process would slow the others
        groups += [[("bare", None), ("transformers DebugUnderflowOverflow", setup_debug_underflow)],
                   [("bare", None), ("wandb.watch(log='all', log_freq=1), offline", setup_wandb)]]
    print(f"reference: {DEPTH} x [Linear({WIDTH},{WIDTH}), LayerNorm, GELU], batch {BATCH}, BF16 autocast, CPU, "
          f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps per variant")
    print(f"{'variant':50s} {'mean step':>10s} {'ratio':>7s} {'median of round ratios':>24s}")
    for i, group in enumerate(groups):
        rounds = args.rounds if i == 0 else max(args.rounds // 3, 3)
        for k, (name, mean, ratio, per_round) in enumerate(measure(group, rounds, args.steps)):
            if k == 0 and i > 0:
                name = f"  (bare, baseline of the next line, {rounds} rounds)"
            print(f"{name:50s} {mean * 1e3:7.2f} ms  x{ratio:5.2f}  x{per_round:5.2f}", flush=True)


if __name__ == "__main__":
    main()
