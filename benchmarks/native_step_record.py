"""What the sentinel's gradient figures would cost read in C++: the measured basis of the "native step record" design
(docs/overhead.md), not a part of ampdoctor.

The sentinel reads every parameter gradient once per step (global L2 norm and largest |g|). ampdoctor does it with
its numba kernel, after Python has collected the gradients and checked each one's dtype, device, layout and size:
~5 torch attribute reads per gradient, each ~2-3 us inside a training loop (cold caches), and one Python wrapper made
per gradient (``p.grad`` of a tensor autograd made in C++). Here the same figures come from one C++ call that takes
the parameter list and reads ``grad()``, its metadata and its float32 values in C++ (a torch extension compiled with
``torch.utils.cpp_extension.load_inline``: needs a C++ compiler and ninja).

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
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sentinel_pieces import Run, interleave

from ampdoctor.collect import stats

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstring>

// (L2 norm, largest |g|, gradients read) over the parameters' float32 CPU gradients; NaN where one is not that.
std::tuple<double, double, int64_t> norm_peak(const std::vector<at::Tensor>& params) {
  double q = 0.0;
  uint32_t m = 0;
  int64_t read = 0;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (!g.device().is_cpu() || g.scalar_type() != at::kFloat || !g.is_contiguous()) return {NAN, NAN, -1};
    const float* x = g.data_ptr<float>();
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
    const int64_t n = g.numel();
    double s = 0.0;
    uint32_t peak = 0;
    for (int64_t i = 0; i < n; ++i) { const double f = x[i]; s += f * f; }
    for (int64_t i = 0; i < n; ++i) { const uint32_t a = bits[i] & 0x7FFFFFFFu; peak = a > peak ? a : peak; }
    q += s;
    m = peak > m ? peak : m;
    ++read;
  }
  float peak;
  std::memcpy(&peak, &m, 4);
  if (std::isnan(peak)) return {NAN, NAN, read};
  return {std::sqrt(q), static_cast<double>(peak), read};
}
"""


def build():
    t0 = time.perf_counter()
    ext = load_inline(
        "ampdoctor_native_step_record",
        cpp_sources=SOURCE,
        functions=["norm_peak"],
        # (reassociation lets the float64 sum vectorize, as numba's 'reassoc'; NaN and Inf still propagate)
        extra_cflags=["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
    )
    print(f"extension built (or loaded from its cache) in {time.perf_counter() - t0:.1f} s")
    return ext


def with_figures(figures) -> Run:
    """The small model with ``figures(params)`` in its optimizer's pre-hook."""
    run = Run()
    params = list(run.model.parameters())

    def pre(optimizer, args, kwargs):  # (a pre-hook that returns a value replaces the step's arguments)
        figures(params)

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
    print("figures, C++:  ", ext.norm_peak(params)[:2])

    bare = Run()
    bare.after = lambda loss: loss.item()
    runs = {
        "bare": bare,
        "numba (ampdoctor's read)": with_figures(lambda ps: stats.grad_norm_peak(kernels, [p.grad for p in ps])),
        "C++ (one call)": with_figures(ext.norm_peak),
    }
    print(f"small model, 1 torch thread, {args.rounds} rounds of {args.steps} steps")
    interleave(runs, args.rounds, args.steps)


if __name__ == "__main__":
    main()
