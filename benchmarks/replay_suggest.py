"""The loss-scale replay on long runs: CPU time of ``suggest`` (the search ``diagnose`` runs) and of ``replay`` (the
run's own settings, every step kept), this checkout side by side with another's (``--before DIR``, its ampdoctor/
first on PYTHONPATH), alternating, each measurement in its own process on a trace already read (the steps, the scan
and the evidence warmed up first: what is timed is the replay's own work). Printed: the median CPU seconds of each
and their ratio (medians of alternating runs: these machines are noisy).

Run: .venv/bin/python benchmarks/replay_suggest.py TRACE [TRACE ...] --before DIR [--repeat 3]
(traces from benchmarks/tracegen.py, e.g. $TMPDIR/ampdoctor-bench/gen-v3-steps1000000-*.db; copy one first if
another process may be writing next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import ampdoctor
from ampdoctor.lossscale import evidence, replay, suggest
from ampdoctor.trace.view import View
view = View.of(ampdoctor.load(sys.argv[1]))
evidence.gather(view)  # the trace's columns, scan and evidence read once
out = {}
for name, fn in (("suggest", lambda: suggest(view)), ("replay", lambda: replay(view))):
    t0 = time.process_time()
    fn()
    out[name] = time.process_time() - t0
print(json.dumps(out))
"""


def measure(trace: str, code: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": code}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, os.path.abspath(trace)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--before", required=True, help="a checkout of the code to compare with")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for trace in args.traces:
        runs: dict[str, list[dict[str, float]]] = {"now": [], "before": []}
        for _ in range(args.repeat):
            runs["before"].append(measure(trace, os.path.abspath(args.before)))
            runs["now"].append(measure(trace, here))
        print(os.path.basename(trace))
        for name in ("suggest", "replay"):
            now = statistics.median(r[name] for r in runs["now"])
            before = statistics.median(r[name] for r in runs["before"])
            print(f"  {name:8s} cpu {now:6.2f} s   before {before:6.2f} s   ratio {before / now:4.1f}x")


if __name__ == "__main__":
    main()
