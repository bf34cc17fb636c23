"""Where the time ampdoctor adds to a step goes, down to the native symbol: Linux ``perf`` samples a process that
trains the small model (sentinel_pieces.py's variants: bare, empty hooks, the sentinel's least, ampdoctor with or
without the lane, ...) and the samples are split by library and by symbol. Python's interpreter shows up as
``_PyEval_EvalFrameDefault`` and its attribute lookups; torch's kernels as ``libtorch_cpu``; ampdoctor's C++ reads as
its extension.

Each variant trains in its own process, one torch thread; after a warm-up, ``perf record`` samples it (every thread:
the writer's too) for ``--seconds``. Per-step figures are each library's or symbol's share of the samples times the
process's CPU time per step (its time per step times the CPUs its threads kept busy while sampled). Printed: per
library, and the symbols whose time per step differs most from the bare run's. Between two processes torch's own
kernels (MKL's sgemm above all) move by up to ~10% of the step on a shared machine, with no ampdoctor in either:
read the libraries that are ampdoctor's work (the interpreter, the extension, numpy and sqlite for the writer),
not torch's, as what a variant adds.

Needs ``perf`` (Debian: linux-perf) and the rights to sample a process (root, or kernel.perf_event_paranoid <= 1).

Run: .venv/bin/python benchmarks/perf_split.py [--variants replay,no-lane] [--seconds 8] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FREQUENCY = 1999  # samples per second per CPU


def child(variant: str) -> None:
    """Train ``variant`` until stdin closes: 'ready' once warm, then the time per step of the steps since."""
    import warnings

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import sentinel_pieces as pieces
    import torch

    from ampdoctor.collect import compiled, stats

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    stats.native(wait=True)
    compiled.wait()
    try:
        run = pieces.Run() if variant == "bare" else pieces.make(variant)
    except ValueError as exc:
        print(f"perf_split: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run.block(400)
    print("ready", flush=True)
    steps, t0 = 0, time.perf_counter()
    while not select.select([sys.stdin], [], [], 0)[0]:
        run.block(400)  # (ampdoctor's variants flush() at a block's end: the writer's wait, once per 400 steps)
        steps += 400
    print(f"{1e6 * (time.perf_counter() - t0) / steps:.1f}", flush=True)
    if run.doctor is not None:
        run.doctor.close()


def sample(variant: str, seconds: float, where: str) -> tuple[float, str]:
    """(the variant's time per step in us, the perf data file)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", variant], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    if proc.stdout.readline().strip() != "ready":
        fail(f"the {variant!r} run did not start", proc)
    data = os.path.join(where, f"{variant.replace('+', '_').replace(' ', '_')}.data")
    record = subprocess.run(
        ["perf", "record", "-q", "-F", str(FREQUENCY), "-p", str(proc.pid), "-o", data, "--", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if record.returncode != 0:
        why = record.stderr.strip().splitlines()[-1:] or ["no message"]
        fail(f"perf record could not sample the run ({why[0][:200]}); kernel.perf_event_paranoid <= 1?", proc)
    proc.stdin.close()
    us = float(proc.stdout.readline())
    proc.wait()
    return us, data


def fail(message: str, proc: subprocess.Popen[str]) -> None:
    """One line, exit code 2; the child stopped."""
    proc.kill()
    proc.wait()
    print(f"perf_split: {message}", file=sys.stderr)
    raise SystemExit(2)


def shares(data: str) -> tuple[dict[tuple[str, str], float], int]:
    """((library, symbol) -> share of the samples, the number of samples)."""
    out = subprocess.run(
        ["perf", "report", "-i", data, "--sort", "dso,sym", "--stdio", "--no-children"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[tuple[str, str], float] = {}
    count = re.search(r"# Samples: (\d+)([KM]?)", out)
    assert count is not None, out[:500]
    samples = int(count.group(1)) * {"": 1, "K": 1000, "M": 10**6}[count.group(2)]
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m:
            key = (m.group(2), m.group(3).strip())
            found[key] = found.get(key, 0.0) + float(m.group(1)) / 100
    return found, samples


def per_step(data: str, us: float, seconds: float) -> tuple[dict[tuple[str, str], float], float]:
    """Each (library, symbol)'s CPU us per step, and the CPU us per step in all."""
    found, samples = shares(data)
    cpu = us * samples / (FREQUENCY * seconds)  # (the CPUs kept busy: ~1 for the training thread, more with a writer)
    return {k: v * cpu for k, v in found.items()}, cpu


def median(
    runs: list[tuple[float, dict[tuple[str, str], float], float]],
) -> tuple[float, dict[tuple[str, str], float], float]:
    """The median of each figure over a variant's samples (a symbol absent from one counts 0 there)."""
    keys = set().union(*[split for _, split, _ in runs])
    split = {k: statistics.median([s.get(k, 0.0) for _, s, _ in runs]) for k in keys}
    return statistics.median([u for u, _, _ in runs]), split, statistics.median([c for _, _, c in runs])


def by_library(split: dict[tuple[str, str], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (lib, _), t in split.items():
        out[lib] = out.get(lib, 0.0) + t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="empty hooks,least,replay,no-lane")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=1, help="samples of each variant, in a new shuffled order each time")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    if shutil.which("perf") is None:
        print("perf_split: needs Linux perf (Debian: apt install linux-perf)", file=sys.stderr)
        raise SystemExit(2)
    if args.repeat < 1 or args.seconds <= 0:
        print("perf_split: --repeat must be at least 1 and --seconds above 0", file=sys.stderr)
        raise SystemExit(2)
    where = tempfile.mkdtemp(prefix="perf_split-")
    variants = ["bare", *[v for v in args.variants.split(",") if v]]
    taken: dict[str, list[tuple[float, dict[tuple[str, str], float], float]]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for v in random.sample(variants, len(variants)):
            us, data = sample(v, args.seconds, where)
            split, cpu = per_step(data, us, args.seconds)
            taken[v].append((us, split, cpu))
    measured = {v: median(runs) for v, runs in taken.items()}
    bare_us, bare, bare_cpu = measured["bare"]
    print(f"small model, 1 torch thread, {args.seconds:.0f} s of samples per variant, median of {args.repeat}")
    print(f"bare: {bare_us:.0f} us/step, {bare_cpu:.0f} us of CPU per step")
    print("CPU us per step, each library (then symbol) of the variant against the bare run")
    for v in variants[1:]:
        us, split, cpu = measured[v]
        before, after = by_library(bare), by_library(split)
        print(f"\n{v}: {us:.0f} us/step, {cpu:.0f} us of CPU per step ({cpu - bare_cpu:+.0f} against bare)")
        for lib in sorted(set(before) | set(after), key=lambda k: before.get(k, 0.0) - after.get(k, 0.0)):
            a, b = before.get(lib, 0.0), after.get(lib, 0.0)
            if abs(b - a) >= 0.5:
                print(f"  {b - a:+7.1f}  {a:7.1f} -> {b:7.1f}  {lib}")
        print("  symbols:")
        keys = set(bare) | set(split)
        deltas = sorted(keys, key=lambda k: bare.get(k, 0.0) - split.get(k, 0.0))[: args.top]
        for k in deltas:
            a, b = bare.get(k, 0.0), split.get(k, 0.0)
            print(f"  {b - a:+7.1f}  {a:7.1f} -> {b:7.1f}  {k[0][:24]:24s} {k[1][:80]}")


if __name__ == "__main__":
    main()
