"""A long run (10,000 steps): every figure the dashboard sends stays under the point budget."""

import json
import sqlite3

import numpy as np
import pytest
from ampdoctor.dashboards import data, figures
from ampdoctor.dashboards.app import create_app
from ampdoctor.dashboards.pages import layer, layers, overview, whatif

from ampdoctor.trace import schema

N_STEPS, N_SITES = 10_000, 100


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A synthetic trace in the documented format: peaks every step, full statistics every 10th, a few skips."""
    path = tmp_path_factory.mktemp("long") / "long.db"
    conn = sqlite3.connect(path, isolation_level=None)
    schema.create(conn)
    rng = np.random.default_rng(0)
    conn.execute("BEGIN")
    meta = {
        "run": {"model": "Long", "params": 1, "device": "cpu", "every": 10},
        "config": {
            "autocast": {"enabled": True, "dtype": "float16"},
            "param_dtypes": {"float32": 1},
            "scaler": {
                "class": "GradScaler",
                "enabled": True,
                "init_scale": 65536.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
            },
        },
        "closed": {"steps": N_STEPS},
    }
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
    conn.executemany(
        "INSERT INTO sites VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (i, f"blocks.{i // 2}", f"blocks.{i // 2}", ("act", "grad_out")[i % 2], "Linear", "float16", "8x8", 0)
            for i in range(N_SITES)
        ],
    )
    skipped = rng.random(N_STEPS) < 0.01
    scale = 65536.0 * 0.5 ** np.cumsum(np.r_[0, skipped[:-1]])
    first = [f for f in schema.STEP_FIELDS if f not in schema.LATER_STEP_FIELDS]  # (as traces before the tiers)
    conn.executemany(
        f"INSERT INTO steps ({', '.join(first)}) VALUES ({', '.join('?' * 16)})",
        [
            (
                s,
                float(s),
                0.1,
                0.01,
                8,
                80.0,
                float(rng.random()),
                "[0.01]",
                float(scale[s]),
                float(scale[s] / 2 if skipped[s] else scale[s]),
                int(skipped[s]),
                1.0,
                1,
                None,
                0,
                int(skipped[s]),
            )
            for s in range(N_STEPS)
        ],
    )
    base = rng.random(N_SITES).astype("<f4") * 100
    conn.executemany(
        "INSERT INTO peaks VALUES (?, ?)",
        [(s, (base * (1 + rng.random(N_SITES))).astype("<f4").tobytes()) for s in range(N_STEPS)],
    )
    fields = ", ".join(schema.STATS_FIELDS)
    conn.executemany(
        f"INSERT INTO stats (step, site, scale, calls, {fields}) VALUES ({', '.join('?' * 18)})",
        [
            (
                s,
                i,
                1.0,
                1,
                64.0,
                0.0,
                0.0,
                1.0,
                float(base[i]),
                1e-3,
                0.0,
                1.0,
                0.0,
                0.0,
                float(rng.integers(0, 64)),
                0.0,
                0.0,
                0.0,
            )
            for s in range(0, N_STEPS, 10)
            for i in range(N_SITES)
        ],
    )
    conn.execute("COMMIT")
    conn.close()
    return path


def _max_points(fig) -> int:
    fig = fig.to_plotly_json() if hasattr(fig, "to_plotly_json") else fig
    out = 0
    for t in fig.get("data", []):
        x = t.get("x")
        if x is not None and t.get("type") != "heatmap":
            out = max(out, len(x))
    return out


def test_every_view_of_a_long_run_stays_under_the_point_budget(long_run):
    ctx = create_app(str(long_run.parent)).ampdoctor
    search = "?run=long.db&site=1"
    version = {"run": "long.db", "n": N_STEPS}
    _, _, _, *figs = overview.update(ctx, version, search)
    _, _hist, series, _ = layer.update(ctx, version, search)
    figs += [series, whatif.update(ctx, 1024, 100, 2.0, 0.5, version, search)[0]]
    for fig in figs:
        assert 0 < _max_points(fig) <= figures.MAX_POINTS < 10_000
    for stat in data.STATS:
        heat, _ = layers.update(ctx, "grad_out", stat, "worst", version, search)
        z = heat.data[0].z
        assert np.asarray(z).size <= figures.MAX_CELLS and len(heat.data[0].x) <= 600
