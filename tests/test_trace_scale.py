"""Reading traces at the size of real runs: memory follows what a file holds (a crafted trace that claims 10^4 steps x
10^4 sites but holds 1.6 MB is diagnosed in a bounded footprint, not [steps x sites] arrays of 0.8 GB each), a large
file's values are checked as they are read (a corrupt value is an error or is never read: never a different answer),
the bounded estimators agree with the exact ones, and a trace written by this version keeps reading."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ampdoctor
from ampdoctor.trace import reader

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, "data")


def tracegen():
    spec = importlib.util.spec_from_file_location("tracegen", os.path.join(ROOT, "benchmarks", "tracegen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MEASURE = """
import sys, tracemalloc, numpy as np, ampdoctor
from ampdoctor.cli import main
path = sys.argv[1]
tracemalloc.start()
found = ampdoctor.diagnose(path)
tr = ampdoctor.load(path)
full = tr.full_steps()
tr.records("absmax", "act", steps=full[:50])  # a bounded read of a long run
main(["info", path])
print("PEAK", tracemalloc.get_traced_memory()[1], len(full))
"""


def test_a_crafted_sparse_trace_is_read_in_memory_bounded_by_its_content(tmp_path):
    """10^4 steps x 10^4 act sites claimed, 2,000 statistics rows and histograms held: diagnose, a bounded records()
    and info allocate at most 200 MB (measured by tracemalloc, which sees numpy's arrays) in a process of their own;
    one dense [steps x sites] float64 array of it would be 800 MB, and the code before the rework reached 8 GB."""
    path = tracegen().sparse(str(tmp_path / "sparse.db"))
    assert os.path.getsize(path) < 2e6
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), path], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peak, n_full = (int(x) for x in out.stdout.split("PEAK")[1].split())
    assert n_full == 2000
    assert peak < 200e6, peak
    with pytest.raises(ampdoctor.TraceError, match="too large to read at once"):
        ampdoctor.load(path).records("absmax", "act")  # the dense form is refused, not allocated


def test_the_bounded_trend_is_scipys_theil_sen():
    """The trend rules fit a Theil-Sen slope without scipy's n x n arrays: the same slope and confidence interval
    as scipy.stats.theilslopes, ties in x and y included."""
    from scipy.stats import theilslopes

    from ampdoctor.trace.reduce import col_median, group_median, theil_sen

    rng = np.random.default_rng(3)
    for n in (2, 7, 300, 2048):
        x = np.sort(rng.integers(0, 3 * n, n)).astype(float)
        y = np.round(rng.normal(size=n), 1) + 0.01 * x
        r = theilslopes(y, x, alpha=0.95)
        assert theil_sen(y, x, 0.95) == (float(r.slope), float(r.low_slope), float(r.high_slope))
    a = rng.normal(size=(9, 5))
    a[rng.random(a.shape) < 0.3] = np.nan
    a[:, 0] = np.nan
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        assert np.array_equal(col_median(a), np.nanmedian(a, axis=0), equal_nan=True)
    v, g = rng.normal(size=40), rng.integers(0, 6, 40)
    groups, med = group_median(v, g)
    assert np.array_equal(med, [np.median(v[g == k]) for k in groups])


def test_a_trace_of_this_version_reads_and_diagnoses_as_it_did(tmp_path):
    """tests/data/v1-fp16-run.db was written by a real FP16 run with this version's writer (format 1; see
    tests/data/README.md): it opens, info prints it, and its findings are those recorded with it."""
    src = os.path.join(DATA, "v1-fp16-run.db")
    path = str(tmp_path / "v1.db")
    with open(src, "rb") as f, open(path, "wb") as g:
        g.write(f.read())
    with open(os.path.join(DATA, "v1-fp16-run.json")) as f:
        expected = json.load(f)
    tr = ampdoctor.load(path)
    assert tr.n_steps == expected["steps"] and len(tr.sites()) == expected["sites"]
    found = ampdoctor.diagnose(tr)
    assert [(d.rule, d.severity, d.layers) for d in found] == [tuple(x) for x in expected["findings"]]
    from ampdoctor.cli import main

    assert main(["info", path]) == 0


# -- a large file's values are checked as they are read ----------------------------------------------------------
def _everything(path: str) -> dict:
    """Every view of a trace, read whole."""
    tr = ampdoctor.load(path)
    out = {"meta": tr.meta, "sites": tr.sites(), "steps": tr.steps(), "fast": tr.steps(lr_groups=False)}
    out["events"], out["metrics"], out["full"] = tr.events(), tr.metrics(), tr.full_steps()
    for kind in ("act", "grad_out", "param_grad", "weight", "update"):
        for field in ("peak", "scale", "calls", *ampdoctor.trace.schema.STATS_FIELDS):
            out[(kind, field)] = tr.records(field, kind)
    for sid in tr.sites()["id"]:
        out[("hist", int(sid))] = tr.hist(int(sid))
    tr.close()
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if hasattr(a, "equals"):
        return a.equals(b)
    return a == b


@pytest.mark.timeout(240)
def test_a_large_files_corrupt_value_is_an_error_or_never_read(tmp_path, monkeypatch):
    """A file above FULL_CHECK_BYTES is not scanned whole when opened; its values are checked as they are read.
    Forcing that path on the fuzz tests' corruptions (tests/test_fuzz.py): reading every view of the file either
    fails with a one-line TraceError, or gives exactly what the intact file gives (the corrupt value is in no view,
    e.g. a statistics row of a site id that does not exist); and no command answers with a traceback."""
    from test_fuzz import _args, _cli, _make

    monkeypatch.setattr(reader, "FULL_CHECK_BYTES", 0)
    good_path = str(tmp_path / "good.db")
    base_path = _base(tmp_path)
    with open(base_path, "rb") as f, open(good_path, "wb") as g:
        g.write(f.read())
    good = _everything(good_path)
    rng = random.Random(18)
    errors = 0
    for i in range(120):
        path = str(tmp_path / f"bad{i}.db")
        what = _make(base_path, path, rng)
        try:
            got = _everything(path)
        except ampdoctor.TraceError as exc:
            assert "\n" not in str(exc) and path in str(exc), what
            errors += 1
        else:
            assert _same(got, good), what
        cmd = ("info", "diagnose", "replay", "layers")[i % 4]
        rc, err, _ = _cli(_args(cmd, path))
        assert rc in (0, 2) and "Traceback" not in err, (what, cmd, err[-400:])
        assert rc == 0 or err.count("\n") == 1, (what, cmd, err)
    assert errors > 80  # most corruptions break a value some view reads


def test_a_large_files_value_out_of_range_is_an_error_or_never_read(tmp_path, monkeypatch):
    """The fuzz tests' values of the right type but out of range (issue 21: a data wait of 1e308 s, a level of 7, a
    negative count), each in a file read through the large-file path (values checked as read): what the whole-file
    checks of a small file refuse is a one-line TraceError naming the column, or is in no view (every view as the
    intact file's); what they accept reads the same through both paths."""
    from test_fuzz import out_of_range

    base_path = _base(tmp_path)
    good = _everything(base_path)
    rng = random.Random(21)
    errors = 0
    refused = 0
    for i in range(20):
        path = str(tmp_path / f"range{i}.db")
        shutil.copy(base_path, path)
        c = sqlite3.connect(path)
        what = out_of_range(c, rng)
        c.commit()
        c.close()
        monkeypatch.setattr(reader, "FULL_CHECK_BYTES", 1 << 40)
        try:
            whole = _everything(path)
        except ampdoctor.TraceError:
            whole = None
            refused += 1
        monkeypatch.setattr(reader, "FULL_CHECK_BYTES", 0)
        try:
            got = _everything(path)
        except ampdoctor.TraceError as exc:
            assert "\n" not in str(exc) and path in str(exc), what
            assert whole is None, (what, str(exc))  # refused only what the whole-file checks refuse
            errors += 1
        else:
            assert _same(got, good if whole is None else whole), what
    assert refused >= 5 and errors >= 3, (refused, errors)  # the draw exercised the checks of both paths


def _base(tmp_path) -> str:
    """The fuzz tests' base trace (a real FP16 run with a row in every table), made here."""
    from runs import every_table_trace

    return every_table_trace(str(tmp_path / "base.db"))


# -- divergence's blow-up evidence, chunked and vectorised, against the loops over dense arrays it replaced -----------
def _ref_update_ratio(run, first: int):
    """main's (ab6e3d8) loop: largest update RMS / its weights' last RMS before (else 1/sqrt(fan_in))."""
    from ampdoctor.rules.weights import NO_FAN_IN, _fan_in

    ups, ws = run.sites("update"), run.sites("weight")
    u_rms, w_rms = run.records("rms", "update"), run.records("rms", "weight")
    skipped = run.steps["skipped"].to_numpy(bool)
    w_col = {p: j for j, p in enumerate(ws["path"])}
    best = None
    for j, s in enumerate(ups.itertuples()):
        fan = _fan_in(s.shape)
        if not fan or run.module_types.get(s.module) in NO_FAN_IN:
            continue
        for r in [r for r in np.flatnonzero(np.isfinite(u_rms[:first, j])) if not skipped[r]]:
            jw = w_col.get(s.path)
            earlier = w_rms[:r, jw] if jw is not None else np.zeros(0)
            earlier = earlier[np.isfinite(earlier) & (earlier > 0)]
            ratio = float(u_rms[r, j]) / (float(earlier[-1]) if len(earlier) else 1.0 / math.sqrt(fan))
            if best is None or ratio > best[0]:
                best = (ratio, s.path, r)
    return best or (None, None, None)


def _ref_jump(run, first: int, bad: np.ndarray):
    """The dense loop: the largest one-step move of an output peak that the next observed steps kept; on that step,
    the first module (execution order, an inner one before the root) that moved at least half as much."""
    from ampdoctor import formats
    from ampdoctor.rules.divergence import _observed

    acts, pk = run.sites("act"), run.records("peak", "act")
    rows = np.flatnonzero(_observed(run))
    rows = rows[rows <= first + 1]
    best = None
    for a, c in zip(rows[:-1], rows[1:]):
        if c != a + 1 or c > first:
            continue
        moves = []
        for j in range(pk.shape[1]):
            prev, now, dtype = pk[a, j], pk[c, j], acts["dtype"].iloc[j]
            if not (np.isfinite(prev) and prev > 0):
                continue
            if np.isfinite(now):
                later = pk[rows[rows > c][:3], j]
                if now <= 0 or not all((not np.isfinite(v)) or v >= now / 4 for v in later):
                    continue
                move = math.log2(now / prev)
            elif dtype in formats.DTYPE_FORMATS and bad[c]:
                move = math.log2(formats.get(dtype).max / prev)
            else:
                continue
            moves.append((move, acts["path"].iloc[j], float(prev)))
        if not moves:
            continue
        top = max(m for m, _, _ in moves)
        cand = [m for m in moves if (m[0] >= top / 2 if top > 0 else m[0] == top)]
        inner = [m for m in cand if m[1] != ampdoctor.trace.schema.ROOT] or cand
        move, path, prev = inner[0]
        key = (top, path != ampdoctor.trace.schema.ROOT)
        if best is None or key > best[0]:
            best = (key, move, path, int(c), prev)
    return best[1:] if best else (None, None, None, None)


def _ref_growth(run, first: int):
    from ampdoctor.rules.divergence import _observed

    acts, pk = run.sites("act"), run.records("peak", "act")
    rows = np.flatnonzero(_observed(run)[:first])
    best = None
    for j in range(pk.shape[1]):
        col = pk[rows, j]
        ok = np.isfinite(col) & (col > 0)
        if ok.sum() >= 2:
            g = math.log2(col[ok][-1] / col[ok][0])
            if best is None or g > best[0]:
                best = (g, acts["path"].iloc[j], [int(rows[ok][0]), int(rows[ok][-1])])
    return best or (None, None, [])


@pytest.mark.parametrize(
    "kw",
    [  # a forward overflow at step 700: the evidence over the 700 steps before it; peaks every step, or every 5th
        {"steps": 900, "blocks": 2, "every": 20, "hist_every": 40, "peak_every": 1, "weight_every": 20},
        {"steps": 900, "blocks": 3, "every": 20, "hist_every": 40, "peak_every": 5, "init_scale": 2.0**24},
    ],
)
def test_the_blowup_evidence_read_a_chunk_at_a_time_is_the_dense_loops(tmp_path, monkeypatch, kw):
    """Divergence's blow-up evidence (the largest update against its weights' scale, the largest kept one-step jump of
    an output peak, into a non-finite one included, the activation growth) streamed over the steps before the first
    bad one a chunk at a time is what the loops over [steps x sites] arrays gave, ties and chunk boundaries included
    (chunks of 7 steps and of 2,048)."""
    from ampdoctor.rules import divergence as D
    from ampdoctor.rules.engine import Run

    path = tracegen().generate(str(tmp_path / "t.db"), forward_fault=700, seed=3, **kw)
    run = Run(ampdoctor.load(path))
    bad = D._bad(run)
    first = int(np.flatnonzero(bad)[-1])  # the last bad step: the most steps before it
    assert first >= 700
    want = (_ref_update_ratio(run, first), _ref_jump(run, first, bad), _ref_growth(run, first))
    assert want[0][0] is not None and want[1][0] is not None and want[2][0] is not None
    for chunk in (7, 2048):
        monkeypatch.setattr(D, "CHUNK", chunk)
        b = D.Blowup(first_step=first)
        D._update_ratio(run, first, b)
        D._jump(run, first, bad, b)
        D._flat_and_growth(run, first, b)
        got = (
            (b.update_ratio, b.update_param, b.update_step),
            (b.jump, b.jump_site, b.jump_step, b.jump_from),
            (b.growth, b.growth_site, b.growth_steps),
        )
        assert got == want, chunk


def test_a_trace_without_histograms_is_scanned_and_diagnosed(tmp_path):
    """The delayed-scaling windows are asked at the histogram steps; a trace with none (e.g. histograms switched off)
    scans its peaks and diagnoses without them."""
    from ampdoctor.trace.view import View

    path = tracegen().generate(str(tmp_path / "t.db"), steps=300, blocks=1, seed=4)
    c = sqlite3.connect(path)
    c.execute("DELETE FROM hists")
    c.commit()
    c.close()
    tr = ampdoctor.load(path)
    view = View(tr)
    assert not len(view.hist_steps) and np.isfinite(view.peak_max("act")).all()
    assert isinstance(ampdoctor.diagnose(tr), list)


LEAN = {"live": False, "replay": False}  # (what this test reads is the steps table: no replays to wait for)


@pytest.fixture(scope="module")
def blocked_trace(tmp_path_factory):
    """A real FP16 run (a scale high enough to skip steps, so that reasons and flags vary; a learning rate that
    changes after every step) written with blocks of 4 steps: 5 whole blocks and 3 steps after them."""
    import torch
    from runs import mlp, train

    from ampdoctor.trace import blocks

    path = str(tmp_path_factory.mktemp("blocks") / "run.db")
    model = mlp(width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mp = pytest.MonkeyPatch()
    mp.setattr(blocks, "SIZE", 4)
    try:

        def schedule(step, model, doc):
            opt.param_groups[0]["lr"] = 0.01 / (1 + step)

        train(model, 23, init_scale=2.0**28, optimizer=opt, trace=path, on_step=schedule, attach_options=LEAN)
    finally:
        mp.undo()
    return path


@pytest.mark.parametrize("damage", ["none", "a block missing", "a block cut short", "blocks of another version"])
def test_the_steps_packed_into_blocks_read_as_their_rows(blocked_trace, tmp_path, damage):
    """The writer packs the steps' numbers into blocks (trace.blocks) that a reader takes at once; what it reads is
    what the rows say, and a block that does not continue the blocks before it sends the reader to the rows."""
    path = str(tmp_path / "run.db")
    shutil.copy(blocked_trace, path)
    rows_only = str(tmp_path / "rows.db")
    shutil.copy(blocked_trace, rows_only)
    with sqlite3.connect(rows_only) as c:
        c.execute("DROP TABLE step_blocks")
    with sqlite3.connect(path) as c:
        assert [r[0] for r in c.execute("SELECT first FROM step_blocks ORDER BY first")] == [0, 4, 8, 12, 16]
        if damage == "a block missing":
            c.execute("DELETE FROM step_blocks WHERE first = 4")
        elif damage == "a block cut short":
            c.execute("UPDATE step_blocks SET data = substr(data, 1, 100) WHERE first = 4")
        elif damage == "blocks of another version":  # a column added later, in the middle
            for first, fields, data in c.execute("SELECT first, fields, data FROM step_blocks").fetchall():
                cols = np.frombuffer(data, dtype="<f8").reshape(-1, 4)
                more = np.concatenate([cols[:3], np.full((1, 4), 7.0), cols[3:]])
                names = fields.split(",")
                c.execute(
                    "UPDATE step_blocks SET fields = ?, data = ? WHERE first = ?",
                    (",".join([*names[:3], "later", *names[3:]]), more.astype("<f8").tobytes(), first),
                )
    got = ampdoctor.load(path).steps(lr_groups=False)
    want = ampdoctor.load(rows_only).steps(lr_groups=False)
    assert len(want) == 23 and want["skipped"].any() and want["lr"].nunique() == 22
    assert (want["reason"] != "sentinel").any()  # (the flight recorder after the skips)
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(got, want, check_exact=True)
    assert ampdoctor.load(path).steps().drop(columns="lr_groups").equals(want)  # every group's: from the rows


def test_the_delayed_scaling_windows_read_a_chunk_at_a_time_are_the_dense_ones():
    """The windows the FP8 what-if asks of the peaks (trace.peaks.scan, fed a few rows at a time) hold what a
    direct reading of every row gives: per query step and history h, over the steps q - h .. q - 1, the largest
    finite positive value (output gradients divided by their loss scale) and how many there were, the last one
    before q, and the value stored at q."""
    from ampdoctor.trace import peaks as P

    rng = np.random.default_rng(3)
    n_steps, n_sites = 3000, 7
    steps = np.sort(rng.choice(n_steps, 900, replace=False))  # the steps with a peaks row
    vals = rng.lognormal(0, 3, (len(steps), n_sites)).astype(np.float32)
    odd = rng.random(vals.shape)
    vals[odd < 0.1] = -1.0  # not observed
    vals[(odd >= 0.1) & (odd < 0.13)] = np.nan
    vals[(odd >= 0.13) & (odd < 0.15)] = np.inf
    vals[(odd >= 0.15) & (odd < 0.17)] = 0.0
    stored = np.exp2(rng.integers(0, 16, n_steps)).astype(float)
    cols, divide = np.array([0, 2, 3, 6]), np.array([False, False, True, True])
    queries = np.sort(rng.choice(n_steps, 60, replace=False))
    histories = (1, 16, 128, 1024)

    def windows() -> P.Windows:
        return P.Windows(cols=cols, divide=divide, stored=stored, queries=queries, histories=histories)

    # the direct reading
    a = vals[:, cols].astype(np.float64) / np.where(divide[None, :], stored[steps][:, None], 1.0)
    a = np.where(np.isfinite(a) & (a > 0), a, np.nan)
    want_max = {h: np.full((len(queries), len(cols)), np.nan) for h in histories}
    want_count = {h: np.zeros((len(queries), len(cols)), dtype=np.int64) for h in histories}
    want_last = np.full((len(queries), len(cols)), np.nan)
    want_at = np.full((len(queries), len(cols)), np.nan)
    for i, q in enumerate(queries):
        for h in histories:
            part = a[(steps >= q - h) & (steps < q)]
            want_count[h][i] = (~np.isnan(part)).sum(axis=0)
            for j in range(len(cols)):
                held = part[:, j][~np.isnan(part[:, j])]
                want_max[h][i, j] = held.max() if len(held) else np.nan
        before = a[steps < q]
        for j in range(len(cols)):
            held = before[:, j][~np.isnan(before[:, j])]
            want_last[i, j] = held[-1] if len(held) else np.nan
        row = np.flatnonzero(steps == q)
        if len(row):
            v = vals[row[0], cols].astype(np.float64)
            want_at[i] = np.where(v >= 0, v, np.nan)

    for rows in (1, 7, 64, len(steps)):  # chunks of rows as the reader yields them
        chunks = [(steps[k : k + rows], vals[k : k + rows]) for k in range(0, len(steps), rows)]
        got = P.scan(iter(chunks), n_sites, {}, None, windows()).windows
        for h in histories:
            np.testing.assert_array_equal(got.wmax[h], want_max[h])
            np.testing.assert_array_equal(got.count[h], want_count[h])
        np.testing.assert_array_equal(got.last, want_last)
        np.testing.assert_array_equal(got.at, want_at)
