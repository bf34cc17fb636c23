"""What ampdoctor costs on a dead run: a model whose weights went NaN at step 20 and which trains on (nobody halted
it), the default tiers, ``live=False``. Every step after that is an anomaly; the flight recorder observes the first
16 of them in full, then the steps at a power of two into it (and every ``hist_every``-th). Printed per variant: the
median step time over steps 100-399 (bare, ampdoctor, and with ``--before DIR`` ampdoctor from DIR's checkout, which
observed every step of it in full), in interleaved rounds, each variant in its own process.
Run: .venv/bin/python benchmarks/dead_run.py [--rounds 3] [--before DIR]
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
import json, math, os, sys, tempfile, time, torch
variant = sys.argv[1]
torch.manual_seed(0)
torch.set_num_threads(1)
layers = []
for _ in range(10):
    layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randn(32, 64)
doc = None
if variant != "bare":
    import ampdoctor
    doc = ampdoctor.attach(model, optimizer=opt, trace=os.path.join(tempfile.mkdtemp(), "t.db"), live=False)
times = []
for step in range(400):
    t0 = time.perf_counter()
    if step == 20:
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan  # the weights go NaN: every later step is non-finite
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    if doc is not None:
        doc.log_loss(loss)
    times.append(time.perf_counter() - t0)
if doc is not None:
    doc.close()
print(json.dumps({"median_ms": 1e3 * sorted(times[100:])[150], "finite": math.isfinite(loss.item())}))
"""


def worker(variant: str, before: str | None) -> dict:
    env = dict(os.environ)
    path = before if variant == "before" else ROOT
    env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [sys.executable, "-c", WORKER, variant], capture_output=True, text=True, cwd=d, env=env, check=True
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=None, help="a checkout of the code before a change (git archive | tar -x)")
    args = ap.parse_args()
    variants = ["bare", "ampdoctor"] + (["before"] if args.before else [])
    ms: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            ms[v].append(worker(v, args.before)["median_ms"])
        print(f"round {r}: " + ", ".join(f"{v} {ms[v][-1]:.2f} ms" for v in variants), flush=True)
    bare = statistics.median(ms["bare"])
    print("median step of the dead run: " + ", ".join(f"{v} {statistics.median(ms[v]):.2f} ms" for v in variants))
    print("ratio to bare: " + ", ".join(f"{v} {statistics.median(ms[v]) / bare:.2f}x" for v in variants[1:]))
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
