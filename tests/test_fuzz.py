"""Hostile or broken trace files: a few hundred malformed traces made from a real one (random corruption of its
tables and columns) must each give one line on stderr and exit 2 from every command, and a TraceError from
``ampdoctor.load``, in bounded time and memory; never a traceback, a hang or a 22 GiB allocation."""

import contextlib
import io
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.cli import main as cli_main

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
TABLES = ("meta", "sites", "steps", "peaks", "stats", "hists", "events", "metrics")
COMMANDS = ("info", "layers", "diagnose", "replay", "report")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A real trace with a row in every table: FP16 + GradScaler starting too high (skipped steps, non-finite
    events), full statistics and histograms every other step, a logged metric."""
    from runs import every_table_trace

    path = every_table_trace(str(tmp_path_factory.mktemp("fuzz") / "base.db"))
    c = sqlite3.connect(path)
    assert all(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES)
    c.close()
    return path


# -- corruptions: each one breaks the format; the reader must notice ----------------------------------------------
NUMERIC = {
    "steps": [
        "time",
        "step_time",
        "data_time",
        "samples",
        "samples_per_s",
        "loss",
        "loss_scale",
        "loss_scale_next",
        "skipped",
        "grad_norm",
        "microbatches",
        "peak_mem",
        "level",
        "nonfinite",
    ],
    "stats": [
        "scale",
        "calls",
        "numel",
        "nan",
        "inf",
        "zeros",
        "absmax",
        "minabs",
        "mean",
        "rms",
        "fp16_over",
        "fp16_sub",
        "fp16_flush",
        "bf16_over",
        "bf16_sub",
        "bf16_flush",
    ],
    "metrics": ["value", "time"],
    "sites": ["first_step"],
}
TEXT = {
    "sites": ["path", "module", "kind", "module_type", "dtype", "shape"],
    "events": ["kind", "phase", "message"],
    "metrics": ["name"],
    "meta": ["key", "value"],
}
NOT_NUMBERS = ["'garbage'", "x'0102'", "'1 2'"]
NOT_TEXT = ["x'00ff'", "x'41'", "zeroblob(3)"]  # (a number would be stored as text: TEXT affinity)
BAD_JSON = ['{"a": ', "[" * 200000, "{" * 5000, "nan", '"\\ud800', "[1, 2"]
BAD_LR = ["'{}'", "'5'", "'[\"a\"]'", "'[[1]]'", "'[{\"lr\": 1}]'"]
BAD_META = {
    "run": [{"params": "many"}, {"model": 5}, {"every": None}, 7, [1]],
    "config": [
        {"autocast": 5},
        {"scaler": {"init_scale": "big"}},
        {"optimizer": {"groups": 7}},
        {"optimizer": {"groups": [{"lr": "fast"}]}},
        {"param_dtypes": {"float16": "many"}},
        {"module_param_dtypes": [1]},
        {"loss_dtype": 16},
        {"scaler": {"enabled": "yes"}},
    ],
    "closed": [{"steps": []}, "done"],
}
BAD_EVENT_DATA = ["'5'", "'[1]'", "'{\"value\": 3}'", '\'{"params": "a"}\'', '\'{"count": "x"}\'']
BAD_IDS = [
    ("stats", "site", ["1000000000", "-1", "2.5", "'a'"]),
    ("stats", "step", ["-3", "'x'", "1.5", "1000000"]),
    ("hists", "site", ["99999", "-2"]),
    ("hists", "lo", ["500", "-1000", "120", "'lo'", "1.5"]),
    ("hists", "step", ["-1", "'s'", "6"]),
    ("peaks", "step", ["1000000", "-1"]),
    ("events", "site", ["99999", "-5", "'x'"]),
    ("events", "step", ["-1", "'s'"]),
    ("metrics", "step", ["-2", "'s'"]),
]
BAD_BLOBS = [
    ("peaks", "data", ["'text'", "x'010203'", "42", "2.5"]),
    ("hists", "counts", ["'text'", "x'01020304050607'", "x''", "7"]),
]


def _where(c, table, rng) -> str:
    """A WHERE clause naming one existing row (tables without a rowid by their primary key)."""
    if table in ("stats", "hists", "probes"):  # WITHOUT ROWID: by their key
        step, site = rng.choice(c.execute(f"SELECT step, site FROM {table}").fetchall())
        return f"step = {step} AND site = {site}"
    if table == "meta":
        return f"key = '{rng.choice([r[0] for r in c.execute('SELECT key FROM meta')])}'"
    return f"rowid = {rng.choice([r[0] for r in c.execute(f'SELECT rowid FROM {table}')])}"


def corrupt(c: sqlite3.Connection, rng: random.Random) -> str:
    """Apply one random corruption; returns what it did."""
    kind = rng.choice(
        ["number", "text", "json", "lr", "meta", "event", "id", "blob", "dense", "drop", "view", "recursive", "column"]
    )
    if kind == "number":
        table = rng.choice(list(NUMERIC))
        col, value = rng.choice(NUMERIC[table]), rng.choice(NOT_NUMBERS)
    elif kind == "text":
        table = rng.choice(list(TEXT))
        col, value = rng.choice(TEXT[table]), rng.choice(NOT_TEXT + (["'bogus'"] if table == "sites" else []))
        if table == "sites" and col != "kind" and value == "'bogus'":
            value = "x'00'"
    elif kind == "json":
        table, col = rng.choice([("steps", "lr"), ("events", "data"), ("meta", "value")])
        value = "'" + rng.choice(BAD_JSON) + "'"
    elif kind == "lr":
        table, col, value = "steps", "lr", rng.choice(BAD_LR)
    elif kind == "meta":
        key = rng.choice(list(BAD_META))
        current = json.loads(c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])
        bad = rng.choice(BAD_META[key])
        new = {**current, **bad} if isinstance(bad, dict) else bad
        c.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(new), key))
        return f"meta {key} = {json.dumps(bad)[:60]}"
    elif kind == "event":
        table, col, value = "events", "data", rng.choice(BAD_EVENT_DATA)
    elif kind == "id":
        table, col, values = rng.choice(BAD_IDS)
        value = rng.choice(values)
        if table == "hists" and value == "120":  # a span that runs past binade 127
            c.execute(f"UPDATE hists SET lo = 120, counts = zeroblob(80) WHERE {_where(c, 'hists', rng)}")
            return "hists span 120..129"
    elif kind == "blob":
        table, col, values = rng.choice(BAD_BLOBS)
        value = rng.choice(values)
    elif kind == "dense":
        table, col = rng.choice([("sites", "id"), ("steps", "step")])
        big = rng.choice([3_000_000_000, 10**6, -1])
        c.execute(f"UPDATE {table} SET {col} = {big} WHERE {col} = (SELECT max({col}) FROM {table})")
        return f"{table}.{col} = {big}"
    elif kind == "drop":
        table = rng.choice(TABLES)
        c.execute(f"DROP TABLE {table}")
        return f"dropped {table}"
    elif kind in ("view", "recursive"):
        table = rng.choice(TABLES)
        c.execute(f"ALTER TABLE {table} RENAME TO {table}_old")
        if kind == "view":
            c.execute(f"CREATE VIEW {table} AS SELECT * FROM {table}_old")
        else:  # endless rows: any query over it never returns
            c.execute(
                f"CREATE VIEW {table} AS WITH RECURSIVE r(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM r) "
                f"SELECT {table}_old.* FROM r, {table}_old"
            )
        return f"{table} replaced by a {'recursive ' if kind == 'recursive' else ''}view"
    else:  # a column dropped (one that SQLite lets go: not a key, not indexed)
        table, col = rng.choice(
            [
                ("steps", "loss"),
                ("steps", "lr"),
                ("stats", "rms"),
                ("sites", "dtype"),
                ("events", "data"),
                ("metrics", "time"),
                ("hists", "counts"),
                ("peaks", "data"),
            ]
        )
        try:
            c.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
        except sqlite3.OperationalError:  # NOT NULL / key columns cannot be dropped: drop the table
            c.execute(f"DROP TABLE {table}")
            return f"dropped {table}"
        return f"dropped column {table}.{col}"
    c.execute(f"UPDATE {table} SET {col} = {value} WHERE {_where(c, table, rng)}")
    return f"{table}.{col} = {value[:40]}"


def _make(base: str, path: str, rng: random.Random) -> str:
    with open(base, "rb") as f, open(path, "wb") as g:
        g.write(f.read())
    c = sqlite3.connect(path, isolation_level=None)
    try:
        return corrupt(c, rng)
    finally:
        c.close()


def _cli(args) -> tuple[int, str, float]:
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(args)
        except SystemExit as exc:  # argparse --help and the like: not expected here
            rc = exc.code
    return rc, err.getvalue(), time.perf_counter() - t0


def _args(cmd: str, path: str) -> list:
    return [cmd, path] + (["-o", path + ".html"] if cmd == "report" else [])


@pytest.mark.timeout(240)
def test_a_few_hundred_malformed_traces_give_one_line_and_exit_2(tmp_path, base):
    rng = random.Random(20260101)
    seen_kinds, per_command = set(), dict.fromkeys(COMMANDS, 0)
    for i in range(300):
        path = str(tmp_path / f"bad{i}.db")
        what = _make(base, path, rng)
        seen_kinds.add(what.split(" ")[0])
        t0 = time.perf_counter()
        with pytest.raises(ampdoctor.TraceError) as info:
            tr = ampdoctor.load(path)  # if it opened, its views must say what is wrong
            tr.meta, tr.config, tr.steps(), tr.sites(), tr.events(), tr.metrics(), tr.full_steps()
            for field in ("peak", "numel", "rms"):
                tr.records(field, "grad_out")
            tr.hist(0)
        assert "\n" not in str(info.value) and path in str(info.value), what
        assert time.perf_counter() - t0 < 10, what
        for cmd in (COMMANDS[i % 5], COMMANDS[(i + 2) % 5]):  # every command meets 120 of them
            rc, err, took = _cli(_args(cmd, path))
            assert rc == 2 and err.count("\n") == 1 and err.startswith("ampdoctor"), (what, cmd, err[-500:])
            assert took < 10, (what, cmd, took)
            per_command[cmd] += 1
        assert not os.path.exists(path + ".html"), what
    assert min(per_command.values()) >= 100
    assert len(seen_kinds) > 20  # the corruptions were varied


LIMITED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))     # a 22 GiB allocation fails at once
from ampdoctor.cli import main
codes = []
for cmd in ("info", "layers", "diagnose", "replay", "report"):
    t0 = time.time()
    codes.append(main([cmd, sys.argv[1]] + (["-o", sys.argv[1] + ".html"] if cmd == "report" else [])))
    assert time.time() - t0 < 20, cmd
print(codes)
"""


@pytest.mark.parametrize(
    "sql, message",
    [
        (
            "UPDATE sites SET id = 3000000000 WHERE id = (SELECT max(id) FROM sites WHERE kind = 'grad_out')",
            "sites: id runs",
        ),
        (
            "ALTER TABLE steps RENAME TO steps_old; CREATE VIEW steps AS WITH RECURSIVE r(x) AS (SELECT 0 UNION ALL "
            "SELECT x + 1 FROM r) SELECT steps_old.* FROM r, steps_old",
            "steps is a view",
        ),
        ("UPDATE meta SET value = '" + "[" * 200000 + "' WHERE key = 'config'", "nested deeper"),
    ],
)
def test_in_a_real_process_with_memory_limited(tmp_path, base, sql, message):
    """The three that crashed or hung before, run as the command line runs (a process with 3 GiB of address
    space and a time limit): a site id of 3e9 (a 22 GiB array), a recursive view, 200,000-deep JSON."""
    path = str(tmp_path / "bad.db")
    with open(base, "rb") as f, open(path, "wb") as g:
        g.write(f.read())
    c = sqlite3.connect(path, isolation_level=None)
    c.executescript(sql)
    c.close()
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIMITED), path], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout.split() == ["[2,", "2,", "2,", "2,", "2]"], out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 5 and all(line.startswith("ampdoctor") and message in line for line in lines), lines


# -- values of the right type, out of range: the reader accepts or refuses them, no command raises --------------------
INF, NAN = float("inf"), float("nan")
SQL_NUMBERS = [  # SQL literals of numbers a column of numbers takes; 9e999 is SQLite's +Inf
    "0",
    "-1",
    "-0.0",
    "0.5",
    "1e308",
    "-1e308",
    "5e-324",
    "1e-300",
    "9007199254740993",
    "4611686018427387904",
    "9223372036854775807",
    "-9223372036854775808",
    "9e999",
    "-9e999",
    "NULL",
    "'nan'",
    "'inf'",
    "'-inf'",
]
SQL_INTEGERS = ["0", "-1", "1", "2147483648", "9007199254740993", "9223372036854775807", "-9223372036854775808"]
SQL_TEXTS = [
    "''",
    "'x'",
    "NULL",
    "'(model)'",
    "'float8_e4m3fn'",
    "'bogus'",
    "'[]'",
    "'[-1]'",
    "'[1e308]'",
    "'['",
    "'" + "a" * 5000 + "'",
    "'0x0'",
]
PY_NUMBERS = [0, -1, 0.5, 2, 1e300, -1e308, 5e-324, INF, -INF, NAN, 2**63 - 1, -(2**63), 10**15, 10**30]
PY_INTEGERS = [0, -1, 1, 2**31, 10**15, 2**63 - 1, -(2**63), 10**30]
COLUMN_VALUES = {  # table -> {column: SQL literals}
    "steps": {c: SQL_NUMBERS for c in NUMERIC["steps"] + ["grad_max", "observer_time"]}
    | {
        "lr": ["'[]'", "'[1e308]'", "'[-1]'", "'[0]'", "'[null]'", "'[1, 1e308, -1e308]'", "NULL"],
        "reason": ["''", "NULL", "'bogus'", "'" + "r" * 5000 + "'"],
    },
    "stats": {c: [v for v in SQL_NUMBERS if v[0] != "'"] for c in NUMERIC["stats"]},
    "metrics": {
        "value": SQL_NUMBERS,
        "time": [v for v in SQL_NUMBERS if v[0] != "'"],
        "step": ["NULL", "0", "9223372036854775807"],
        "name": ["''", "'x'", "'" + "m" * 5000 + "'"],
    },
    "sites": {
        "module_type": SQL_TEXTS,
        "dtype": SQL_TEXTS,
        "shape": SQL_TEXTS,
        "path": SQL_TEXTS[:2] + SQL_TEXTS[3:],
        "module": SQL_TEXTS[:2] + SQL_TEXTS[3:],
        "first_step": ["NULL", "-1", "0", "9223372036854775807"],
    },
    "events": {
        "step": ["NULL", "0", "9223372036854775807"],
        "site": ["NULL", "0"],
        "phase": SQL_TEXTS,
        "message": SQL_TEXTS,
        "kind": ["'nonfinite'", "'nonfinite_unknown'", "'nonfinite_weights'", "'probe'", "''", "'bogus'"],
        "data": [
            "NULL",
            "'{}'",
            '\'{"value": ""}\'',
            "'{\"after\": -1}'",
            "'{\"after\": 9223372036854775807}'",
            "'{\"count\": -1}'",
            "'{\"count\": 0}'",
            "'{\"count\": 9223372036854775807}'",
            "'{\"params\": []}'",
            "'{\"skipped\": 5}'",
            '\'{"value": "-inf", "after": 0, "count": 2, "params": [""]}\'',
        ],
    },
    "hists": {
        "counts": ["zeroblob(2040)", "x'" + "ffffffffffffff3f" * 255 + "'", "x'0100000000000000'"],
        "lo": ["-127", "127"],
    },
    "probes": {
        **{c: ["0", "-1", "9223372036854775807", "NULL", "0.5"] for c in ("calls", "k", "numel")},
        **{c: [v for v in SQL_NUMBERS if v != "'-inf'"] for c in ("rel_err", "max_err", "ref_norm", "ref_absmax")},
        "dtype": SQL_TEXTS,
    },
    "peaks": {
        "data": [
            "x''",
            "x'0000807f'",
            "x'0000c07f'",
            "x'000080ff'",
            "x'000080bf'",
            "x'ffff7f7f'",
            "x'01000000'",
            "zeroblob(4000)",
            "x'" + "0000807f" * 64 + "'",
        ]
    },
}
META_VALUES = {  # meta key -> {JSON path: Python values of the right type}
    "run": {
        "every": PY_INTEGERS,
        "hist_every": PY_INTEGERS,
        "weight_every": PY_INTEGERS,
        "peak_every": PY_INTEGERS,
        "rank": PY_INTEGERS,
        "world_size": PY_INTEGERS,
        "params": PY_INTEGERS,
        "pid": PY_INTEGERS,
        "threads": PY_INTEGERS,
        "cpu_count": PY_INTEGERS + [None],
        "calibration": PY_INTEGERS,
        "started": PY_NUMBERS,
        "capability": [[], [-1], [10**18, 0], [9, 0, 1]],
        "model": ["", "x" * 5000],
        "device": ["", "cuda:99", "meta"],
        "mode": ["", "bogus", "debug"],
        "device_name": [""],
        "run_id": ["", None, 5],
    },
    "config": {
        "scaler.growth_interval": [0, -1, 1, INF, NAN, 1e300, 0.5, 2**63 - 1, 10**30],
        "scaler.growth_factor": [0.5, 1, 0, -2, INF, NAN, 1e300, 5e-324],
        "scaler.backoff_factor": [2, 1, 0, -0.5, NAN, INF, 5e-324],
        "scaler.init_scale": [INF, NAN, 0, -1, 5e-324, 1e300, 2**63 - 1],
        "scaler.enabled": [False],
        "scaler.class": ["", "ShardedGradScaler"],
        "autocast.dtype": ["", "float8_e4m3fn", "bfloat16", "float64", None],
        "autocast.device_type": ["", "xla", None],
        "autocast.enabled": [False, True],
        "param_dtypes": [{}, {"float16": -1}, {"float16": 10**30}, {"": 1}, {"bogus": 0}],
        "module_param_dtypes": [{}, {"0": "bogus"}, {"": "float16"}],
        "loss_dtype": ["", "float64", "int64", None],
        "boundary": ["", "bogus"],
        "optimizer.groups": [[], [{}], [{"lr": INF}], [{"lr": NAN}], [{"lr": -1}], [{"lr": 1e308}]],
        "optimizer.class": [""],
    },
    "closed": {"steps": PY_INTEGERS, "time": PY_NUMBERS},
}


def out_of_range(c: sqlite3.Connection, rng: random.Random) -> str:
    """Set one value to something of its column's type but out of its range; returns what it did."""
    if rng.random() < 0.3:
        key = rng.choice(list(META_VALUES))
        path = rng.choice(list(META_VALUES[key]))
        value = rng.choice(META_VALUES[key][path])
        doc = json.loads(c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])
        *parents, leaf = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        c.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(doc), key))
        return f"meta {key}.{path} = {json.dumps(value)[:40]}"
    table = rng.choice([t for t in COLUMN_VALUES if c.execute(f"SELECT EXISTS (SELECT 1 FROM {t})").fetchone()[0]])
    col = rng.choice(list(COLUMN_VALUES[table]))
    value = rng.choice(COLUMN_VALUES[table][col])
    where = _where(c, table, rng) if rng.random() < 0.7 else "1"  # one row, or every row
    try:
        c.execute(f"UPDATE {table} SET {col} = {value} WHERE {where}")
    except sqlite3.IntegrityError:  # two sites of one path and kind: the format's own key refuses it
        return out_of_range(c, rng)
    return f"{table}.{col} = {value[:40]}" + (" (every row)" if where == "1" else "")


@pytest.fixture(scope="module")
def long_base(tmp_path_factory):
    """A longer real trace: 24 steps (enough for the rules that skip warm-up steps and need a few more), the
    precision-loss probe every 4 steps, a metric every step, FP16 + GradScaler from 2^20 (skips at the start)."""
    from runs import mlp, train

    path = str(tmp_path_factory.mktemp("fuzz") / "long.db")
    train(
        mlp(width=16, depth=2),
        24,
        init_scale=2.0**20,
        trace=path,
        attach_options={"every": 3, "hist_every": 3, "weight_every": 3, "probe_every": 4, "live": False},
        on_step=lambda step, model, doc: doc.log_metric("val/loss", 1.0 / (step + 1)),
    )
    return path


def _mutated(base: str, path, rng: random.Random, k: int) -> str:
    """A copy of ``base`` at ``path`` with ``k`` values out of range; returns what was done."""
    shutil.copy(base, path)
    c = sqlite3.connect(path, isolation_level=None)
    try:
        return "; ".join(out_of_range(c, rng) for _ in range(k))
    finally:
        c.close()


def _no_traceback(args: list, what: str) -> int:
    """The exit code of a command: 0 or 1 with no traceback, or 2 with one line on stderr."""
    try:
        rc, err, took = _cli(args)
    except Exception as exc:  # a traceback is the failure this test looks for
        pytest.fail(f"{args[0]} raised {type(exc).__name__}: {exc} on: {what}")
    assert rc in (0, 1, 2), (args[0], what, rc)
    if rc == 2:
        assert err.count("\n") == 1 and err.startswith("ampdoctor"), (args[0], what, err[-500:])
    assert took < 20, (args[0], what, took)
    return rc


# (command, traces, values changed in each): a few hundred values per command in ~20 s on a quiet machine
OUT_OF_RANGE_RUNS = {"info": (150, 2), "layers": (200, 2), "replay": (60, 3), "diagnose": (50, 4), "report": (6, 4)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cmd", COMMANDS)
def test_values_of_the_right_type_out_of_range_give_no_traceback(tmp_path, base, long_base, cmd):
    """Issue 21, items 5-7: values of the right type but out of range (0, -1, 1e308, inf, nan, 2^63-1, empty and
    5,000-character texts, empty lists, NaN/Infinity in the metadata's JSON, ...) in every table and in the
    metadata. The reader refuses what no run can record (one line, exit 2); what it accepts, every command reads
    to the end (exit 0 or 1). Seeded: the same values every run."""
    n, k = OUT_OF_RANGE_RUNS[cmd]
    rng = random.Random(f"out-of-range {cmd}")
    codes = []
    for i in range(n):
        path = tmp_path / f"v{i}.db"
        what = _mutated((base, long_base)[i % 2], path, rng, k)
        codes.append(_no_traceback(_args(cmd, str(path)), what))
        for p in (path, tmp_path / f"v{i}.db.html"):
            p.unlink(missing_ok=True)
    accepted = sum(rc != 2 for rc in codes)
    assert accepted >= n // 3, (accepted, n)  # the commands themselves met most of the values, not only the checks


@pytest.mark.timeout(180)
def test_the_dashboard_data_layer_takes_values_out_of_range(tmp_path, base, long_base):
    """The dashboard's data layer (what its pages and the HTML report draw) on traces with values out of range:
    every function returns, or the trace is refused with a TraceError; nothing else raises. (The findings the
    pages show are the diagnose command's, fuzzed above.)"""
    from ampdoctor.dashboards import data, matrix

    rng = random.Random("out-of-range dashboard")
    reference = ampdoctor.load(base)
    read = 0
    for i in range(30):
        path = tmp_path / f"d{i}.db"
        what = _mutated((base, long_base)[i % 2], path, rng, 4)
        try:
            tr = ampdoctor.load(path)
        except ampdoctor.TraceError:
            continue
        try:
            sid = int(tr.sites("grad_out")["id"].iloc[0])
            for fn in (
                data.run_summary,
                lambda t: data.precision_rows(t, None),  # (while the diagnosis runs)
                lambda t: data.precision_rows(t, []),
                data.scaler_settings,
                data.whatif,
                data.formats_rows,  # (formats_shares reads the same table)
                data.probe_series,
                lambda t: data.whatif(t, init_scale=2.0**10, growth_interval=5),
                lambda t: data.site_info(t, sid),
                *[lambda t, s=s: matrix.site_series(t, sid, s) for s in matrix.STATS],
                lambda t: matrix.site_hist(t, sid),
                lambda t: data.compare_layers(t, reference),
                *[lambda t, s=s: matrix.layer_matrix(t, "grad_out", s) for s in matrix.STATS],
            ):
                fn(tr)
            read += 1
        except ampdoctor.TraceError as exc:
            assert "\n" not in str(exc), what
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__}: {exc} on: {what}")
        finally:
            tr.close()
            path.unlink()
    assert read >= 10


# -- issue 21, items 5-7, as the issue reproduced them ---------------------------------------------------------------
def _with_meta(src: str, path, key: str, change) -> str:
    shutil.copy(src, path)
    c = sqlite3.connect(path)
    value = json.loads(c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])
    change(value)
    c.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(value), key))  # inf/nan: Infinity/NaN
    c.commit()
    c.close()
    return str(path)


@pytest.mark.parametrize(
    "key, value",
    [
        ("growth_interval", 0),
        ("growth_interval", float("inf")),
        ("growth_interval", float("nan")),
        ("growth_interval", 1e300),
        ("growth_factor", 0.5),
        ("backoff_factor", 2),
        ("backoff_factor", float("nan")),
        ("init_scale", float("inf")),
    ],
)
def test_scaler_settings_out_of_range_are_unknown_with_a_note(tmp_path, long_base, capsys, key, value):
    """Issue 21, item 5: a GradScaler setting of the right type but out of range in meta.config made `diagnose`
    and `report` exit 1 with a traceback (a CI gate reads exit 1 as findings) and `replay` too. The reader now
    takes it as unknown (config.scaler.invalid), says so, and the replay runs with torch's default in its place."""
    from ampdoctor.lossscale import TORCH_DEFAULTS

    path = _with_meta(long_base, tmp_path / "t.db", "config", lambda c: c["scaler"].__setitem__(key, value))
    sc = ampdoctor.load(path).config["scaler"]
    assert key not in sc and list(sc["invalid"]) == [key]
    note = f"GradScaler setting out of range in the trace: {key} {value!r} (should be "
    assert cli_main(["diagnose", path]) in (0, 1)
    assert note in capsys.readouterr().err
    assert cli_main(["info", path]) == 0
    assert f"note       {note}" in capsys.readouterr().out
    assert cli_main(["replay", path]) == 0
    out = capsys.readouterr().out
    assert f"note: {note}" in out
    if key != "init_scale":  # (the replay starts from the scale recorded at the first step)
        assert f"{key} {TORCH_DEFAULTS[key]:g}" in out.splitlines()[1]
    assert cli_main(["report", path, "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().err == ""


def _set(src: str, path, sql: str) -> str:
    shutil.copy(src, path)
    c = sqlite3.connect(path)
    c.executescript(sql)
    c.close()
    return str(path)


@pytest.mark.parametrize(
    "sql, commands, message",
    [
        ("UPDATE events SET step = NULL", ("info", "report"), "table events: column step holds None: not a step"),
        (
            "UPDATE steps SET data_time = 1e308",
            ("diagnose", "report"),
            "table steps: column data_time holds 1e+308: not a duration (0 to 1e+09 s)",
        ),
    ],
)
def test_values_no_run_records_are_refused_in_one_line(tmp_path, long_base, capsys, sql, commands, message):
    """Issue 21, item 6: an event without a step (info and report: TypeError) and a data wait of 1e308 s on every
    step (diagnose and report: OverflowError in the input-pipeline rule) are values no run records: the reader
    refuses the trace, naming the value."""
    path = _set(long_base, tmp_path / "t.db", sql)
    for cmd in commands:
        assert cli_main(_args(cmd, path)) == 2
        assert capsys.readouterr().err == f"ampdoctor: {path}: corrupt trace ({message})\n"


def test_a_site_without_a_module_type_is_listed_without_one(tmp_path, long_base, capsys):
    """Issue 21, item 6: sites.module_type NULL (the format allows it) made `layers` raise TypeError."""
    path = _set(long_base, tmp_path / "t.db", "UPDATE sites SET module_type = NULL")
    assert cli_main(["layers", path, "--kind", "act"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 6 and all(r.split()[1] in ("float16", "float32") for r in rows)  # no type column text


RANKS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
from ampdoctor.cli import main
for args in (["info", sys.argv[1]], ["report", sys.argv[1], "-o", sys.argv[2]]):
    print(main(args))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("claim", ["world_size", "rank"])
def test_a_rank_claiming_a_world_of_10_15_costs_nothing(tmp_path, base, claim):
    """Issue 21, item 7: a rank trace claiming world_size or rank 10^15 made `info DIR` and `report DIR` run out
    of memory listing the missing ranks. They are runs of ranks now: 0-999999999999999 costs what 0-1 does."""
    d = tmp_path / "run"
    d.mkdir()
    if claim == "world_size":
        for r in (0, 1):
            _with_meta(base, d / f"run.rank{r}.db", "run", lambda m, r=r: m.update(rank=r, world_size=10**15))
        line = "missing    no trace for rank(s) 2-999999999999999 (999,999,999,999,998 ranks)"
    else:
        _with_meta(base, d / "run.rank0.db", "run", lambda m: m.update(rank=10**15, world_size=2))
        line = "missing    no trace for rank(s) 0-999999999999999 (1,000,000,000,000,000 ranks)"
    out = subprocess.run(
        [sys.executable, "-c", RANKS, str(d), str(tmp_path / "ranks.html")],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert line in lines and lines[-3:] == ["0", f"wrote {tmp_path / 'ranks.html'}", "0"], out.stdout[-2000:]
    assert "999999999999999" in (tmp_path / "ranks.html").read_text()
