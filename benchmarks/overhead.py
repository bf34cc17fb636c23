"""Step-time overhead of ampdoctor and its peers on a suite of models, every variant in its own process.

Models: small (10 modules: Linear 64 -> 4 x Linear 128 -> 10 with ReLU/LayerNorm, batch 64), reference (8 x
[Linear(512, 512), LayerNorm, GELU], batch 256) and transformer (4 pre-norm blocks of attention q/k/v/o + MLP,
d 128, 32 tokens, batch 16: 65 modules). SGD, MSE loss. FP32; BF16 autocast too where the CPU has native BF16
(avx512_bf16 / amx: an AVX2-only CPU emulates BF16 matmuls ~20x slower, which drowns every ratio).

Variants: bare, the bare loop again in a second process (the error bar of every ratio), ampdoctor defaults (tiers:
sentinel every step, sampled sites, calibration, flight recorder; live rules on), the defaults under ``budget=0.03``
and the same without the anomaly replay (``replay=False``: what its capture of every step costs), ampdoctor debug
(every site, every step, full statistics and histograms), and the same two with the torch/numpy statistics passes
instead of the native one-pass kernels (AMPDOCTOR_NATIVE=0: what a machine without numba gets); the floors (the least
that "peaks of every tensor every step", "histograms of every tensor every step" and "full statistics of every tensor
every step" cost with Python hooks: no bookkeeping, nothing kept; the full statistics with the native kernel and with
the torch passes), the sentinel floors (the gradient norm and peak with no hooks: torch's fused reductions, and the
native single read), naive per-layer .item() hooks, transformers' DebugUnderflowOverflow, wandb.watch(log="all",
log_freq=1) offline (when installed).

The native kernels load in a background thread at their first use (stats.native()); every worker waits for them
after its warm-up steps, so that the timed steps measure the kernel that serves a run past its first seconds. The
load's own time is printed per worker (``kernels load``: seconds from the first call, CPU seconds of the loading
thread). In the same way the workers with ampdoctor's live rules wait until its live thread has imported the rules
(it does as it starts; its CPU seconds are printed as ``live rules loaded``); the live checks that follow count in
the background share.

Method. One worker process per variant, all alive at once and idle but the one being timed; rounds interleave the
variants in a new shuffled order each round, so machine noise hits all alike. A block is N steps plus, for ampdoctor,
``flush()`` (its writer catches up inside the block). Each worker first runs untimed warm-up steps (allocator,
autocast caches, ampdoctor's calibration steps, whose one-off cost is printed apart). At the end each worker times
its own ``close()`` (charged once, over its timed steps) and the CPU time of its background work (ampdoctor's
live-rules thread, wandb's service process) as a share of the measurement's wall time, charged to every step (the
work runs by the wall clock, whichever variant is being timed). Printed per model and variant: the mean step,
the ratio of means (periodic costs such as full-statistics steps included), the median of the per-round ratios,
the median per-round ratio of the process's CPU time per step ("cpu": every thread of the worker, its background
work outside the blocks and close() charged as above; steadier than the wall time on a loaded machine, blind to a
training thread waiting for the GIL),
the host microseconds added per step, and per observed tensor (module outputs, their gradients and the parameter
gradients a step observes); for ampdoctor also its own recorded observer time per step and per sentinel-only step.
``--before DIR`` adds, for every ampdoctor variant, the same variant run with DIR's ampdoctor/ (a checkout of the
code before a change: ``git archive <commit> | tar -x -C DIR``), in the same interleaved rounds: a change's effect
measured side by side, which is the only comparison a loaded machine allows.
Run: .venv/bin/python benchmarks/overhead.py [--rounds N] [--block-s S] [--models small,reference,transformer]
     [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

# the code measured: this checkout's, or (a worker of --before) another checkout's ampdoctor/
sys.path.insert(0, os.environ.get("AMPDOCTOR_BENCH_CODE") or os.path.join(os.path.dirname(__file__), ".."))
import ampdoctor

BEFORE = " (before)"  # a variant's name with this suffix: the same variant run with --before's code

WARMUP_STEPS = 25  # covers ampdoctor's calibration (10 steps) and the first sampled steps


# -- models ----------------------------------------------------------------------------------------------------------
class Attention(torch.nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.drop = torch.nn.Dropout(0.0)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads

        def split(y):
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = self.drop(((q @ k.transpose(-2, -1)) / math.sqrt(d // h)).softmax(-1))
        return self.o((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.attn, self.ln2 = torch.nn.LayerNorm(d), Attention(d), torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d), torch.nn.Dropout(0.0)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(torch.nn.Module):
    def __init__(self, d_in=16, d=128, depth=4):
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, d_in)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def small():
    layers = [torch.nn.Linear(64, 128), torch.nn.ReLU()]
    for k in range(4):
        layers += [torch.nn.Linear(128, 128)] + ([torch.nn.LayerNorm(128)] if k == 1 else []) + [torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1], torch.nn.Linear(128, 10)), (64, 64), (64, 10)


def reference():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.GELU()]
    return torch.nn.Sequential(*layers), (256, 512), (256, 512)


def transformer():
    return Transformer(), (16, 32, 16), (16, 32, 16)


MODELS = {"small": small, "reference": reference, "transformer": transformer}


def native_bf16() -> bool:
    """Whether this CPU computes BF16 matmuls natively (else BF16 figures would measure an emulation)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# -- variants (set up inside the worker) ----------------------------------------------------------------------------
def setup_ampdoctor(w, native=True, **options):
    from ampdoctor.collect import stats

    stats.NATIVE = native  # AMPDOCTOR_NATIVE=0 when False
    w.trace = os.path.join(tempfile.mkdtemp(), "bench.db")
    doc = ampdoctor.attach(w.model, optimizer=w.opt, trace=w.trace, **options)
    w.step_hook = doc.log_loss
    w.settle = doc.flush
    w.threads = [doc.live] if doc.live is not None else []
    return doc.close


def setup_naive_item(w):
    """What people write first: a forward hook per module calling .item(), and one per output gradient."""

    def fwd(mod, args, out):
        if isinstance(out, torch.Tensor):
            out.abs().max().item()
            if out.requires_grad:
                out.register_hook(lambda g: g.abs().max().item() and None)

    for m in w.model.modules():
        m.register_forward_hook(fwd)


def _every_tensor(w, on_tensor, at_step):
    """Minimal hooks for the floors: ``on_tensor`` on every module output and its gradient (not the root's, which is
    its last child's), ``at_step(params)`` after each step."""

    def fwd(mod, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            on_tensor(out.detach())
            out.register_hook(on_tensor)

    for name, m in w.model.named_modules():
        if name:
            m.register_forward_hook(fwd)
    params = list(w.model.parameters())
    w.step_hook = lambda loss: at_step(params)


def setup_floor(w):
    """One aminmax per module output and output gradient, one aminmax and one dot product per parameter gradient and
    the global norm, every step: the work per-site peaks need, without any bookkeeping."""

    def at_step(params):
        squares = []
        for p in params:
            g = p.grad.reshape(-1)
            torch.aminmax(g)
            squares.append(torch.dot(g, g))
        torch.stack(squares).sum().sqrt()

    def peak(t):  # a tensor hook must return None (or a replacement gradient)
        torch.aminmax(t)

    _every_tensor(w, peak, at_step)


def setup_hist_floor(w):
    """The floor's hooks with, per tensor, only the exponent histogram every full-statistics count derives from."""

    def hist(t):
        key = (t.detach().float().reshape(-1).view(torch.int32) & 0x7FFFFFFF) >> 22
        torch.bincount(key, minlength=512)

    def at_step(params):
        for p in params:
            hist(p.grad)

    _every_tensor(w, hist, at_step)


def setup_full_floor(w, native=True):
    """The floor's hooks with, per tensor, ampdoctor's full-statistics kernel (stats.full: exponent histogram, exact
    FP16/BF16 cast counts, sum, norm, abs max), nothing kept: what debug mode's statistics cost without its
    bookkeeping, trace and live rules. ``native=False``: the torch/numpy passes (stats._full_cpu)."""
    from ampdoctor.collect import stats

    kernel = stats.full if native else (lambda t: stats._full_cpu(t.detach().reshape(-1)))

    def full(t):  # a tensor hook must return None (or a replacement gradient)
        kernel(t)

    def at_step(params):
        for p in params:
            full(p.grad)

    _every_tensor(w, full, at_step)


def setup_sentinel_floor(w):
    """The work of ampdoctor's sentinel alone, no hooks, nothing kept: the fused gradient norm and the largest
    gradient (one aminmax per gradient), read on the host once per step."""
    params = list(w.model.parameters())

    def at_step(loss):
        grads = [p.grad for p in params]
        norms = torch._foreach_norm(grads, 2)
        [e.item() for g in grads for e in torch.aminmax(g)]
        [n.item() for n in norms]
        loss.item()

    w.step_hook = at_step


def setup_native_sentinel_floor(w):
    """The sentinel's work with the native kernel: the gradient norm and peak in one read of every gradient."""
    from ampdoctor.collect import stats

    params = list(w.model.parameters())

    def at_step(loss):
        grads = [p.grad for p in params]
        k = stats.native()
        if k is not None:  # (else warm-up, while the kernels load)
            stats.grad_norm_peak(k, grads)
        loss.item()

    w.step_hook = at_step


def setup_debug_underflow(w):
    from transformers.debug_utils import DebugUnderflowOverflow

    DebugUnderflowOverflow(w.model)


def setup_wandb(w):
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    run = wandb.init(mode="offline", dir=tempfile.mkdtemp())  # wandb.watch logs through the global run
    wandb.watch(w.model, log="all", log_freq=1)
    w.step_hook = lambda loss: wandb.log({"loss": loss.item()})
    return run.finish


VARIANTS = {
    "bare": None,
    # the same bare loop in another process: how far two processes of the same code differ (their memory layout,
    # the core they ran on), the error bar of every ratio below
    "bare (a second process)": None,
    "ampdoctor defaults": lambda w: setup_ampdoctor(w),
    "ampdoctor defaults (budget 0.03)": lambda w: setup_ampdoctor(w, budget=0.03),
    # what the anomaly replay's capture of every step (the call, its RNG state, the backward's seed) costs
    "ampdoctor defaults (budget 0.03; no replay)": lambda w: setup_ampdoctor(w, budget=0.03, replay=False),
    "ampdoctor debug": lambda w: setup_ampdoctor(w, mode="debug"),
    "ampdoctor defaults (torch passes)": lambda w: setup_ampdoctor(w, native=False),
    "ampdoctor debug (torch passes)": lambda w: setup_ampdoctor(w, native=False, mode="debug"),
    "floor: one aminmax per tensor": setup_floor,
    "histogram floor: one bincount per tensor": setup_hist_floor,
    "full-statistics floor: stats.full per tensor": setup_full_floor,
    "full-statistics floor (torch passes)": lambda w: setup_full_floor(w, native=False),
    "sentinel floor: fused norm + aminmax per grad": setup_sentinel_floor,
    "sentinel floor: one native read": setup_native_sentinel_floor,
    "naive per-layer .item() hooks": setup_naive_item,
    "transformers DebugUnderflowOverflow": setup_debug_underflow,
    "wandb.watch log=all log_freq=1": setup_wandb,
}
# Tensors a step observes, per variant: module outputs and output gradients (m: modules other than the root),
# parameter gradients (p), parameters (w). ampdoctor defaults: the debug count times the share of observed steps.
OBSERVED = {
    "ampdoctor debug": lambda m, p: 2 * m + 2 + p,
    "ampdoctor debug (torch passes)": lambda m, p: 2 * m + 2 + p,
    "floor: one aminmax per tensor": lambda m, p: 2 * m + p,
    "histogram floor: one bincount per tensor": lambda m, p: 2 * m + p,
    "full-statistics floor: stats.full per tensor": lambda m, p: 2 * m + p,
    "full-statistics floor (torch passes)": lambda m, p: 2 * m + p,
    "naive per-layer .item() hooks": lambda m, p: 2 * m + 2,
    "transformers DebugUnderflowOverflow": lambda m, p: 2 * m + p,
    "sentinel floor: fused norm + aminmax per grad": lambda m, p: p,
    "sentinel floor: one native read": lambda m, p: p,
    "wandb.watch log=all log_freq=1": lambda m, p: 2 * p,
}


class Worker:
    """The worker side: one model, one variant; answers "run N" with the block's seconds and "close" with its close
    time, background CPU and (ampdoctor) what its trace says about its own cost."""

    def __init__(self, model_name, variant, dtype):
        torch.manual_seed(0)
        self.model, xs, ys = MODELS[model_name]()
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(*xs, generator=g), torch.randn(*ys, generator=g)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.dtype = torch.bfloat16 if dtype == "bf16" else None
        self.step_hook = self.settle = self.trace = None
        self.threads = []
        setup = VARIANTS[variant.removesuffix(BEFORE)]
        self.closer = setup(self) if setup else None
        import psutil

        self.proc = psutil.Process()
        self.steps = 0
        self.hook_s = 0.0  # time inside the step hook (the sentinel floor's own work)
        self.kernels = {}  # how the native kernels' load went (stats.load_info), where they were used
        self.rules_load_s = None  # CPU seconds the live thread took to import the rules (ampdoctor with live rules)

    def run(self, n):
        self.cpu0 = time.process_time()  # (every thread of the process: training, writer, live checks)
        t0 = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                out = self.model(self.x)
            loss = torch.nn.functional.mse_loss(out.float(), self.y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.step_hook:
                h0 = time.perf_counter()
                self.step_hook(loss)
                self.hook_s += time.perf_counter() - h0
        if self.settle:
            self.settle()
        self.steps += n
        return time.perf_counter() - t0

    def background_cpu(self):
        """CPU seconds of the variant's own background: named threads and child processes (wandb's service)."""
        total = 0.0
        for t in self.threads:
            if t.is_alive():
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for c in self.proc.children(recursive=True):
            try:
                ct = c.cpu_times()
                total += ct.user + ct.system
            except Exception:
                pass
        return total

    def close(self, warm):
        t0 = time.perf_counter()
        if self.closer:
            self.closer()
        out = {"close_s": time.perf_counter() - t0}
        if self.trace:
            st = ampdoctor.load(self.trace).steps()
            timed = st[st["step"] >= warm]
            sentinel = timed[timed["level"] == -1]
            out.update(
                observer_us=1e6 * float(timed["observer_time"].mean()),
                sentinel_us=1e6 * float(sentinel["observer_time"].median()) if len(sentinel) else None,
                calibration_ms=1e3 * float(st.loc[st["reason"] == "calibration", "observer_time"].sum()),
                observed_share=float((timed["level"] >= 0).mean()),
            )
        return out


def worker_main(model_name, variant, dtype, threads):
    if int(threads):
        torch.set_num_threads(int(threads))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the variant prints goes to stderr, not the protocol
    warnings.simplefilter("ignore")
    w = Worker(model_name, variant, dtype)
    proto.write(
        json.dumps(
            {
                "ready": True,
                "modules": len(list(w.model.modules())) - 1,
                "params": len(list(w.model.parameters())),
                "children": len(w.proc.children(recursive=True)),
                "code": os.path.dirname(os.path.dirname(os.path.abspath(ampdoctor.__file__))),
            }
        )
        + "\n"
    )
    bg0 = warm = bg_in_blocks = 0
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "warm":
            w.run(int(arg))
            from ampdoctor.collect import stats

            if stats._load_thread is not None:  # the native kernels were asked for: time what serves after the load
                stats.native(wait=True)
                w.kernels = dict(stats.load_info)
                try:  # the sentinel's C++ read (session 16 on), built beforehand by make install
                    from ampdoctor.collect import compiled
                except ImportError:
                    pass
                else:
                    compiled.wait()
                    w.kernels["compiled"] = compiled.info.get("error") or "C++ read"
            for t in w.threads:  # ampdoctor's live rules import themselves as the thread starts: a one-off, as above
                if hasattr(t, "loaded"):
                    t.loaded.wait(60)
                    w.rules_load_s = t.load_cost
            warm = w.steps
            bg0, wall0 = w.background_cpu(), time.perf_counter()
            w.hook_s = 0.0
            proto.write(json.dumps({"t": 0.0}) + "\n")
        elif cmd == "run":
            bg_block = w.background_cpu()
            t = w.run(int(arg))
            cpu = time.process_time() - w.cpu0
            bg_block = w.background_cpu() - bg_block
            bg_in_blocks += bg_block
            proto.write(json.dumps({"t": t, "cpu": cpu}) + "\n")
        elif cmd == "close":
            bg = w.background_cpu() - bg0
            proto.write(
                json.dumps(
                    {
                        "background_s": bg,
                        "background_outside_blocks_s": bg - bg_in_blocks,
                        "background_share": bg / (time.perf_counter() - wall0),
                        "hook_us": 1e6 * w.hook_s / max(w.steps - warm, 1),
                        "kernels": w.kernels,
                        "rules_load_s": w.rules_load_s,
                        **w.close(warm),
                    }
                )
                + "\n"
            )
            return


# -- the parent: interleaved rounds over worker processes --------------------------------------------------------------
class Proc:
    def __init__(self, model, variant, dtype, threads, before=None):
        self.variant = variant
        env = dict(os.environ)
        if variant.endswith(BEFORE):
            env["AMPDOCTOR_BENCH_CODE"] = before
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--worker", model, variant, dtype, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant} ended")
        return json.loads(line)


def measure(model, dtype, rounds, block_s, variants, threads=0, before=None):
    procs = [Proc(model, v, dtype, threads, before) for v in variants]
    live = []
    for p in procs:
        try:
            p.info = p.read()
            live.append(p)
        except RuntimeError:
            print(f"  skipping {p.variant}: not available here")
    procs = live
    for p in procs:
        if p.variant.endswith(BEFORE) and p.info["code"] != before:
            raise RuntimeError(f"worker {p.variant} imported ampdoctor from {p.info['code']}, not {before}")
        p.ask(f"warm {WARMUP_STEPS}")
    bare = procs[0]
    n = max(3, round(block_s / min(bare.ask("run 5")["t"] / 5 for _ in range(3))))
    times = {p.variant: [] for p in procs}
    cpu = {p.variant: [] for p in procs}
    order = random.Random(0)
    for _ in range(rounds):
        for p in order.sample(procs, len(procs)):
            block = p.ask(f"run {n}")
            times[p.variant].append(block["t"] / n)
            cpu[p.variant].append(block["cpu"] / n)
    ends = {p.variant: p.ask("close") for p in procs}
    for p in procs:
        try:
            p.p.wait(120)
        except subprocess.TimeoutExpired:  # (its results are in; a loaded machine can take long to end a process)
            p.p.kill()
    total = rounds * n
    rows = []
    base = statistics.fmean(times["bare"])
    base_med = statistics.median(times["bare"])
    for p in procs:
        # background work runs by the wall clock (the live checks every few seconds, wandb's service): its CPU share
        # of the wall time is charged to every step; close() once, over the timed steps
        e = ends[p.variant]
        per = [t * (1 + e["background_share"]) + e["close_s"] / total for t in times[p.variant]]
        mean = statistics.fmean(per)
        ratio_med = statistics.median(a / b for a, b in zip(per, times["bare"]))
        # the process's CPU time per step (its threads and children), the same per-round ratio: steadier than the
        # wall time on a loaded machine (what the other processes take is not in it), blind to a thread that waits
        # for the GIL (its wait costs no CPU)
        cpu_per = [c + (e["background_outside_blocks_s"] + e["close_s"]) / total for c in cpu[p.variant]]
        cpu_ratio_med = statistics.median(a / b for a, b in zip(cpu_per, cpu["bare"]))
        observed = OBSERVED.get(p.variant.removesuffix(BEFORE))
        tensors = observed(p.info["modules"], p.info["params"]) if observed else None
        if p.variant.removesuffix(BEFORE) == "ampdoctor defaults":
            tensors = (
                OBSERVED["ampdoctor debug"](p.info["modules"], p.info["params"]) * ends[p.variant]["observed_share"]
            )
        added_us = 1e6 * (ratio_med - 1) * base_med  # the median round ratio: steadier than the means
        rows.append(
            {
                "variant": p.variant,
                "mean_ms": 1e3 * mean,
                "median_ms": 1e3 * statistics.median(per),
                "ratio": mean / base,
                "ratio_med": ratio_med,
                "cpu_ratio_med": cpu_ratio_med,
                "added_us": added_us,
                "per_tensor_us": added_us / tensors if tensors else None,
                **ends[p.variant],
                "modules": p.info["modules"],
                "steps": n,
            }
        )
    return rows


def show(model, dtype, rows):
    r0 = rows[0]
    print(
        f"\n{model} ({r0['modules']} modules), {dtype}: bare {r0.get('median_ms', r0['mean_ms']):.2f} ms/step "
        f"(median block), {r0['steps']} steps per block"
    )
    print(
        f"  {'variant':46s} {'ratio':>6s} {'median':>7s} {'cpu':>6s} {'+us/step':>9s} {'us/tensor':>9s} {'close':>7s} "
        f"{'bg':>5s}  ampdoctor's own record"
    )
    for r in rows:
        own = f"its own work {r['hook_us']:.0f} us/step" if r["variant"].startswith("sentinel floor") else ""
        if "observer_us" in r:
            own = f"{r['observer_us']:.0f} us/step"
            if r.get("sentinel_us") is not None:
                own += f", sentinel-only steps {r['sentinel_us']:.0f} us"
            own += f", calibration {r['calibration_ms']:.0f} ms once, {100 * r['observed_share']:.0f}% steps observed"
        if r.get("kernels", {}).get("error"):
            own += f" [native kernels unavailable: {r['kernels']['error']}]"
        elif r.get("kernels"):
            own += f" [kernels loaded in {r['kernels']['seconds']:.1f} s, {r['kernels']['cpu_seconds']:.1f} s CPU]"
            if "compiled" in r["kernels"]:
                own += f" [{r['kernels']['compiled']}]"
        if r.get("rules_load_s") is not None:
            own += f" [live rules loaded: {r['rules_load_s']:.2f} s CPU]"
        per_t = f"{r['per_tensor_us']:9.1f}" if r["per_tensor_us"] is not None else f"{'-':>9s}"
        print(
            f"  {r['variant']:46s} x{r['ratio']:5.2f} x{r['ratio_med']:5.2f} x{r['cpu_ratio_med']:5.2f} "
            f"{r['added_us']:9.0f} {per_t} "
            f"{1e3 * r['close_s']:5.0f}ms {100 * r['background_share']:4.1f}%  {own}",
            flush=True,
        )


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block-s", type=float, default=0.4, help="seconds of bare training per block")
    ap.add_argument("--models", default="small,reference,transformer")
    ap.add_argument("--dtypes", default="auto", help="fp32, bf16, or auto: fp32, and bf16 where native")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; bare is always first")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--before", metavar="DIR", help="also run every ampdoctor variant with DIR's ampdoctor/")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the README table of these runs' files, no run")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0: torch's default); 1 keeps "
        "a loaded machine's scheduler from stalling every parallel op on its second thread",
    )
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    native = native_bf16()
    dtypes = (["fp32"] + (["bf16"] if native else [])) if args.dtypes == "auto" else args.dtypes.split(",")
    threads = args.threads or torch.get_num_threads()
    print(
        f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads; BF16 "
        f"{'native (avx512_bf16/amx)' if native else 'emulated: BF16 not measured'}; dtypes {', '.join(dtypes)}; "
        f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}"
    )
    variants = ["bare"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "bare"]
    if args.before:
        if not os.path.isdir(os.path.join(args.before, "ampdoctor")):
            ap.error(f"--before {args.before}: no ampdoctor/ there")
        args.before = os.path.abspath(args.before)
        variants += [v + BEFORE for v in variants if v.startswith("ampdoctor")]
    out = {"load_start": os.getloadavg()[0], "threads": threads, "before": args.before, "results": []}
    for dtype in dtypes:
        for model in args.models.split(","):
            rows = measure(model, dtype, args.rounds, args.block_s, variants, args.threads, args.before)
            show(model, dtype, rows)
            out["results"].append({"model": model, "dtype": dtype, "rows": rows})
    out["load_end"] = os.getloadavg()[0]
    print(f"\nload average at the end {out['load_end']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


def table(paths):
    """Markdown: per model and dtype, each variant's median round ratio (and ratio of means) run by run, host us added
    per step and per observed tensor (first run), and ampdoctor's own record."""
    runs = [json.load(open(p)) for p in paths]
    print(
        "load average (start/end): "
        + "; ".join(f"run {i + 1} {r['load_start']:.1f}/{r['load_end']:.1f}" for i, r in enumerate(runs))
    )
    for k, res in enumerate(runs[0]["results"]):
        others = [r["results"][k] for r in runs]
        bare_ms = " / ".join(f"{o['rows'][0].get('median_ms', o['rows'][0]['mean_ms']):.2f}" for o in others)
        base = res["rows"][0].get("median_ms", res["rows"][0]["mean_ms"])
        print(f"\n**{res['model']}** ({res['rows'][0]['modules']} modules, {res['dtype']}; bare {bare_ms} ms/step)\n")
        print(
            "| variant | median round ratio | ratio of means | +µs/step | µs/observed tensor | close(), background "
            "| ampdoctor's own record |"
        )
        print("|---|---|---|---|---|---|---|")
        for j, row in enumerate(res["rows"][1:], 1):
            rs = [o["rows"][j] for o in others]
            own = f"its own work {row['hook_us']:.0f} µs/step" if row["variant"].startswith("sentinel floor") else ""
            if "observer_us" in row:
                own = f"{row['observer_us']:.0f} µs/step"
                if row.get("sentinel_us") is not None:
                    own += f"; sentinel-only steps {row['sentinel_us']:.0f} µs"
                if row["calibration_ms"]:
                    own += f"; calibration {row['calibration_ms']:.0f} ms once"
            added = 1e3 * (row["ratio_med"] - 1) * base  # us, from the median round ratio of run 1
            tensors = row["added_us"] / row["per_tensor_us"] if row["per_tensor_us"] else None
            per_t = f"{added / tensors:.1f}" if tensors else "-"
            med = " / ".join(f"{r['ratio_med']:.2f}x" for r in rs)
            means = " / ".join(f"{r['ratio']:.2f}x" for r in rs)
            bg = f"{1e3 * row['close_s']:.0f} ms, {100 * row['background_share']:.1f}%"
            print(f"| {row['variant']} | {med} | {means} | {added:.0f} | {per_t} | {bg} | {own} |")


if __name__ == "__main__":
    main()
