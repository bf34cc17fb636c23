"""A synthetic trace in the documented format, at the default tiers, for the dashboard and report benchmark.

Minimal on purpose (the `scale` branch writes the general generator, benchmarks/tracegen.py): a model of
``modules`` blocks' modules (Linear, LayerNorm, GELU under ``encoder.layers.{i}``) with an activation and an
output-gradient site each, plus parameter-gradient sites; every step has the sentinel's figures (loss, loss scale
with GradScaler's rule, skipped and non-finite steps, times, gradient norm), peaks every 10th step, full statistics
every 100th and histograms every 200th (and the first 10 steps in full, as the calibration tier does). A few
skipped steps, one non-finite burst and one loss spike, so that every view has something to show.

    python benchmarks/dash_tracegen.py OUT.db --steps 1000000 --sites 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ampdoctor.trace import schema

PEAK_EVERY, EVERY, HIST_EVERY, CALIBRATION = 10, 100, 200, 10
CHUNK = 20_000  # steps per transaction
_SUBS = (("q", "Linear"), ("k", "Linear"), ("v", "Linear"), ("o", "Linear"), ("ln", "LayerNorm"), ("act", "GELU"))


def site_table(n_sites: int) -> list[tuple]:
    """(id, path, module, kind, module_type, dtype, shape, first_step) rows: act + grad_out per module, then the
    parameter gradients of the Linear modules until there are ``n_sites`` rows."""
    n_mod = max(1, (n_sites * 4) // 10)
    mods = [
        (f"encoder.layers.{i // len(_SUBS)}.{_SUBS[i % len(_SUBS)][0]}", _SUBS[i % len(_SUBS)][1]) for i in range(n_mod)
    ]
    rows = []
    for path, mtype in mods:
        dtype = "float32" if mtype == "LayerNorm" else "float16"
        for kind in ("act", "grad_out"):
            rows.append((len(rows), path, path, kind, mtype, dtype, "32x512", 0))
    linear = [p for p, t in mods if t == "Linear"]
    i = 0
    while len(rows) < n_sites:
        p = linear[i % len(linear)] + (".weight" if i < len(linear) else f".extra{i}")
        rows.append((len(rows), p, linear[i % len(linear)], "param_grad", None, "float32", "512x512", 0))
        i += 1
    return rows[:n_sites]


def level(step: int) -> int:
    if step < CALIBRATION or step % HIST_EVERY == 0:
        return schema.LEVEL_HIST
    if step % EVERY == 0:
        return schema.LEVEL_FULL
    if step % PEAK_EVERY == 0:
        return schema.LEVEL_PEAK
    return schema.LEVEL_SENTINEL


def generate(path: str, n_steps: int, n_sites: int, seed: int = 0) -> str:
    if os.path.exists(path):
        raise SystemExit(f"{path} exists; not overwritten")
    rng = np.random.default_rng(seed)
    conn = sqlite3.connect(path, isolation_level=None)
    schema.create(conn)
    conn.execute("PRAGMA synchronous=OFF")
    sites = site_table(n_sites)
    kinds = np.array([s[3] for s in sites])
    meta = {
        "run": {
            "model": "SyntheticEncoder",
            "params": 10_000_000,
            "device": "cpu",
            "every": EVERY,
            "hist_every": HIST_EVERY,
        },
        "config": {
            "autocast": {"enabled": True, "dtype": "float16", "device_type": "cpu"},
            "param_dtypes": {"float32": 10_000_000},
            "loss_dtype": "float32",
            "optimizer": {"class": "AdamW", "groups": [{"lr": 1e-3}]},
            "scaler": {
                "class": "GradScaler",
                "enabled": True,
                "init_scale": 65536.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
            },
        },
        "closed": {"steps": n_steps, "time": 0.0},
    }
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
    conn.executemany("INSERT INTO sites VALUES (?, ?, ?, ?, ?, ?, ?, ?)", sites)
    conn.execute("COMMIT")
    # per-site magnitudes: activations ~2^0..2^6, output gradients (scaled) ~2^-4..2^4, parameter gradients small
    base = np.where(
        kinds == "act",
        rng.uniform(0, 6, n_sites),
        np.where(kinds == "grad_out", rng.uniform(-4, 4, n_sites), rng.uniform(-20, -8, n_sites)),
    )
    ids = np.arange(n_sites)
    lo = np.floor(base).astype(int) - 20
    pool = [np.bincount(rng.integers(0, 20, 4096), minlength=20).astype("<i8").tobytes() for _ in range(64)]
    scale, good = 65536.0, 0
    late = np.arange(min(100, n_steps // 2), n_steps)  # a few skipped steps after the calibration
    skip_at = set(rng.choice(late, size=max(1, n_steps // 5000), replace=False).tolist()) if len(late) else set()
    burst = (n_steps * 2 // 3, n_steps * 2 // 3 + 5)  # five non-finite steps
    spike = n_steps // 3
    t = 0.0
    for c0 in range(0, n_steps, CHUNK):
        c1 = min(n_steps, c0 + CHUNK)
        steps, peaks, stats, hists = [], [], [], []
        for s in range(c0, c1):
            bad = burst[0] <= s < burst[1]
            skipped = bad or s in skip_at
            loss = float("nan") if bad else 2.0 / (1 + s / 5000) + 0.05 * rng.random() + (5.0 if s == spike else 0)
            nxt = scale * 0.5 if skipped else scale
            good = 0 if skipped else good + 1
            if good >= 2000:
                nxt, good = scale * 2, 0
            dt = 0.1 + 0.01 * rng.random()
            t += dt
            lv = level(s)
            steps.append(
                (
                    s,
                    t,
                    dt,
                    0.01,
                    32,
                    320.0,
                    None if bad else loss,
                    "[0.001]",
                    scale,
                    nxt,
                    int(skipped),
                    None if bad else 1.0 + rng.random(),
                    1,
                    None,
                    lv,
                    int(bad),
                    "calibration" if s < CALIBRATION else ("sampled" if lv >= 0 else "sentinel"),
                    1.0,
                    0.001,
                )
            )
            if lv >= schema.LEVEL_PEAK:
                p = (2.0 ** (base + rng.normal(0, 0.3, n_sites))).astype("<f4")
                if bad:
                    p[:5] = np.inf
                peaks.append((s, p.tobytes()))
            if lv >= schema.LEVEL_FULL:
                e = base + rng.normal(0, 0.3, n_sites)
                am = 2.0**e
                under = np.round(np.clip((-14 - (e - 12)) / 12, 0, 1) * 4096)  # counts are whole numbers
                z = np.zeros(n_sites)
                cols = (
                    np.full(n_sites, s),
                    ids,
                    np.full(n_sites, scale),
                    np.ones(n_sites, int),
                    np.full(n_sites, 4096.0),
                    z,
                    z,
                    z,
                    am,
                    am * 1e-4,
                    z,
                    am / 8,
                    z,
                    np.round(under * 0.8),
                    under - np.round(under * 0.8),
                    z,
                    z,
                    z,
                )
                stats.extend(zip(*(c.tolist() for c in cols)))
            if lv == schema.LEVEL_HIST:
                hists.extend((s, i, int(lo[i]), pool[(s // HIST_EVERY + i) % len(pool)]) for i in range(n_sites))
            scale = nxt
        conn.execute("BEGIN")
        conn.executemany(f"INSERT INTO steps VALUES ({', '.join('?' * len(schema.STEP_FIELDS))})", steps)
        conn.executemany("INSERT INTO peaks VALUES (?, ?)", peaks)
        conn.executemany(f"INSERT INTO stats VALUES ({', '.join('?' * 18)})", stats)
        conn.executemany("INSERT INTO hists VALUES (?, ?, ?, ?)", hists)
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--sites", type=int, default=1010)
    args = ap.parse_args()
    t0 = time.perf_counter()
    generate(args.out, args.steps, args.sites)
    print(
        f"wrote {args.out}: {args.steps} steps x {args.sites} sites, {os.path.getsize(args.out) / 2**20:.1f} MB "
        f"in {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
