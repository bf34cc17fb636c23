"""How many Python calls ampdoctor makes on a clean step: counted, not timed, so the same on a loaded machine.

Inside a training loop each distinct call a step makes pays its cache misses again (step_costs.py), and a step's
time on a shared machine moves by more than a change to a few calls does (sentinel_pieces.py, overhead.py). This
counts instead: after the warm-up (calibration, the kernels and the C++ extension loaded), ``sys.setprofile`` sees
every Python function entered ("py") and every builtin or extension function called from Python ("c") on the
training thread during N steps of the small model; printed per step, for the bare loop and each variant of
sentinel_pieces.py (same names), with ampdoctor's own calls (its package's functions, and the builtins they call)
apart. ``--before DIR`` also counts the variants with DIR's ampdoctor/ (a checkout of the code before a change), each
in its own process.

Run: .venv/bin/python benchmarks/step_calls.py [--steps N] [--variants replay,no-replay,...] [--before DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from typing import NoReturn

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(message: str) -> NoReturn:
    """Bad input or a failed count: one line, exit code 2."""
    print(f"step_calls.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def count(variant: str, steps: int) -> dict[str, float]:
    """Calls per step of one variant in this process (the child's work)."""
    import warnings

    import torch

    from ampdoctor.collect import compiled, stats  # (before sentinel_pieces, which puts this checkout first)

    sys.path.insert(0, HERE)
    import sentinel_pieces as sp

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    stats.native(wait=True)
    run = sp.Run() if variant == "bare" else sp.make(variant)
    if compiled.wait() is None:
        fail("the C++ extension did not load (make install builds it)")
    run.block(60)
    package = os.path.dirname(os.path.abspath(sys.modules["ampdoctor"].__file__))
    calls: collections.Counter[str] = collections.Counter()
    depth = [0]  # (nesting inside ampdoctor's own functions: the builtins they call are its calls too)

    def profile(frame, event, arg):
        if event == "call":
            ours = frame.f_code.co_filename.startswith(package)
            calls["py, ampdoctor" if ours else "py"] += 1
            if ours:
                depth[0] += 1
        elif event == "return":
            if frame.f_code.co_filename.startswith(package):
                depth[0] -= 1
        elif event == "c_call":
            calls["c, ampdoctor" if depth[0] > 0 else "c"] += 1

    sys.setprofile(profile)
    try:
        run.block(steps)
    finally:
        sys.setprofile(None)
    if run.doctor is not None:
        run.doctor.close()
    return {k: v / steps for k, v in calls.items()}


def child(code: str | None, variant: str, steps: int) -> dict[str, float]:
    env = dict(os.environ)
    if code:
        env["AMPDOCTOR_BENCH_CODE"] = code
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("step_calls.py: ")
        fail(f"variant {variant!r} failed: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="replay,no-replay,no-lane")
    ap.add_argument("--before", metavar="DIR", help="also count the variants with DIR's ampdoctor/")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        fail("--steps must be at least 1")
    if args.before and not os.path.isfile(os.path.join(args.before, "ampdoctor", "__init__.py")):
        fail(f"{args.before!r} holds no ampdoctor/ (a checkout: git archive ... | tar -x)")
    code = os.path.abspath(os.environ.get("AMPDOCTOR_BENCH_CODE") or os.path.join(HERE, ".."))
    sys.path.insert(0, code)
    if args.child:
        try:
            result = count(args.child, args.steps)
        except ValueError as exc:  # (sentinel_pieces.make: an unknown variant)
            fail(str(exc))
        print(json.dumps(result))
        return
    variants = [v for v in args.variants.split(",") if v]
    names = [("bare", None, "bare")] + [(v, None, v) for v in variants]
    if args.before:
        names += [(f"{v} (before)", args.before, v) for v in variants]
    print(f"small model, {args.steps} steps after the warm-up; calls per step on the training thread")
    print(f"  {'variant':28s} {'py':>8s} {'c':>8s} {'ampdoctor py':>13s} {'ampdoctor c':>12s} {'all':>8s}")
    for name, where, variant in names:
        c = child(where, variant, args.steps)
        total = sum(c.values())
        print(
            f"  {name:28s} {c.get('py', 0):8.1f} {c.get('c', 0):8.1f} {c.get('py, ampdoctor', 0):13.1f} "
            f"{c.get('c, ampdoctor', 0):12.1f} {total:8.1f}"
        )


if __name__ == "__main__":
    main()
