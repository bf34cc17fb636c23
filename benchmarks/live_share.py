"""Live diagnosis's share of a wide model's training: 3,000 modules (1,000 x [Linear(16, 16), ReLU, LayerNorm]) trained
in FP32 with ampdoctor's defaults, ``live=True`` against ``live=False``, each for the same wall time in a process of
its own, the two alternating over rounds. Printed per round: steps per second of each, their ratio, and the live
thread's own CPU time (LiveDiagnosis.spent: what its checks took from training) as a share of the run; then the
medians. Run: .venv/bin/python benchmarks/live_share.py [--rounds 3] [--seconds 60]
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
import json, sys, time, torch, ampdoctor
live, seconds, path = sys.argv[1] == "1", float(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
blocks = [m for _ in range(1000) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16))]
model = torch.nn.Sequential(*blocks)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 16)
with ampdoctor.attach(model, optimizer=opt, trace=path, live=live) as doc:
    for _ in range(12):  # calibration steps, untimed
        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
        steps += 1
    wall = time.perf_counter() - t0
    lv = doc._live
    spent = lv.spent if lv is not None else 0.0
    checks = lv._last_steps if lv is not None else 0
print(json.dumps({"steps_per_s": steps / wall, "live_cpu_s": spent, "wall_s": wall, "last_checked_steps": checks}))
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
        share = on["live_cpu_s"] / on["wall_s"]
        ratios.append(ratio)
        shares.append(share)
        print(
            f"round {r}: off {off['steps_per_s']:.1f} steps/s, live {on['steps_per_s']:.1f} steps/s, "
            f"slowdown {ratio:.3f}x; live checks' CPU {on['live_cpu_s']:.2f} s = {100 * share:.2f}% of the run "
            f"(last check at step {on['last_checked_steps']})",
            flush=True,
        )
    slow, share = statistics.median(ratios), statistics.median(shares)
    print(f"median slowdown {slow:.3f}x; median live CPU share {100 * share:.2f}%")
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
