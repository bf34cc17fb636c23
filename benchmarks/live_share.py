"""Live diagnosis's share of a wide model's training: 3,000 modules (1,000 pre-norm residual blocks x [LayerNorm(16),
Linear(16, 16), ReLU], x + 0.03 * block(x): a deep model that trains, its gradients finite) trained in FP32 with
ampdoctor's defaults, ``live=True`` against ``live=False``, each for the same wall time in a process of its own, the
two alternating over rounds. Printed per round: steps per second of each, their ratio, and the live thread's own CPU
time (LiveDiagnosis.spent: what its checks took from training) as a share of the run, the checks made and the first
one's cost; then the medians. A run whose loss or gradients went non-finite is reported as such (every step after
an anomaly is observed in full: it measures another thing). Run: .venv/bin/python benchmarks/live_share.py
[--rounds 3] [--seconds 60]

Until session 13 the model was a plain stack of the same 3,000 layers, whose gradients are NaN from the first step
(the product of 1,000 LayerNorm Jacobians overflows): every step was an anomaly observed in full, 5-50x the bare
step, and the figures measured that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = """
import json, math, sys, time, torch, ampdoctor
live, seconds, path = sys.argv[1] == "1", float(sys.argv[2]), sys.argv[3]


class Wide(torch.nn.Module):
    def __init__(self, blocks=1000, width=16, scale=0.03):
        super().__init__()
        self.scale = scale
        block = lambda: (torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.ReLU())
        self.layers = torch.nn.ModuleList([m for _ in range(blocks) for m in block()])

    def forward(self, x):
        for i in range(0, len(self.layers), 3):
            x = x + self.scale * self.layers[i + 2](self.layers[i + 1](self.layers[i](x)))
        return x


torch.manual_seed(0)
model = Wide()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 16)


def step():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    doc.log_loss(loss)
    return loss


with ampdoctor.attach(model, optimizer=opt, trace=path, live=live) as doc:
    attached = time.perf_counter()  # the live thread's share is bounded against the run's time from here
    for _ in range(12):  # calibration steps, untimed
        step()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loss = step()
        steps += 1
    wall = time.perf_counter() - t0
    run_s = time.perf_counter() - attached
    finite = math.isfinite(loss.item()) and all(torch.isfinite(p).all() for p in model.parameters())
    lv = doc.live
    spent = lv.spent if lv is not None else 0.0
    checks = lv.checks if lv is not None else 0
    first = lv.first_cost if lv is not None else 0.0
    last = lv._last_steps if lv is not None else 0
print(json.dumps({"steps_per_s": steps / wall, "live_cpu_s": spent, "wall_s": wall, "run_s": run_s,
                  "last_checked_steps": last,
                  "checks": checks, "first_check_s": first, "finite": finite}))
"""


def worker(live: bool, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [sys.executable, "-c", WORKER, "1" if live else "0", str(seconds), os.path.join(d, "t.db")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    ratios, shares = [], []
    for r in range(args.rounds):
        pair = [(False, worker(False, args.seconds)), (True, worker(True, args.seconds))]
        if r % 2:
            pair.reverse()
        off, on = dict(pair)[False], dict(pair)[True]
        ratio = off["steps_per_s"] / on["steps_per_s"]
        share = on["live_cpu_s"] / on["run_s"]  # (the checks made during the calibration steps included)
        ratios.append(ratio)
        shares.append(share)
        print(
            f"round {r}: off {off['steps_per_s']:.1f} steps/s, live {on['steps_per_s']:.1f} steps/s, "
            f"slowdown {ratio:.3f}x; live checks' CPU {on['live_cpu_s']:.2f} s = {100 * share:.2f}% of the run "
            f"({on['checks']} checks, the first {on['first_check_s']:.2f} s of CPU, the last at step "
            f"{on['last_checked_steps']}){'' if off['finite'] and on['finite'] else '; THE RUN WENT NON-FINITE'}",
            flush=True,
        )
    slow, share = statistics.median(ratios), statistics.median(shares)
    print(f"median slowdown {slow:.3f}x; median live CPU share {100 * share:.2f}%")
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
