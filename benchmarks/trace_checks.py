"""What the reader's checks at open cost on a long, wide trace: the checks of a given git revision against the
working tree's, side by side in one run (these machines are noisy: compare the ratio, not the seconds).

The trace is generated with plain SQL (a valid trace, every row as the writer lays it out): STEPS steps, SITES sites
per kind, full statistics every FULL_EVERY steps, peaks every PEAK_EVERY steps. Run:
    .venv/bin/python benchmarks/trace_checks.py [--steps 1000000] [--sites 1000] [--base 75e4ff3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ampdoctor.trace import checks, schema

ROOT = os.path.join(os.path.dirname(__file__), "..")


def generate(path: str, steps: int, sites: int, full_every: int, peak_every: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    schema.create(conn)
    conn.execute("BEGIN")
    conn.execute("INSERT INTO meta VALUES ('run', ?)", (json.dumps({"rank": 0, "world_size": 1, "every": full_every}),))
    conn.execute("INSERT INTO meta VALUES ('config', ?)", (json.dumps({"scaler": {"growth_interval": 2000}}),))
    kinds = ("act", "grad_out", "param_grad")
    conn.executemany(
        "INSERT INTO sites VALUES (?, ?, ?, ?, 'Linear', 'float16', '256x512', 0)",
        [(i, f"blocks.{i // len(kinds)}", f"blocks.{i // len(kinds)}", kinds[i % len(kinds)]) for i in range(sites)],
    )
    rng = np.random.default_rng(0)
    chunk = 100_000
    for lo in range(0, steps, chunk):
        n = min(chunk, steps - lo)
        loss = rng.random(n)
        conn.executemany(
            "INSERT INTO steps VALUES (?, ?, 0.1, 0.01, 256, 2560.0, ?, '[0.001]', 65536.0, 65536.0, 0, 1.0, 1, "
            "NULL, ?, 0, 'sampled', 0.5, 0.001)",
            [(s, 1.7e9 + s, float(loss[s - lo]), 1 if s % full_every == 0 else -1) for s in range(lo, lo + n)],
        )
    blob = rng.random(sites, dtype=np.float32).astype("<f4").tobytes()
    conn.executemany("INSERT INTO peaks VALUES (?, ?)", [(s, blob) for s in range(0, steps, peak_every)])
    row = (1.0, 1, 131072.0, 0.0, 0.0, 12.0, 3.5, 1e-6, 0.01, 0.5, 0.0, 100.0, 3.0, 0.0, 0.0, 0.0)
    for s in range(0, steps, full_every):
        conn.executemany(
            f"INSERT INTO stats VALUES (?, ?, {', '.join('?' * len(row))})", [(s, i, *row) for i in range(sites)]
        )
    conn.execute("COMMIT")
    conn.close()


def load_checks(rev: str):
    """ampdoctor/trace/checks.py as it was at ``rev`` (imported as a module of its own)."""
    text = subprocess.run(
        ["git", "show", f"{rev}:ampdoctor/trace/checks.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "checks_base.py")
    with open(path, "w") as f:
        f.write(text.replace("from . import schema", "from ampdoctor.trace import schema"))
    spec = importlib.util.spec_from_file_location("checks_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn, path: str) -> float:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        t0 = time.perf_counter()
        fn(conn)
        return time.perf_counter() - t0
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--sites", type=int, default=1000)
    ap.add_argument("--full-every", type=int, default=1000)
    ap.add_argument("--peak-every", type=int, default=100)
    ap.add_argument(
        "--base", default="75e4ff3", help="git revision whose checks.py to compare with (default: before ranges)"
    )
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "long.db")
    t0 = time.perf_counter()
    generate(path, args.steps, args.sites, args.full_every, args.peak_every)
    print(
        f"trace: {args.steps:,} steps, {args.sites:,} sites, statistics every {args.full_every} steps, "
        f"{os.path.getsize(path) / 2**20:.0f} MB (generated in {time.perf_counter() - t0:.0f} s)"
    )
    base = load_checks(args.base)
    timed(checks.check_tables, path)  # the file into the page cache
    old, new = [], []
    for _ in range(args.repeat):  # interleaved: both see the same machine
        old.append(timed(base.check_tables, path))
        new.append(timed(checks.check_tables, path))
    o, n = min(old), min(new)
    print(f"checks at open, {args.base:>8s}: {o:7.2f} s (best of {args.repeat})")
    print(f"checks at open, this tree: {n:7.2f} s  ratio {n / o:.2f}")


if __name__ == "__main__":
    main()
