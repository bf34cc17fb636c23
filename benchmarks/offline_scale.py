"""Reading long runs: ``diagnose``, ``info`` and ``report`` on generated traces (benchmarks/tracegen.py) of 10^6 and
2 x 10^4 steps x 1,010 sites at the default tiers, a wide model's (5,000 modules, 100 steps) and a crafted sparse one
(10^4 steps x 10^4 sites claimed, 1.5 MB held). Each command runs in its own process; printed: wall time, CPU time
(user + system: what the command itself cost, less sensitive than wall time to a loaded machine) and peak resident
memory (ru_maxrss from wait4), against the targets of issue 18. ``--before DIR`` runs the same commands with another
checkout's code (its ampdoctor first on PYTHONPATH) side by side, as ratios; the 20k trace's findings are compared with
those the code before the rework gave (benchmarks/results/findings-20k-before.json: main's offline side at ab6e3d8,
with the anomaly replay and FSDP rules, without this rework; its `diagnose --json` took 34 s CPU, 6 min wall).

Run: .venv/bin/python benchmarks/offline_scale.py [--traces 1M,20k,wide,sparse] [--cache DIR] [--before DIR]
[--commands diagnose,info,report] [--repeat N] [--json OUT]. ``--repeat N`` measures each command N times, now and
before interleaved, and prints the medians (a loaded machine's figures vary by tens of percent from run to run).
Generated traces are kept in --cache (default $TMPDIR/ampdoctor-bench; the 10^6-step one is 2.2 GB and takes ~10
minutes to write the first time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import tracegen  # noqa: E402

TRACES = {
    "1M": {"steps": 1_000_000, "blocks": 19},
    "20k": {"steps": 20_000, "blocks": 19},
    "wide": {"steps": 100, "blocks": 454},  # 11 * 454 + 5 = 4,999 modules
}
COMMANDS = ("diagnose", "info", "report")
# (seconds, MB of resident memory) per trace and command; None: no target
TARGETS = {
    ("1M", "diagnose"): (10, 1000),
    ("1M", "info"): (1, None),
    ("1M", "report"): (20, 1000),
    ("20k", "diagnose"): (3, 500),
    ("20k", "info"): (1, None),
    ("wide", "diagnose"): (5, None),
    ("wide", "report"): (5, None),
    ("sparse", "diagnose"): (None, 500),
}
BEFORE_FINDINGS = os.path.join(HERE, "results", "findings-20k-before.json")


RUNNER = """
import resource, sys
from ampdoctor.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
ru = resource.getrusage(resource.RUSAGE_SELF)
sys.stderr.write(f"\\nMEASURED {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime} {rc} {ru.ru_utime} {ru.ru_stime}\\n")
"""


def measure(argv: list, pythonpath: str, timeout: float) -> dict:
    """One command in its own process (cwd outside any checkout, so PYTHONPATH decides the code): wall seconds, and
    from the process itself (getrusage after it ran: a forked child would count its parent's pages) CPU seconds and
    peak RSS in MB; exit code and the output's last line."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, "-c", RUNNER, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
            wall, timed_out, err, out = time.perf_counter() - t0, False, p.stderr, p.stdout
        except subprocess.TimeoutExpired as exc:
            wall, timed_out, err, out = time.perf_counter() - t0, True, str(exc.stderr or ""), ""
    got = [ln for ln in err.splitlines() if ln.startswith("MEASURED ")]
    rss_kb, cpu, rc, user, system = got[-1].split()[1:] if got else ("nan",) * 5
    text = [ln for ln in (out + err).splitlines() if ln.strip() and not ln.startswith("MEASURED ")]
    return {
        "wall_s": wall,
        "cpu_s": float(cpu),
        "user_s": float(user),  # (the system part is mostly page faults: memory first touched)
        "system_s": float(system),
        "rss_mb": float(rss_kb) / 1024,
        "rc": int(rc) if rc not in ("nan", "None") else (0 if rc == "None" else -1),
        "timed_out": timed_out,
        "last": text[-1][:100] if text else "",
    }


CALIBRATE = """
import sqlite3, sys, time
c = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
t0 = time.process_time()
c.execute("SELECT loss FROM steps WHERE step < 1000000").fetchall()
print(time.process_time() - t0)
"""


def calibrate(path: str) -> float:
    """CPU seconds to read one column of 10^6 steps rows through Python's sqlite3 (a yardstick of this machine
    now), in a process of its own."""
    out = subprocess.run([sys.executable, "-c", CALIBRATE, path], capture_output=True, text=True, check=True)
    return float(out.stdout)


def median(runs: list[dict]) -> dict:
    """Per figure, the median of the runs (the exit code and the output: the last run's)."""
    out = dict(runs[-1])
    for key in ("wall_s", "cpu_s", "user_s", "system_s", "rss_mb"):
        values = sorted(r[key] for r in runs)
        mid = len(values) // 2
        out[key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    out["timed_out"] = any(r["timed_out"] for r in runs)
    out["runs"] = runs if len(runs) > 1 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="1M,20k,wide,sparse")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ampdoctor-bench"))
    ap.add_argument("--before", help="a checkout of the code to compare with (its ampdoctor/ on PYTHONPATH)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="of diagnose,info,report")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each command this many times, now and before interleaved; the figures are the medians",
    )
    args = ap.parse_args()
    names = args.traces.split(",")
    paths = {}
    for name in names:
        t0 = time.perf_counter()
        if name == "sparse":
            path = os.path.join(args.cache, "sparse-10k-10k.db")
            if not os.path.exists(path):
                os.makedirs(args.cache, exist_ok=True)
                tracegen.sparse(path)
        else:
            path = tracegen.cached(args.cache, **TRACES[name])
        paths[name] = path
        print(f"{name:6s} {path}: {os.path.getsize(path) / 1e6:.1f} MB (ready in {time.perf_counter() - t0:.0f} s)")
    load = os.getloadavg()[0]
    yard = calibrate(paths["1M"]) if "1M" in paths else None
    print(
        f"load average {load:.1f} on {os.cpu_count()} cores"
        + (f"; 10^6-row SQLite column read {yard:.2f} s CPU" if yard else "")
    )
    rows, figures = [], []
    for name, path in paths.items():
        for cmd in args.commands.split(","):
            if name == "sparse" and cmd != "diagnose":
                continue
            nows, befores, size = [], [], None
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory() as d:
                    argv = [cmd, path] + (["-o", os.path.join(d, "r.html")] if cmd == "report" else [])
                    nows.append(measure(argv, ROOT, args.timeout))
                    if cmd == "report" and nows[-1]["rc"] == 0:
                        size = os.path.getsize(os.path.join(d, "r.html")) / 1e6
                    if args.before:
                        befores.append(measure(argv, os.path.abspath(args.before), args.timeout))
            now = median(nows)
            before = median(befores) if befores else None
            target = TARGETS.get((name, cmd), (None, None))
            ok = (
                now["rc"] == 0
                and (target[0] is None or now["wall_s"] <= target[0])
                and (target[1] is None or now["rss_mb"] <= target[1])
            )
            line = (
                f"{name:6s} {cmd:8s} wall {now['wall_s']:7.2f} s  cpu {now['cpu_s']:7.2f} s "
                f"(user {now['user_s']:.2f})  "
                f"rss {now['rss_mb']:7.0f} MB"
                + (f"  html {size:.1f} MB" if size is not None else "")
                + f"  target {target[0] or '-'} s / {target[1] or '-'} MB: {'ok' if ok else 'MISSED'}"
                + ("" if now["rc"] == 0 else f"  (exit {now['rc']}: {now['last']})")
            )
            if before is not None:
                line += (
                    f"  | before: cpu {before['cpu_s']:.1f} s (user {before['user_s']:.2f}), "
                    f"rss {before['rss_mb']:.0f} MB"
                    + (" (timed out)" if before["timed_out"] else "")
                    + f", cpu ratio {before['cpu_s'] / max(now['cpu_s'], 1e-9):.1f}x"
                )
            print(line, flush=True)
            rows.append(line)
            figures.append({"trace": name, "command": cmd, **now, "html_mb": size, "before": before})
    if "20k" in paths and os.path.exists(BEFORE_FINDINGS):
        got = subprocess.run(
            [sys.executable, "-m", "ampdoctor", "diagnose", "--json", paths["20k"]],
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        with open(BEFORE_FINDINGS) as f:
            same = json.loads(got.stdout) == json.load(f)
        print(f"20k findings equal to the code before the rework's: {'yes' if same else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "column_read_s": yard, "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
