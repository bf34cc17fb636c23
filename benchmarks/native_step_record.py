"""What the sentinel's gradient figures cost read in C++ against the numba kernel: the measured basis of the
"native step record" design (docs/overhead.md), now ampdoctor's own C++ read (collect/compiled.py).

The sentinel reads every parameter gradient once per step (global L2 norm and largest |g|). The numba kernel reads
the values as fast, after Python has collected the gradients and checked each one's dtype, device, layout and size:
~5 torch attribute reads per gradient, each ~2-3 us inside a training loop (cold caches), and one Python wrapper made
per gradient (``p.grad`` of a tensor autograd made in C++). The C++ read takes the parameter list once and reads
``grad()``, its metadata and its values in C++, in one call per step.

Printed: the figures of both (they must agree), then whole training steps of the small model (overhead.py's) with
the figures computed in the optimizer's pre-hook each way and without them, interleaved in shuffled rounds in one
process, one torch thread: the median block time and the median per-round ratio to bare.

Run: .venv/bin/python benchmarks/native_step_record.py [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sentinel_pieces import Run, interleave

from ampdoctor.collect import compiled, stats


def build():
    t0 = time.perf_counter()
    ext = compiled.wait()
    if ext is None:
        sys.exit("the C++ extension did not load: " + str(compiled.info))
    print(f"C++ read built (or loaded from its cache) in {time.perf_counter() - t0:.1f} s")
    return ext


def with_figures(make_read) -> Run:
    """The small model with ``make_read(params)()`` in its optimizer's pre-hook."""
    run = Run()
    read = make_read(list(run.model.parameters()))

    def pre(optimizer, args, kwargs):  # (a pre-hook that returns a value replaces the step's arguments)
        read()

    run.opt.register_step_pre_hook(pre)
    run.after = lambda loss: loss.item()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ext = build()
    kernels = stats.native(wait=True)
    if kernels is None:
        sys.exit("the numba kernels did not load: " + str(stats.load_info.get("error")))

    run = Run()
    torch.nn.functional.mse_loss(run.model(run.x), run.y).backward()
    params = list(run.model.parameters())
    print("figures, numba:", stats.grad_norm_peak(kernels, [p.grad for p in params]))
    print("figures, C++:  ", ext.Grads(params).figures()[:2])

    bare = Run()
    bare.after = lambda loss: loss.item()
    runs = {
        "bare": bare,
        "numba (the read behind Python)": with_figures(
            lambda ps: lambda: stats.grad_norm_peak(kernels, [p.grad for p in ps])
        ),
        "C++ (ampdoctor's read: one call)": with_figures(lambda ps: ext.Grads(ps).figures),
    }
    print(f"small model, 1 torch thread, {args.rounds} rounds of {args.steps} steps")
    interleave(runs, args.rounds, args.steps)


if __name__ == "__main__":
    main()
